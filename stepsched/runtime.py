"""The step scheduler on the kernel scheduler: every batched step is a job.

:class:`StepRuntime` drives a step policy (:class:`~.cell_scheduler.CellularScheduler`,
:class:`~.iteration_scheduler.IterationScheduler` or the graph-batching baseline
:class:`~.padding.PaddingBatcher`) through a scheduler context.
Whenever a worker is idle it asks the policy for tasks and submits each as one job
(``ctx.submit``) of the model's step adaptor, with one internal request per request in
the task, carrying that request's client id. So Paella's policy sees the steps of every
model sharing the GPU as ordinary jobs (SRPT across models, deficit counters across
clients), and a client that goes away cancels its part of a running step like any
request's.

A *worker* is BatchMaker's: a FIFO of tasks of which one is on the GPU at a time
(tasks of one subgraph depend on each other, and the kernel scheduler may reorder
independent jobs). ``n_workers`` > 1 keeps that many steps in flight; Algorithm 1's
pinning keeps dependent steps on one worker.

What a task launches comes from ``kernels_for(task)`` (:mod:`.step_kernels`); what it
computes, on a device that runs no code, from ``effect(task, view)``, applied in device
memory when the task's last kernel completes (the simulator's functional effects).

Where the jobs go: the :class:`~paella.dispatcher.batchers.base.SchedulerContext`, the
runtime's one way to the dispatcher. In the daemon it is the one the batching stage
gives a scheduler plug-in (:mod:`.orca_plugin`); in virtual time (experiments, tests)
the caller builds one on its dispatcher
(:func:`paella.dispatcher.batchers.stage.scheduler_context`) and :meth:`StepRuntime.drive`
steps it. The runtime uses the clock, registering a model, submitting a job for
clients, and device memory.

Replayed steps (``plans=True``): each task runs instead as a job of a launch plan made
of its kernel list (:meth:`StepRuntime._plan_model`: one dispatcher model per distinct
list, registered through the context on first use), which the dispatcher replays with no
greenlet, and its kernel core with no Python per kernel when the dispatcher runs one
(``Dispatcher(kernel_core="auto")``: no step adaptor is registered then, which would take
it off its core). The GPU sees the same launches in the same order, so in virtual time
the steps end at the same instants (tests/stepsched/test_orca_replay.py: the orca
experiment's points come out bit for bit the same either way); what differs is the
dispatcher's bookkeeping: each kernel list is a model of its own, with its own kernel
statistics for SRPT (the step adaptor's steps share one model's), and a list met once
costs its registration. Timing-only steps: no functional effect and no copies (a
preempting engine's swaps need the step adaptor).

Host cost: with ``cpu_scale`` > 0 the CPU time the step scheduler spends forming a round
of tasks (``time.thread_time`` around the policy) delays their submission by that much
virtual time, times ``cpu_scale``, split evenly over the round's tasks (the GPU runs the
first while the others are formed): BatchMaker's "scheduling and gathering overhead"
(§7.3), measured on this implementation rather than assumed. The two clock reads' own
share of the window (``paella.cpu_clock.clock_overhead``, 0.44 us here) is taken out, as the
harness does for the dispatcher.
"""
from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from paella.cpu_clock import clock_overhead
from paella.dispatcher import cudart as cuda
from paella.dispatcher.adaptor import JobAdaptor
from paella.dispatcher.batchers.base import SchedulerContext
from paella.dispatcher.devices.base import Device, ModuleImage

from .step_kernels import StepKernels
from .timeline import StepPolicy


