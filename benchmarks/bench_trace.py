"""Benchmark (not a test): what a trace (``paella trace``) costs the dispatcher per kernel,
off and on.

    .venv/bin/python -m paella.benchmarks.bench_trace                   # us per kernel
    .venv/bin/python -m paella.benchmarks.bench_trace --instructions    # + callgrind

The dispatcher alone (``bench_dispatcher``'s Figure-2 jobs, an H2D copy, 8 kernels and
a D2H copy each, on a device that completes everything at once, so only the
dispatcher's CPU counts), on the C kernel core (what the daemon runs) and on the
dispatcher's own path, without and with a
:class:`~paella.dispatcher.trace.TraceRecorder` installed. Its records are kept (a
trace of the daemon writes them only at its end, off the loop; writing is not counted
here).

* **us per kernel**: median over windows of 1,000 jobs, off and on alternated
  ``--repeat`` times; the median of the runs' medians, and their ratio;
* **instructions per kernel** (``--instructions``): callgrind, collection switched on
  after setup (``callgrind_control -i on``), the difference between a run of
  ``--large`` and one of ``--small`` jobs over the kernels between them. Repeatable
  whatever the host does.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import time
from typing import Any

import numpy as np

from paella.benchmarks.bench_dispatcher import InstantDevice, drive_alone
from paella.benchmarks.callgrind import instructions, per_kernel_arguments
from paella.dispatcher.core import Dispatcher
from paella.dispatcher.devices.base import KERNEL
from paella.dispatcher.trace import TraceRecorder
from paella.experiments.harness import adaptor_for
from paella.models.synthetic import figure2_job

#: Where the per-kernel path runs: the C core (the daemon's), the dispatcher's own path.
PATHS = {"c": "c", "own": None}


def setup(path: str, traced: bool) -> tuple[Dispatcher, int, int, TraceRecorder | None]:
    """The dispatcher alone (an instant device) with the Figure-2 model; a recorder
    installed if ``traced``. Returns it, the model id, kernels per job and the recorder."""
    dev = InstantDevice("gtx1660s", n_streams=1024, seed=1)
    d = Dispatcher(dev, "paella", kernel_core=PATHS[path])
    mid = d.register_model("fig2", adaptor_for(figure2_job())())
    kernels = sum(1 for s in d.models[mid].replay.steps if s.kind == KERNEL)
    dev._tail = d.tracker.head
    dev.instant = True
    rec = TraceRecorder(d, max_events=1 << 30).start() if traced else None
    return d, mid, kernels, rec


def us_per_kernel(path: str, traced: bool, n_jobs: int) -> float:
    d, mid, kernels, _ = setup(path, traced)
    out: list[float] = []
    c0 = [time.thread_time()]

    def window(jobs: int) -> None:
        c1 = time.thread_time()
        out.append((c1 - c0[0]) / (jobs * kernels))
        c0[0] = c1
    drive_alone(d, mid, n_jobs, on_window=window, window=1000)
    return float(np.median(out) * 1e6)


def instructions_per_kernel(path: str, traced: bool, small: int, large: int) -> float:
    args = ["paella.benchmarks.bench_trace", "--plan", path] + (["--traced"] if traced else [])
    counts = [instructions(args + ["--count", str(n)]) for n in (small, large)]
    _, _, kernels, _ = setup(path, False)
    return (counts[1] - counts[0]) / ((large - small) * kernels)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    per_kernel_arguments(p, tuple(PATHS))
    p.add_argument("--traced", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.count is not None:                  # one run under callgrind
        d, mid, _, _ = setup(a.plan, a.traced)
        subprocess.run(["callgrind_control", "-i", "on", str(os.getpid())], check=True,
                       capture_output=True)
        drive_alone(d, mid, a.count)
        return 0
    print(f"dispatcher alone, Figure-2 jobs, policy paella, {a.jobs} jobs per run, "
          f"{a.repeat} alternated runs")
    for path in PATHS:
        runs: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(a.repeat):
            for traced in runs:
                runs[traced].append(us_per_kernel(path, traced, a.jobs))
        off, on = (float(np.median(runs[t])) for t in (False, True))
        print(f"  {path:4s} us/kernel    off {off:6.2f}  on {on:6.2f}  ({on / off:.2f}x)   runs: "
              + " / ".join(f"{x:.2f}|{y:.2f}" for x, y in zip(runs[False], runs[True])),
              flush=True)
        if a.instructions:
            i_off, i_on = (instructions_per_kernel(path, t, a.small, a.large) for t in (False, True))
            print(f"  {path:4s} instr/kernel off {i_off:8,.0f} on {i_on:8,.0f} "
                  f"(+{i_on - i_off:,.0f}, {i_on / i_off:.2f}x)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
