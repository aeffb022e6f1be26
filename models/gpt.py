"""A decoder-only transformer (GPT-2-like) as Orca serves it: one *iteration* over the
flattened new tokens of a batch of requests, with the KV cache in slots.

Selective batching (Orca §4.3.1): every operation that does not mix tokens (embeddings,
layer norms, the QKV and output projections, the MLP, the LM head) runs once over the
``T`` new tokens of the whole batch, flattened to ``[T, d]``, whatever request each
belongs to and however many tokens each brings (a whole prompt on its first iteration,
one token after). Only attention is per request: a token attends to its own request's
cached keys and values, and to the new ones before it.

The compiled iteration (:func:`gpt_iteration`) expresses the per-request attention with
two ``[T, S]`` matrices over the ``S`` KV slots: ``write`` (one-hot: the slot each new
token's key and value go to) and ``mask`` (0 where a token may attend, -1e9 elsewhere).
The numpy reference (:func:`generate_reference`) recomputes each request alone from
scratch with no cache at all, so the runtime's tokens are checked against an
independent computation from the same weights.

Configurations: :meth:`GPTConfig.gpt2_small` (GPT-2 small's shapes) and
:meth:`GPTConfig.tiny` for tests.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tvm import relax
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn.core import wrap_nested

from .base import DEFAULT_SEED, ModelDef, export, random_weights

NEG = -1e9


@dataclass(frozen=True)
class GPTConfig:
    vocab: int
    d: int
    n_layer: int
    n_head: int
    n_ctx: int

    @classmethod
    def gpt2_small(cls) -> "GPTConfig":
        return cls(vocab=50257, d=768, n_layer=12, n_head=12, n_ctx=1024)

    @classmethod
    def tiny(cls) -> "GPTConfig":
        return cls(vocab=64, d=32, n_layer=2, n_head=2, n_ctx=64)

    @property
    def head_dim(self) -> int:
        return self.d // self.n_head

    def kv_bytes_per_slot(self) -> int:
        """One token's keys and values in every layer (float32): a KV slot."""
        return 2 * self.n_layer * self.d * 4


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        d = cfg.d
        self.cfg = cfg
        self.ln1_scale = nn.Parameter((d,), "float32")
        self.ln1_shift = nn.Parameter((d,), "float32")
        self.w_qkv = nn.Parameter((d, 3 * d), "float32")
        self.b_qkv = nn.Parameter((3 * d,), "float32")
        self.w_o = nn.Parameter((d, d), "float32")
        self.b_o = nn.Parameter((d,), "float32")
        self.ln2_scale = nn.Parameter((d,), "float32")
        self.ln2_shift = nn.Parameter((d,), "float32")
        self.w_fc = nn.Parameter((d, 4 * d), "float32")
        self.b_fc = nn.Parameter((4 * d,), "float32")
        self.w_proj = nn.Parameter((4 * d, d), "float32")
        self.b_proj = nn.Parameter((d,), "float32")

    def forward(self, x, k_cache, v_cache, write, keep, mask):
        cfg = self.cfg
        T, S = write.shape
        nh, dh = cfg.n_head, cfg.head_dim
        a = nn.op.layer_norm(x, [cfg.d], self.ln1_scale, self.ln1_shift)
        q, k, v = nn.op.split(nn.op.matmul(a, self.w_qkv) + self.b_qkv, 3, axis=1)
        wt = nn.op.permute_dims(write)                              # [S, T]
        K = k_cache * keep + nn.op.matmul(wt, k)                    # the cache, new keys written
        V = v_cache * keep + nn.op.matmul(wt, v)
        qh = nn.op.permute_dims(nn.op.reshape(q, (T, nh, dh)), [1, 0, 2])      # [nh, T, dh]
        kh = nn.op.permute_dims(nn.op.reshape(K, (S, nh, dh)), [1, 2, 0])      # [nh, dh, S]
        vh = nn.op.permute_dims(nn.op.reshape(V, (S, nh, dh)), [1, 0, 2])      # [nh, S, dh]
        p = nn.op.softmax(nn.op.matmul(qh, kh) * (1.0 / float(np.sqrt(dh))) + mask, axis=-1)
        o = nn.op.reshape(nn.op.permute_dims(nn.op.matmul(p, vh), [1, 0, 2]), (T, cfg.d))
        x = x + nn.op.matmul(o, self.w_o) + self.b_o
        m = nn.op.layer_norm(x, [cfg.d], self.ln2_scale, self.ln2_shift)
        x = x + nn.op.matmul(nn.op.gelu(nn.op.matmul(m, self.w_fc) + self.b_fc), self.w_proj) + self.b_proj
        return x, K, V


