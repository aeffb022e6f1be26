"""The kernel core: everything the dispatcher does per kernel, behind a one-way seam.

The paper's dispatcher is two halves (ARCHITECTURE.md, "The seam at the heart"). The
control plane (:class:`~paella.dispatcher.core.Dispatcher`: submission, buffer pools,
models, cancellation, answers) works per request. The kernel core works per kernel:

* drain the notifQ into the occupancy tracker, complete ops, walk each job's compiled
  plan (stream order, events, lookahead, eager release);
* keep each model's kernel statistics and each job's SRPT estimate;
* order the ready jobs by a built-in policy (``paella``, ``fifo``, ``ms-kbk``,
  ``ms-jbj``, ``sjf``, ``rr``, ``priority``) and release under the +B rule;
* map virtual streams to real ones and launch, into the simulated engine by a direct
  call.

Its interface is narrow and one-way: jobs come in through :meth:`KernelCore.admit`,
events come out of :meth:`KernelCore.step` as ``(ALMOST, job)``, ``(FINISHED, job,
kernels released)`` or ``(kind, job, reason)`` (``REFUSED``, ``FAULT``). The core never calls
back into the control plane; it calls only down, into the device.

It exists twice, equivalent event for event: this module is the **reference**, written
to be read, and ``dispatcher/_kcore.c`` (:class:`paella.dispatcher._kcore.KernelCore`)
the one that runs, written for speed (``tests/dispatcher/test_kernel_core.py`` compares
the two on random plans under every policy). Both take the same :class:`PlanSpec` and
:class:`KernelSpec` records, made once per model by :func:`plan_spec`.

Decisions (docs/dispatcher.md, "The kernel core"):

* Estimates are integer nanoseconds (the legacy path rounds floats to the same 1 ns
  grid): equal work compares equal, and C and Python agree bit for bit.
* A kernel's engine parameters are resolved once per launch shape (``KernelSpec``);
  a kernel with a functional effect (the simulator's stand-in computation) is launched
  through the device's own Python method, which wraps the effect: once per request,
  not per kernel.
"""
from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass
from heapq import heapify, heappop, heappush
from typing import Any, Callable, Sequence

from paella.dispatcher.devices.base import D2H, H2D, KERNEL, MARKER
from paella.dispatcher.devices.sim.cost import slice_cost
from paella.occupancy import wave_blocks

from .native import load
from .policies import get_policy
from .policies.paella import DEFAULT_FAIRNESS_THRESHOLD, DEFAULT_HOLD_FACTOR
from .policies.base import class_key
from .pqueue import IndexedHeap
from .streams import every_stream_gated, next_ungated
from .waitlist import DONE, DROPPED, READY, RELEASED, WAITING

#: A copy released with no event (:func:`implied_copies`); the core's own state.
IMPLIED = 5

#: Event kinds out of :meth:`KernelCore.step`.
ALMOST, FINISHED, REFUSED, FAULT = 1, 2, 3, 4
#: Op events, only while the core's ``ops`` is set (an instrument listens to ops):
#: ``(OP_RELEASED, job, node, stream, launch id (-1: a copy), t)`` as an op goes to its
#: stream and ``(OP_ENDED, job, node, t_started, t)`` as it completes; ``t_started`` is
#: when the kernel's first block was seen placed, < 0 for a copy (the core sees no copy
#: start: take its release).
OP_RELEASED, OP_ENDED = 5, 6
#: ``(OP_HELD, None, queued, t)``, only while ``ops`` is set: the policy released nothing
#: although ``queued`` jobs had a ready kernel (a hold: the class rule, the hold and order
#: rules, a strict priority), reported at the first such pick after a release.
OP_HELD = 7

#: The built-in policies the core runs, with what each declares to the dispatcher
#: (gated, stream mode, eager), read from their classes. Plug-ins run on the
#: dispatcher's own path. (The C core knows the same seven by name.)
POLICIES = {name: (cls.gated, cls.stream_mode, cls.eager) for name in
            ("paella", "sjf", "rr", "priority", "ms-kbk", "fifo", "ms-jbj")
            for cls in (get_policy(name),)}
_REBASE = 1e9


def to_ns(seconds: float) -> int:
    """Seconds on the 1 ns grid (round half to even, as C's ``nearbyint``)."""
    return int(round(seconds * 1e9))


@dataclass(frozen=True, slots=True)
class KernelSpec:
    """One launch shape of a plan, resolved for the core: its model's kernel index (the
    SRPT key), its tracker demand, and what the engine needs to run it."""
    key: int
    blocks: int
    warps: int
    regs: int
    smem: int
    entries: int
    shape: int               # the engine's shape id
    flops: float
    nbytes: float
    duration: float          # < 0: the cost model decides
    record: Any = None       # the KernelLaunch, for the device's Python launch (effects)
    effect: bool = False     # it has a functional effect: launched through the device
    demand: Any = None       # the tracker's Demand (the reference core's tracker calls)


@dataclass(frozen=True, slots=True)
class PlanSpec:
    """A compiled plan (``ReplayPlan``'s graph) as the core replays it: per node its kind
    (KERNEL, H2D, D2H, MARKER), stream successor, dependents (``dep[dstart[i]:
    dstart[i+1]]``), unmet dependencies, pending stream predecessor and state right after
    the issue, the nodes active then (in order); its kernel (index into ``kernels``, -1),
    the wake-up mark, its virtual stream (dense index) and stream predecessor op (-1)."""
    kinds: tuple[int, ...]
    succ: tuple[int, ...]
    dstart: tuple[int, ...]
    dep: tuple[int, ...]
    deps: tuple[int, ...]
    pp: tuple[int, ...]
    st: tuple[int, ...]
    ready: tuple[int, ...]
    kernel: tuple[int, ...]
    almost: tuple[int, ...]
    vstream: tuple[int, ...]
    pred: tuple[int, ...]
    n_vstreams: int
    kernels: tuple[KernelSpec, ...]
    io_start: tuple[int, ...] = ()      # copies: their bytes of the job's io buffer
    io_end: tuple[int, ...] = ()
    #: Per node, 1 for an input copy whose completion its stream successor tells
    #: (:func:`implied_copies`; :func:`plan_spec` bounds their size by the device's link;
    #: empty: derived here with no bound).
    implied: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.kinds)
        for name in ("succ", "deps", "pp", "st", "kernel", "almost", "vstream", "pred"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"PlanSpec.{name} has {len(getattr(self, name))} entries for "
                                 f"{n} nodes")
        if len(self.dstart) != n + 1 or self.dstart[-1] != len(self.dep):
            raise ValueError("PlanSpec.dstart must have one entry per node plus one, "
                             "ending at len(dep)")
        for i, k in enumerate(self.kinds):
            if k == KERNEL and not 0 <= self.kernel[i] < len(self.kernels):
                raise ValueError(f"PlanSpec: kernel node {i} names kernel {self.kernel[i]}")
            if k not in (KERNEL, H2D, D2H, MARKER):
                raise ValueError(f"PlanSpec: node {i} has unknown kind {k}")
        refs = list(self.succ) + list(self.dep) + list(self.ready) + list(self.pred)
        if any(not -1 <= x < n for x in refs):
            raise ValueError("PlanSpec: a node index is out of range")
        if any(not 0 <= v < self.n_vstreams for v in self.vstream):
            raise ValueError("PlanSpec: a virtual stream index is out of range")
        if not self.implied:
            object.__setattr__(self, "implied", implied_copies(self))
        elif len(self.implied) != n or any(x not in (0, 1) for x in self.implied):
            raise ValueError("PlanSpec.implied must be 0 or 1 for each node")


