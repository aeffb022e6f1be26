"""Branchy networks found by architecture search, for Nimble's multi-stream experiment
(``paella experiment nimble``): NASNet-A (mobile), AmoebaNet-A and DARTS (V2) *like*
models built from their published cells, with seeded weights.

"Like": the cells follow the published ones (which op on which earlier state, what is
concatenated) as we read them from the papers' figures and DARTS's ``genotypes.py``,
written here without checking against the reference code; and the network is cut
down so that TVM compiles it in well under a minute (16-26 s here): two normal cells
per stage (the paper's mobile models have four to six), one
application of each separable convolution (NASNet applies it twice), channels 24 / 48
/ 96 at 56 / 28 / 14 pixels, and no auxiliary head, drop-path or factorized-reduction
subtleties. What matters here is the shape of the graph: every cell is five (NASNet,
AmoebaNet) or four (DARTS) pairwise-summed branches over two input states, the
structure whose concurrency the paper's Table 3.1 measures.

A cell: both inputs go through a ReLU-1x1-conv-BN to ``c`` channels (the previous-
previous state with stride 2 when it is twice the resolution); each node adds two
ops, each on an earlier state (0: previous-previous, 1: previous, 2.. the cell's
nodes); the output concatenates the nodes no other node consumes (NASNet, AmoebaNet)
or the listed ones (DARTS). In a reduction cell the ops on the inputs have stride 2.
"""
from __future__ import annotations

from dataclasses import dataclass

from tvm.relax.frontend import nn

from .base import ModelDef, export
from .layers import BatchNorm, ConvBN, avg_pool, concat, global_avg_pool, max_pool


@dataclass(frozen=True)
class Genotype:
    """A cell: ``nodes[i]`` = ((op, input), (op, input)); ``concat`` = the states joined
    at the output (None: every node no other node reads)."""
    nodes: tuple[tuple[tuple[str, int], tuple[str, int]], ...]
    concat: tuple[int, ...] | None = None


# NASNet-A (Zoph et al. 2018, Fig. 4), states 0 = h_{i-1}, 1 = h_i.
NASNET_NORMAL = Genotype((
    (("sep3", 1), ("skip", 1)), (("sep3", 0), ("sep5", 1)), (("avg3", 1), ("skip", 0)),
    (("avg3", 0), ("avg3", 0)), (("sep5", 0), ("sep3", 0))))
NASNET_REDUCE = Genotype((
    (("sep7", 0), ("sep5", 1)), (("max3", 1), ("sep7", 0)), (("avg3", 1), ("sep5", 0)),
    (("max3", 1), ("sep3", 2)), (("avg3", 2), ("skip", 3))))
# AmoebaNet-A (Real et al. 2019, Fig. 4).
AMOEBA_NORMAL = Genotype((
    (("avg3", 0), ("max3", 0)), (("sep3", 1), ("skip", 1)), (("avg3", 0), ("sep3", 1)),
    (("skip", 1), ("sep3", 2)), (("avg3", 3), ("sep3", 0))))
AMOEBA_REDUCE = Genotype((
    (("avg3", 0), ("sep3", 0)), (("max3", 0), ("sep7", 0)), (("max3", 1), ("conv17", 0)),
    (("sep7", 1), ("avg3", 2)), (("max3", 3), ("skip", 4))))
# DARTS V2 (Liu et al. 2019, genotypes.py DARTS_V2).
DARTS_NORMAL = Genotype((
    (("sep3", 0), ("sep3", 1)), (("sep3", 0), ("sep3", 1)), (("sep3", 1), ("skip", 0)),
    (("skip", 0), ("dil3", 2))), concat=(2, 3, 4, 5))
DARTS_REDUCE = Genotype((
    (("max3", 0), ("max3", 1)), (("skip", 2), ("max3", 1)), (("max3", 0), ("skip", 2)),
    (("skip", 2), ("max3", 1))), concat=(2, 3, 4, 5))


