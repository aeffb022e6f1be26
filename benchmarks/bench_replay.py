"""Benchmark (not a test): the dispatcher's cost per kernel replaying a plan, the compiled
replay (``dispatcher/_replay.c``) against the reference replay (the Python waitlist),
single-stream and multi-stream plans.

    .venv/bin/python -m paella.benchmarks.bench_replay                 # us per kernel
    .venv/bin/python -m paella.benchmarks.bench_replay --instructions  # + callgrind

Two plans, replayed by the dispatcher alone (``bench_dispatcher``'s
:class:`~paella.benchmarks.bench_dispatcher.InstantDevice`: launches post their
notifications at once, copies and events complete at once, so the thread CPU of
``submit`` + ``step`` is all the dispatcher's), policy ``paella``:

* **single**: Figure 2's job (an H2D copy, 8 dependent kernels, a D2H copy, stream 0);
* **multi**: a fork-join on four streams with events: an H2D copy on stream 0, a record,
  three streams that wait for it and run 3 kernels each, then record; stream 0 waits
  for the three and runs 2 kernels and the D2H copy (11 kernels, 4 records, 4 waits).

**us per kernel**: median over windows of 500 jobs (4 submitted per step), the two
modes alternated ``--repeat`` times; the median of the runs' medians is the figure.
**instructions per kernel** (``--instructions``): ``valgrind --tool=callgrind
--instr-atstart=no`` on a run of ``--small`` jobs and one of ``--large`` jobs of one plan
and mode, instrumentation switched on (``callgrind_control -i on``) only around the
jobs' loop (start-up, imports and the profiling runs go uninstrumented, ~10x faster);
the difference over the kernels between the two runs (what the loop's first steps
cost apart cancels). Callgrind counts are repeatable to within ~1% whatever the host
does.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import time

import numpy as np

from paella.dispatcher.adaptor import Plan, PlanAdaptor, PlanOp
from paella.dispatcher.core import Dispatcher
from paella.dispatcher.devices.base import KERNEL, KernelInfo
from paella.benchmarks.bench_dispatcher import InstantDevice, drive_alone
from paella.benchmarks.callgrind import instructions, per_kernel_arguments
from paella.experiments.harness import adaptor_for
from paella.models.synthetic import figure2_job


def multi_stream_plan() -> Plan:
    """The fork-join plan of the module docstring."""
    infos = [KernelInfo(f"fj_k{i}", 16, duration=50e-6) for i in range(4)]
    k = [i.name for i in infos]
    ops = [PlanOp("h2d", stream=0, buffer="x", io_offset=0, nbytes=256),
           PlanOp("record", stream=0, event=0)]
    for s in (1, 2, 3):
        ops.append(PlanOp("wait", stream=s, event=0))
        ops += [PlanOp("launch", stream=s, kernel=k[j], grid=(1,), block=(128,)) for j in range(3)]
        ops.append(PlanOp("record", stream=s, event=s))
    ops += [PlanOp("wait", stream=0, event=s) for s in (1, 2, 3)]
    ops += [PlanOp("launch", stream=0, kernel=k[3], grid=(1,), block=(128,)) for _ in range(2)]
    ops.append(PlanOp("d2h", stream=0, buffer="x", io_offset=256, nbytes=256))
    return Plan("forkjoin", infos, ops, {"x": 256}, 512)


PLANS = {"single": lambda: adaptor_for(figure2_job())(),
         "multi": lambda: PlanAdaptor(multi_stream_plan())}


def setup(plan: str, compiled: bool) -> tuple[InstantDevice, Dispatcher, int, int]:
    dev = InstantDevice("gtx1660s", n_streams=1024, seed=1)
    d = Dispatcher(dev, "paella", compiled_replay=compiled)
    mid = d.register_model(plan, PLANS[plan]())
    dev._tail = d.tracker.head
    dev.instant = True
    kernels = sum(1 for s in d.models[mid].replay.steps if s.kind == KERNEL)
    return dev, d, mid, kernels


def us_per_kernel(plan: str, compiled: bool, n_jobs: int) -> float:
    """Median over windows of thread CPU per kernel (us)."""
    dev, d, mid, kernels = setup(plan, compiled)
    out = []
    c0 = [time.thread_time()]

    def window(jobs: int) -> None:
        c1 = time.thread_time()
        out.append((c1 - c0[0]) / (jobs * kernels))
        c0[0] = c1
    drive_alone(d, mid, n_jobs, on_window=window, window=500)
    return float(np.median(out) * 1e6)


def instructions_per_kernel(plan: str, compiled: bool, small: int, large: int) -> float:
    """Callgrind's instruction count, (large run - small run) / kernels between them."""
    counts = [instructions(["paella.benchmarks.bench_replay", "--count", str(n), "--plan", plan,
                            "--mode", "compiled" if compiled else "reference"])
              for n in (small, large)]
    _, _, _, kernels = setup(plan, compiled)
    return (counts[1] - counts[0]) / ((large - small) * kernels)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    per_kernel_arguments(p, tuple(PLANS))
    p.add_argument("--mode", choices=("compiled", "reference"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.count is not None:
        _, d, mid, _ = setup(a.plan, a.mode == "compiled")
        subprocess.run(["callgrind_control", "-i", "on", str(os.getpid())], check=True,
                       capture_output=True)
        drive_alone(d, mid, a.count)
        return
    print(f"dispatcher alone, policy paella, {a.jobs} jobs per run, {a.repeat} alternated runs")
    for plan in PLANS:
        runs: dict[str, list[float]] = {"reference": [], "compiled": []}
        for _ in range(a.repeat):
            for mode in runs:
                runs[mode].append(us_per_kernel(plan, mode == "compiled", a.jobs))
        ref, comp = (float(np.median(runs[m])) for m in ("reference", "compiled"))
        line = (f"  {plan:6s} us/kernel   reference {ref:6.2f}  compiled {comp:6.2f}  "
                f"({comp / ref:.2f}x)   runs: " + " / ".join(
                    f"{r:.2f}|{c:.2f}" for r, c in zip(runs["reference"], runs["compiled"])))
        print(line, flush=True)
        if a.instructions:
            ri, ci = (instructions_per_kernel(plan, m, a.small, a.large) for m in (False, True))
            print(f"  {plan:6s} instr/kernel reference {ri / 1e3:6.1f}k compiled {ci / 1e3:6.1f}k "
                  f"({ci / ri:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
