"""A small BERT-like encoder (post-LN transformer layers over token embeddings), seeded
weights: the length-axis model of the batching experiment, and the model later
TurboTransformers-style batchers (variable lengths) reuse.

Inputs: ``x`` (batch, seq_len, hidden) float32 embeddings and ``mask`` (batch,
seq_len) float32, 1 for a real token and 0 for padding. Padded positions are masked
out of attention (a large negative bias), so a request padded into a longer length
bucket gets the same answers for its own tokens, up to float rounding. Output ``y``
(batch, seq_len, hidden).
"""
from __future__ import annotations

from tvm.relax.frontend import nn

from .base import ModelDef, export, named_weights


class EncoderLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int):
        self.heads, self.dh = heads, hidden // heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln1 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)
        self.ln2 = nn.LayerNorm(hidden)

    def forward(self, x: nn.Tensor, bias: nn.Tensor) -> nn.Tensor:
        b, s, h = x.shape
        qkv = nn.op.reshape(self.qkv(x), (b, s, 3, self.heads, self.dh))
        q, k, v = (nn.op.permute_dims(nn.op.squeeze(t, 2), (0, 2, 1, 3))
                   for t in nn.op.split(qkv, 3, axis=2))          # (b, heads, s, dh)
        att = nn.op.matmul(q, nn.op.permute_dims(k, (0, 1, 3, 2))) * (self.dh ** -0.5)
        att = nn.op.softmax(att + bias, axis=-1)
        ctx = nn.op.reshape(nn.op.permute_dims(nn.op.matmul(att, v), (0, 2, 1, 3)), (b, s, h))
        x = self.ln1(x + self.proj(ctx))
        return self.ln2(x + self.fc2(nn.op.gelu(self.fc1(x))))


class Encoder(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, ffn: int):
        self.layers = nn.ModuleList([EncoderLayer(hidden, heads, ffn) for _ in range(layers)])

    def forward(self, x: nn.Tensor, mask: nn.Tensor) -> nn.Tensor:
        b, s = mask.shape
        # (1 - mask) * -1e4 as an additive attention bias over the keys: (b, 1, 1, s).
        bias = nn.op.reshape((mask - 1.0) * 10000.0, (b, 1, 1, s))
        for layer in self.layers:
            x = layer(x, bias)
        return x


def bert_encoder(batch: int = 1, seq_len: int = 64, layers: int = 2, hidden: int = 128,
                 heads: int = 2, ffn: int = 512) -> ModelDef:
    """BERT-like encoder (2 layers, hidden 128, 2 heads, FFN 512 by default)."""
    return export("bert_encoder", Encoder(layers, hidden, heads, ffn),
                  {"x": ((batch, seq_len, hidden), "float32"),
                   "mask": ((batch, seq_len), "float32")},
                  description=f"BERT-like encoder, {layers} layers, hidden {hidden}, "
                              f"{heads} heads, batch {batch}, length {seq_len}")


def bert_base(batch: int = 1, seq_len: int = 128) -> ModelDef:
    """The same encoder at BERT-base's size (12 layers, hidden 768, 12 heads, FFN 3072):
    DVABatch's BERT-like model."""
    md = bert_encoder(batch, seq_len, layers=12, hidden=768, heads=12, ffn=3072)
    md.name = "bert_base"
    return md


def tiny_encoder(batch: int = 1, seq_len: int = 8) -> ModelDef:
    """The same encoder at test size (1 layer, hidden 16): compiles in seconds."""
    md = bert_encoder(batch, seq_len, layers=1, hidden=16, heads=2, ffn=32)
    md.name = "tiny_encoder"
    return md


def bert_encoder_stage(layers: range, batch: int = 1, seq_len: int = 64, total_layers: int = 2,
                       hidden: int = 128, heads: int = 2, ffn: int = 512) -> ModelDef:
    """The stage of :func:`bert_encoder` made of ``layers`` (a DVABatch stage): an encoder
    of those layers with the whole model's weights, so running the stages one after the
    other gives the whole model's outputs. Each stage takes ``mask`` again and recomputes
    the attention bias from it (a few elementwise operations)."""
    if not layers or layers.start < 0 or layers.stop > total_layers or layers.step != 1:
        raise ValueError(f"layers {layers} is not a stage of a {total_layers}-layer encoder")
    shapes = {"x": ((batch, seq_len, hidden), "float32"), "mask": ((batch, seq_len), "float32")}
    full = named_weights(Encoder(total_layers, hidden, heads, ffn), shapes)
    mine = {}
    for i in range(len(layers)):
        prefix = f"layers.{i}."
        mine.update({k.replace(f"layers.{layers.start + i}.", prefix, 1): v for k, v in full.items()
                     if k.startswith(f"layers.{layers.start + i}.")})
    md = export(f"bert_encoder_s{layers.start}_{layers.stop}",
                Encoder(len(layers), hidden, heads, ffn), shapes, weights=mine,
                description=f"BERT-like encoder layers {layers.start}..{layers.stop - 1} of "
                            f"{total_layers}, batch {batch}, length {seq_len}")
    md.batch, md.seq_len = batch, seq_len
    return md
