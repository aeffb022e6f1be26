"""Slicing a model into DVABatch stages (paper section 7.1).

The operators (kernels after fusion, in topological order) are cut into ``n`` stages:
first where the operators' preferred batch size changes -- a stage then holds
operators that want the same batch size, so policy II can split a batch exactly where
the smaller size starts to pay -- then, for the stages still missing, balanced in time
at the largest batch size (the longest stage cut at its midpoint).

A compiled network's operators change preference often (one 1x1 convolution prefers 8,
the next 3x3 one 64), so not every change can be a cut: of the places where the
preference changes, the ones taken are those that most reduce the longest stage,
never leaving a stage under ``min_share`` of the model's time (a trick, labelled as
one: the paper does not say how it picks among many changes; cutting at the first ones
gave the full U-Net-like network a first stage of one operator, 0.2% of its time).

An operator's *preferred batch size* is the paper's: the smallest batch size that
fully uses the GPU, read from its profiled times as the first size past which the time
grows (nearly) in proportion to the batch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
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


def slice_stages(ops: Sequence[OpProfile], n: int, min_share: float | None = None) -> list[range]:
    """Cut ``ops`` into ``n`` consecutive stages (ranges of operator indices): first
    where the preferred batch size changes -- up to ``n - 1`` such places, each time the
    one leaving the shortest longest stage, none leaving a stage under ``min_share``
    (default ``1 / (4 n)``) of the total time -- then, while stages are missing, the
    longest stage (its time at the largest profiled batch size) in two at its time
    midpoint."""
    if not 1 <= n <= len(ops):
        raise ValueError(f"cannot cut {len(ops)} operators into {n} stages")
    bs = ops[0].times[-1][0]
    t = [op.time(bs) for op in ops]
    prefs = [preferred_batch(op) for op in ops]
    changes = [i for i in range(1, len(ops)) if prefs[i] != prefs[i - 1]]
    floor = sum(t) * (1 / (4 * n) if min_share is None else min_share)
    bounds = [0, len(ops)]
    while len(bounds) - 1 < n:
        best = None
        for c in changes:
            if c in bounds:
                continue
            cand = sorted(bounds + [c])
            segs = [sum(t[a:b]) for a, b in zip(cand, cand[1:])]
            if min(segs) >= floor and (best is None or max(segs) < best[0]):
                best = (max(segs), c)
        if best is None:
            break
        bounds = sorted(bounds + [best[1]])
    while len(bounds) - 1 < n:
        segs = [(sum(t[a:b]), a, b) for a, b in zip(bounds, bounds[1:]) if b - a > 1]
        _, a, b = max(segs)
        half, acc, cut = sum(t[a:b]) / 2, 0.0, a + 1
        best = math.inf
        for i in range(a + 1, b):
            acc += t[i - 1]
            if abs(acc - half) < best:
                best, cut = abs(acc - half), i
        bounds = sorted(bounds + [cut])
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


__all__ = ["OpProfile", "preferred_batch", "slice_stages"]