class StepAdaptor(JobAdaptor):
    """The job adaptor of one model's steps: ``run(io)`` launches the kernels of the
    task whose id is in ``io`` (modules loaded once per distinct kernel list)."""

    io_bytes = 8

    def __init__(self, name: str, runtime: "StepRuntime"):
        self.name = name
        self.runtime = runtime
        self.device: Device | None = None
        self._modules: dict[str, dict] = {}

    def init(self, device: Device) -> None:
        if device.late_effects:
            # The step's results are its last kernel's effect, read when the job ends,
            # which the notifQ can show before the effect arrives (a crash before this).
            raise RuntimeError(f"step model {self.name!r} reads its kernels' functional "
                               f"effects as they complete, which this simulator applies "
                               f"later (--sim-mode process); serve it with the simulator "
                               f"stepped in the loop (--sim-mode stepped, the default)")
        self.device = device

    def _funcs(self, sk: StepKernels) -> dict:
        funcs = self._modules.get(sk.name)
        if funcs is None:
            rt = self.runtime
            last = sk.launches[-1].kernel
            def effect(view: Callable, args: tuple) -> None:
                if len(args) == 1:
                    rt._effect(args[0], view)
            if rt.pending is not None:
                effect.pending = lambda view, args: (    # type: ignore[attr-defined]
                    rt._pending(args[0]) if len(args) == 1 else None)
                # A step serves a batch of many clients' requests, a few at a time: its
                # hold is never refused for the device's bound (SimDevice._refuse_hold).
                effect.step_hold = True                  # type: ignore[attr-defined]
            effects = {last: effect}
            funcs = self.device.load_module(ModuleImage(sk.name, sk.kernels, effects=effects))
            self._modules[sk.name] = funcs
        return funcs

    def run(self, io: np.ndarray) -> None:
        task_id = int(io[:8].view(np.int64)[0])
        sk = self.runtime._running[task_id].kernels
        funcs = self._funcs(sk)
        for kind, nbytes in sk.copies:       # timing of a swap through the copy engines
            dev_buf, host = cuda.malloc(nbytes), np.empty(nbytes, np.uint8)
            if kind == "d2h":
                cuda.memcpy_dtoh(host, dev_buf)
            else:
                cuda.memcpy_htod(dev_buf, host)
        n = len(sk.launches)
        for i, ln in enumerate(sk.launches):
            cuda.launch(funcs[ln.kernel], ln.grid, ln.block, dyn_smem=ln.dyn_smem,
                        args=(task_id,) if i == n - 1 else ())
        cuda.device_synchronize()


@dataclass(eq=False)
class _InFlight:
    task: Any
    kernels: StepKernels
    cancelled: bool = False


@dataclass
class StepStats:
    tasks: int = 0
    rows: int = 0               # request-steps run
    padded_rows: int = 0        # rows of compiled batch sizes no request filled
    padded_cells: int = 0       # graph batching: cells run past a request's own length
    host_seconds: float = 0.0   # scheduler CPU charged

    def to_dict(self) -> dict:
        return {"tasks": self.tasks, "rows": self.rows, "padded_rows": self.padded_rows,
                "padded_cells": self.padded_cells,
                "mean_batch": self.rows / self.tasks if self.tasks else 0.0,
                "host_us_per_task": 1e6 * self.host_seconds / self.tasks if self.tasks else 0.0}


