"""Stage work as jobs of the kernel scheduler.

Each stage executor's run becomes one job of the dispatcher: the stage's variant of the
run's batch size (and length bucket) is a model registered with the dispatcher on first
use, and a run of ``num`` rows of a batch is a job of the ``num``-row variant on the
rows' offset in the batch's buffers -- so the late rows of a stretched batch catch up
in the same buffers with the smaller variant, and the children of a split run the
variant of their own size. The dispatcher's policy orders the kernels of the stages'
jobs among themselves and among other models' jobs.

Streams: with ``own_streams`` (the paper's design) every stage executor is bound to a
real stream of its own, reserved under ``f"{name}/s{stage}"``
(:meth:`~paella.dispatcher.core.Dispatcher.stream_named`): a stage's runs follow one
another in that stream's FIFO order, and no other work lands on it. Without, each job
takes free streams from the dispatcher's pool, like any job.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from paella.dispatcher.adaptor import JobAdaptor
from paella.dispatcher.core import STATUS_OK, Request


class DispatcherStageRunner:
    """A :class:`~.pipeline.StageRunner` submitting each run to ``disp``.

    ``make_adaptor(stage, rows, seq_len)`` builds the adaptor of a stage variant; the
    variant is registered as ``f"{name}/s{stage}/b{rows}/l{seq_len}"``."""

    def __init__(self, disp: Any, name: str,
                 make_adaptor: Callable[[int, int, int], JobAdaptor], client_id: int = 0,
                 profile_runs: int = 0, own_streams: bool = False):
        self.disp, self.name, self.make_adaptor = disp, name, make_adaptor
        self.own_streams = own_streams
        self.client_id, self.profile_runs = client_id, profile_runs
        self.model_ids: dict[tuple[int, int, int], int] = {}
        self._io: dict[int, np.ndarray] = {}
        self._next = 0
        self.failed: list[str] = []

    def model_id(self, stage: int, rows: int, seq_len: int) -> int:
        key = (stage, rows, seq_len)
        mid = self.model_ids.get(key)
        if mid is None:
            mid = self.disp.register_model(f"{self.name}/s{stage}/b{rows}/l{seq_len}",
                                           self.make_adaptor(stage, rows, seq_len),
                                           profile_runs=self.profile_runs)
            self.model_ids[key] = mid
            self._io[mid] = np.zeros(max(self.disp.models[mid].adaptor.io_bytes, 1), np.uint8)
        return mid

    def run(self, stage: int, rows: int, seq_len: int, done: Callable[[], None]) -> None:
        mid = self.model_id(stage, rows, seq_len)
        self._next += 1

        def complete(req: Request, status: int, err: str | None) -> None:
            if status != STATUS_OK:
                self.failed.append(f"{self.name} stage {stage}: {err}")
            done()
        req = Request(self._next, self.client_id, mid, self._io[mid], on_complete=complete)
        self.disp.submit_group([req], self._io[mid], model_id=mid,
                               stream=self.stream_name(stage) if self.own_streams else None)

    def stream_name(self, stage: int) -> str:
        """The name of stage ``stage``'s own stream."""
        return f"{self.name}/s{stage}"


class PipelineFront:
    """A :class:`~.pipeline.DvaPipeline` as the virtual-time driver's front stage
    (:class:`~paella.dispatcher.virtual_time.FrontStage`): polled at the device's time,
    its window's end a deadline. (The tests drive a bare pipeline with it; the
    experiment and the daemon drive the ``dvabatch`` batcher through the batching stage.)"""

    def __init__(self, pipe: Any, dev: Any):
        self.pipe = pipe
        self.dev = dev

    @property
    def busy(self) -> bool:
        return not self.pipe.idle

    def step(self) -> None:
        self.pipe.poll(self.dev.now())

    def deadline(self) -> float | None:
        return self.pipe.deadline()


def drive_pipeline(disp: Any, pipe: Any, queries: list, arrival: Callable[[Any], float]) -> None:
    """Run ``queries`` (sorted by ``arrival(q)``, device seconds) through ``pipe`` on
    ``disp`` in virtual time, with the one driver
    (:class:`~paella.dispatcher.virtual_time.VirtualDriver`)."""
    from paella.dispatcher.virtual_time import VirtualDriver
    dev = disp.device

    def arrive(due: range) -> None:
        now = dev.now()
        for i in due:
            pipe.add(queries[i], now)
    VirtualDriver(disp, PipelineFront(pipe, dev), name="dvabatch pipeline").run(
        [arrival(q) for q in queries], arrive)


__all__ = ["DispatcherStageRunner", "PipelineFront", "drive_pipeline"]
