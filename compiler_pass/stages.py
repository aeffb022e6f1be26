"""Slicing a model into DVABatch stages (paper section 7.1).

The paper's rule: "the operators are time-evenly assigned to the stages in the
topological order", and DVABatch "considers the operators' preferred batch size and
slices a model at specific operators for operator diversity". So the operators (kernels
after fusion, in topological order) are first cut into ``n`` stages as evenly in time as
a contiguous cut allows (the longest stage as short as possible, at the largest profiled
batch size); then each cut moves to the nearest place where the preferred batch size
changes, if the longest stage stays within ``tolerance`` of the even cut's -- a stage
then starts where its operators want another batch size, so policy II can split a batch
exactly there.

``tolerance`` (10%) is ours, labelled as such: the paper does not say how it weighs the
two rules. Cutting at preference changes first (this module's earlier rule) left
ResNet-152's 36 identical bottleneck blocks in one stage (10 / 13 / 78 / 8 ms at batch
64) and the U-Net-like network with stages of 52 / 229 / 60 / 220 ms, and a stage cut
with one dominant stage pipelines little (docs/dvabatch.md, "Slicing").

An operator's *preferred batch size* is the paper's: the smallest batch size that
fully uses the GPU, read from its profiled times as the first size past which the time
grows (nearly) in proportion to the batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Sequence


@dataclass(frozen=True)
class OpProfile:
    """One operator's profiled time (seconds) per batch size."""
    name: str
    times: tuple[tuple[int, float], ...]          # ((batch size, seconds), ...) ascending

    def time(self, bs: int) -> float:
        return dict(self.times)[bs]


def preferred_batch(op: OpProfile, linear: float = 0.9) -> int:
    """The smallest profiled batch size from which doubling (the next profiled size)
    costs at least ``linear`` times proportionally more time; the largest size if the
    operator never saturates the GPU."""
    ts = list(op.times)
    for (b0, t0), (b1, t1) in zip(ts, ts[1:]):
        if t1 >= linear * t0 * b1 / b0:
            return b0
    return ts[-1][0]


def _fits(t: Sequence[float], n: int, most: float) -> bool:
    """Whether ``t`` cuts into at most ``n`` contiguous stages of at most ``most`` each
    (greedy: a stage takes operators while they fit)."""
    stages, acc = 1, 0.0
    for x in t:
        if x > most:
            return False
        if acc + x > most:
            stages, acc = stages + 1, 0.0
        acc += x
    return stages <= n


def even_cuts(t: Sequence[float], n: int) -> list[int]:
    """The ``n - 1`` cut positions of ``t`` (times in topological order) whose longest
    stage is shortest; among those, the one whose stages' squared times sum least (the
    most even). The shortest longest stage by bisection on the greedy packing, then a
    dynamic programme over the cuts whose stages stay within it: each stage spans only
    the operators that fit, so a model of a few hundred operators cuts in well under a
    second whatever ``n``."""
    size = len(t)
    if not 1 <= n <= size:
        raise ValueError(f"cannot cut {size} operators into {n} stages")
    pre = [0.0, *accumulate(t)]
    lo, hi = max(t, default=0.0), pre[-1]
    for _ in range(100):                 # to float resolution: the bound is a sum of t
        mid = (lo + hi) / 2
        if mid <= lo or mid >= hi:
            break
        lo, hi = (lo, mid) if _fits(t, n, mid) else (mid, hi)
    most = hi * (1 + 1e-12) + 1e-300
    inf = (float("inf"), ())
    # best[i]: (sum of squares, cuts) of t[i:] in k stages, each within ``most``
    best = [((pre[size] - pre[i]) ** 2, ()) if pre[size] - pre[i] <= most else inf
            for i in range(size)]
    for k in range(2, n + 1):
        nxt = [inf] * size
        for i in range(size - k + 1):
            top = inf
            for j in range(i + 1, size - k + 2):
                head = pre[j] - pre[i]
                if head > most:
                    break
                squares, cuts = best[j]
                if head * head + squares < top[0]:
                    top = (head * head + squares, (j,) + cuts)
            nxt[i] = top
        best = nxt
    return list(best[0][1])


def slice_stages(ops: Sequence[OpProfile], n: int, tolerance: float = 0.1) -> list[range]:
    """Cut ``ops`` into ``n`` consecutive stages (ranges of operator indices): evenly in
    time at the largest profiled batch size (:func:`even_cuts`), then each cut, in order,
    moved to the preference change nearest it in time between its neighbours whose move
    keeps the longest stage within ``1 + tolerance`` of the even cut's."""
    if not 1 <= n <= len(ops):
        raise ValueError(f"cannot cut {len(ops)} operators into {n} stages")
    if tolerance < 0:
        raise ValueError(f"tolerance must be at least 0, not {tolerance}")
    bs = ops[0].times[-1][0]
    t = [op.time(bs) for op in ops]
    prefs = [preferred_batch(op) for op in ops]
    changes = [i for i in range(1, len(ops)) if prefs[i] != prefs[i - 1]]
    pre = [0.0, *accumulate(t)]

    def longest(cuts: list[int]) -> float:
        b = [0, *cuts, len(ops)]
        return max(pre[y] - pre[x] for x, y in zip(b, b[1:]))

    cuts = even_cuts(t, n)
    limit = longest(cuts) * (1 + tolerance)
    for k, c in enumerate(cuts):
        lo = cuts[k - 1] + 1 if k else 1
        hi = cuts[k + 1] - 1 if k + 1 < len(cuts) else len(ops) - 1
        for _, near in sorted((abs(pre[x] - pre[c]), x) for x in changes if lo <= x <= hi):
            trial = cuts[:k] + [near] + cuts[k + 1:]
            if longest(trial) <= limit:
                cuts = trial
                break
    b = [0, *cuts, len(ops)]
    return [range(x, y) for x, y in zip(b, b[1:])]


__all__ = ["OpProfile", "even_cuts", "preferred_batch", "slice_stages"]
