"""A virtual-time worker loop for step schedulers: the paper's timelines, exactly.

Workers run their tasks in submission order (one CUDA stream each, §5 of BatchMaker), and
ask the scheduler for more only when idle (Algorithm 1 runs "whenever some worker becomes
idle"). Each task lasts ``cost(task)`` time units. Events at one instant are all handled
(arrivals, then completions) before any idle worker asks, so a request that arrives when a
task ends can join the next one, as req5 does at t=2 in Figure 5.

This loop is the scheduler's specification and the experiments' fast model; the runtime
(:mod:`paella.stepsched.runtime`) runs the same schedulers with every task a job of the
kernel scheduler on the simulated GPU.
"""
from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol


class StepPolicy(Protocol):
    def add(self, item: Any, now: float) -> None: ...
    def schedule(self, worker: int, now: float) -> list: ...
    def task_done(self, task: Any, now: float) -> list: ...


@dataclass
class Timeline:
    """What happened: every task with its start and end, and each request's finish time."""
    tasks: list = field(default_factory=list)
    finished: dict = field(default_factory=dict)     # request -> time it left

    def rows(self) -> list[tuple[float, float, list]]:
        """(start, end, requests) per task, in start order: what a test compares."""
        return [(t.t_start, t.t_end, list(t.requests)) for t in sorted(self.tasks, key=lambda t: (t.t_start, t.worker))]


def simulate(policy: StepPolicy, arrivals: list[tuple[float, Any]], cost: Callable[[Any], float],
             n_workers: int = 1, horizon: float = float("inf")) -> Timeline:
    """Run ``policy`` over ``arrivals`` ((time, item) pairs) until every request has left
    (or ``horizon``). ``item`` is whatever the policy's ``add`` takes."""
    seq = itertools.count()
    events: list = [(t, 0, next(seq), "arrive", item) for t, item in arrivals]
    heapq.heapify(events)
    queues = [deque() for _ in range(n_workers)]
    busy = [False] * n_workers
    out = Timeline()

    def start(w: int, now: float) -> None:
        task = queues[w].popleft()
        task.t_start = now
        task.t_end = now + cost(task)
        busy[w] = True
        heapq.heappush(events, (task.t_end, 1, next(seq), "done", task))

    while events:
        now = events[0][0]
        if now > horizon:
            break
        while events and events[0][0] == now:
            _, _, _, kind, payload = heapq.heappop(events)
            if kind == "arrive":
                policy.add(payload, now)
                continue
            out.tasks.append(payload)
            for req in policy.task_done(payload, now):
                out.finished[req] = now
            busy[payload.worker] = False
            if queues[payload.worker]:
                start(payload.worker, now)
        for w in range(n_workers):
            if not busy[w] and not queues[w]:
                queues[w].extend(policy.schedule(w, now))
                if queues[w]:
                    start(w, now)
    return out