def implied_copies(spec: "PlanSpec", max_bytes: float = float("inf")) -> tuple[int, ...]:
    """Per node, 1 for an *implied* copy: an input (H2D) copy of at most ``max_bytes``
    (:func:`implied_copy_bytes`) whose stream successor is a kernel or another input
    copy, with no other dependent.

    Why: a copy's completion is otherwise learned from an event recorded behind it and
    queried (two driver calls, charged 2 us each by the experiments, and a round trip
    before its kernel is released). But stream order already says it: the op behind it on
    its stream cannot start before it completes. So the core launches such a copy with
    no event, releases its successor at once (behind it on the same stream, whatever the
    lookahead: a copy is not a kernel), and counts the copy done when that successor is
    seen done. A successor that never runs (its job failed or was cancelled first) gets
    the copy an event then (``_orphan_before``). The C core reads the result
    (``PlanSpec.implied``).

    Why the size bound: the successor is admitted (the +B rule counts its blocks as
    waiting) when the copy is released, so it holds its share of the GPU back from
    everyone else for the copy's whole transfer. Worth it for a copy that lands about as
    soon as the host could have seen it; not for a 602 KB image (58 us on a T4's link:
    `paella experiment priority`'s best-effort throughput fell 2.5% without the bound)."""
    kinds, succ, pred, dstart = spec.kinds, spec.succ, spec.pred, spec.dstart
    sizes = [e - b for b, e in zip(spec.io_start, spec.io_end)] if spec.io_start else None
    out = []
    for i, k in enumerate(kinds):
        s = succ[i]
        out.append(int(k == H2D and s >= 0 and kinds[s] in (KERNEL, H2D) and pred[s] == i
                       and dstart[i] == dstart[i + 1]
                       and (sizes is None or sizes[i] <= max_bytes)))
    return tuple(out)


def implied_copy_bytes(gpu: Any) -> float:
    """The largest implied copy on ``gpu`` (a ``GpuSpec``): the bytes its link moves in
    its fixed per-copy latency (``pcie_bw * pcie_latency``: 96 KB on the T4's PCIe 3).
    Up to that, the transfer is at most as long as the part every copy pays anyway; a
    device that does not say (None) gets the presets' defaults."""
    from paella.gpus import GpuSpec
    bw = getattr(gpu, "pcie_bw", None) or GpuSpec.pcie_bw
    lat = getattr(gpu, "pcie_latency", None) or GpuSpec.pcie_latency
    return float(bw) * float(lat)


def plan_spec(replay: Any, key_of: Callable[[str], int],
              shape_of: Callable[[Any], int], gpu: Any = None) -> PlanSpec:
    """The :class:`PlanSpec` of a compiled :class:`~paella.dispatcher.replay.ReplayPlan`.
    ``key_of(name)``: the model's kernel index of a kernel name; ``shape_of(fp)``: the
    engine's shape id of a footprint (``SimDevice._shapes``); ``gpu``: the device's
    ``GpuSpec``, which a plan with slices needs (a slice's share of its kernel's work)."""
    g = replay.graph_lists
    if g is None:
        raise ValueError(f"plan {replay.name!r} is not compiled (compiled_replay=False)")
    n = len(g["kinds"])
    kernel = [-1] * n
    almost = [0] * n
    vstream = [0] * n
    specs: list[KernelSpec] = []
    index: dict[int, int] = {}
    stream_ids: dict[int, int] = {}
    for step_i, step in enumerate(replay.steps):
        node = replay._nodes[step_i]
        if node < 0:
            continue
        almost[node] = int(step.almost_finished)
        vstream[node] = stream_ids.setdefault(step.stream, len(stream_ids))
        if step.kind == KERNEL:
            k = step.launch
            if id(k) not in index:
                d = k.demand
                info = k.func.info
                flops, nbytes, duration = info.flops, info.bytes, info.duration
                if k.whole:                  # a slice: its share of the kernel (slicing)
                    flops, nbytes, duration = slice_cost(flops, nbytes, duration, k.blocks,
                                                         k.whole, wave_blocks(gpu, k.fp))
                index[id(k)] = len(specs)
                specs.append(KernelSpec(
                    key_of(k.name), d.blocks, d.warps, d.regs, d.smem, d.entries,
                    shape_of(k.fp), float(flops), float(nbytes),
                    -1.0 if duration is None else float(duration), k,
                    k.func.handle is not None, d))
            kernel[node] = index[id(k)]
    for node, kind in enumerate(g["kinds"]):      # MARKERs: the stream of their successor
        if kind == MARKER:
            vstream[node] = 0
    pred = [-1] * n
    for node, p in replay._preds:
        pred[node] = p
    io_start, io_end = [0] * n, [0] * n
    for step_i, step in enumerate(replay.steps):
        node = replay._nodes[step_i]
        if node >= 0 and step.kind in (H2D, D2H):
            io_start[node], io_end[node] = step.io_start, step.io_end
    dstart = [0]
    dep: list[int] = []
    for ds in g["dependents"]:
        dep.extend(ds)
        dstart.append(len(dep))
    spec = PlanSpec(tuple(g["kinds"]), tuple(g["succ"]), tuple(dstart), tuple(dep),
                    tuple(g["deps"]), tuple(g["pp"]), tuple(g["st"]), tuple(g["ready"]),
                    tuple(kernel), tuple(almost), tuple(vstream), tuple(pred),
                    max(len(stream_ids), 1), tuple(specs), tuple(io_start), tuple(io_end))
    return dataclasses.replace(spec, implied=implied_copies(spec, implied_copy_bytes(gpu)))


