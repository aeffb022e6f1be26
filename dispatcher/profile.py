"""Per-model kernel statistics for the remaining-time estimate of §6 (1).

    remaining(job) = sum over unique kernels i of max(0, C_i - c_i) * T_i

``C_i`` is the average number of times a job of the model runs kernel ``i`` and ``T_i``
its average time (first placement to last completion, as the dispatcher sees it);
``c_i`` counts the job's own releases of ``i`` so far. Kernels are identified by name.

Profiling runs at registration fill the averages; every finished job and kernel then
refines them online. Averages are running means over the last ``window`` observations
(an exact mean until then), so a model whose behaviour drifts is followed. A job's
estimate starts at the model's total when it arrives and drops by
``min(1, C_i - c_i) * T_i`` at each release of ``i`` (O(1) per release); estimates of
jobs already running are not revised when the averages move.

Estimates live on a 1 ns grid (``ESTIMATE_DIGITS``). Means of measured times carry
float noise (a 100 us kernel averages to 0.00030000000000000003 in one model and
0.0002999999999999996 in an identical one), and an SRPT order on raw floats would let
that noise, not arrival order, break ties between identical jobs, differently for
every unit of time. Rounded to whole nanoseconds, equal work compares equal, and the
policy's tie-break (arrival order) decides.
"""
from __future__ import annotations

from dataclasses import dataclass

#: Estimates are rounded to this many decimals of a second (1 ns): see the module docstring.
ESTIMATE_DIGITS = 9


@dataclass(slots=True)
class KernelStat:
    count: float = 0.0      # C_i: mean executions per job
    time: float = 0.0       # T_i: mean seconds per execution
    n_time: int = 0


class ModelProfile:
    def __init__(self, window: int = 1000):
        if window < 1:
            raise ValueError(f"profile window must be >= 1, got {window}")
        self.window = window
        self.kernels: dict[str, KernelStat] = {}
        self.jobs = 0
        self._total: float | None = 0.0

    @property
    def total(self) -> float:
        """Estimated time of a whole job: sum of C_i * T_i (cached)."""
        total = self._total
        if total is None:            # (a list, not a generator: the same sum, faster)
            total = self._total = round(sum([k.count * k.time for k in self.kernels.values()]),
                                        ESTIMATE_DIGITS)
        return total

    def charge(self, key: str, done_before: int) -> float:
        """How much a job's remaining estimate drops when it releases ``key`` for the
        ``done_before + 1``-th time."""
        k = self.kernels.get(key)
        if k is None:
            return 0.0
        left = k.count - done_before
        if left <= 0.0:
            return 0.0
        return (1.0 if left > 1.0 else left) * k.time

    def split(self, runs: dict[str, float]) -> "ModelProfile":
        """A copy in which kernel ``key`` runs ``runs[key]`` times as often, each run as
        long as that fraction of it (the same work per job): the statistics of a plan
        whose kernels are cut into slices (paella.dispatcher.slicing)."""
        out = ModelProfile(self.window)
        out.jobs = self.jobs
        for key, k in self.kernels.items():
            f = runs.get(key, 1.0)
            out.kernels[key] = KernelStat(k.count * f, round(k.time / f, ESTIMATE_DIGITS), k.n_time)
        out._total = None
        return out

    def record_kernel(self, key: str, seconds: float) -> None:
        k = self.kernels.get(key)
        if k is None:
            k = self.kernels[key] = KernelStat()
        n = k.n_time + 1
        k.n_time = n
        w = self.window              # min(n, w) without the call: once per kernel
        k.time += (seconds - k.time) / (n if n < w else w)
        self._total = None

    def record_job(self, counts: dict[str, int]) -> None:
        """A job finished having run each kernel ``counts[key]`` times."""
        jobs = self.jobs = self.jobs + 1
        w = self.window
        div = jobs if jobs < w else w
        kernels = self.kernels
        get = counts.get
        for key, k in kernels.items():
            k.count += (get(key, 0) - k.count) / div
        if not counts.keys() <= kernels.keys():      # (a first run of some kernel: rare)
            for key, c in counts.items():
                if key not in kernels:
                    kernels[key] = KernelStat(count=c / div)
        self._total = None