class GPTIteration(nn.Module):
    def __init__(self, cfg: GPTConfig):
        self.cfg = cfg
        self.wte = nn.Parameter((cfg.vocab, cfg.d), "float32")
        self.wpe = nn.Parameter((cfg.n_ctx, cfg.d), "float32")
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.lnf_scale = nn.Parameter((cfg.d,), "float32")
        self.lnf_shift = nn.Parameter((cfg.d,), "float32")

    def forward(self, tok, pos, write, mask, kv):
        cfg = self.cfg
        T, S = write.shape
        x = nn.op.take(self.wte, tok, axis=0) + nn.op.take(self.wpe, pos, axis=0)
        keep = nn.op.reshape(1.0 - nn.op.sum(write, axis=0), (S, 1))
        parts = nn.op.split(kv, 2 * cfg.n_layer, axis=0)             # each [1, S, d]
        new = []
        for i, blk in enumerate(self.blocks):
            kc = nn.op.reshape(parts[2 * i], (S, cfg.d))
            vc = nn.op.reshape(parts[2 * i + 1], (S, cfg.d))
            x, K, V = blk(x, kc, vc, write, keep, mask)
            new += [nn.op.reshape(K, (1, S, cfg.d)), nn.op.reshape(V, (1, S, cfg.d))]
        x = nn.op.layer_norm(x, [cfg.d], self.lnf_scale, self.lnf_shift)
        logits = nn.op.matmul(x, nn.op.permute_dims(self.wte))
        nxt = wrap_nested(relax.op.astype(relax.op.argmax(logits._expr, axis=1), "int32"), "argmax")
        return nxt, nn.op.concat(new, dim=0)


def gpt_iteration(cfg: GPTConfig, tokens: int, slots: int, seed: int = DEFAULT_SEED) -> ModelDef:
    """One iteration over ``tokens`` flattened new tokens with ``slots`` KV slots:
    inputs ``tok``, ``pos`` [T] int32, ``write``, ``mask`` [T, S], ``kv`` [2L, S, d];
    outputs the argmax next token of every new token [T] and the updated cache."""
    T, S = tokens, slots
    f = "float32"
    return export(f"gpt_d{cfg.d}_l{cfg.n_layer}_t{T}_s{S}", GPTIteration(cfg),
                  {"tok": ((T,), "int32"), "pos": ((T,), "int32"), "write": ((T, S), f),
                   "mask": ((T, S), f), "kv": ((2 * cfg.n_layer, S, cfg.d), f)}, seed,
                  description=f"GPT iteration: d {cfg.d}, {cfg.n_layer} layers, {T} tokens, {S} KV slots")


def gpt_weights(cfg: GPTConfig, seed: int = DEFAULT_SEED) -> dict[str, np.ndarray]:
    """The same seeded weights :func:`gpt_iteration` embeds, by parameter name (they do
    not depend on T and S)."""
    mod = GPTIteration(cfg)
    named = list(mod.named_parameters())
    return dict(zip([n for n, _ in named], random_weights(named, seed)))


# ------------------------------------------------------------------ numpy references
def _ln(x, s, b):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + 1e-5) * s + b


def _erf(x: np.ndarray) -> np.ndarray:
    """erf, vectorized: Abramowitz and Stegun 7.1.26 (absolute error below 1.5e-7, about
    float32's epsilon). Speed: ``np.vectorize(math.erf)`` called Python per element and
    made a GPT-2-small iteration's reference cost about 0.45 s (the MLP's 3072 x tokens
    activations in 12 layers); this is numpy throughout."""
    a1, a2, a3, a4, a5, p = 0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429, 0.3275911
    sign = np.sign(x)
    ax = np.abs(x).astype(np.float64)
    t = 1.0 / (1.0 + p * ax)
    y = 1.0 - ((((a5 * t + a4) * t + a3) * t + a2) * t + a1) * t * np.exp(-ax * ax)
    return (sign * y).astype(x.dtype, copy=False)


def _gelu(x):
    # TVM's gelu is the erf form
    return 0.5 * x * (1.0 + _erf(x * x.dtype.type(0.7071067811865476)))   # 1/sqrt(2), x's dtype


