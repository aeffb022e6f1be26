"""Stage work as jobs of the kernel scheduler, for a bare pipeline its caller drives.

Each stage executor's run becomes one job submitted through a scheduler context
(:class:`~paella.dispatcher.batchers.base.SchedulerContext`, a scheduler's one way to the
dispatcher; in virtual time built by
:func:`~paella.dispatcher.batchers.stage.scheduler_context`): the stage's variant of the
run's batch size (and length bucket) is a model the runner registers on first use, and
a run of ``num`` rows of a batch is a job of the ``num``-row variant on the rows' offset
in the batch's buffers -- so the late rows of a stretched batch catch up in the same
buffers with the smaller variant, and the children of a split run the variant of their
own size. The dispatcher's policy orders the kernels of the stages' jobs among
themselves and among other models' jobs.

Streams: with ``own_streams`` (the paper's design) every stage executor is bound to a
real stream of its own, reserved under ``f"{ctx.name}/s{stage}"``
(:meth:`~paella.dispatcher.core.Dispatcher.stream_named`): a stage's runs follow one
another in that stream's FIFO order, and no other work lands on it. Without, each job
takes free streams from the dispatcher's pool, like any job.

(The daemon and the experiment run the ``dvabatch`` scheduler, :mod:`.batcher`, whose
stage runs move real rows; this runner moves timing only.)
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from paella import rings
from paella.dispatcher.adaptor import JobAdaptor
from paella.dispatcher.batchers.base import SchedulerContext


class DispatcherStageRunner:
    """A :class:`~.pipeline.StageRunner` submitting each run through ``ctx``.

    ``make_adaptor(stage, rows, seq_len)`` builds the adaptor of a stage variant; the
    variant is registered as ``f"s{stage}/b{rows}/l{seq_len}"`` (the context prefixes
    its name)."""

    def __init__(self, ctx: SchedulerContext,
                 make_adaptor: Callable[[int, int, int], JobAdaptor], client_id: int = 0,
                 profile_runs: int = 0, own_streams: bool = False):
        self.ctx, self.make_adaptor = ctx, make_adaptor
        self.own_streams = own_streams
        self.client_id, self.profile_runs = client_id, profile_runs
        self.model_ids: dict[tuple[int, int, int], int] = {}
        self._io: dict[int, np.ndarray] = {}
        self.failed: list[str] = []

    def model_id(self, stage: int, rows: int, seq_len: int) -> int:
        key = (stage, rows, seq_len)
        mid = self.model_ids.get(key)
        if mid is None:
            mid = self.ctx.register_model(f"s{stage}/b{rows}/l{seq_len}",
                                          self.make_adaptor(stage, rows, seq_len),
                                          profile_runs=self.profile_runs)
            self.model_ids[key] = mid
            self._io[mid] = np.zeros(max(self.ctx.adaptor(mid).io_bytes, 1), np.uint8)
        return mid

    def run(self, stage: int, rows: int, seq_len: int, done: Callable[[], None]) -> None:
        mid = self.model_id(stage, rows, seq_len)

        def complete(status: int, err: str | None) -> None:
            if status != rings.OK:
                self.failed.append(f"{self.ctx.name} stage {stage}: {err}")
            done()
        self.ctx.submit(mid, self._io[mid], [self.client_id], complete,
                        stream=f"s{stage}" if self.own_streams else None)

    def stream_name(self, stage: int) -> str:
        """The name of stage ``stage``'s own stream (the dispatcher's)."""
        return f"{self.ctx.name}/s{stage}"


class PipelineFront:
    """A :class:`~.pipeline.DvaPipeline` as the virtual-time driver's front stage
    (:class:`~paella.dispatcher.virtual_time.FrontStage`): polled at the context's time,
    its window's end a deadline. (The tests drive a bare pipeline with it; the
    experiment and the daemon drive the ``dvabatch`` batcher through the batching stage.)"""

    def __init__(self, pipe: Any, ctx: SchedulerContext):
        self.pipe = pipe
        self.ctx = ctx

    @property
    def busy(self) -> bool:
        return not self.pipe.idle

    def step(self) -> None:
        self.pipe.poll(self.ctx.now())

    def deadline(self) -> float | None:
        return self.pipe.deadline()


def drive_pipeline(ctx: SchedulerContext, pipe: Any, queries: list,
                   arrival: Callable[[Any], float]) -> None:
    """Run ``queries`` (sorted by ``arrival(q)``, device seconds) through ``pipe`` in
    virtual time, with the one driver (:meth:`SchedulerContext.run_virtual`)."""
    def arrive(due: range) -> None:
        now = ctx.now()
        for i in due:
            pipe.add(queries[i], now)
    ctx.run_virtual(PipelineFront(pipe, ctx), [arrival(q) for q in queries], arrive,
                    name="dvabatch pipeline")


__all__ = ["DispatcherStageRunner", "PipelineFront", "drive_pipeline"]
