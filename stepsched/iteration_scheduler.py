"""Orca's iteration-level scheduling (Algorithm 2 of the dissertation's Orca chapter),
and what its users ask for beyond it.

Every iteration the scheduler picks, from the requests not already running, at most
``max_bs`` in arrival order (iteration-level FCFS: an earlier request has run at least as
many iterations as a later one). A request's first iteration (INITIATION: the whole prompt)
first reserves ``max_tokens`` KV slots; when that reservation would pass ``n_slots`` the
selection *stops* (line 25: ``break``, not ``continue``), so nobody behind the oldest
waiting request jumps it, and every admitted request can always finish: admission never
deadlocks. Slots return when the request finishes (line 14).

Beyond Orca (each off by default, so the defaults are Algorithm 2 exactly):

- **priorities**: the pool is ordered by (priority, arrival) instead of arrival;
- **fairness**: deficit counters per user, Paella's rule (docs/policies.md): serving a
  request of user u lowers u's deficit by 1 - 1/#users and raises every other active
  user's by 1/#users; a user whose deficit passes ``fairness_threshold`` goes first; a
  user's counter goes when its last request leaves the pool (an emptied queue's in
  deficit round robin);
- **preemption that keeps the place in line**: when the first request in that order cannot
  get its slots, requests *behind* it that hold slots give them up (the last in line
  first) until it fits. A preempted request keeps its arrival time, so it resumes ahead
  of everything that came after it. Its KV cache is either swapped to host memory or
  dropped and recomputed (one prefill over its prompt and the tokens it has produced),
  whichever ``preempt_cost`` says is cheaper.

Decisions (docs/step-scheduler.md): ``max_tokens`` counts the prompt and the generated
tokens (the paper's footnote: "the maximum number of tokens that a request can have after
processing"); a request is finished when it has produced its ``out_len`` tokens (its EOS,
known to the workload generator, not to the scheduler) or reached ``max_tokens``.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable

INITIATION, RUNNING, INCREMENT, PREEMPTED = "initiation", "running", "increment", "preempted"


@dataclass(eq=False)
class GenRequest:
    """One generation request as the scheduler sees it."""
    req_id: object
    prompt_len: int
    max_tokens: int                 # slots reserved: prompt + generated, at most
    out_len: int | None = None      # tokens it will generate (None: until max_tokens)
    arrival: float = 0.0
    user: int = 0
    priority: int = 0               # higher first
    state: str = INITIATION
    generated: int = 0
    #: how its KV cache was given up when preempted ("swap" or "recompute")
    evicted: str | None = None
    resumed_from: str | None = None    # set on the iteration that brings it back
    seq: int = 0                    # submission order: breaks arrival ties

    def __post_init__(self) -> None:
        if self.prompt_len < 1:
            raise ValueError(f"request {self.req_id!r}: prompt_len must be >= 1, got {self.prompt_len}")
        if self.max_tokens <= self.prompt_len:
            raise ValueError(f"request {self.req_id!r}: max_tokens ({self.max_tokens}) must exceed "
                             f"the prompt ({self.prompt_len} tokens): it counts prompt and output")

    @property
    def context(self) -> int:
        """Tokens whose keys and values the cache holds after its last iteration."""
        return self.prompt_len + self.generated

    @property
    def limit(self) -> int:
        cap = self.max_tokens - self.prompt_len
        return cap if self.out_len is None else min(cap, self.out_len)

    @property
    def finished(self) -> bool:
        return self.generated >= self.limit

    def tokens_this_iteration(self) -> int:
        """Tokens the next iteration processes: the prompt (or, after a recompute, the
        prompt and what it generated) the first time, one token after."""
        if self.state == INITIATION:
            return self.prompt_len
        if self.state == PREEMPTED and self.evicted == "recompute":
            return self.prompt_len + self.generated
        return 1


@dataclass(eq=False)
class Iteration:
    """One batched iteration: what the engine runs, and who gave up slots for it."""
    task_id: int
    requests: list[GenRequest]
    worker: int = 0
    preempted: list[GenRequest] = field(default_factory=list)
    kind: str = "iteration"
    #: per request, what this iteration does for it: "prefill", "decode", "swap-in", "recompute"
    phases: list[str] = field(default_factory=list)
    #: per request, tokens this iteration processes (selective batching flattens them)
    n_tokens: list[int] = field(default_factory=list)
    t_start: float = float("nan")
    t_end: float = float("nan")
    status: int = 0                 # its job's (set by the runtime when it returns)

    @property
    def tokens(self) -> int:
        return sum(self.n_tokens)


class IterationScheduler:
    """Algorithm 2's ``Select`` and its return path, with the extensions above."""

    def __init__(self, max_bs: int, n_slots: int, *, n_workers: int = 1, priorities: bool = False,
                 fairness_threshold: float | None = None, preempt: bool = False,
                 preempt_cost: Callable[[GenRequest], str] | None = None):
        if max_bs < 1 or n_slots < 1 or n_workers < 1:
            raise ValueError(f"max_bs, n_slots and n_workers must be >= 1, got {max_bs}, {n_slots}, {n_workers}")
        self.max_bs, self.n_slots, self.n_workers = max_bs, n_slots, n_workers
        self.priorities = priorities
        self.fairness_threshold = fairness_threshold
        self.preempt = preempt
        self.preempt_cost = preempt_cost or (lambda r: "recompute")
        self.pool: list[GenRequest] = []
        self.n_rsrv = 0
        self.n_scheduled = 0
        self.deficit: dict[int, float] = {}
        self._ids = itertools.count()
        self._seq = itertools.count()

    # ---- pool ------------------------------------------------------------------------
    def add(self, req: GenRequest, now: float = 0.0) -> None:
        if req.max_tokens > self.n_slots:
            raise ValueError(f"request {req.req_id!r}: max_tokens {req.max_tokens} exceeds the KV "
                             f"cache ({self.n_slots} slots); it could never be admitted")
        req.seq = next(self._seq)
        self.pool.append(req)
        if self.fairness_threshold is not None:
            self.deficit.setdefault(req.user, 0.0)

    def cancel(self, req: GenRequest) -> None:
        """Its client went away: it leaves the pool and its slots return now, unless an
        iteration is running it (then :meth:`returned` frees them)."""
        if req not in self.pool:
            return
        self.pool.remove(req)
        self._left(req.user)
        if req.state != RUNNING and self._holds_slots(req):
            self.n_rsrv -= req.max_tokens
        req.state = "cancelled" if req.state != RUNNING else "cancelled-running"

    @staticmethod
    def _holds_slots(req: GenRequest) -> bool:
        return req.state in (RUNNING, INCREMENT)

    @property
    def pending(self) -> bool:
        return bool(self.pool)

    def order(self) -> list[GenRequest]:
        """The line: arrival order (Algorithm 2), or by priority then arrival; users over
        the fairness threshold first, the most owed first."""
        thr = self.fairness_threshold

        def key(r: GenRequest):
            owed = self.deficit.get(r.user, 0.0)
            over = thr is not None and owed > thr
            return (0 if over else 1, -owed if over else 0.0,
                    -r.priority if self.priorities else 0, r.arrival, r.seq)
        return sorted(self.pool, key=key)

    # ---- Algorithm 2 -----------------------------------------------------------------
    def select(self, worker: int = 0, now: float = 0.0) -> Iteration | None:
        """Lines 17-28, plus preemption when enabled. None: nothing can run."""
        if self.n_scheduled >= self.n_workers:
            return None
        line = [r for r in self.order() if r.state != RUNNING]
        batch: list[GenRequest] = []
        preempted: list[GenRequest] = []
        for req in line:
            if len(batch) == self.max_bs:
                break
            if not self._holds_slots(req):           # INITIATION or PREEMPTED
                if self.n_rsrv + req.max_tokens > self.n_slots:
                    if not (self.preempt and self._make_room(req, line, batch, preempted)):
                        break
                self.n_rsrv += req.max_tokens
            batch.append(req)
        if not batch:
            return None
        it = Iteration(next(self._ids), batch, worker, preempted)
        for r in batch:
            it.n_tokens.append(r.tokens_this_iteration())
            it.phases.append("prefill" if r.state == INITIATION else
                             "decode" if r.state == INCREMENT else
                             "swap-in" if r.evicted == "swap" else "recompute")
            r.resumed_from = r.evicted if r.state == PREEMPTED else None
            r.state = RUNNING
        self.n_scheduled += 1
        self._charge(batch)
        return it

    def _make_room(self, req: GenRequest, line: list[GenRequest], batch: list[GenRequest],
                   preempted: list[GenRequest]) -> bool:
        """Preempt requests behind ``req`` in line, last first, until it fits. Only
        idle slot holders (not in this batch, not running) can give slots up."""
        behind = line[line.index(req) + 1:]
        victims = [r for r in reversed(behind) if r.state == INCREMENT and r not in batch]
        need = self.n_rsrv + req.max_tokens - self.n_slots
        if sum(v.max_tokens for v in victims) < need:
            return False
        for v in victims:
            if need <= 0:
                break
            v.state = PREEMPTED
            v.evicted = self.preempt_cost(v)
            self.n_rsrv -= v.max_tokens
            need -= v.max_tokens
            preempted.append(v)
        return True

    def _charge(self, batch: list[GenRequest]) -> None:
        """Deficit counters: each request served is one unit for its user."""
        if self.fairness_threshold is None:
            return
        users = {r.user for r in self.pool}
        n = len(users)
        if n < 2:
            return
        for r in batch:
            for u in users:
                self.deficit[u] += -(1 - 1 / n) if u == r.user else 1 / n

    # schedule / task_done: the worker protocol of paella.stepsched.timeline
    def schedule(self, worker: int = 0, now: float = 0.0) -> list[Iteration]:
        it = self.select(worker, now)
        return [it] if it is not None else []

    def returned(self, it: Iteration, now: float = 0.0) -> list[GenRequest]:
        """Lines 10-15: one more token for each; finished ones leave and free slots."""
        self.n_scheduled -= 1
        done = []
        for r in it.requests:
            if r.state == "cancelled-running":
                self.n_rsrv -= r.max_tokens
                r.state = "cancelled"
                continue
            r.generated += 1
            r.evicted = None
            r.state = INCREMENT
            if r.finished:
                self.n_rsrv -= r.max_tokens
                self.pool.remove(r)
                self._left(r.user)
                r.state = "finished"
                done.append(r)
        return done

    def _left(self, user: int) -> None:
        """A request of ``user`` left the pool: with none left, so does its deficit
        counter, as an emptied queue's in deficit round robin (a user is a client
        connection: counters kept for every one that ever generated would only grow)."""
        if user in self.deficit and all(r.user != user for r in self.pool):
            del self.deficit[user]

    def task_done(self, it: Iteration, now: float = 0.0) -> list[GenRequest]:
        return self.returned(it, now)