class SepConv(nn.Module):
    """ReLU, depthwise k x k (dilated by ``dilation``), pointwise 1x1, batch norm."""

    def __init__(self, c: int, k: int, stride: int, dilation: int = 1):
        self.dw = nn.Conv2D(c, c, k, stride=stride, padding=dilation * (k // 2), dilation=dilation,
                            groups=c, bias=False)
        self.pw = ConvBN(c, c, 1, act=None)

    def forward(self, x):
        return self.pw(self.dw(nn.op.relu(x)))


class Conv17(nn.Module):
    """ReLU, 1x7 then 7x1 convolution, batch norm (AmoebaNet's "1x7 then 7x1")."""

    def __init__(self, c: int, stride: int):
        self.a = nn.Conv2D(c, c, (1, 7), stride=(1, stride), padding=(0, 3), bias=False)
        self.b = nn.Conv2D(c, c, (7, 1), stride=(stride, 1), padding=(3, 0), bias=False)
        self.bn = BatchNorm(c)

    def forward(self, x):
        return self.bn(self.b(self.a(nn.op.relu(x))))


class Pool(nn.Module):
    def __init__(self, kind: str, stride: int):
        self.kind, self.stride = kind, stride

    def forward(self, x):
        pool = avg_pool if self.kind == "avg" else max_pool
        return pool(x, 3, self.stride, 1)


class Identity(nn.Module):
    def forward(self, x):
        return x


def make_op(name: str, c: int, stride: int) -> nn.Module:
    if name.startswith("sep"):
        return SepConv(c, int(name[3:]), stride)
    if name == "dil3":
        return SepConv(c, 3, stride, dilation=2)
    if name == "conv17":
        return Conv17(c, stride)
    if name in ("avg3", "max3"):
        return Pool(name[:3], stride)
    if name == "skip":
        return Identity() if stride == 1 else ConvBN(c, c, 1, stride=stride, act=None)
    raise ValueError(f"unknown cell op {name!r}")


class Preprocess(nn.Module):
    """ReLU, 1x1 conv (stride 2 to halve the resolution), batch norm."""

    def __init__(self, cin: int, c: int, stride: int = 1):
        self.conv = ConvBN(cin, c, 1, stride=stride, act=None)

    def forward(self, x):
        return self.conv(nn.op.relu(x))


class Cell(nn.Module):
    def __init__(self, g: Genotype, c_pp: int, c_p: int, c: int, reduction: bool, reduce_pp: bool):
        self.pre0 = Preprocess(c_pp, c, 2 if reduce_pp else 1)
        self.pre1 = Preprocess(c_p, c)
        self.inputs = [(a, b) for (_, a), (_, b) in g.nodes]
        ops = []
        for (na, a), (nb, b) in g.nodes:
            for name, i in ((na, a), (nb, b)):
                ops.append(make_op(name, c, 2 if reduction and i < 2 else 1))
        self.ops = nn.ModuleList(ops)
        used = {i for ab in self.inputs for i in ab}
        n = 2 + len(g.nodes)
        self.concat = list(g.concat) if g.concat else [i for i in range(2, n) if i not in used]
        self.multiplier = len(self.concat)

    def forward(self, s0, s1):
        states = [self.pre0(s0), self.pre1(s1)]
        for k, (a, b) in enumerate(self.inputs):
            states.append(self.ops[2 * k](states[a]) + self.ops[2 * k + 1](states[b]))
        return concat([states[i] for i in self.concat])


class CellNet(nn.Module):
    """Stem (two stride-2 convs to 56x56), three stages of ``normal`` normal cells with a
    reduction cell between stages, global pooling, classifier."""

    def __init__(self, normal: Genotype, reduce: Genotype, c: int = 24, per_stage: int = 2,
                 classes: int = 1000):
        self.stem0 = ConvBN(3, c, 3, stride=2, padding=1)
        self.stem1 = ConvBN(c, c, 3, stride=2, padding=1)
        cells = []
        c_pp, c_p, reduce_prev = c, c, False
        for stage in range(3):
            if stage:
                c *= 2
                cell = Cell(reduce, c_pp, c_p, c, True, reduce_prev)
                cells.append(cell)
                c_pp, c_p, reduce_prev = c_p, c * cell.multiplier, True
            for _ in range(per_stage):
                cell = Cell(normal, c_pp, c_p, c, False, reduce_prev)
                cells.append(cell)
                c_pp, c_p, reduce_prev = c_p, c * cell.multiplier, False
        self.cells = nn.ModuleList(cells)
        self.fc = nn.Linear(c_p, classes)

    def forward(self, x):
        s0 = self.stem0(x)
        s1 = self.stem1(s0)
        s0 = s1
        for cell in self.cells:
            s0, s1 = s1, cell(s0, s1)
        return self.fc(global_avg_pool(nn.op.relu(s1)))


def _model(name: str, normal: Genotype, reduce: Genotype, label: str, batch: int) -> ModelDef:
    return export(name, CellNet(normal, reduce), {"x": ((batch, 3, 224, 224), "float32")},
                  description=f"{label}-like cells (docs/nimble.md), batch {batch}, 224x224, "
                              f"seeded random weights")


def nasnet_mobile(batch: int = 1) -> ModelDef:
    return _model("nasnet_mobile", NASNET_NORMAL, NASNET_REDUCE, "NASNet-A (mobile)", batch)


def amoebanet(batch: int = 1) -> ModelDef:
    return _model("amoebanet", AMOEBA_NORMAL, AMOEBA_REDUCE, "AmoebaNet-A", batch)


def darts(batch: int = 1) -> ModelDef:
    return _model("darts", DARTS_NORMAL, DARTS_REDUCE, "DARTS (V2)", batch)
