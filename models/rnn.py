"""RNN cells for the step scheduler (BatchMaker): an LSTM cell and Seq2Seq's encoder and
decoder cells, each one compiled step at a fixed batch size, with numpy references.

A cell is the unit BatchMaker batches: the step scheduler runs one cell for a batch of
requests (each at its own position in its own chain), so every cell takes its state
``(h, c)`` as inputs and returns the new state. The weights are the cell's own (embedded
in the compiled step, "part of the internal state as opposed to the inputs", §4.2).

Shapes follow the paper: hidden 1024 (Figure 3's LSTM); the tiny configuration keeps
test compiles to seconds. Gates are ordered i, f, g, o; ``[x, h]`` multiplies ``W`` ([2H, 4H]).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tvm import relax
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn.core import wrap_nested

from .base import DEFAULT_SEED, ModelDef, export


@dataclass(frozen=True)
class RNNConfig:
    hidden: int = 1024
    vocab: int = 30000          # Seq2Seq's WMT-15 vocabulary (§7.4)

    @classmethod
    def tiny(cls) -> "RNNConfig":
        return cls(hidden=16, vocab=32)


class LSTMCell(nn.Module):
    def __init__(self, hidden: int):
        self.hidden = hidden
        # stored [in, out] so the step multiplies by it as is: a [out, in] weight made
        # TVM transpose 32 MiB on every step (200 us on a T4, measured on the simulator)
        self.w = nn.Parameter((2 * hidden, 4 * hidden), "float32")
        self.b = nn.Parameter((4 * hidden,), "float32")

    def forward(self, x: nn.Tensor, h: nn.Tensor, c: nn.Tensor):
        z = nn.op.matmul(nn.op.concat([x, h], dim=1), self.w) + self.b
        i, f, g, o = nn.op.split(z, 4, axis=1)
        c2 = nn.op.sigmoid(f) * c + nn.op.sigmoid(i) * nn.op.tanh(g)
        h2 = nn.op.sigmoid(o) * nn.op.tanh(c2)
        return h2, c2


class EncoderCell(nn.Module):
    """Embedding lookup of this step's token, then the LSTM cell."""

    def __init__(self, cfg: RNNConfig):
        self.emb = nn.Parameter((cfg.vocab, cfg.hidden), "float32")
        self.cell = LSTMCell(cfg.hidden)

    def forward(self, tok: nn.Tensor, h: nn.Tensor, c: nn.Tensor):
        return self.cell(nn.op.take(self.emb, tok, axis=0), h, c)


class DecoderCell(nn.Module):
    """Figure 12's "feed previous" decoder: embed the previous token, LSTM, project to the
    vocabulary, argmax (the next token, fed to the next step)."""

    def __init__(self, cfg: RNNConfig):
        self.emb = nn.Parameter((cfg.vocab, cfg.hidden), "float32")
        self.cell = LSTMCell(cfg.hidden)
        self.proj = nn.Parameter((cfg.hidden, cfg.vocab), "float32")

    def forward(self, tok: nn.Tensor, h: nn.Tensor, c: nn.Tensor):
        h2, c2 = self.cell(nn.op.take(self.emb, tok, axis=0), h, c)
        logits = nn.op.matmul(h2, self.proj)
        nxt = wrap_nested(relax.op.astype(relax.op.argmax(logits._expr, axis=1), "int32"), "argmax")
        return nxt, h2, c2


class TreeLeafCell(nn.Module):
    """A binary TreeLSTM's leaf (Tai et al. 2015, N-ary with N = 2): its input only, no
    children: ``i, o, u`` gates of ``x``; ``c = i * u``, ``h = o * tanh(c)``."""

    def __init__(self, hidden: int):
        self.w = nn.Parameter((hidden, 3 * hidden), "float32")
        self.b = nn.Parameter((3 * hidden,), "float32")

    def forward(self, x: nn.Tensor):
        z = nn.op.matmul(x, self.w) + self.b
        i, o, u = nn.op.split(z, 3, axis=1)
        c = nn.op.sigmoid(i) * nn.op.tanh(u)
        return nn.op.sigmoid(o) * nn.op.tanh(c), c


class TreeInternalCell(nn.Module):
    """A binary TreeLSTM's internal node: its two children's states (a missing child is
    zeros), no input of its own (a constituency tree's words are at its leaves); gates
    ``i, f_l, f_r, o, u`` of ``[h_l, h_r]``."""

    def __init__(self, hidden: int):
        self.w = nn.Parameter((2 * hidden, 5 * hidden), "float32")
        self.b = nn.Parameter((5 * hidden,), "float32")

    def forward(self, hl: nn.Tensor, cl: nn.Tensor, hr: nn.Tensor, cr: nn.Tensor):
        z = nn.op.matmul(nn.op.concat([hl, hr], dim=1), self.w) + self.b
        i, fl, fr, o, u = nn.op.split(z, 5, axis=1)
        c = nn.op.sigmoid(i) * nn.op.tanh(u) + nn.op.sigmoid(fl) * cl + nn.op.sigmoid(fr) * cr
        return nn.op.sigmoid(o) * nn.op.tanh(c), c