class Profile:
    """A model's kernel statistics (``paella.dispatcher.profile``'s rules) over kernel
    indices: mean count per job ``count[i]``, mean time ``time[i]`` (seconds), running
    means over the last ``window`` observations."""
    __slots__ = ("count", "time", "n_time", "jobs", "window", "seen", "_total")

    def __init__(self, n_kernels: int, window: int = 1000):
        self.count = [0.0] * n_kernels
        self.time = [0.0] * n_kernels
        self.n_time = [0] * n_kernels
        self.seen = [False] * n_kernels   # appears in the statistics (profile order)
        self.jobs = 0
        self.window = window
        self._total: int | None = 0

    def total_ns(self) -> int:
        if self._total is None:
            s = 0.0
            for i in range(len(self.count)):
                if self.seen[i]:
                    s += self.count[i] * self.time[i]
            self._total = to_ns(s)
        return self._total

    def charge_ns(self, i: int, done_before: int) -> int:
        if not self.seen[i]:
            return 0
        left = self.count[i] - done_before
        if left <= 0.0:
            return 0
        return to_ns((1.0 if left > 1.0 else left) * self.time[i])

    def record_kernel(self, i: int, seconds: float) -> None:
        self.seen[i] = True
        n = self.n_time[i] = self.n_time[i] + 1
        w = self.window
        self.time[i] += (seconds - self.time[i]) / (n if n < w else w)
        self._total = None

    def record_job(self, counts: Sequence[int]) -> None:
        jobs = self.jobs = self.jobs + 1
        w = self.window
        div = jobs if jobs < w else w
        for i in range(len(self.count)):
            if self.seen[i]:
                self.count[i] += (counts[i] - self.count[i]) / div
            elif counts[i]:
                self.seen[i] = True
                self.count[i] = counts[i] / div
        self._total = None


class CoreJob:
    """A job inside the core: its plan run and scheduling state. ``token`` is the
    control plane's job, handed back in events and never looked into."""
    __slots__ = ("token", "seq", "plan", "profile", "unit_key", "level", "pin", "args", "started",
                 "handle",
                 "copies", "deps", "pp", "st", "stream", "lid", "t_rel", "ahead", "tail",
                 "real", "ready", "in_policy", "left_policy", "pending", "kcount",
                 "estimate", "remaining", "almost_sent", "failed", "finished", "unit",
                 "queued", "infifo", "on_device")

    def __init__(self, token: Any, seq: int, plan: PlanSpec, profile: Profile, unit_key: Any,
                 level: int, pin: int, args: Sequence[Any], copies: Sequence[Any]):
        n = len(plan.kinds)
        self.token = token
        self.seq = seq
        self.plan = plan
        self.profile = profile
        self.unit_key = unit_key
        self.level = level
        self.pin = pin
        self.args = args
        self.copies = copies
        self.deps = list(plan.deps)
        self.pp = list(plan.pp)
        self.st = list(plan.st)
        self.stream = [-1] * n
        self.lid = [-1] * n
        self.t_rel = [0.0] * n
        self.ahead = [0] * plan.n_vstreams
        self.tail = [-1] * plan.n_vstreams
        self.real = [-1] * plan.n_vstreams        # sticky mode: the bound real stream
        self.ready: deque[int] = deque()
        self.in_policy = False
        self.left_policy = False
        self.pending = sum(1 for s in plan.st if s != DONE)
        self.kcount = [0] * len(profile.count)
        self.estimate = profile.total_ns()
        self.remaining = self.estimate
        self.almost_sent = False
        self.failed: str | None = None
        self.finished = False
        self.unit: Any = None
        self.queued = False
        self.infifo = False
        self.on_device = 0
        self.started = False
        self.handle = -1


