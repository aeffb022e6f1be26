"""Translated data transforms: scaling, one-hot encoding, binning (paper §5.2.1, §5.2.3).

* ``StandardScaler`` is a parametric arithmetic operator: a per-column affine map whose
  two vectors become trainable parameters (:class:`Affine`).
* ``OneHotEncoder`` is a lookup: category ``c`` of column ``j`` selects a row of an
  identity matrix. The translation is that lookup with the matrix made a trainable
  embedding (:class:`OneHotEmbedding`), initialised to the identity so the output is
  the encoder's until fine-tuning moves it. Each column keeps its own table (a block of
  the matrix), as an embedding lookup per feature does.
* ``KBinsDiscretizer`` counts the bin edges at or below a value; each count becomes a
  soft step ``(1 + tanh((x - edge) / (tau * width))) / 2`` with a trainable slope and
  edge (:class:`SoftBins`), summed for ordinal codes, differenced for one-hot bins.
  ``width`` is the column's mean bin width: binned columns are raw ones whose scales
  differ by orders of magnitude (areas in thousands, ratios in hundredths), and the
  output counts bins, so the step's softness is measured in bins (tau = 1: a step
  spread over about a bin; 1e-3: the encoder's own codes).

The network reads every input column as float32: categorical columns hold numeric
codes (the categories the encoder was fitted on must be numbers).
"""
from __future__ import annotations

import numpy as np
import torch

from .errors import WindTunnelError
from .network import Block, OnnxBuilder, param, uniform_
from .thresholds import place


