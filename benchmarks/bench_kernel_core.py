"""Benchmark (not a test): the kernel core's cost per released kernel, the C core
(``dispatcher/_kcore.c``) against its Python reference (``dispatcher/kernel_core.py``),
single- and multi-stream plans, policy ``paella``.

    .venv/bin/python -m paella.benchmarks.bench_kernel_core                 # us per kernel
    .venv/bin/python -m paella.benchmarks.bench_kernel_core --instructions  # + callgrind

The plans are ``bench_replay``'s: **single** (Figure 2's job: an H2D copy, 8 dependent
kernels, a D2H copy) and **multi** (a fork-join on four streams with events, 11
kernels). Jobs arrive 4 at a time on the simulated GTX 1660 SUPER in virtual time; the
clock jumps to the next device event whenever a step has nothing to do.

* **us per kernel, alone**: the time inside the core's two entry points
  (``core.admit`` + ``core.step``: everything per kernel: notifQ drain, completion, plan
  walk, SRPT estimate, policy, tracker, stream map, the launch into the simulated
  engine, the copies), as the core meters it (``core.meter``: ``CLOCK_MONOTONIC`` at
  each entry and exit in C, ``perf_counter`` in the reference), per kernel, median over
  windows of 500 jobs, the two cores alternated ``--repeat`` times; the median of the
  runs' medians. These are the two functions callgrind's count toggles on, below.
* **us per kernel, with the loop**: the same windows' thread CPU of this benchmark's
  whole loop: the core's calls and the Python around them (the calls themselves, the
  events' loop, the clock jumps and their timing wrapper). The simulated GPU's own work
  between steps (``run_until``) is taken out: it stands in for the hardware.
* **instructions per kernel** (``--instructions``): ``valgrind --tool=callgrind
  --toggle-collect=Core_step --toggle-collect=Core_admit_fast`` (the C core's two entry
  points, with everything they call) on a run of ``--small`` and one of ``--large``
  jobs; the difference over the kernels between the two. Callgrind counts are
  repeatable whatever the host does. (The Python reference's count, and the legacy
  dispatcher's, come from ``bench_replay --instructions``: the whole loop.)
"""
from __future__ import annotations

import argparse
import time
from typing import Any, Callable

import numpy as np

from paella.benchmarks.bench_replay import PLANS
from paella.benchmarks.callgrind import instructions, per_kernel_arguments
from paella.dispatcher import kernel_core as kc
from paella.dispatcher.core import Dispatcher
from paella.dispatcher.devices.base import KERNEL
from paella.dispatcher.devices.sim import SimDevice

CORES = ("python", "c")


def setup(plan: str, impl: str) -> tuple[SimDevice, Any, Any, Any, int]:
    """A device, a core, the model (legacy record, for its buffer pool) and its core
    registration, and the plan's kernels per job."""
    dev = SimDevice("gtx1660s", n_streams=1024, seed=1)
    d = Dispatcher(dev, "paella")
    mid = d.register_model(plan, PLANS[plan]())
    m = d.models[mid]
    core = kc.make_core(impl, d.tracker, dev, "paella", group=d.group)
    cm = kc.register_model(core, m.replay, m.profile, dev)
    kernels = sum(1 for s in m.replay.steps if s.kind == KERNEL)
    return dev, core, m, cm, kernels


def drive(dev: SimDevice, core: Any, m: Any, cm: Any, n_jobs: int, batch: int = 4,
          on_window: Callable[[int], None] | None = None, window: int = 500) -> None:
    """Admit ``n_jobs`` jobs, ``batch`` per step while fewer than 64 are in flight; the
    clock jumps when a step did nothing."""
    io = np.zeros(m.adaptor.io_bytes, np.uint8)
    sets = [m.pool.acquire() for _ in range(64 + batch)]
    # As the dispatcher admits (Dispatcher._core_admit): operands made once per buffer
    # set, the job's io buffer given per job.
    operands = [kc.set_operands(cm, m.replay, b.bound, dev.memory) for b in sets]
    admitted = finished = 0
    step = core.step
    admit = core.admit
    while finished < n_jobs:
        k = 0
        while admitted < n_jobs and core.jobs < 64 and k < batch:
            args, copies = operands[admitted % len(operands)]
            admit(admitted, admitted, cm.plan, cm.profile, 0, 0, -1, args, copies, io)
            admitted += 1
            k += 1
        ev = step(dev.now()) or ()
        for e in ev:
            if e[0] == kc.FINISHED:
                finished += 1
                if on_window is not None and finished % window == 0:
                    on_window(window)
        if not ev and not core.pending_arrivals:
            dev.run_until(dev.next_event_time())


def us_per_kernel(plan: str, impl: str, n_jobs: int) -> tuple[float, float]:
    """Medians over windows, per kernel: the core alone (its metered entry points), and
    the loop's thread CPU with the simulated GPU's own work (``run_until``, timed with
    ``perf_counter``: no system call) taken out."""
    dev, core, m, cm, kernels = setup(plan, impl)
    gpu = [0.0]
    run_until, clock = dev.run_until, time.perf_counter

    def timed_run_until(t: float) -> bool:
        c0 = clock()
        try:
            return run_until(t)
        finally:
            gpu[0] += clock() - c0
    dev.run_until = timed_run_until
    alone: list[float] = []
    loop: list[float] = []
    core.meter = True
    c0 = [time.thread_time(), 0.0]

    def window(jobs: int) -> None:
        c1, inside = time.thread_time(), core.metered[0]
        loop.append((c1 - c0[0] - gpu[0]) / (jobs * kernels))
        alone.append((inside - c0[1]) / (jobs * kernels))
        c0[:] = c1, inside
        gpu[0] = 0.0
    drive(dev, core, m, cm, n_jobs, on_window=window)
    return float(np.median(alone) * 1e6), float(np.median(loop) * 1e6)


def instructions_per_kernel(plan: str, small: int, large: int) -> float:
    """Callgrind's count inside the C core's entry points, (large run - small run) /
    kernels between them."""
    counts = [instructions(["paella.benchmarks.bench_kernel_core", "--count", str(n), "--plan",
                            plan], toggles=("Core_step", "Core_admit_fast"))
              for n in (small, large)]
    kernels = setup(plan, "c")[4]
    return (counts[1] - counts[0]) / ((large - small) * kernels)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    per_kernel_arguments(p, tuple(PLANS))
    a = p.parse_args()
    if a.count is not None:
        dev, core, m, cm, _ = setup(a.plan, "c")
        drive(dev, core, m, cm, a.count)
        return
    print(f"kernel core alone, policy paella, {a.jobs} jobs per run, {a.repeat} alternated runs")
    for plan in PLANS:
        runs: dict[str, list[tuple[float, float]]] = {c: [] for c in CORES}
        for _ in range(a.repeat):
            for impl in CORES:
                runs[impl].append(us_per_kernel(plan, impl, a.jobs))
        for k, what in enumerate(("alone", "with the loop")):
            py, c = (float(np.median([r[k] for r in runs[i]])) for i in CORES)
            print(f"  {plan:6s} us/kernel {what:13s} python {py:6.2f}  c {c:6.3f}  "
                  f"({py / c:.1f}x faster)   runs: "
                  + " / ".join(f"{x[k]:.2f}|{y[k]:.3f}" for x, y in zip(*runs.values())),
                  flush=True)
        if a.instructions:
            ci = instructions_per_kernel(plan, a.small, a.large)
            print(f"  {plan:6s} instr/kernel c {ci:,.0f} (Core_step + Core_admit_fast, callgrind)",
                  flush=True)


if __name__ == "__main__":
    main()