class KernelCore:
    """The reference kernel core (module docstring). ``engine``: the simulated GPU's
    ``_engine.Gpu`` (its ``launch`` is called directly); ``device``: the device, for
    copies, events and kernels with a functional effect."""

    def __init__(self, tracker: Any, device: Any, engine: Any, n_streams: int, policy: str,
                 lookahead: int, group: int, wake_lead: float, threshold: float,
                 by_client: bool, hold: float, device_error: type, device_lost: type,
                 backlog: int = 0):
        # The C type's signature, positional as there: make_core() is the friendly door.
        if type(backlog) is not int or backlog < 0:
            raise ValueError("backlog must be >= 0 (0: no saturation rule)")
        #: The saturation rule (docs/dispatcher.md, "Saturation"): past this many queued
        #: jobs the occupancy gate is lifted (0: never).
        self.backlog = backlog
        self.class0: int | None = None      # the first job's class
        self.mixed = False                  # another class seen since: the rule is off
        self.tracker = tracker
        self.device = device
        self.engine = self.engine_given = engine
        self.policy = policy
        self.gated, self.stream_mode, self.eager = POLICIES[policy]
        self.lookahead = lookahead
        self.group = group
        self.lead = to_ns(wake_lead)
        self.threshold = threshold
        self.by_client = by_client
        self.hold = hold or None
        self.device_error, self.device_lost = device_error, device_lost
        self.n_streams = n_streams
        self.wall: tuple[float, float] | None = None   # real time: (t0, speed)
        self.plans: list[PlanSpec] = []
        self.handles: dict[int, CoreJob] = {}
        #: The driver calls its launches and copies stand for (1 a kernel; 3 a copy: the
        #: copy, its event's record, the query that sees it; 1 an implied copy, and 2
        #: more if its successor never runs): a harness charges them.
        self.device_calls = 0
        #: Implied copies record no event (:func:`implied_copies`); set with no job live.
        self._implied_on = True
        self.next_handle = 0
        self.progress = 0
        self.profiles: list[Profile] = []
        self.free: deque[int] = deque(range(n_streams))
        self.busy = [0] * n_streams
        self.rr_stream = 0
        self.arrivals: deque[CoreJob] = deque()
        self.copies: deque[tuple[CoreJob, int]] = deque()
        self.copy_events: dict[int, deque] = {}
        self.events: list[tuple] = []
        #: Report op events (OP_RELEASED, OP_ENDED).
        self.ops = False
        self.queued = 0
        self.jobs = 0
        self.released = 0
        self.now = 0.0
        # policies
        self.heap = IndexedHeap()        # the heap policies; paella's srpt
        self.turn = 0                    # rr
        self.level_on_device: dict[int, int] = {}   # priority
        self.live_levels: dict[int, int] = {}       # paella: live jobs per class (class rule)
        self.held = False            # a hold reported since the last release (OP_HELD)
        self.inflight = IndexedHeap()    # paella: live jobs by (remaining, seq)
        self.fifo: list = []             # paella: (seq, job) of queued jobs
        self.dheap = IndexedHeap()       # paella: units with a queued job by (-s, useq)
        self.units: dict[Any, _Unit] = {}
        self.G = 0.0
        self.share = 0.0
        self.useq = 0
        self.n_live = 0

    # -- the contract ------------------------------------------------------------------------
    def add_plan(self, spec: PlanSpec) -> int:
        """Register a compiled plan; its index names it in :meth:`admit`."""
        self.plans.append(spec)
        return len(self.plans) - 1

    def add_profile(self, count: Sequence[float], time: Sequence[float],
                    n_time: Sequence[int], seen: Sequence[bool], jobs: int, window: int) -> int:
        """Register a model's statistics (the core owns and refines them); its index."""
        p = Profile(len(count), window)
        p.count, p.time, p.n_time = list(map(float, count)), list(map(float, time)), list(n_time)
        p.seen, p.jobs, p._total = [bool(x) for x in seen], jobs, None
        self.profiles.append(p)
        return len(self.profiles) - 1

    def profile(self, index: int) -> tuple:
        """``(count, time, n_time, seen, jobs, total_ns)`` of a registered profile."""
        p = self.profiles[index]
        return (list(p.count), list(p.time), list(p.n_time), list(p.seen), p.jobs,
                p.total_ns())

    def admit(self, token: Any, seq: int, plan: int, profile: int, client: Any = 0,
              level: int = 0, pin: int = -1, args: Any = None, copies: Any = None,
              io: Any = None) -> int:
        """A job of plan ``plan`` (index): its ops start in the next :meth:`step`; its
        handle. ``args``: per node, a kernel's arguments (for its effect); ``copies``:
        per node, a copy's ``(dptr, host[, device view])``, host None: ``io`` at the
        plan's offsets."""
        spec = self.plans[plan]
        if copies is not None and io is not None:
            copies = tuple(None if c is None or c[1] is not None else
                           (c[0], io[spec.io_start[n]:spec.io_end[n]], *c[2:])
                           for n, c in enumerate(copies))
        job = CoreJob(token, seq, spec, self.profiles[profile], client, level,
                      pin, args, copies)
        if self.class0 is None:
            self.class0 = level
        elif level != self.class0:
            self.mixed = True
        self.arrivals.append(job)
        self.jobs += 1
        job.handle = self.next_handle
        self.handles[job.handle] = job
        self.next_handle += 1
        return job.handle

    def abort(self, handle: int, token: Any) -> list[tuple]:
        """The job stops (its client went away): unreleased ops dropped, out of the
        policy; it finishes when its released ops drain (now if none: the FINISHED
        event is returned here)."""
        job = self.handles.get(handle)
        if job is None or job.finished or job.token is not token:
            raise ValueError(f"abort: handle {handle} is not that job's")
        self.events = events = []
        if job.failed is None:
            self._fail(job, 0, "aborted")
        if job.pending == 0:
            self._finish(job)
        self.progress += 1
        return events

    def job_of(self, launch_id: int) -> Any:
        """The token of the live job whose kernel was released as ``launch_id``, or
        None. For a kernel that failed after its completion was reported
        (``Device.late_faults``): the dispatcher fails that job. Rare, so a scan."""
        for job in self.handles.values():
            if job.finished:
                continue
            kinds = job.plan.kinds
            for i, lid in enumerate(job.lid):
                if lid == launch_id and kinds[i] == KERNEL and job.st[i] in (RELEASED, DONE):
                    return job.token
        return None

    def real_time(self, t0: float, speed: float) -> None:
        """The engine follows the wall clock: each direct launch first fires what is due."""
        self.wall = (t0, speed)

    def reserve(self, s: int) -> None:
        """A named stream leaves the pool for good (a sentinel count keeps it busy)."""
        if not 0 <= s < self.n_streams:
            raise ValueError(f"reserve: no stream {s}")
        if s in self.free:
            self.free.remove(s)
        self.busy[s] += 1

    @property
    def direct(self) -> bool:
        """Launches go into the engine directly (False: through the device's methods)."""
        return self.engine is not None

    @direct.setter
    def direct(self, on: bool) -> None:
        self.engine = self.engine_given if on else None

    @property
    def pending_arrivals(self) -> int:
        return len(self.arrivals)

    @property
    def meter(self) -> bool:
        """Time :meth:`step` and :meth:`admit` (True starts afresh): the core's own cost,
        apart from the loop that calls it (``metered``). Off, the methods are the
        class's own: no cost."""
        return "step" in self.__dict__

    @meter.setter
    def meter(self, on: bool) -> None:
        if not on:
            self.__dict__.pop("step", None)
            self.__dict__.pop("admit", None)
            return
        if self.meter:
            return
        self._metered = [0.0, 0]
        clock, tally = time.perf_counter, self._metered

        def timed(method: Callable) -> Callable:
            def call(*args: Any, **kw: Any) -> Any:
                t0 = clock()
                try:
                    return method(*args, **kw)
                finally:
                    tally[0] += clock() - t0
                    tally[1] += 1
            return call
        self.step, self.admit = timed(self.step), timed(self.admit)

    @property
    def metered(self) -> tuple[float, int]:
        """(seconds inside :meth:`step` and :meth:`admit` while metered, calls)."""
        t, n = getattr(self, "_metered", (0.0, 0))
        return (t, n)

    def spin(self, until: float, probe: Any, near: float) -> list[tuple] | None:
        """The C core's spin (passes until the control plane is due, real time): the
        reference makes one pass, which the daemon's loop repeats; the same events come
        out, only the loop around them differs."""
        if self.wall is None or self.engine is None:
            raise RuntimeError("spin: the core must launch into a real-time engine "
                               "(real_time() and direct launches)")
        self.engine.poll_wall(*self.wall)
        return self.step((time.perf_counter() - self.wall[0]) * self.wall[1])

    def step(self, now: float) -> list[tuple]:
        """One pass of the paper's loop: notifQ, copies' events, arrivals, release.
        Returns the events of this pass, or None if it changed nothing (a driver's idle
        test)."""
        p0 = self.progress
        self.now = now
        self.events = events = []            # (the C core returns () when empty)
        self.progress += self.tracker.drain(now, self._kernel_done)
        if self.copy_events:
            self._poll_copies()
        while self.arrivals:
            self._start(self.arrivals.popleft())
        if self.queued or self.copies:
            self._release()
        if not events and self.progress == p0:
            return None
        return events

    def in_flight(self) -> int:
        """Jobs admitted and not finished."""
        return self.jobs

    # -- arrivals ----------------------------------------------------------------------------
    def _start(self, job: CoreJob) -> None:
        if job.finished:
            return
        self.progress += 1
        job.started = True
        self._job_arrived(job)
        plan = job.plan
        for i in plan.ready:
            if job.st[i] == READY:
                self._active(job, i)
        if job.pending == 0:
            self._finish(job)

    def _active(self, job: CoreJob, i: int) -> None:
        job.st[i] = READY
        if job.plan.kinds[i] == KERNEL:
            job.ready.append(i)
            if not job.in_policy:
                self._queue(job)
        else:
            self.copies.append((job, i))

    def _queue(self, job: CoreJob) -> None:
        job.in_policy = True
        self.queued += 1
        self._kernel_ready(job)

    # -- the plan walk (the compiled waitlist's rules) ------------------------------------------
    def _met(self, job: CoreJob, t: int, stack: list[int]) -> None:
        job.deps[t] -= 1
        if job.deps[t] != 0 or job.st[t] != WAITING:
            return
        if job.plan.kinds[t] == MARKER:
            job.st[t] = DONE
            job.pending -= 1
            stack.append(t)
        else:
            self._active(job, t)

    def _finish_node(self, job: CoreJob, i: int) -> None:
        job.st[i] = DONE
        job.pending -= 1
        plan = job.plan
        stack = [i]
        while stack:
            d = stack.pop()
            s = plan.succ[d]
            if s >= 0 and job.pp[s]:
                job.pp[s] = 0
                self._met(job, s, stack)
            for k in range(plan.dstart[d], plan.dstart[d + 1]):
                self._met(job, plan.dep[k], stack)

    def _release_succ(self, job: CoreJob, i: int) -> None:
        plan = job.plan
        s = plan.succ[i]
        if s < 0 or not job.pp[s] or plan.kinds[s] == MARKER:
            return
        job.pp[s] = 0
        job.deps[s] -= 1
        if job.deps[s] == 0 and job.st[s] == WAITING:
            self._active(job, s)

    def _behind(self, job: CoreJob, i: int) -> int:
        p = job.plan.pred[i]
        if p >= 0 and ((job.st[p] == RELEASED and self.lookahead > 1) or job.st[p] == IMPLIED):
            return p
        return -1

    # -- release ------------------------------------------------------------------------------
    def _release(self) -> None:
        if self.copies:
            self._flush_copies()
        tracker = self.tracker
        pool = self.stream_mode == "pool"
        while self.queued:
            job = self._pick()
            if job is None:
                if self.ops and not self.held:
                    self.held = True
                    self.events.append((OP_HELD, None, self.queued, self.now))
                return
            i = job.ready[0]
            plan = job.plan
            k = plan.kernels[plan.kernel[i]]
            p = self._behind(job, i)
            gated = self.gated and not self._saturated()
            if p >= 0 and gated and plan.kinds[p] == KERNEL:
                if not tracker.admits_after(k.demand, plan.kernels[plan.kernel[p]].demand,
                                            job.lid[p]):
                    return
            elif not (tracker.admits(k.demand) if gated else tracker.flow_ok(k.demand)):
                return
            elif pool and not self.free and p < 0 and job.pin < 0:
                return
            elif not pool and p < 0 and self._must_wait(job, i):
                return
            job.ready.popleft()
            job.in_policy = False
            self.queued -= 1
            c = job.kcount[k.key]
            job.remaining = left = job.remaining - job.profile.charge_ns(k.key, c)
            job.kcount[k.key] = c + 1
            self._released(job)
            s = self._assign(job, i, p)
            lid = tracker.release(k.demand, (job, i),
                                  job.lid[p] if p >= 0 and plan.kinds[p] == KERNEL else -1)
            job.lid[i] = lid
            self.progress += 1
            job.t_rel[i] = self.now
            self.released += 1
            self.held = False
            if self._launch(job, i, k, s, lid):
                if plan.almost[i] or (self.lead and left <= self.lead and not job.almost_sent
                                      and job.estimate > 0):
                    self._almost(job)        # (before the release's event, as for copies)
                if self.ops:
                    self.events.append((OP_RELEASED, job.token, i, s, lid, self.now))
                job.st[i] = RELEASED
                if self.eager:
                    self._release_succ(job, i)
                elif self.lookahead > 1:
                    v = plan.vstream[i]
                    job.ahead[v] += 1
                    job.tail[v] = i
                    if job.ahead[v] < self.lookahead:
                        self._release_succ(job, i)
            if self.copies:
                self._flush_copies()
            if job.ready and not job.in_policy and not job.finished:
                self._queue(job)

    def _assign(self, job: CoreJob, i: int, behind: int) -> int:
        mode = self.stream_mode
        if job.pin >= 0 and mode != "single":
            s = job.pin
        elif mode == "pool":
            s = job.stream[behind] if behind >= 0 else self.free.popleft()
        elif mode == "single":
            s = job.real[0]                  # every op of a job on one stream: 0 unless held
            if s < 0:
                s = job.real[0] = self._ungated(0)
        else:
            v = job.plan.vstream[i]
            s = job.real[v]
            if s < 0:
                s = job.real[v] = self._ungated(self.rr_stream)
                self.rr_stream = (s + 1) % self.n_streams
        self.busy[s] += 1
        job.stream[i] = s
        return s

    def _must_wait(self, job: CoreJob, i: int) -> bool:
        """Op ``i`` would take its job's first real stream (sticky: its virtual
        stream's) while every stream holds a gate, where jobs share streams (single,
        sticky): it waits for a stream with none rather than queue behind a gate that may
        hold for another client's answer (_kcore.c's must_wait says why)."""
        mode = self.stream_mode
        if mode == "pool" or (job.pin >= 0 and mode != "single"):
            return False
        if job.real[0 if mode == "single" else job.plan.vstream[i]] >= 0:
            return False
        return every_stream_gated(self._gated(), self.n_streams)

    def _ungated(self, s: int) -> int:
        """``s``, or the next stream after it that holds no gate (the simulated device
        holding a kernel whose answer is still being computed): a new job, or a job's new
        virtual stream, goes there, not behind the held kernel (issue 37). Real time
        only; a core not launching into the engine sees none."""
        return next_ungated(self._gated(), s, self.n_streams)

    def _gated(self) -> Callable[[int], bool] | None:
        """Whether a stream holds a gate: the engine's counts (direct), else the device's
        own if it keeps them (the process simulator: ``stream_gated``), else None."""
        engine = self.engine
        return engine.stream_gated if engine is not None else getattr(self.device, "stream_gated", None)

    def _stream_done(self, s: int) -> None:
        self.busy[s] -= 1
        if self.busy[s] == 0 and self.stream_mode == "pool":
            self.free.append(s)

    def _launch(self, job: CoreJob, i: int, k: KernelSpec, s: int, lid: int) -> bool:
        self.device_calls += 1
        try:
            if k.effect or self.engine is None:
                self.device.launch_checked(k.record, s, lid,
                                           job.args[i] if job.args is not None else None,
                                           self.group)
            else:
                if self.wall is not None:
                    self.engine.poll_wall(*self.wall)
                self.engine.launch(k.shape, k.blocks, k.flops, k.nbytes,
                                   None if k.duration < 0 else k.duration, s, lid, True,
                                   self.group, None)
        except self.device_error as e:       # the device refused it: that job fails
            if isinstance(e, self.device_lost):
                raise
            self.tracker.unrelease(lid)
            self._stream_done(s)
            self._orphan_before(job, i)
            job.st[i] = RELEASED
            self._fail(job, REFUSED, f"{type(e).__name__}: {e}")
            self._finish_node(job, i)
            if job.pending == 0:
                self._finish(job)
            return False
        return True

    def _flush_copies(self) -> None:
        copies = self.copies
        while copies:
            job, i = copies[0]
            if job.st[i] == DROPPED:
                copies.popleft()
                continue
            p = self._behind(job, i)
            if p < 0 and self.stream_mode == "pool" and not self.free:
                return
            if p < 0 and self._must_wait(job, i):
                return
            copies.popleft()
            self._launch_copy(job, i, p)

    def _launch_copy(self, job: CoreJob, i: int, behind: int) -> None:
        s = self._assign(job, i, behind)
        # Implied while streams are not scarce: see _kcore.c's launch_copy (at most half
        # the pool waits behind implied copies; all of it deadlocked Figure 2 at 50k/s).
        imp = self._implied_on and job.plan.implied[i] and (
            self.stream_mode != "pool" or 2 * len(self.free) >= self.n_streams)
        self.progress += 1
        self.device_calls += 1 if imp else 3
        job.t_rel[i] = self.now
        if job.plan.almost[i]:
            self._almost(job)
        dptr, host = job.copies[i][:2]
        dev = self.device
        try:
            if job.plan.kinds[i] == H2D:
                dev.memcpy_htod(dptr, host, s)
            else:
                dev.memcpy_dtoh(host, dptr, s)
            ev = None if imp else dev.record_event(s)
        except self.device_error as e:       # refused: that job fails
            if isinstance(e, self.device_lost):
                raise
            self._stream_done(s)
            self._orphan_before(job, i)
            job.st[i] = RELEASED
            self._fail(job, REFUSED, f"{type(e).__name__}: {e}")
            self._finish_node(job, i)
            if job.pending == 0 and not job.finished:
                self._finish(job)
            return
        if not imp:
            self.copy_events.setdefault(s, deque()).append((ev, job, i))
        job.st[i] = IMPLIED if imp else RELEASED
        if self.ops:
            self.events.append((OP_RELEASED, job.token, i, s, -1, self.now))
        if self.eager or self.lookahead > 1 or imp:
            self._release_succ(job, i)

    @property
    def implied_copies(self) -> bool:
        """Whether implied copies record no event (:func:`implied_copies`; default on)."""
        return self._implied_on

    @implied_copies.setter
    def implied_copies(self, on: bool) -> None:
        if self.jobs:                        # (released copies went under the other rule)
            raise ValueError("implied_copies can change only with no job live")
        self._implied_on = bool(on)

    def _implied_done(self, job: CoreJob, i: int) -> None:
        """The implied copies just ahead of node ``i`` on its stream: done, oldest first,
        now that ``i`` is seen done (stream order: they completed before it started)."""
        plan = job.plan
        first, q = -1, plan.pred[i]
        while q >= 0 and job.st[q] == IMPLIED:
            first, q = q, plan.pred[q]
        while first >= 0 and first != i:
            nxt = plan.succ[first]
            self.progress += 1
            if self.ops:
                self.events.append((OP_ENDED, job.token, first, -1.0, self.now))
            self._op_done(job, first)
            first = nxt

    def _orphan_before(self, job: CoreJob, n: int) -> None:
        """Node ``n`` will not run (dropped, refused): an implied copy just ahead of it,
        released, has nothing left to tell its completion, so an event recorded behind
        it does (the two driver calls it had saved)."""
        plan = job.plan
        q = plan.pred[n]
        if q < 0 or plan.succ[q] != n or job.st[q] != IMPLIED:
            return
        s = job.stream[q]
        ev = self.device.record_event(s)
        self.device_calls += 2
        self.copy_events.setdefault(s, deque()).append((ev, job, q))

    # -- completions --------------------------------------------------------------------------
    def _poll_copies(self) -> None:
        query = self.device.event_query
        for s in list(self.copy_events):
            q = self.copy_events[s]
            while q and query(q[0][0]):
                _, job, i = q.popleft()
                self.progress += 1
                pred = job.plan.pred[i]
                if pred >= 0 and job.st[pred] == IMPLIED and not job.finished:
                    self._implied_done(job, i)
                if self.ops and not job.finished:
                    self.events.append((OP_ENDED, job.token, i, -1.0, self.now))
                self._op_done(job, i)
            if not q:
                del self.copy_events[s]

    def _kernel_done(self, token: Any, t_first: float) -> None:
        job, i = token
        plan = job.plan
        k = plan.kernels[plan.kernel[i]]
        q = plan.pred[i]
        if q >= 0 and job.st[q] == IMPLIED:
            self._implied_done(job, i)
        job.profile.record_kernel(k.key, self.now - t_first)
        if self.ops:
            self.events.append((OP_ENDED, job.token, i, t_first, self.now))
        faults = getattr(self.device, "faults", None)
        if faults and job.lid[i] in faults:
            reason = faults.pop(job.lid[i])
            if not job.finished and job.failed is None:
                self._fail(job, FAULT, reason)
        if self.policy == "priority" and job.on_device:
            self._level_count(job, -1)
        self._op_done(job, i)

    def _op_done(self, job: CoreJob, i: int) -> None:
        self._stream_done(job.stream[i])
        self._finish_node(job, i)
        plan = job.plan
        if self.lookahead > 1 and plan.kinds[i] == KERNEL and not self.eager:
            v = plan.vstream[i]
            job.ahead[v] -= 1
            tail = job.tail[v]
            if tail == i:
                job.tail[v] = -1
            elif tail >= 0 and job.st[tail] == RELEASED:
                self._release_succ(job, tail)
        if job.pending == 0 and not job.finished:
            self._finish(job)

    def _almost(self, job: CoreJob) -> None:
        if not job.almost_sent:
            job.almost_sent = True
            self.events.append((ALMOST, job.token))

    def _fail(self, job: CoreJob, kind: int, reason: str) -> None:
        """Stop a job: its unreleased ops are dropped; it finishes once its released
        ops have drained."""
        job.failed = reason
        if kind:                             # 0: aborted, nothing to say
            self.events.append((kind, job.token, reason))
        for n, st in enumerate(job.st):
            if st in (WAITING, READY):
                job.st[n] = DROPPED
                job.pending -= 1
                self._orphan_before(job, n)
        job.ready.clear()
        self._withdraw(job)

    def _withdraw(self, job: CoreJob) -> None:
        if not job.left_policy:
            job.left_policy = True
            if job.in_policy:
                self.queued -= 1
            job.in_policy = False
            if job.started:                  # (aborted before it started: never arrived)
                self._job_finished(job)

    def _finish(self, job: CoreJob) -> None:
        job.finished = True
        self.jobs -= 1
        self.handles.pop(job.handle, None)     # (the C core reuses its slot)
        if job.failed is None:
            job.profile.record_job(job.kcount)
            self._almost(job)
        self._withdraw(job)
        self.events.append((FINISHED, job.token, sum(job.kcount)))

    # -- the built-in policies ------------------------------------------------------------------
    # One contract, as paella.dispatcher.policies.base: job_arrived, kernel_ready, pick,
    # released, job_finished (kernel_completed: priority's count, in _kernel_done).
    def _job_arrived(self, job: CoreJob) -> None:
        if self.policy != "paella":
            return
        key = job.unit_key if self.by_client else job
        unit = self.units.get(key)
        if unit is None:
            unit = self.units[key] = _Unit(-self.G, self.useq)
            self.useq += 1
            self.share = 1.0 / len(self.units)
        unit.jobs += 1
        job.unit = unit
        self.n_live += 1
        self.inflight.push(job, job.remaining, job.seq)
        self.live_levels[job.level] = self.live_levels.get(job.level, 0) + 1

    def _kernel_ready(self, job: CoreJob) -> None:
        pol = self.policy
        # Classes first in every policy (class_key: class, then the policy's own key).
        lv = job.level
        if pol in ("fifo", "ms-jbj", "ms-kbk"):
            self.heap.push(job, class_key(lv, job.seq), 0)
        elif pol == "sjf":
            self.heap.push(job, class_key(lv, job.estimate), job.seq)
        elif pol == "rr":
            self.heap.push(job, class_key(lv, self.turn), 0)
            self.turn += 1
        elif pol == "priority":
            self.heap.push(job, class_key(lv, job.remaining), job.seq)
        else:
            job.queued = True
            self.heap.push(job, class_key(lv, job.remaining), job.seq)
            unit = job.unit
            if not job.infifo:
                job.infifo = True
                fifo = unit.ready if self.by_client else self.fifo
                heappush(fifo, (job.seq, job))
                if len(fifo) > 2 * self.n_live + 64:
                    self._compact(fifo)
            unit.nready += 1
            if unit.nready == 1:
                self.dheap.push(unit, -unit.s, unit.seq)

    def _saturated(self) -> bool:
        """The saturation rule: more jobs wait for a release than ``backlog``. Their
        latency is then queueing, which only the GPU's throughput shortens, so the
        occupancy gate (the +B rule, paella's order and hold rules) is lifted and only
        flow control applies. Only while every job admitted so far was of one class: a
        more urgent class's bounded wait needs the gate."""
        return 0 < self.backlog < self.queued and not self.mixed

    def _pick(self) -> CoreJob | None:
        pol = self.policy
        if pol != "paella":
            job = self.heap.top()
            if pol == "priority" and job is not None and self.level_on_device:
                if any(lv < job.level for lv in self.level_on_device):
                    return None
            return job
        unit = self.dheap.top()
        if unit is not None and self.G - self.dheap.top_key() >= self.threshold:
            # Deficits act within the most urgent class waiting.
            first = self._oldest(unit.ready if self.by_client else self.fifo)
            top = self.heap.top()
            if top is None or first.level <= top.level:
                return first
        job = self.heap.top()
        if job is None:
            return None
        plan = job.plan
        k = plan.kernels[plan.kernel[job.ready[0]]]
        t = self.tracker
        # The class rule: while a job of a more urgent class is live, no kernel of a less
        # urgent one goes (it would delay that job's next kernel and share its SMs).
        if len(self.live_levels) > 1 and min(self.live_levels) < job.level:
            return None
        other = self.inflight.top()
        if other is job:
            return job
        if self._saturated():
            return job
        if not t.starts_now(k.demand):
            return None
        if (self.hold is None or not self.inflight.top_key() < job.remaining
                or other.level > job.level):          # (no hold for a less urgent class)
            return job
        prof = job.profile
        if (prof.seen[k.key] and prof.time[k.key] * 1e9 > self.hold * other.estimate
                and not t.fits_now(k.demand)):
            return None
        return job

    def _released(self, job: CoreJob) -> None:
        pol = self.policy
        self.heap.remove(job)
        if pol == "priority":
            self._level_count(job, +1)
            return
        if pol != "paella":
            return
        job.queued = False
        unit = job.unit
        unit.nready -= 1
        if unit.nready == 0:
            self.dheap.remove(unit)
        self.inflight.push(job, job.remaining, job.seq)
        self.G += self.share
        unit.s -= 1.0
        if unit.nready:
            self.dheap.push(unit, -unit.s, unit.seq)
        if self.G > _REBASE:
            g = self.G
            self.G = 0.0
            for u in self.units.values():
                u.s += g
            self.dheap.shift(-g)

    def _job_finished(self, job: CoreJob) -> None:
        pol = self.policy
        self.heap.remove(job)
        if pol == "priority":
            if job.on_device:
                self._level_count(job, -job.on_device)
            return
        if pol != "paella":
            return
        unit = job.unit
        if job.queued:
            job.queued = False
            unit.nready -= 1
            if unit.nready == 0:
                self.dheap.remove(unit)
        self.inflight.remove(job)
        self.n_live -= 1
        n = self.live_levels[job.level] - 1
        if n:
            self.live_levels[job.level] = n
        else:
            del self.live_levels[job.level]
        unit.jobs -= 1
        if unit.jobs == 0:
            key = job.unit_key if self.by_client else job
            del self.units[key]
            if self.units:
                self.share = 1.0 / len(self.units)

    def _level_count(self, job: CoreJob, n: int) -> None:
        job.on_device += n
        m = self.level_on_device.get(job.level, 0) + n
        if m:
            self.level_on_device[job.level] = m
        else:
            self.level_on_device.pop(job.level, None)

    @staticmethod
    def _compact(fifo: list) -> None:
        keep = []
        for e in fifo:
            if e[1].queued:
                keep.append(e)
            else:
                e[1].infifo = False
        heapify(keep)
        fifo[:] = keep

    @staticmethod
    def _oldest(fifo: list) -> CoreJob:
        while fifo:
            job = fifo[0][1]
            if job.queued:
                return job
            heappop(fifo)
            job.infifo = False
        raise AssertionError("a unit counted as ready has no ready job")


