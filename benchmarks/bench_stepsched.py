"""The step schedulers' host cost: CPU per scheduled step, in unit-time timelines.

``python -m paella.benchmarks.bench_stepsched [--requests N] [--runs R]``

* Algorithm 1 (cellular): N LSTM chains of length 24 arriving one per time unit's
  hundredth, batch sizes 1-512, MaxTasksToSubmit 5. CPU per cell scheduled, forming and
  completing tasks together (the requests' unfolding is done before the clock starts).
* Algorithm 2 (iteration): N generations (prompt 8, 32 tokens), max_bs 32. CPU per
  request-iteration.

Median of R runs of ``time.process_time``; the machine's load moves single runs.
This is what ``paella experiment cellular --cpu-scale 1`` charges to the GPU's clock.
"""
from __future__ import annotations

import argparse
import statistics
import time

from paella.stepsched.cell_scheduler import CellType, CellularScheduler
from paella.stepsched.graph import unfold_chain
from paella.stepsched.iteration_scheduler import GenRequest, IterationScheduler
from paella.stepsched.timeline import simulate


def cellular_us_per_cell(n: int) -> tuple[float, float]:
    sch = CellularScheduler([CellType("lstm", tuple(2 ** i for i in range(10)))], 5)
    arrivals = [(i * 0.01, unfold_chain(i, 24)) for i in range(n)]
    t0 = time.process_time()
    tl = simulate(sch, arrivals, lambda t: 1.0)
    dt = time.process_time() - t0
    cells = sum(len(t.nodes) for t in tl.tasks)
    return 1e6 * dt / cells, cells / len(tl.tasks)


def iteration_us_per_step(n: int) -> tuple[float, float]:
    sch = IterationScheduler(max_bs=32, n_slots=1 << 20)
    arrivals = [(i * 0.05, GenRequest(i, 8, 40, 32, i * 0.05)) for i in range(n)]
    t0 = time.process_time()
    tl = simulate(sch, arrivals, lambda t: 1.0)
    dt = time.process_time() - t0
    steps = sum(len(t.requests) for t in tl.tasks)
    return 1e6 * dt / steps, steps / len(tl.tasks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()
    for name, fn in (("cellular (Algorithm 1)", cellular_us_per_cell),
                     ("iteration (Algorithm 2)", iteration_us_per_step)):
        res = [fn(a.requests) for _ in range(a.runs)]
        us = statistics.median(r[0] for r in res)
        print(f"{name}: {us:.2f} us per step (median of {a.runs}; single runs "
              f"{min(r[0] for r in res):.2f}-{max(r[0] for r in res):.2f}), mean batch {res[0][1]:.0f}")


if __name__ == "__main__":
    main()
