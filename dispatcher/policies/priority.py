"""``priority``: strict request priority, then SRPT, kernel by kernel under the +B rule.

Tenants of one GPU are rarely equal: a latency-critical service shares it with batch
work. A request's priority travels in its ring entry (``paella.wire``: 1 the highest,
255 the lowest, 0 none, which counts as the middle level, 128, as a Triton request
without a priority takes the default level). A job's level is its most urgent request's;
the ready job of the most urgent level goes first, and within a level the one with the
least estimated remaining work (SRPT, as ``paella``), ties to the earlier arrival.

Strict, in two ways. A level is served only while no more urgent job has a ready
kernel; and a less urgent kernel is held back while a more urgent job has a kernel on
the device: blocks cannot be preempted, so a kernel released into the gap between two
dependent kernels of an urgent job would delay the next one (work conservation would
make the urgent job share the GPU with everything behind it). The hold lasts only
while the urgent job's kernels run: waiting for a copy or for its host, it holds nothing.
A stream of urgent work can starve the rest; that is what a strict priority means, and
the deficit counters of ``paella`` are the policy for sharing instead.
"""
from __future__ import annotations

from typing import Any

from .base import HeapPolicy
from .registry import register_policy

@register_policy("priority")
class StrictPriority(HeapPolicy):
    def __init__(self, dispatcher: Any = None, **options: Any):
        super().__init__(dispatcher, **options)
        self.on_device: dict[Any, int] = {}       # job -> its kernels released, not completed
        self.level_on_device: dict[int, int] = {}  # level -> the same, summed

    def key(self, job: Any) -> tuple[float, int]:
        # (the class orders first: HeapPolicy keeps a heap per class; the estimate in
        # whole nanoseconds, its grid, as the kernel core's)
        return round(job.remaining * 1e9), job.seq

    def pick(self) -> Any:
        job = self.top()
        if job is not None and self.level_on_device:
            level = job.level
            if any(lv < level for lv in self.level_on_device):
                return None                          # the hold (module docstring)
        return job

    def released(self, job: Any, op: Any) -> None:
        super().released(job, op)
        self._count(job, +1)

    def kernel_completed(self, job: Any, op: Any) -> None:
        if self.on_device.get(job):
            self._count(job, -1)

    def job_finished(self, job: Any) -> None:
        super().job_finished(job)
        left = self.on_device.get(job, 0)        # (a cancelled job's kernels may not report)
        if left:
            self._count(job, -left)

    def _count(self, job: Any, n: int) -> None:
        level = job.level
        k = self.on_device.get(job, 0) + n
        if k:
            self.on_device[job] = k
        else:
            self.on_device.pop(job, None)
        m = self.level_on_device.get(level, 0) + n
        if m:
            self.level_on_device[level] = m
        else:
            self.level_on_device.pop(level, None)