class _Unit:
    """paella's fairness unit: its deficit ``s`` (``deficit = s + G``), ready jobs, live
    jobs and creation order (the deficit heap's tie-break)."""
    __slots__ = ("s", "nready", "ready", "jobs", "seq")

    def __init__(self, s: float, seq: int):
        self.s = s
        self.nready = 0
        self.ready: list = []       # client mode: (seq, job) of its queued jobs
        self.jobs = 0
        self.seq = seq


@dataclass(frozen=True, slots=True)
class CoreModel:
    """A model registered with a core: its plan and profile indices there, its spec, the
    kernel names in profile order, and where each node's operands come from (per node:
    its plan step, -1 for MARKERs); ``operands``: :func:`set_operands` compiled for it
    (:func:`compile_operands`)."""
    plan: int
    profile: int
    spec: PlanSpec
    names: tuple[str, ...]
    steps: tuple[int, ...]
    operands: Callable[[Sequence[Any], Any], tuple] | None = None


def register_model(core: Any, replay: Any, profile: Any, device: Any,
                   direct: bool = True) -> CoreModel:
    """Register a compiled ``ReplayPlan`` and its model's ``ModelProfile`` (the legacy
    statistics, seeded by profiling runs) with ``core``. ``direct``: the core launches
    into the simulated engine (its shape ids are resolved here)."""
    names = list(profile.kernels)
    for step in replay.steps:                # kernels never profiled come last
        if step.kind == KERNEL and step.launch.name not in names:
            names.append(step.launch.name)
    index = {n: i for i, n in enumerate(names)}
    spec = plan_spec(replay, index.__getitem__,
                     device._shapes.__getitem__ if direct else (lambda fp: -1), device.props)
    stats = [profile.kernels.get(n) for n in names]
    pi = core.add_plan(spec)
    fi = core.add_profile([k.count if k else 0.0 for k in stats],
                          [k.time if k else 0.0 for k in stats],
                          [k.n_time if k else 0 for k in stats],
                          [k is not None for k in stats], profile.jobs, profile.window)
    steps = [-1] * len(spec.kinds)
    for i, node in enumerate(replay._nodes):
        if node >= 0:
            steps[node] = i
    return CoreModel(pi, fi, spec, tuple(names), tuple(steps),
                     compile_operands(tuple(steps), replay))