def _block_dense_in(w, i, x):
    p = f"blocks.{i}."
    a = _ln(x, w[p + "ln1_scale"], w[p + "ln1_shift"])
    return np.split(a @ w[p + "w_qkv"] + w[p + "b_qkv"], 3, axis=1)


def _block_dense_out(w, i, x, o):
    p = f"blocks.{i}."
    x = x + o @ w[p + "w_o"] + w[p + "b_o"]
    m = _ln(x, w[p + "ln2_scale"], w[p + "ln2_shift"])
    return x + _gelu(m @ w[p + "w_fc"] + w[p + "b_fc"]) @ w[p + "w_proj"] + w[p + "b_proj"]


def _attend(cfg: GPTConfig, q, K, V, first: int):
    """Causal attention of new queries at positions first.. over keys 0..len(K)-1."""
    nh, dh = cfg.n_head, cfg.head_dim
    T, S = len(q), len(K)
    qh = q.reshape(T, nh, dh).transpose(1, 0, 2)
    kh = K.reshape(S, nh, dh).transpose(1, 2, 0)
    vh = V.reshape(S, nh, dh).transpose(1, 0, 2)
    s = qh @ kh / np.sqrt(dh)
    allowed = np.arange(S)[None, :] <= (first + np.arange(T))[:, None]
    s = np.where(allowed, s, NEG)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    # In the queries' dtype: NEG (a Python float) made the scores float64, and a float64
    # output then converted every following float32 weight matrix to float64 (Speed:
    # a GPT-2-small decode step went from 0.40 s to well under a tenth of that).
    return (p @ vh).transpose(1, 0, 2).reshape(T, cfg.d).astype(q.dtype, copy=False)


def forward_reference(cfg: GPTConfig, w: dict[str, np.ndarray], tokens: list[int]) -> np.ndarray:
    """Logits of every position of one sequence, computed from scratch (no cache)."""
    x = w["wte"][tokens] + w["wpe"][np.arange(len(tokens))]
    for i in range(cfg.n_layer):
        q, k, v = _block_dense_in(w, i, x)
        x = _block_dense_out(w, i, x, _attend(cfg, q, k, v, 0))
    x = _ln(x, w["lnf_scale"], w["lnf_shift"])
    return x @ w["wte"].T


def generate_reference(cfg: GPTConfig, w: dict[str, np.ndarray], prompt: list[int], n: int) -> list[int]:
    """Greedy decoding of ``n`` tokens, recomputing the whole sequence every time."""
    seq = list(prompt)
    out = []
    for _ in range(n):
        t = int(np.argmax(forward_reference(cfg, w, seq)[-1]))
        out.append(t)
        seq.append(t)
    return out


def selective_iteration(cfg: GPTConfig, w: dict[str, np.ndarray], kv: np.ndarray,
                        reqs: list[tuple[list[int], int, list[int]]]) -> list[int]:
    """One selectively batched iteration with the KV cache ``kv`` [2L, n_slots, d]
    (updated in place). ``reqs``: per request, its new tokens, the position of the first,
    and its slots (one per position from 0, the new tokens' included). Returns each
    request's next token. The dense operations run once over the flattened tokens; the
    attention runs per request over its own slots."""
    toks = [t for new, _, _ in reqs for t in new]
    pos = [first + j for new, first, _ in reqs for j in range(len(new))]
    x = (w["wte"][toks] + w["wpe"][pos]).astype(np.float32)
    for i in range(cfg.n_layer):
        q, k, v = _block_dense_in(w, i, x)                  # flattened: [T, d]
        outs, at = [], 0
        for new, first, slots in reqs:                       # attention: per request
            n = len(new)
            mine = np.asarray(slots[:first + n])
            kv[2 * i, mine[first:]] = k[at:at + n]
            kv[2 * i + 1, mine[first:]] = v[at:at + n]
            outs.append(_attend(cfg, q[at:at + n], kv[2 * i, mine], kv[2 * i + 1, mine], first))
            at += n
        x = _block_dense_out(w, i, x, np.concatenate(outs)).astype(np.float32)
    x = _ln(x, w["lnf_scale"], w["lnf_shift"])
    logits = x @ w["wte"].T
    ends = np.cumsum([len(new) for new, _, _ in reqs]) - 1
    return [int(np.argmax(logits[e])) for e in ends]
