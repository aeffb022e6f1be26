"""``fifo`` (Paella-SS in Table 3): one real stream, jobs in arrival order.

Dispatch is at job granularity: a job's stream-ordered ops go to stream 0 as soon as
their predecessor is released (``eager``), and nothing is held back (``gated`` off), so
the GPU's single FIFO queue serializes jobs exactly as one CUDA stream would. It is also
the fallback when a plug-in policy raises.
"""
from __future__ import annotations

from typing import Any

from .base import HeapPolicy
from .registry import register_policy


@register_policy("fifo")
class Fifo(HeapPolicy):
    gated = False
    stream_mode = "single"
    eager = True

    def key(self, job: Any) -> tuple[float, int]:
        return job.seq, 0