def compile_operands(steps: tuple[int, ...], replay: Any) -> Callable[[Sequence[Any], Any], tuple]:
    """``(bound, view) -> (args, copies)``: :func:`set_operands_reference` for one
    model, with ``view`` its ``memory.view`` (None: no device views).

    Speed (a trick, labelled): generated once per model and run by ``exec``, as
    ``PlanAdaptor``'s binder (``adaptor.compile_binder``, which says why a buffer set's
    making is worth it): the nodes' kinds and the copies' sizes are read here, not per
    set. Only integers and fixed names go into the code."""
    args, copies, views = [], [], []
    for node, i in enumerate(steps):
        if i < 0:
            args.append("None")
            copies.append("None")
            continue
        step = replay.steps[i]
        if step.kind == KERNEL:
            args.append(f"b[{int(i)}]")
            copies.append("None")
            continue
        args.append("None")
        n = int(step.io_end - step.io_start)
        views.append(f"    v{node} = view(b[{int(i)}], {n})\n")
        copies.append(f"(b[{int(i)}], None, v{node}, v{node}.ctypes.data, v{node}.nbytes)")
    plain = [c if c == "None" else c.split(", None, ")[0] + ", None, None)" for c in copies]
    src = ("def operands(b, view):\n"
           "    if view is None:\n"
           f"        return ({''.join(a + ', ' for a in args)}), ({''.join(c + ', ' for c in plain)})\n"
           + "".join(views) +
           f"    return ({''.join(a + ', ' for a in args)}), ({''.join(c + ', ' for c in copies)})\n")
    scope: dict[str, Any] = {}
    exec(src, scope)                         # noqa: S102 - integers and fixed names only
    return scope["operands"]


