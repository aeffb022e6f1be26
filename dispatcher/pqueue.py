"""Ordered structures for scheduling policies: :class:`IndexedHeap`.

A policy keeps its ready jobs ordered (by remaining time, by arrival, by deficit) and
changes that order on every release. With :mod:`heapq`, a job whose key changes gets a
new entry and the old one is skipped later (lazy deletion, with version counters and
periodic compaction): per kernel that is several tuple allocations, pushes and stale
pops in Python. An indexed heap re-keys or removes an item in place, O(log n), so a
policy states what it means ("this job's key is now x", "this job is not ready") and
nothing stale ever reaches the top.

``IndexedHeap`` (C, ``dispatcher/_pqueue.c``) holds Python objects, compared by
identity, keyed by ``(key: float, tie: int)`` in lexicographic order, least first:

* ``h.push(item, key, tie)`` inserts ``item``, or re-keys it if it is already there;
* ``h.remove(item) -> bool`` (False if absent); ``h.pop() -> item``;
* ``h.top() -> item | None``; ``h.top_key() -> float`` (IndexError if empty);
* ``h.key(item) -> (key, tie)``; ``h.shift(delta)`` adds ``delta`` to every key;
* ``len(h)``, ``item in h``, ``h.items()`` (heap order), ``h.clear()``.

A NaN key is refused (ValueError): it orders against nothing. For a max-heap, push
the negated key.
"""
from __future__ import annotations

from .native import load

IndexedHeap = load("_pqueue").IndexedHeap

__all__ = ["IndexedHeap"]
