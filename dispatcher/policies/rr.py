"""``rr`` (Paella-RR): round robin over jobs, one kernel per turn, under the +B rule.

A job that releases a kernel goes to the back of the queue when its next kernel is
ready: the key is a counter taken at each (re)queueing, so the heap is a FIFO of turns.
"""
from __future__ import annotations

import itertools
from typing import Any

from .base import HeapPolicy
from .registry import register_policy


@register_policy("rr")
class RoundRobin(HeapPolicy):
    def __init__(self, dispatcher: Any = None, **options: Any):
        super().__init__(dispatcher, **options)
        self._turn = itertools.count()

    def key(self, job: Any) -> tuple[float, int]:
        return next(self._turn), 0
