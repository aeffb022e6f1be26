"""DVABatch's three scheduling policies (paper section 7.2), as pure functions.

* **Input diversity** (policy I): queries are grouped by input length -- padded to
  their length bucket -- and each group is a batch of its own, so short queries are not
  padded to the longest one and leave early; the groups run in parallel.
* **Operator diversity** (policy II): when a stage completes, a batch of ``bs`` is split
  in two halves when the remaining stages take at least twice as long at ``bs`` as at
  ``bs / 2`` (``T_remain(bs) >= 2 x T_remain(bs / 2)``): past that point the GPU is
  saturated by half the batch, and running the halves one after the other lets the
  first half leave earlier at no cost. Applied again to each half.
* **Load diversity** (policy III): a query that arrives while the newest batch is
  running joins it (stretch) unless that batch has been running for ``T_comp_wait``
  already (the stretch would delay its own queries too much).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence


def length_bucket(seq_len: int, buckets: Sequence[int]) -> int:
    """The smallest bucket taking ``seq_len`` (the length a query is padded to); 0 for
    a model without a length axis (``buckets`` empty)."""
    if not buckets:
        return 0
    for b in sorted(buckets):
        if seq_len <= b:
            return b
    raise ValueError(f"length {seq_len} exceeds the largest bucket {max(buckets)}")


def group_by_length(queries: Sequence[Any], buckets: Sequence[int]) -> list[tuple[int, list[Any]]]:
    """Policy I: ``[(bucket, queries)]``, shortest bucket first, arrival order kept
    within a group. Without buckets, one group of everything (bucket 0)."""
    groups: dict[int, list[Any]] = {}
    for q in queries:
        groups.setdefault(length_bucket(q.seq_len, buckets), []).append(q)
    return sorted(groups.items())


def split_sizes(bs: int, t_remain: Callable[[int], float], factor: float = 2.0) -> list[int]:
    """Policy II: the sizes ``bs`` is split into (``[bs]``: no split). ``t_remain(b)``
    is the profiled time of the remaining stages at batch size ``b``; a batch splits
    while ``t_remain(bs) >= factor x t_remain(bs/2)`` (the paper's factor: 2). An odd
    batch splits into its ceiling half first."""
    if bs < 2:
        return [bs]
    hi = (bs + 1) // 2
    lo = bs - hi
    if t_remain(bs) >= factor * t_remain(hi):
        return split_sizes(hi, t_remain, factor) + split_sizes(lo, t_remain, factor)
    return [bs]


def may_stretch(batch_time: float, now: float, t_comp_wait: float) -> bool:
    """Policy III: a batch made at ``batch_time`` takes more queries until it has been
    running for ``t_comp_wait``."""
    return now - batch_time < t_comp_wait


__all__ = ["group_by_length", "length_bucket", "may_stretch", "split_sizes"]
