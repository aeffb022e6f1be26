"""The paper's toy timing model (Figure 3) for driving a DVABatch pipeline in tests.

A stage run has an isolated time and a GPU share (``util``, 1 = the whole GPU). Runs
whose shares add up to at most 1 all progress at full speed; beyond that they share
the GPU in proportion (processor sharing). Time is in units of the paper's ``T``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from paella.stepsched.dvabatch import DvaConfig, DvaPipeline


@dataclass
class Query:
    id: int
    arrival: float
    seq_len: int = 0
    stages: int = 0            # stages it needs (Case-I); 0: all
    done: float = float("nan")


class ToyGpu:
    def __init__(self, cost: Callable[[int, int, int], tuple[float, float]]):
        self.cost = cost          # (stage, rows, seq_len) -> (isolated time, GPU share)
        self.now = 0.0
        self.jobs: list[list[Any]] = []   # [remaining isolated time, share, done]

    def run(self, stage: int, rows: int, seq_len: int, done: Callable[[], None]) -> None:
        t, share = self.cost(stage, rows, seq_len)
        self.jobs.append([t, share, done])

    def _rate(self) -> float:
        return 1.0 / max(1.0, sum(j[1] for j in self.jobs))

    def next_completion(self) -> float:
        if not self.jobs:
            return float("inf")
        return self.now + min(j[0] for j in self.jobs) / self._rate()

    def advance(self, t: float) -> None:
        """Move to ``t`` (not past the next completion), finishing the runs due."""
        rate = self._rate()
        for j in self.jobs:
            j[0] -= (t - self.now) * rate
        self.now = t
        due = [j for j in self.jobs if j[0] <= 1e-9]
        self.jobs = [j for j in self.jobs if j[0] > 1e-9]
        for j in due:
            j[2]()


def simulate(cfg: DvaConfig, cost: Callable[[int, int, int], tuple[float, float]],
             queries: list[Query]) -> tuple[list[Query], DvaPipeline]:
    """Run ``queries`` (sorted by arrival) through a pipeline on the toy GPU."""
    gpu = ToyGpu(cost)
    pipe = DvaPipeline(cfg, gpu, lambda q, now: setattr(q, "done", now), lambda: gpu.now)
    i, n = 0, len(queries)
    while i < n or not pipe.idle:
        d = pipe.deadline()
        t = min(queries[i].arrival if i < n else float("inf"), gpu.next_completion(),
                float("inf") if d is None else d)
        if t == float("inf"):
            raise RuntimeError("toy pipeline stalled")
        gpu.advance(max(t, gpu.now))
        while i < n and queries[i].arrival <= gpu.now:
            pipe.add(queries[i], gpu.now)
            i += 1
        pipe.poll(gpu.now)
    return queries, pipe


def mean_latency(queries: list[Query]) -> float:
    return sum(q.done - q.arrival for q in queries) / len(queries)
