"""``slack``: earliest deadline first on deadlines derived from the SRPT estimate, capped
at the mix's mean, with a bounded demotion of jobs that can no longer make theirs.

Why (Figure 11, docs/policies.md "`slack`"): SRPT (``paella``) protects the short models
but makes the longest ones wait behind every shorter job, so the whole mix's p99 is
theirs; arrival order (``ms-jbj``: the GPU's own queues) protects no model in a burst.
Deadlines do both:

* **The deadline.** When a job arrives (the dispatcher's clock), its *budget* is
  ``slack_x`` times the smaller of its estimated total (``job.estimate``, the same
  profile SRPT uses) and the mix's mean estimate (an exponential mean, over about
  ``mean_window`` arrivals, of the estimates of the jobs this policy has seen); its
  deadline is its arrival plus its budget. A short model's job is due soon after it
  arrives (SRPT's gain for it); a long model's is due no later than a job of mean size
  would be, so no job waits past the mix's own tail because shorter ones keep coming.
* **The order.** Ready jobs go by deadline (ties to the earlier arrival), within their
  priority class (classes first, as every built-in policy).
* **Demotion, once and bounded.** A job that can no longer make its deadline (the
  clock plus its estimated remaining time is past it) is late whatever is done; serving
  it first would make the jobs behind it late too (EDF's domino effect in a burst). Its
  deadline is moved back once, by ``late_x`` times the mix's budget (``slack_x`` x the
  mean estimate): it lets the jobs that can still make theirs go first, and it is
  overtaken by nothing that arrives after its new deadline. ``late_x = 0`` is plain EDF.

So a job is never postponed past ``arrival + (budget + late_x x mix budget)``: a job
that arrives later has a later deadline (every budget is at least the smallest
model's), and the kernels released before it are bounded by what arrived up to then.
The parameters are the same for every model and experiment: ``slack_x`` is the
multiple of a job's size it may wait (the paper's experiments judge latency at 10x
the isolated time), ``late_x`` how much longer a late job yields.

Beyond the documented interface it reads only the dispatcher's clock (``now``, the
device time of the loop iteration, which every job also reads); without a dispatcher
(unit tests) the clock is :attr:`Slack.clock`.
"""
from __future__ import annotations

from typing import Any

from ..pqueue import IndexedHeap
from .base import Policy, PolicyError, class_key
from .registry import register_policy

#: A job may wait this multiple of its budget (its estimate, capped at the mix's mean).
DEFAULT_SLACK_X = 10.0
#: A late job's deadline moves back by this many mix budgets, once.
DEFAULT_LATE_X = 3.0
#: The mix's mean estimate is an exponential mean over about this many arrivals.
DEFAULT_MEAN_WINDOW = 256


class _State:
    __slots__ = ("deadline", "demoted")

    def __init__(self, deadline: float):
        self.deadline = deadline        # seconds, on the dispatcher's clock
        self.demoted = False


@register_policy("slack")
class Slack(Policy):
    """Ready jobs in one indexed heap keyed by ``(class, deadline in ns)``; ``pick()``
    moves the late jobs at the top back once (a lazy re-key: the answer depends only on
    the clock, so asking again gives the same job). O(log n) per kernel."""

    def __init__(self, dispatcher: Any = None, *, slack_x: float = DEFAULT_SLACK_X,
                 late_x: float = DEFAULT_LATE_X, mean_window: int = DEFAULT_MEAN_WINDOW,
                 order: str = "edf", **options: Any):
        super().__init__(dispatcher, **options)
        if not slack_x > 0 or slack_x == float("inf"):
            raise PolicyError(f"slack_x must be a positive number, got {slack_x}")
        if not 0 <= late_x < float("inf"):
            raise PolicyError(f"late_x must be >= 0 (0: never demote), got {late_x}")
        if type(mean_window) is not int or mean_window < 1:
            raise PolicyError(f"mean_window must be an int >= 1, got {mean_window!r}")
        if order not in ("edf", "llf"):
            raise PolicyError(f"order must be 'edf' or 'llf', got {order!r}")
        self.slack_x = float(slack_x)
        self.late_x = float(late_x)
        self.alpha = 1.0 / mean_window
        self.llf = order == "llf"
        #: The mix's mean estimate (None until a job with an estimate arrives).
        self.mean: float | None = None
        #: The clock without a dispatcher (unit tests set it).
        self.clock = 0.0
        self.ready = IndexedHeap()       # queued jobs by (class, deadline ns; seq)

    # -- the rule --------------------------------------------------------------------------
    def now(self) -> float:
        d = self.dispatcher
        return self.clock if d is None else d.now

    def mix_budget(self) -> float:
        """``slack_x`` x the mix's mean estimate: the latest any job is due after arriving."""
        return self.slack_x * (self.mean or 0.0)

    def job_arrived(self, job: Any) -> None:
        est = job.estimate
        m = self.mean
        if est > 0.0:                    # (profiling runs arrive before any estimate)
            m = self.mean = est if m is None else m + self.alpha * (est - m)
        budget = self.slack_x * (min(est, m) if m is not None else est)
        job.policy_state = _State(self.now() + budget)

    def _key(self, job: Any, st: _State) -> float:
        """The heap key: the deadline (EDF), or the latest start (LLF: deadline minus the
        estimated remaining time)."""
        k = st.deadline - job.remaining if self.llf else st.deadline
        return class_key(job.level, round(k * 1e9))

    # -- hooks -----------------------------------------------------------------------------
    def kernel_ready(self, job: Any) -> None:
        self.ready.push(job, self._key(job, job.policy_state), job.seq)

    def pick(self) -> Any:
        h = self.ready
        job = h.top()
        if job is None or not self.late_x:
            return job
        now = self.now()
        while True:
            st = job.policy_state
            if st.demoted or now + job.remaining <= st.deadline:
                return job
            # Late whatever is done: yield, once, to the jobs that can still make theirs.
            st.demoted = True
            st.deadline += self.late_x * self.mix_budget()
            h.push(job, self._key(job, st), job.seq)
            job = h.top()

    def released(self, job: Any, op: Any) -> None:
        self.ready.remove(job)

    def job_finished(self, job: Any) -> None:
        self.ready.remove(job)