def tree_leaf_cell(batch: int = 1, cfg: RNNConfig = RNNConfig(), seed: int = DEFAULT_SEED + 2) -> ModelDef:
    H = cfg.hidden
    return export(f"tree_leaf_h{H}_b{batch}", TreeLeafCell(H), {"x": ((batch, H), "float32")}, seed,
                  description=f"TreeLSTM leaf cell, hidden {H}, batch {batch}")


def tree_internal_cell(batch: int = 1, cfg: RNNConfig = RNNConfig(), seed: int = DEFAULT_SEED + 3) -> ModelDef:
    H = cfg.hidden
    f = ((batch, H), "float32")
    return export(f"tree_internal_h{H}_b{batch}", TreeInternalCell(H),
                  {"hl": f, "cl": f, "hr": f, "cr": f}, seed,
                  description=f"TreeLSTM internal cell, hidden {H}, batch {batch}")


def lstm_cell(batch: int = 1, cfg: RNNConfig = RNNConfig(), seed: int = DEFAULT_SEED) -> ModelDef:
    H = cfg.hidden
    f = ((batch, H), "float32")
    return export(f"lstm_h{H}_b{batch}", LSTMCell(H), {"x": f, "h": f, "c": f}, seed,
                  description=f"one LSTM cell, hidden {H}, batch {batch}")


def encoder_cell(batch: int = 1, cfg: RNNConfig = RNNConfig(), seed: int = DEFAULT_SEED) -> ModelDef:
    H = cfg.hidden
    f = ((batch, H), "float32")
    return export(f"s2s_enc_h{H}_v{cfg.vocab}_b{batch}", EncoderCell(cfg),
                  {"tok": ((batch,), "int32"), "h": f, "c": f}, seed,
                  description=f"Seq2Seq encoder cell, hidden {H}, batch {batch}")


def decoder_cell(batch: int = 1, cfg: RNNConfig = RNNConfig(), seed: int = DEFAULT_SEED + 1) -> ModelDef:
    """Seed differs from the encoder's: the paper's encoder and decoder share no weights."""
    H = cfg.hidden
    f = ((batch, H), "float32")
    return export(f"s2s_dec_h{H}_v{cfg.vocab}_b{batch}", DecoderCell(cfg),
                  {"tok": ((batch,), "int32"), "h": f, "c": f}, seed,
                  description=f"Seq2Seq decoder cell, hidden {H}, vocab {cfg.vocab}, batch {batch}")


# ------------------------------------------------------------------ numpy references
def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def lstm_reference(x: np.ndarray, h: np.ndarray, c: np.ndarray, w: np.ndarray, b: np.ndarray):
    z = np.concatenate([x, h], axis=1) @ w + b
    i, f, g, o = np.split(z, 4, axis=1)
    c2 = _sigmoid(f) * c + _sigmoid(i) * np.tanh(g)
    return (_sigmoid(o) * np.tanh(c2)).astype(np.float32), c2.astype(np.float32)


def decoder_reference(tok: np.ndarray, h: np.ndarray, c: np.ndarray, params: list[np.ndarray]):
    emb, w, b, proj = params
    h2, c2 = lstm_reference(emb[tok], h, c, w, b)
    return np.argmax(h2 @ proj, axis=1).astype(np.int32), h2, c2


def tree_leaf_reference(x: np.ndarray, w: np.ndarray, b: np.ndarray):
    i, o, u = np.split(x @ w + b, 3, axis=1)
    c = _sigmoid(i) * np.tanh(u)
    return (_sigmoid(o) * np.tanh(c)).astype(np.float32), c.astype(np.float32)


def tree_internal_reference(hl: np.ndarray, cl: np.ndarray, hr: np.ndarray, cr: np.ndarray,
                            w: np.ndarray, b: np.ndarray):
    i, fl, fr, o, u = np.split(np.concatenate([hl, hr], axis=1) @ w + b, 5, axis=1)
    c = _sigmoid(i) * np.tanh(u) + _sigmoid(fl) * cl + _sigmoid(fr) * cr
    return (_sigmoid(o) * np.tanh(c)).astype(np.float32), c.astype(np.float32)


def treelstm_reference(xs: np.ndarray, parents: list[int], leaf: list[np.ndarray],
                       internal: list[np.ndarray]) -> np.ndarray:
    """Every node's ``h`` of the tree ``parents`` (``parents[i]``: node i's parent, -1 at
    the root), computed node by node at batch 1 (children before parents; a node's
    children in index order, left then right). ``xs[i]``: leaf i's input."""
    n, H = len(parents), xs.shape[1]
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        if p >= 0:
            kids.setdefault(p, []).append(i)
    h = np.zeros((n, H), np.float32)
    c = np.zeros((n, H), np.float32)
    done: set[int] = set()

    def visit(i: int) -> None:
        for k in kids.get(i, ()):
            visit(k)
        ch = kids.get(i, [])
        if not ch:
            h[i], c[i] = (a[0] for a in tree_leaf_reference(xs[i:i + 1], *leaf))
        else:
            z = np.zeros((1, H), np.float32)
            hl, cl = h[ch[0]:ch[0] + 1], c[ch[0]:ch[0] + 1]
            hr, cr = (h[ch[1]:ch[1] + 1], c[ch[1]:ch[1] + 1]) if len(ch) > 1 else (z, z)
            h[i], c[i] = (a[0] for a in tree_internal_reference(hl, cl, hr, cr, *internal))
        done.add(i)

    visit(parents.index(-1))
    return h