def set_operands(model: CoreModel, replay: Any, bound: Sequence[Any],
                 memory: Any = None) -> tuple:
    """:func:`set_operands_reference`, by the model's compiled ``operands``; where a
    copy's range is not on the device (a view refused), by the reference."""
    from paella.dispatcher.devices.base import DeviceError
    if model.operands is not None:
        try:
            return model.operands(bound, None if memory is None else memory.view)
        except DeviceError:
            pass
    return set_operands_reference(model, replay, bound, memory)


def set_operands_reference(model: CoreModel, replay: Any, bound: Sequence[Any],
                           memory: Any = None) -> tuple:
    """``(args, copies)`` of one buffer set for :meth:`KernelCore.admit` (made once per
    set and model: the same for every job on it): per node, a kernel's bound arguments,
    and a copy's ``(dptr, None, device view[, its address, its bytes])``: the host side is the job's io buffer at
    the plan's offsets (``admit(..., io)``); the device view (the simulator's bytes, for
    the C core's direct copies; None without ``memory`` or where the range is not on
    the device, and that copy goes through the device, which refuses it)."""
    from paella.dispatcher.devices.base import DeviceError
    args: list[Any] = [None] * len(model.steps)
    copies: list[Any] = [None] * len(model.steps)
    for node, i in enumerate(model.steps):
        if i < 0:
            continue
        step = replay.steps[i]
        if step.kind == KERNEL:
            args[node] = bound[i]
            continue
        dev = None
        if memory is not None:
            try:
                dev = memory.view(bound[i], step.io_end - step.io_start)
            except DeviceError:
                pass
        # Speed (a trick, labelled): the view's address and size, read once per buffer
        # set, so the C core takes no buffer of the view per job (numpy's buffer export
        # costs ~350 instructions); the view in the tuple keeps the memory alive.
        copies[node] = ((bound[i], None, dev) if dev is None else
                        (bound[i], None, dev, dev.ctypes.data, dev.nbytes))
    return tuple(args), tuple(copies)