class StepRuntime:
    """A step policy's tasks as jobs submitted through ``ctx`` (see the module docstring)."""

    def __init__(self, ctx: SchedulerContext, policy: StepPolicy,
                 kernels_for: Callable[[Any], StepKernels],
                 *, name: str = "steps", n_workers: int = 1,
                 client_of: Callable[[Any], int] = lambda req: 0,
                 effect: Callable[[Any, Callable], None] | None = None,
                 pending: Callable[[Any], Any] | None = None,
                 on_task_done: Callable[[Any, list], None] | None = None,
                 cpu_scale: float = 0.0, plans: bool = False):
        self.ctx = ctx
        self.policy = policy
        self.kernels_for = kernels_for
        self.client_of = client_of
        self.effect = effect
        #: ``pending(task)``: the future of the task's effect while it is still being
        #: computed elsewhere (the device holds the task's last kernel until it is done).
        self.pending = pending
        self.on_task_done = on_task_done
        self.cpu_scale = cpu_scale
        #: What the two clock reads around a round add to it (a system call each): the
        #: meter's cost, not the scheduler's, taken out as the harness's CpuCharge does.
        self._clock_overhead = clock_overhead() if cpu_scale else 0.0
        self.n_workers = n_workers
        self.queues = [deque() for _ in range(n_workers)]
        self.busy = [False] * n_workers
        self.adaptor = StepAdaptor(name, self)
        #: Replayed steps (the module docstring), their models by kernel list name.
        self.plans = plans
        if plans and effect is not None:
            raise ValueError(f"step runtime {name!r}: replayed steps (plans=True) are timing "
                             f"only; a functional effect needs the step adaptor (plans=False)")
        self._plan_models: dict[str, int] = {}
        #: The step adaptor's model (-1 with replayed steps: none registered).
        self.model_id = -1 if plans else self.ctx.register_model(name, self.adaptor, profile_runs=0)
        self.finished: dict[Any, float] = {}
        self.stats = StepStats()
        self._running: dict[int, _InFlight] = {}
        self._delayed: list = []            # (ready time, seq, worker, task)
        self._ids = itertools.count(1)
        self._seq = itertools.count()
        self._io = {}
        #: ``job_for(task) -> (model id, io)``: the job a task runs instead of this
        #: runtime's own step adaptor (a compiled plan registered through the context,
        #: on a real GPU); None: the step adaptor.
        self.job_for: Callable[[Any], tuple[int, np.ndarray]] | None = None

    # ---- requests ----------------------------------------------------------------------
    def add(self, item: Any, kick: bool = True) -> None:
        """A request arrives (``kick=False``: more arrive at this instant; call
        :meth:`kick` after the last, so they can share the first step)."""
        self.policy.add(item, self.ctx.now())
        if kick:
            self.kick()

    @property
    def active(self) -> bool:
        return bool(self.policy.pending or self._running or self._delayed or any(self.queues))

    # ---- workers -----------------------------------------------------------------------
    def kick(self) -> None:
        """Hand tasks to every idle worker (Algorithm 1 runs when a worker is idle)."""
        now = self.ctx.now()
        for w in range(self.n_workers):
            if self.busy[w] or self.queues[w]:
                continue
            c0 = time.thread_time() if self.cpu_scale else 0.0
            tasks = self.policy.schedule(w, now)
            if not tasks:
                continue
            spent = (max(0.0, time.thread_time() - c0 - self._clock_overhead) * self.cpu_scale
                     if self.cpu_scale else 0.0)
            self.stats.host_seconds += spent
            # The round's host time is split evenly over its tasks: task i is formed (and
            # can go to the GPU) after (i + 1) / n of it, while the GPU runs the ones before.
            k = len(tasks)
            self.queues[w].extend((now + spent * (i + 1) / k, t) for i, t in enumerate(tasks))
            self._next(w)

    def _next(self, w: int) -> None:
        ready_at, task = self.queues[w].popleft()
        self.busy[w] = True
        if ready_at > self.ctx.now():
            heapq.heappush(self._delayed, (ready_at, next(self._seq), w, task))
        else:
            self._submit(task)

    def release_delayed(self) -> None:
        now = self.ctx.now()
        while self._delayed and self._delayed[0][0] <= now:
            _, _, _, task = heapq.heappop(self._delayed)
            self._submit(task)

    def _submit(self, task: Any) -> None:
        tid = next(self._ids)
        reqs = list(task.requests)
        sk = self.kernels_for(task)
        self._running[tid] = _InFlight(task, sk)
        st = self.stats
        st.tasks += 1
        st.rows += len(reqs)
        st.padded_rows += max(0, getattr(task, "batch_size", len(reqs)) - len(reqs))
        st.padded_cells += getattr(task, "padded_cells", 0)
        if self.job_for is not None:
            model_id, io = self.job_for(task)
        elif self.plans:
            model_id, io = self._plan_model(sk), np.zeros(StepAdaptor.io_bytes, np.uint8)
        else:
            model_id, io = self.model_id, np.zeros(8, np.uint8)
            io.view(np.int64)[0] = tid
        self.ctx.submit(model_id, io, [self.client_of(r) for r in reqs],
                         lambda status, err, tid=tid: self._task_done(tid, status),
                         ready=self._pending(tid))

    def _plan_model(self, sk: StepKernels) -> int:
        """The dispatcher model whose launch plan is ``sk``'s launches, in order (one
        stream, as the step adaptor launches them), registered on first use: ``sk.name``
        names one kernel list (as for the step adaptor's modules)."""
        if sk.copies:
            raise ValueError(f"step runtime {self.adaptor.name!r}: step {sk.name!r} copies "
                             f"{len(sk.copies)} buffer(s) (a swap), which replayed steps "
                             f"(plans=True) do not; use the step adaptor (plans=False)")
        mid = self._plan_models.get(sk.name)
        if mid is None:
            from paella.dispatcher.adaptor import Plan, PlanAdaptor, PlanOp
            ops = [PlanOp("launch", kernel=ln.kernel, grid=ln.grid, block=ln.block, dyn_smem=ln.dyn_smem)
                   for ln in sk.launches]
            plan = Plan(sk.name, sk.kernels, ops, io_bytes=StepAdaptor.io_bytes)
            mid = self._plan_models[sk.name] = self.ctx.register_model(
                sk.name, PlanAdaptor(plan), profile_runs=0)
        return mid

    def _pending(self, tid: int) -> Any:
        run = self._running.get(tid)
        return None if run is None or self.pending is None else self.pending(run.task)

    def _effect(self, tid: int, view: Callable) -> None:
        if self.effect is not None:
            self.effect(self._running[tid].task, view)

    def _task_done(self, tid: int, status: int) -> None:
        run = self._running.pop(tid)
        run.cancelled = status != 0
        task = run.task
        task.status = status
        now = self.ctx.now()
        done = self.policy.task_done(task, now)
        for req in done:
            self.finished[req] = now
        if self.on_task_done is not None:
            self.on_task_done(task, done)
        w = task.worker
        self.busy[w] = False
        if self.queues[w]:
            self._next(w)
        self.kick()

    # ---- virtual time --------------------------------------------------------------------
    def drive(self, arrivals: list[tuple[float, Any]], until: Callable[[], bool] | None = None,
              on_arrival: Callable[[Any], None] | None = None) -> None:
        """Virtual time: add each item at its time and run until everything has left
        (or ``until()`` says stop), on the one virtual-time driver: the clock jumps to
        the next thing that can happen. Items arriving at one instant are added together
        and then the workers kicked once, so they can share the first step.
        ``on_arrival(item)``: what an arrival does instead of ``add(item, kick=False)``
        (an engine's own submit)."""
        arrive = on_arrival or (lambda item: self.add(item, kick=False))
        arrivals = sorted(arrivals, key=lambda a: a[0])

        def submit(due: range) -> None:
            for k in due:
                arrive(arrivals[k][1])
            self.kick()
        self.ctx.run_virtual(_DelayedTasks(self), [a[0] for a in arrivals], submit, until,
                             name="step runtime")


class _DelayedTasks:
    """A runtime's tasks whose host time (``cpu_scale``) is not over yet, as the
    virtual-time driver's front stage: released when their time comes."""

    def __init__(self, runtime: StepRuntime):
        self.runtime = runtime

    @property
    def busy(self) -> bool:
        return self.runtime.active

    def step(self) -> None:
        # (Called at every iteration of the driver's loop: nothing to do, the usual case,
        # costs one attribute test.)
        if self.runtime._delayed:
            self.runtime.release_delayed()

    def deadline(self) -> float | None:
        delayed = self.runtime._delayed
        return delayed[0][0] if delayed else None