class Affine(Block):
    """``y = x * w + b`` per column (a translated ``StandardScaler``)."""

    featurizer = True

    def __init__(self, w: np.ndarray, b: np.ndarray):
        super().__init__(len(w), len(w))
        self.w = param(w)
        self.b = param(b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w + self.b

    def to_onnx(self, g: OnnxBuilder, x: str) -> str:
        return g.op("Add", [g.op("Mul", [x, g.weight(self.w, "scale")]), g.weight(self.b, "shift")])

    def cold_init(self, gen: torch.Generator) -> None:
        # A normalisation layer's default: the identity (LayerNorm's ones and zeros).
        with torch.no_grad():
            self.w.fill_(1.0)
            self.b.zero_()


def from_standard_scaler(est) -> Affine:
    d = est.n_features_in_
    mean = est.mean_ if est.with_mean else np.zeros(d)
    scale = est.scale_ if est.with_std else np.ones(d)
    return Affine(1.0 / scale, -mean / scale)


class OneHotEmbedding(Block):
    """Per-column embedding lookup by equality with the fitted categories.

    ``slot_col[m]`` and ``slot_value[m]`` name category slot ``m``; ``table`` maps slots to
    output columns (identity at translation, minus dropped categories); ``mask`` keeps
    each column's slots writing only to that column's outputs.
    """

    featurizer = True

    def __init__(self, in_dim: int, slot_col: np.ndarray, slot_value: np.ndarray, table: np.ndarray):
        super().__init__(in_dim, table.shape[1])
        self.register_buffer("slot_col", torch.as_tensor(slot_col, dtype=torch.long), persistent=False)
        self.register_buffer("slot_value", torch.as_tensor(np.asarray(slot_value, np.float32)))
        self.table = param(table)
        self.register_buffer("mask", torch.as_tensor(_block_mask(slot_col, table), dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hot = (x.index_select(1, self.slot_col) == self.slot_value).to(x.dtype)
        return hot @ (self.table * self.mask)

    def to_onnx(self, g: OnnxBuilder, x: str) -> str:
        cols = g.op("Gather", [x, g.const(self.slot_col.numpy().astype(np.int64), "slot_col")], axis=1)
        hot = g.op("Cast", [g.op("Equal", [cols, g.weight(self.slot_value, "categories")])], to=1)
        return g.op("MatMul", [hot, g.weight(self.table * self.mask, "embedding")])

    def cold_init(self, gen: torch.Generator) -> None:
        # nn.Embedding's default: N(0, 1).
        with torch.no_grad():
            self.table.copy_(torch.randn(self.table.shape, generator=gen) * self.mask)


def _block_mask(slot_col: np.ndarray, table: np.ndarray) -> np.ndarray:
    """1 where slot ``m``'s column owns output ``o`` (read off the identity table)."""
    owner = np.full(table.shape[1], -1)
    for m, o in zip(*np.nonzero(table)):
        owner[o] = slot_col[m]
    return (slot_col[:, None] == owner[None, :]).astype(np.float32)


def from_one_hot(est) -> OneHotEmbedding:
    if getattr(est, "_infrequent_enabled", False):
        raise WindTunnelError("OneHotEncoder with infrequent categories (min_frequency/max_categories) is "
                              "not supported: group rare categories before the pipeline instead")
    drop = est.drop_idx_ if est.drop_idx_ is not None else [None] * len(est.categories_)
    slot_col, slot_value, keep = [], [], []
    for j, (cats, d) in enumerate(zip(est.categories_, drop)):
        try:
            values = np.asarray(cats, dtype=np.float64)
        except (TypeError, ValueError):
            raise WindTunnelError(f"OneHotEncoder column {j} has non-numeric categories ({list(cats)[:3]}...): "
                                  "the network reads float32 columns, so encode categories as numeric "
                                  "codes before the pipeline") from None
        for i, v in enumerate(values):
            slot_col.append(j)
            slot_value.append(v)
            keep.append(d is None or i != d)
    keep = np.asarray(keep)
    table = np.eye(len(keep), dtype=np.float32)[:, keep]
    return OneHotEmbedding(len(est.categories_), np.asarray(slot_col), np.asarray(slot_value), table)


class SoftBins(Block):
    """Soft bin codes: ``s_k = (1 + tanh(x[col_k] * slope_k + bias_k)) / 2`` per inner
    edge, then ``out = s @ combine + offset`` (ordinal: sums; one-hot: differences)."""

    featurizer = True

    def __init__(self, in_dim: int, edge_col: np.ndarray, slope: np.ndarray, bias: np.ndarray,
                 combine: np.ndarray, offset: np.ndarray):
        super().__init__(in_dim, combine.shape[1])
        if len(edge_col) == 0:
            raise WindTunnelError("KBinsDiscretizer with a single bin in every column has nothing to translate")
        self.register_buffer("edge_col", torch.as_tensor(edge_col, dtype=torch.long), persistent=False)
        self.slope = param(slope)
        self.bias = param(bias)
        self.register_buffer("combine", torch.as_tensor(np.asarray(combine, np.float32)))
        self.register_buffer("offset", torch.as_tensor(np.asarray(offset, np.float32)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = 0.5 * (1 + torch.tanh(x.index_select(1, self.edge_col) * self.slope + self.bias))
        return s @ self.combine + self.offset

    def to_onnx(self, g: OnnxBuilder, x: str) -> str:
        cols = g.op("Gather", [x, g.const(self.edge_col.numpy().astype(np.int64), "edge_col")], axis=1)
        t = g.op("Tanh", [g.op("Add", [g.op("Mul", [cols, g.weight(self.slope, "slope")]),
                                       g.weight(self.bias, "edge")])])
        half = g.const(np.float32([0.5]), "half")
        s = g.op("Add", [g.op("Mul", [t, half]), half])
        return g.op("Add", [g.op("MatMul", [s, g.weight(self.combine, "combine")]), g.weight(self.offset, "offset")])

    def cold_init(self, gen: torch.Generator) -> None:
        uniform_(self.slope, 1, gen)
        uniform_(self.bias, 1, gen)


def from_kbins(est, tau: float, reference: np.ndarray | None) -> SoftBins:
    if est.encode not in ("ordinal", "onehot", "onehot-dense"):
        raise WindTunnelError(f"KBinsDiscretizer(encode={est.encode!r}) is not supported")
    edge_col, edges, widths, out_cols = [], [], [], []
    for j, e in enumerate(est.bin_edges_):
        e = np.asarray(e, np.float64)
        inner = e[1:-1]
        edge_col += [j] * len(inner)
        edges += list(inner)
        widths += [(e[-1] - e[0]) / max(len(e) - 1, 1)] * len(inner)
        out_cols.append(len(inner))
    edge_col = np.asarray(edge_col, np.int64)
    temp = tau * np.asarray(widths, np.float64)
    # sklearn: bin = number of inner edges <= x, so ties go to the upper bin.
    centre = place(edge_col, np.asarray(edges), np.ones(len(edges), bool), np.ones(len(edges), bool),
                   temp, reference)
    m = len(edges)
    if est.encode == "ordinal":
        combine = np.zeros((m, len(out_cols)), np.float32)
        combine[np.arange(m), edge_col] = 1.0
        offset = np.zeros(len(out_cols), np.float32)
    else:  # one column per bin: bin b = s_b - s_{b+1}, with s_0 = 1 and s_n = 0
        n_out = sum(k + 1 for k in out_cols)
        combine = np.zeros((m, n_out), np.float32)
        offset = np.zeros(n_out, np.float32)
        k = o = 0
        for n_inner in out_cols:
            offset[o] = 1.0
            for b in range(n_inner):
                combine[k + b, o + b] -= 1.0      # s_{b+1} leaves bin b
                combine[k + b, o + b + 1] += 1.0  # ... and enters bin b+1
            k += n_inner
            o += n_inner + 1
    return SoftBins(len(est.bin_edges_), edge_col, 1.0 / temp, -centre / temp, combine, offset)
