"""``ms-jbj`` (Paella-MS-jbj, like CUDA-MS): every job on its own stream, job by job.

Each virtual stream binds to a real stream round-robin over the pool (``sticky``); a
job's stream-ordered ops are all released as soon as they are issued (``eager``,
ungated), so the GPU's hardware queues, not the dispatcher, decide what runs: the
head-of-line blocking of §2 appears when jobs outnumber the hardware queues.
"""
from __future__ import annotations

from typing import Any

from .base import HeapPolicy
from .registry import register_policy


@register_policy("ms-jbj")
class MultiStreamJobByJob(HeapPolicy):
    gated = False
    stream_mode = "sticky"
    eager = True

    def key(self, job: Any) -> tuple[float, int]:
        return job.seq, 0
