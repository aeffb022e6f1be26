"""``sjf`` (Paella-SJF): shortest job first, kernel by kernel under the +B rule.

A job's priority is the model's estimated total time when the job arrived (the same
per-model profile that ``paella`` uses), fixed for the job's life; ties go to the
earlier arrival. Unlike SRPT it does not favour jobs that are almost done.
"""
from __future__ import annotations

from typing import Any

from .base import HeapPolicy
from .registry import register_policy


@register_policy("sjf")
class ShortestJobFirst(HeapPolicy):
    def key(self, job: Any) -> tuple[float, int]:
        return job.estimate, job.seq