def job_operands(model: CoreModel, replay: Any, bound: Sequence[Any], io: Any,
                 memory: Any = None) -> tuple:
    """``(args, copies)`` of one job with its host views made here (the reference form
    of :func:`set_operands` + ``admit(..., io)``: tests and benchmarks)."""
    args, copies = set_operands(model, replay, bound, memory)
    spec = model.spec
    copies = tuple(None if c is None else (c[0], io[spec.io_start[n]:spec.io_end[n]], *c[2:])
                   for n, c in enumerate(copies))
    return args, copies


def make_core(impl: str, tracker: Any, device: Any, policy: str = "paella", *,
              lookahead: int = 1, group: int = 16, wake_lead: float = 0.0,
              fairness_threshold: float | None = None, fairness_unit: str = "job",
              hold_factor: float | None = DEFAULT_HOLD_FACTOR, direct: bool = True,
              saturation_backlog: int = 0) -> Any:
    """A kernel core: ``impl`` "c" (``_kcore.KernelCore``) or "python" (the reference).
    ``direct``: launch kernels into the simulated engine by a direct call (a SimDevice
    in virtual time); otherwise every launch goes through ``device.launch_checked``.
    ``saturation_backlog``: the saturation rule's backlog (0: off; ``KernelCore``)."""
    from paella.dispatcher.devices.base import DeviceError, DeviceLost
    if policy not in POLICIES:
        raise ValueError(f"the kernel core has no built-in policy {policy!r}; it has "
                         f"{', '.join(POLICIES)}")
    if type(lookahead) is not int or lookahead < 1:
        raise ValueError(f"lookahead must be an int >= 1, got {lookahead!r}")
    if fairness_unit not in ("job", "client"):
        raise ValueError(f"fairness_unit must be 'job' or 'client', got {fairness_unit!r}")
    threshold = DEFAULT_FAIRNESS_THRESHOLD if fairness_threshold is None \
        else float(fairness_threshold)
    engine = getattr(device, "gpu", None) if direct else None
    if impl == "c":
        cls = load("_kcore").KernelCore
    elif impl == "python":
        cls = KernelCore
    else:
        raise ValueError(f"kernel core implementation must be 'c' or 'python', got {impl!r}")
    return cls(tracker, device, engine, len(device.streams), policy, lookahead, group,
               float(wake_lead), threshold, fairness_unit == "client",
               float(hold_factor or 0.0), DeviceError, DeviceLost, saturation_backlog)


__all__ = ["make_core", "set_operands", "job_operands", "register_model", "CoreModel", "ALMOST", "FINISHED", "REFUSED", "FAULT", "OP_RELEASED", "OP_ENDED", "OP_HELD", "POLICIES", "KernelSpec", "PlanSpec",
           "Profile", "KernelCore", "plan_spec", "to_ns"]
