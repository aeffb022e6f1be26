"""``ms-kbk`` (Paella-MS-kbk): kernel by kernel, in arrival order, no occupancy gate.

A kernel is released when it becomes ready (its predecessor completed), onto a free
real stream; the GPU schedules whatever has been released. Compared with ``paella`` it
has neither SRPT ordering nor the +B rule.
"""
from __future__ import annotations

from typing import Any

from .base import HeapPolicy
from .registry import register_policy


@register_policy("ms-kbk")
class MultiStreamKernelByKernel(HeapPolicy):
    gated = False
    stream_mode = "pool"
    eager = False

    def key(self, job: Any) -> tuple[float, int]:
        return job.seq, 0
