"""The dispatcher: requests in, kernels out, one short loop (§4.2, §5, §6).

:meth:`Dispatcher.step` is one iteration of the loop; the daemon calls it forever,
the virtual-time harness between clock advances. Everything else here is bookkeeping
called from that loop: jobs (replayed plans, or greenlets running adaptors), their
waitlists, the occupancy tracker, the policy, and the virtual-to-real stream map.

Contract with the daemon:

* ``register_model(name, adaptor) -> model_id`` (runs ``adaptor.init`` and profiling
  jobs that seed the SRPT estimate);
* ``submit(Request)`` (a job serving that one request) or ``submit_group(requests, io)``
  (one job serving several requests of one model: the seam for batchers); each
  request's ``on_almost_finished(req)`` fires when the op its job marked (before the
  last D2H copy, for plans) is released, when the job's estimated unreleased work first
  drops to ``wake_lead`` seconds (if set), or at the latest just before completion;
  ``on_complete(req, status, error)`` once, with ``STATUS_OK``, ``STATUS_ERROR`` (the
  job failed: ``error`` says why) or ``STATUS_CANCELLED``;
* ``step() -> bool`` (True while anything is in flight), ``cancel_client(id)``,
  ``in_flight`` (requests). Completion, wake-up and cancellation are per request;
* ``abandon_all(reason, status)`` completes every request still in flight at once, without
  waiting for the device: the daemon's last act before it exits.
* ``instruments`` (:mod:`paella.dispatcher.instruments`): hooks on requests and ops.

The dispatcher is the :class:`~paella.dispatcher.job.JobHost` of its jobs: they see it
only through that interface.

A policy is plug-in code and may be wrong. A hook that raises, a ``pick()`` that
returns something other than a queued job of this dispatcher, or a ``pick()`` that
keeps returning None while jobs are ready and the device has nothing to do (for
``POLICY_STALL_SECONDS``) is logged, and the dispatcher goes on with ``fifo``.
"""
from __future__ import annotations

import logging
import operator
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import greenlet
import numpy as np

from paella import protocol, rings
from paella.occupancy import wave_blocks
from paella.plugins import PLUGIN_ERRORS
from paella.dispatcher.devices.base import (H2D, KERNEL, Device, DeviceError, DeviceLost, Function,
                                            OutOfMemory, dim3)

from . import kernel_core as kc
from .adaptor import JobAdaptor, PlanAdaptor
from .instruments import Instrument, Instruments, every_dispatcher_instruments
from .job import DEFAULT_LEVEL, FINISHED, Job
from .ops import CoreOp, KernelLaunch, Op
from .policies import Policy, PolicyError, get_policy
from .policies.base import check_declared
from .profile import ESTIMATE_DIGITS, KernelStat, ModelProfile
from .replay import ReplayPlan
from .slicing import SliceRule, SlicedAdaptor, slice_plan, sliceable
from .streams import StreamMap
from .virtual_time import VirtualDriver
from .tracker import Tracker
from .waitlist import DROPPED, RELEASED, Node, VStream

log = logging.getLogger(__name__)

#: The instrument hooks of ops: the kernel core reports them only while one listens.
OP_HOOKS = ("op_issued", "op_released", "op_started", "op_ended", "policy_held")
#: Completion statuses: the wire's own codes (``paella.rings``), one vocabulary from the
#: dispatcher to the client's completion ring.
STATUS_OK, STATUS_ERROR, STATUS_CANCELLED = rings.OK, rings.E_FAILED, rings.E_CANCELLED
FALLBACK_POLICY = "fifo"
#: A policy whose pick() holds every ready job back this long while the device has
#: nothing in flight is stalled (real time; a virtual clock cannot advance meanwhile,
#: so there it counts as stalled at once). No useful policy idles the GPU for a second.
POLICY_STALL_SECONDS = 1.0
#: Per-request buffer sets a model's pool makes at its registration, by default where
#: requests are served (the daemon, the experiments): see ``Dispatcher._reserve_sets``.
#: 512 covers Figure 2's bursts near its knee (as 1,024 did; 256 not for every seed), and
#: costs a model's registration about 4 ms.
DEFAULT_SETS_AHEAD = 512
#: The most of them: a model with bigger sets makes fewer (``SETS_AHEAD_BYTES``).
MAX_SETS_AHEAD = 1 << 16
#: The most kernels of one stream that may be released and not completed (``lookahead``):
#: far past any use, and within the kernel cores' int.
MAX_LOOKAHEAD = 1 << 16
#: The saturation rule's default backlog is never below this many jobs: a burst of a few
#: jobs on a small GPU (Figure 1's four tasks on two SMs) is not saturation, and its order
#: is the ideal schedule's only with the gate.
MIN_SATURATION_BACKLOG = 16
#: Device bytes of sets made ahead per model, at most (a BERT-base's 11-40 MB sets: 1 or
#: none; ResNet-50's: a few); and in all, at most this fraction of the device's memory.
SETS_AHEAD_BYTES = 16 << 20
SETS_AHEAD_SHARE = 1 / 16


@dataclass(eq=False)
class Request:
    """One inference request. ``io`` is a uint8 view of the client's io region."""
    req_id: int
    client_id: int
    model_id: int
    io: np.ndarray
    options: Any = None
    on_almost_finished: Callable[["Request"], None] | None = None
    on_complete: Callable[["Request", int, "str | None"], None] | None = None
    # Filled in by the dispatcher (device clock, seconds).
    t_submit: float = float("nan")
    t_done: float = float("nan")
    status: int = -1
    error: str | None = None
    cancelled: bool = False          # its client went away: completes as STATUS_CANCELLED
    # Its shape (batching): rows on the batch axis, sequence length (0: the model has no
    # length axis), the tensors' slots in ``io`` (paella.shapes.Slot, inputs then
    # outputs; None: the variant's own layout), and a priority level for batchers.
    rows: int = 1
    seq_len: int = 0
    layout: Any = None
    priority: int = 0
    #: Streaming (a scheduler's partial results): ``(req, n)`` says n outputs are valid
    #: in ``io`` so far; set by the front end for requests that asked to stream.
    on_progress: Callable[["Request", int], None] | None = None
    #: Its client's tenant (the front end: the peer's uid; -1 unknown): whose share of
    #: the simulated GPU's answer workers a new input takes (:meth:`Dispatcher.owner_of`).
    tenant: int = -1


@dataclass(eq=False)
class Model:
    model_id: int
    name: str
    adaptor: JobAdaptor
    profile: ModelProfile = field(default_factory=ModelProfile)
    # The adaptor's launch plan compiled for this dispatcher (None: run() in a greenlet).
    replay: ReplayPlan | None = None
    # The adaptor's per-request buffer sets (adaptor.BufferPool), if it has any.
    pool: Any = None
    # Its jobs not yet finished (waiting for a buffer set included).
    jobs: int = 0
    # Taken out of service (Dispatcher.retire_model): removed once ``jobs`` is 0.
    retired: bool = False
    # Device bytes its adaptor's init allocated (params, constants).
    weights_bytes: int = 0
    # Its plan and statistics in the dispatcher's kernel core (kernel_core.CoreModel).
    core: Any = None
    # Slicing (paella.dispatcher.slicing): its twin serving the sliced plan, which the jobs
    # of a less urgent class than the most urgent seen run; a twin names its model here.
    sliced: "Model | None" = None
    parent: "Model | None" = None
    # Its adaptor's ``answer_ahead(io, owner) -> Future | None`` (None: it has none): on the
    # simulated GPU, a job whose answer is new waits for it before it takes anything.
    answer_ahead: Any = None
    # Its adaptor's ``answer_owner(bindings, owner)`` (None: it has none): told whose job
    # takes a buffer set, for the answers computed at that job's kernels.
    answer_owner: Any = None


def _no_wake() -> None:
    """A device with no loop to wake (its answers come in while it is stepped)."""


def _launch_counts(plan: Any) -> dict[str, int]:
    """Launches per kernel name in a plan."""
    counts: dict[str, int] = {}
    for op in plan.ops:
        if op.kind == "launch":
            counts[op.kernel] = counts.get(op.kernel, 0) + 1
    return counts


_T = TypeVar("_T")
#: Jobs in arrival order (their ``seq``).
_BY_SEQ = operator.attrgetter("seq")


def _extents(bindings: Any) -> Any:
    """What a buffer set holds, for ``Device.writes_pending``: its own allocations, or
    (a set carved from shared memory) its buffers' pointers."""
    return bindings.own or bindings.ptrs.values()


def _sim_device_class() -> type:
    """The simulated GPU's device class, whose own methods a kernel core may bypass."""
    from paella.dispatcher.devices.sim import SimDevice
    return SimDevice


class RunInterrupted(RuntimeError):
    """``run_until_idle``'s ``stop()`` returned True before the work drained."""


class Dispatcher:
    def __init__(self, device: Device, policy: str | type[Policy] = "paella", *,
                 extra_blocks: int | None = None, fairness_threshold: float | None = None,
                 group: int = protocol.DEFAULT_GROUP,
                 counter_pairs: int = protocol.DEFAULT_COUNTER_PAIRS,
                 policy_options: dict[str, Any] | None = None, profile_runs: int = 2,
                 instruments: "list[Instrument] | tuple[Instrument, ...]" = (),
                 lookahead: int = 1, compiled_replay: bool = True, wake_lead: float = 0.0,
                 kernel_core: str | None = None, slice_us: float = 0.0,
                 implied_copies: bool = True, buffer_sets_ahead: int = DEFAULT_SETS_AHEAD,
                 saturation_backlog: int | None = None):
        if type(lookahead) is not int or not 1 <= lookahead <= MAX_LOOKAHEAD:
            raise ValueError(f"lookahead must be an int 1..{MAX_LOOKAHEAD} (kernels of one stream released "
                             f"and not completed), got {lookahead!r}")
        if type(buffer_sets_ahead) is not int or not 0 <= buffer_sets_ahead <= MAX_SETS_AHEAD:
            raise ValueError(f"buffer_sets_ahead must be an int 0..{MAX_SETS_AHEAD} (buffer sets "
                             f"a model's pool makes when it is registered), got "
                             f"{buffer_sets_ahead!r}")
        #: Buffer sets each model's pool makes at registration (:meth:`_reserve_sets`).
        self.buffer_sets_ahead = buffer_sets_ahead
        self._ahead_bytes = 0                # device bytes of the sets it made ahead, in all
        if type(wake_lead) not in (int, float) or not 0.0 <= wake_lead <= 1.0:
            raise ValueError(f"wake_lead must be 0..1 seconds (the client's wake-up goes out "
                             f"when a job's estimated unreleased work drops to it; 0: only at "
                             f"the op the job marked), got {wake_lead!r}")
        device_pairs = getattr(device, "counter_pairs", None)
        if device_pairs is not None and counter_pairs > device_pairs:
            # Two launches in flight on pairs p and p + device_pairs would share the
            # device's counters and mix their block counts.
            raise ValueError(f"the dispatcher's counter_pairs ({counter_pairs}) exceed the "
                             f"device's notifQ counter pairs ({device_pairs}): give both the "
                             f"same value")
        self.device = device
        #: The device's failed kernels (launch id -> reason; Device.faults), the same dict.
        self._faults: dict[int, str] = getattr(device, "faults", {})
        #: ... and those that failed after their completion was reported
        #: (``Device.late_faults``), taken at the start of each pass; on this object's
        #: own path, the job of each kernel released on such a device, by launch id (the
        #: kernel cores find it themselves: ``job_of``).
        self._late_faults: dict[int, str] = getattr(device, "late_faults", {})
        #: A device that may still write a finished job's buffers (the process
        #: simulator applies a held kernel's answer after the dispatcher saw the kernel
        #: done: a job cancelled meanwhile finishes first): ``writes_pending(pointers)``;
        #: such a job's buffer set waits in ``_held_sets`` until the device lets go, so
        #: that the next job on it never gets (or loses) the old job's answer.
        self._writes_pending: Callable[[Any], bool] | None = getattr(device, "writes_pending", None)
        self._held_sets: list[tuple[Any, Any]] = []
        self._late_jobs: weakref.WeakValueDictionary | None = (
            weakref.WeakValueDictionary() if getattr(device, "late_effects", False) else None)
        #: Kernels of one job's stream that may be released and not yet completed (1: a
        #: kernel goes when its predecessor has completed; see "Lookahead" in the docs).
        self.lookahead = lookahead
        #: The "almost finished" wake-up goes out, at the latest, at the release that brings
        #: a profiled job's estimated unreleased work down to this (seconds; 0: only at the
        #: op the job marked, the paper's rule). See "Wake-up lead" in docs/dispatcher.md.
        self.wake_lead = float(wake_lead)
        #: On a kernel core: an input copy that a kernel or copy follows on its stream
        #: records no event, and that op is released behind it at once
        #: (kernel_core.implied_copies). The dispatcher's own path keeps an event per copy.
        self.implied_copies = bool(implied_copies)
        if (type(slice_us) not in (int, float) or slice_us != slice_us or slice_us < 0
                or slice_us > 1e6):
            raise ValueError(f"slice_us must be 0..1000000 microseconds (the longest a kernel "
                             f"slice of a less urgent job may make more urgent work wait; 0: "
                             f"no slicing), got {slice_us!r}")
        #: Kernel slicing (paella.dispatcher.slicing): None, or how long a slice may last.
        self.slicer = SliceRule(slice_us * 1e-6) if slice_us else None
        #: The most urgent class (lowest level) any job has had: jobs of a less urgent one
        #: run their model's sliced plan.
        self.urgent_level = DEFAULT_LEVEL
        #: Plans replay through the compiled waitlist (paella.dispatcher.replay); False: the
        #: reference path, for comparison.
        self.compiled_replay = compiled_replay
        self.instruments = Instruments(instruments)
        self.group = group
        self.profile_runs = profile_runs
        #: Its owner's: a profiling run (register_model) gives up when this returns True
        #: (the daemon's: SIGTERM during start-up or a reload), as it does after 60 s.
        self.profile_stop: Callable[[], bool] | None = None
        self.extra_blocks = device.props.sm_count if extra_blocks is None else extra_blocks
        if saturation_backlog is not None and (type(saturation_backlog) is not int
                                               or saturation_backlog < 0):
            raise ValueError(f"saturation_backlog must be an int >= 0 (jobs waiting for a "
                             f"release past which the occupancy gate is lifted; 0: never), "
                             f"got {saturation_backlog!r}")
        #: The saturation rule (docs/dispatcher.md, "Saturation"): with more jobs waiting
        #: for a release than this, the occupancy gate (the +B rule, paella's order and
        #: hold rules) is lifted and only flow control applies (0: never). Default: half
        #: the GPU's SM count, at least :data:`MIN_SATURATION_BACKLOG` (Figure 11's mix:
        #: docs/dispatcher.md has what each measured).
        self.saturation_backlog = (
            max(MIN_SATURATION_BACKLOG, device.props.sm_count // 2) if saturation_backlog is None
            else saturation_backlog)
        self._class0: int | None = None
        self._mixed_classes = False
        self.tracker = Tracker(device.props, device.notifq, extra_blocks=self.extra_blocks,
                               group=group, counter_pairs=counter_pairs)
        opts = dict(policy_options or {})
        if fairness_threshold is not None:
            opts["fairness_threshold"] = fairness_threshold
        cls = get_policy(policy) if isinstance(policy, str) else policy
        self.policy: Policy = cls(self, **opts)
        check_declared(self.policy)
        self._bind_policy()
        self.streams = StreamMap(len(device.streams), self.policy.stream_mode)
        gpu = getattr(device, "gpu", None)
        if getattr(device, "realtime", False) and hasattr(gpu, "stream_gated"):
            self.streams.gated = gpu.stream_gated    # (issue 37: held streams, see streams.py)
        elif hasattr(device, "stream_gated"):        # (the process simulator's own counts)
            self.streams.gated = device.stream_gated
        self.models: dict[int, Model] = {}   # by model id
        self.jobs: set[Job] = set()
        self.in_flight = 0
        self.now = device.now()
        self.iterations = 0
        #: Times a failing policy was replaced by fifo (``policy_failure`` says the last why).
        self.policy_fallbacks = 0
        self.idle = True                     # the last step() changed nothing
        self._arrivals: deque[Job] = deque()
        self._resume: list[Job] = []
        #: Jobs that found the device's memory full: they try again as a job ends.
        self._memory_waiting: deque[Job] = deque()
        #: Jobs waiting for their answer to be computed before they start, and those
        #: whose answer came in (appended by the effect workers' thread): see
        #: :meth:`_await_answer`.
        self._answering: dict[Job, Any] = {}
        #: Client id -> tenant, as the front end told (:meth:`note_tenant`).
        self.tenants: dict[int, int] = {}
        self._answered: deque[Job] = deque()
        #: Greenlet jobs whose own malloc found the device full: resumed as a job ends.
        self._memory_blocked: list[Job] = []
        #: Times a job waited for device memory, and requests failed for want of it.
        self.memory_waits = 0
        self.memory_failures = 0
        self._copies: deque[Op] = deque()    # active copies, released ahead of kernels
        self._copy_events: dict[int, deque] = {}
        self._seq = 0
        self._progress = 0
        self._queued = 0                     # jobs announced to the policy (job.in_policy)
        self._launches: dict[tuple, KernelLaunch] = {}   # checked launch records, by shape
        self._top_id = -1                    # the largest model id ever registered
        #: Every model not removed yet: those in ``models``, and replaced or retired ones
        #: whose jobs still run (their idle buffers can be reclaimed too).
        self._live: set[Model] = set()
        self._held_since = 0.0               # when pick() began holding an idle device back
        self._hold_reported = False          # policy_held told since the last release
        self._held_iter = -2                 # ... the iteration that last saw it do so
        #: The kernel core that runs every job's kernels ("c" or "python"; None: this
        #: object's own per-kernel path, which the core reproduces). See "The kernel
        #: core" in docs/dispatcher.md.
        self.core: Any = None
        self._core_memory: Any = None
        self._core_direct = False
        self._core_driver = False
        #: A core's pass leaves nothing to do at its instant (virtual time: see step).
        self._one_pass = not getattr(device, "realtime", True) and hasattr(device, "next_event_time")
        #: "auto": the core runs while it can serve everything (see _leave_core).
        self._core_auto = kernel_core == "auto"
        self._core_hooks = -1                # len(instruments) when last checked
        self._core_realtime = False          # the core launches into a real-time engine
        #: Real time (the daemon): step() may spin in the kernel core (``Core.spin``)
        #: until this CLOCK_MONOTONIC time (seconds; 0: one pass), returning early when a
        #: word ``spin_probe`` points at changes (the clients' request-ring tails) or when
        #: the device's next event is more than ``spin_near`` seconds away.
        self.spin_until = 0.0
        self.spin_probe: Any = None
        self.spin_near = 250e-6
        #: The instruments' views of the core's ops (while one listens to op events).
        self._core_ops: dict[Job, dict[int, CoreOp]] = {}
        #: What a CoreOp takes from its plan node, per (CoreModel, node).
        self._core_op_static: dict[tuple[Any, int], tuple] = {}
        if kernel_core is not None:
            self._start_core(kernel_core, policy)
        for instrument in every_dispatcher_instruments(self):
            self.instruments.add(instrument)

    # -- the kernel core ---------------------------------------------------------------------
    def _start_core(self, impl: str, policy: Any) -> None:
        """Run every job's kernels in a kernel core (``impl``: "c", "python", or "auto":
        "c" where it can): only launch plans, under a built-in policy."""
        if impl not in ("c", "python", "auto"):
            raise ValueError(f"kernel_core must be 'c', 'python', 'auto' or None, got {impl!r}")
        name = policy if isinstance(policy, str) else getattr(policy, "name", None)
        why = None
        if name not in kc.POLICIES or type(self.policy) is not get_policy(name):
            why = (f"the kernel core runs the built-in policies ({', '.join(kc.POLICIES)}); "
                   f"policy {name!r} runs on the dispatcher's own path: use kernel_core=None "
                   f"(--kernel-core off)")
        if why is not None:
            if self._core_auto:
                return                       # auto: this dispatcher's own path
            raise ValueError(why)
        impl = "c" if impl == "auto" else impl
        dev = self.device
        # Direct launches and copies into the simulated engine (in real time each first
        # brings the engine to the wall clock, as the device's own methods do); not with
        # fault injection (lose_after), which the device's launch implements.
        self._core_direct = (getattr(dev, "gpu", None) is not None and hasattr(dev, "_shapes")
                             and getattr(dev, "lose_after", None) is None)
        self._core_memory = dev.memory if self._core_direct else None
        self._dev_attrs = len(vars(dev))
        pol = self.policy
        self.core = kc.make_core(
            impl, self.tracker, dev, name, lookahead=self.lookahead, group=self.group,
            wake_lead=self.wake_lead, fairness_threshold=getattr(pol, "threshold", None),
            fairness_unit="client" if getattr(pol, "by_client", False) else "job",
            hold_factor=getattr(pol, "hold", None), direct=self._core_direct,
            saturation_backlog=self.saturation_backlog)
        self.core.implied_copies = self.implied_copies
        if self._core_direct:
            self._check_direct()
            if getattr(dev, "realtime", False):
                self.core.real_time(dev.loop._t0, dev.loop.speed)
                self._core_realtime = True
        #: On a real GPU the C core calls the driver's cuLaunchKernel itself.
        self._core_driver = impl == "c" and hasattr(dev, "core_driver")
        if self._core_driver:
            self.core.use_driver(*dev.core_driver(), dev.launch_failed)

    def _core_admit(self, job: Job, replay: ReplayPlan) -> None:
        """A plan job goes to the kernel core (after the checks ``replay.issue`` makes)."""
        job.left_policy = True               # the core's own policy orders it
        job.returned = True
        try:
            replay.check(job)
            cm = job.model.core
            b = job.bindings
            ops = b.core                     # (made once per buffer set and model)
            if ops is None or ops[0] is not cm:
                ops = self._set_core_operands(b, cm, replay)
            job.core = self.core.admit(job, job.seq, cm.plan, cm.profile, job.client_id,
                                       job.level, job.pin, ops[1], ops[2], job.io)
        except Exception as e:               # as the plan's checks: fail this job only
            job.fail(e)
            self._after_run(job)
            return
        if "op_issued" in self.instruments:
            for node, step in enumerate(cm.steps):
                if step >= 0:
                    self.instruments.call("op_issued", self._core_op(job, node))

    def _core_op(self, job: Job, node: int) -> CoreOp:
        """The instruments' view of ``job``'s op at ``node`` (made on first use, kept until
        the op ends): the core reports ops by node index only."""
        views = self._core_ops.get(job)
        if views is None:
            views = self._core_ops[job] = {}
        op = views.get(node)
        if op is None:
            cm = job.model.core
            static = self._core_op_static.get((cm, node))
            if static is None:             # (once per model and node)
                step = job.model.replay.steps[cm.steps[node]]
                launch = step.launch if step.kind == KERNEL else None
                static = self._core_op_static[(cm, node)] = (
                    step.kind, launch.name if launch is not None else None,
                    VStream(step.stream, False), launch, bool(step.almost_finished))
            op = views[node] = CoreOp(job, node, *static, t_issue=self.now)
        return op

    def _core_op_event(self, ev: tuple) -> None:
        """An op event of the core (only while an instrument listens to ops): released,
        or ended (with its start: the kernel's first block seen placed; for a copy, its
        release, as the core sees no copy start)."""
        job, node = ev[1], ev[2]
        ins = self.instruments
        if ev[0] == kc.OP_RELEASED:
            op = self._core_op(job, node)
            op.stream, op.launch_id, op.t_release = ev[3], ev[4], ev[5]
            if "op_released" in ins:
                ins.call("op_released", op, ev[5])
            return
        op = self._core_op(job, node)
        del self._core_ops[job][node]        # (ended: _core_op made or found it there)
        if "op_started" in ins:
            ins.call("op_started", op, ev[3] if ev[3] >= 0 else op.t_release)
        if "op_ended" in ins:
            ins.call("op_ended", op, ev[4])

    def _core_events(self, events: Any) -> None:
        """Apply what the kernel core reports: wake-ups, answers, failures."""
        for ev in events:
            kind, job = ev[0], ev[1]
            if kind == kc.OP_HELD:
                if "policy_held" in self.instruments:
                    self.instruments.call("policy_held", ev[2], ev[3])
                continue
            if kind == kc.ALMOST:
                self._almost_finished(job)
            elif kind >= kc.OP_RELEASED:
                self._core_op_event(ev)
            elif kind == kc.FINISHED:
                if self._core_ops:
                    self._core_ops.pop(job, None)
                job.core = -1
                job.kcount = {job.model.name: ev[2]}
                self._progress += 1
                self._finish(job)
            elif job.state != FINISHED and job.error is None:    # REFUSED, FAULT
                job.cancelled = False
                job.error = ev[2]

    def _leave_core(self, why: str) -> bool:
        """kernel_core="auto": hand everything to this dispatcher's own path (which the
        core reproduces) when something the core cannot serve arrives: a model that runs
        its own code. Only while the core is idle; False if
        it is not (or the core was asked for explicitly)."""
        core = self.core
        if not self._core_auto or core.jobs or core.pending_arrivals:
            return False
        self.sync_profiles()
        self.core = None
        log.info("%s: the dispatcher's own path serves every model from now on (the kernel "
                 "core serves launch plans only)", why)
        return True

    def _check_direct(self) -> None:
        """The device's methods were replaced on the instance (a fault injection, a
        meter): from now on the core calls them instead of the engine, so that whoever
        replaced them sees every launch and copy."""
        dev = self.device
        self._dev_attrs = len(vars(dev))
        sim = _sim_device_class()
        # (on the instance, or in a subclass: the benchmarks' instant device)
        shadowed = [m for m in ("launch_checked", "memcpy_htod", "memcpy_dtoh", "record_event",
                                "event_query")
                    if m in vars(dev) or getattr(type(dev), m) is not getattr(sim, m, None)]
        self.core.direct = not shadowed
        self._core_memory = None if shadowed else dev.memory

    def _core_hooks_changed(self) -> None:
        """The instruments changed: the core reports op events while one listens to ops
        (it costs a tuple per op event then, nothing otherwise)."""
        self._core_hooks = len(self.instruments)
        on = any(h in self.instruments for h in OP_HOOKS)
        if self.core.ops != on:
            self.core.ops = on
            if not on:
                self._core_ops.clear()
                self._core_op_static.clear()

    def _step_core(self, now: float) -> bool:
        """:meth:`step` on the kernel core: arrivals (buffer sets, admission), then one
        pass of the core (notifQ, completions, release), then its events."""
        if len(self.instruments) != self._core_hooks:     # (an int compare per pass)
            self._core_hooks_changed()
        if self._core_direct and len(vars(self.device)) != self._dev_attrs:
            self._check_direct()
        if self._arrivals:
            self._start_arrivals()
        events = self.core.step(now)
        if events:
            self._core_events(events)
        self.idle = self._one_pass or events is None        # (see step)
        self.iterations += 1
        return self.in_flight > 0

    def sync_profiles(self) -> None:
        """Copy the kernel core's statistics of every model into ``model.profile`` (the
        core owns them while it runs; status and the batchers' cost tables read these)."""
        if self.core is None:
            return
        for model in list(self._live):
            cm = model.core
            if cm is None:
                continue
            count, secs, n_time, seen, jobs, _ = self.core.profile(cm.profile)
            prof = model.profile
            for i, key in enumerate(cm.names):
                if seen[i]:
                    st = prof.kernels.get(key)
                    if st is None:
                        st = prof.kernels[key] = KernelStat()
                    st.count, st.time, st.n_time = count[i], secs[i], n_time[i]
            prof.jobs = jobs
            prof._total = None

    @property
    def pending_arrivals(self) -> int:
        """Jobs submitted and not started yet (they start in the next :meth:`step`): a
        virtual-time driver must step again before it may move the clock."""
        return len(self._arrivals)

    # ======================================================================================
    # The loop. One iteration: poll the device, learn what the GPU did, run the jobs that
    # can run, and release what the policy picks while the GPU can take it.
    # ======================================================================================
    def step(self) -> bool:
        dev = self.device
        dev.poll()
        if self._answered:
            self._take_answered()
        if self._late_faults:
            self._take_late_faults()
        if self._held_sets:
            self._release_held_sets()
        self.now = now = dev.now()
        core = self.core
        if core is not None:
            # Speed (a trick, labelled): the kernel core's pass alone while the control
            # plane has nothing to do (no arrival, no instrument or device method changed):
            # this runs at every poll of the loop.
            if (self._arrivals or len(self.instruments) != self._core_hooks
                    or (self._core_direct and len(vars(dev)) != self._dev_attrs)):
                return self._step_core(now)
            # In virtual time one pass of the core does all there is to do at this instant
            # (notifQ, completions, arrivals, release until the policy or +B stops): after
            # it the loop is idle until the device or an arrival changes something
            # (``pending_arrivals``: answers that freed a buffer set for a waiting job).
            # In real time the clock moves during the pass (work may complete meanwhile):
            # idle only after a pass that changed nothing.
            if self.spin_until and self._core_realtime and core.direct:
                # Real time: passes in C until the control plane is due (Core.spin).
                events = core.spin(self.spin_until, self.spin_probe, self.spin_near)
                self.now = dev.now()
            else:
                events = core.step(now)
            self.iterations += 1
            self.idle = self._one_pass or events is None
            if events:
                self._core_events(events)
            return self.in_flight > 0
        before = self._progress
        instr = self.instruments                                         # notifQ
        self._progress += self.tracker.drain(
            now, self._op_done, self._kernel_started if "op_started" in instr else None)
        if self._copy_events:
            self._poll_copies()                                          # device events
        if self._arrivals:
            self._start_arrivals()                                       # new greenlets
        if self._resume:
            self._resume_jobs()                                          # synchronize() done
        if self._queued or self._copies:
            self._release()                                              # policy, +B
            if self._queued and not self._copy_events and not self.tracker.in_flight():
                self._held_back()            # rare: ready jobs, an idle device, pick() None
        self.idle = self._progress == before
        self.iterations += 1
        return self.in_flight > 0

    def _flush_copies(self) -> None:
        copies = self._copies
        streams = self.streams
        while copies:
            op = copies[0]
            if op.state == DROPPED:
                copies.popleft()
                continue
            behind = self._behind(op)
            if behind is None and not streams.available():
                return                       # (a copy behind its predecessor needs none)
            if behind is None and streams.gated is not None and streams.must_wait(op):
                return
            copies.popleft()
            self._launch_copy(op, behind)

    def _behind(self, op: Op) -> Op | None:
        """Lookahead: ``op``'s stream predecessor if it is released and still in flight,
        so that ``op`` goes behind it, on its real stream; else None."""
        pred = op.pred
        if self.lookahead > 1 and pred is not None and pred.state == RELEASED:
            return pred
        return None

    def _saw_class(self, level: int) -> None:
        """The saturation rule's class check: the first job's class, and whether any
        other has been seen since."""
        if self._class0 is None:
            self._class0 = level
        elif level != self._class0:
            self._mixed_classes = True

    @property
    def saturated(self) -> bool:
        """The saturation rule holds now: more jobs wait for a release than
        ``saturation_backlog``. Their latency is then queueing, which only the GPU's
        throughput shortens: the occupancy gate is lifted (policies' own holds too:
        ``paella``'s order and hold rules ask this). Only while every job so far was of
        one class: a more urgent class's bounded wait needs the gate (a flood of less
        urgent blocks in the hardware queues would delay its kernels)."""
        return 0 < self.saturation_backlog < self._queued and not self._mixed_classes

    def _release(self) -> None:
        if self._copies:
            self._flush_copies()
        if not self._queued:                 # nothing announced: pick() has nothing to give
            return
        policy = self.policy
        tracker = self.tracker
        admits = tracker.admits if policy.gated else tracker.flow_ok
        streams = self.streams
        pool = streams.mode == "pool"
        free, busy = streams.free, streams.busy
        launch, group, now = self.device.launch_checked, self.group, self.now
        instr = self.instruments
        hooked = "op_released" in instr      # Speed: one lookup per pass, not per kernel
        ahead = self.lookahead
        lead = self.wake_lead
        while self._queued:
            try:
                job = policy.pick()
            except PLUGIN_ERRORS as e:
                self._policy_failed("pick", e)
                policy = self.policy
                admits = tracker.admits if policy.gated else tracker.flow_ok
                pool = streams.mode == "pool"
                continue
            if job is None:
                if not self._hold_reported and "policy_held" in instr:
                    self._hold_reported = True
                    instr.call("policy_held", self._queued, now)
                return
            if job.__class__ is not Job or job.host is not self or not job.in_policy:
                self._policy_failed("pick", PolicyError(
                    f"pick() returned {job!r}, which is not a job of this dispatcher with a "
                    f"ready kernel"))
                policy = self.policy
                admits = tracker.admits if policy.gated else tracker.flow_ok
                pool = streams.mode == "pool"
                continue
            ready = job.ready
            op = ready[0]
            k = op.launch
            # Lookahead: a kernel released while its stream predecessor (a kernel or a
            # copy) is still in flight goes behind it, on its real stream (it needs no
            # free one).
            pred = op.pred                   # (_behind, inlined: once per kernel)
            behind = ahead > 1 and pred is not None and pred.state == RELEASED
            gated = policy.gated and not self.saturated
            if behind and gated and pred.kind == KERNEL:
                # It cannot start before its predecessor ends: admitted against the
                # resources that predecessor frees (without this credit, lookahead held a
                # large kernel's successor until the loop saw the predecessor complete).
                # (A copy frees no SM: behind one, the usual rule.)
                if not tracker.admits_after(k.demand, pred.launch.demand, pred.launch_id):
                    return
            elif not (admits(k.demand) if gated else tracker.flow_ok(k.demand)) \
                    or (pool and not free and not behind and job.pin < 0):
                return
            elif not pool and not behind and streams.gated is not None and streams.must_wait(op):
                return
            ready.popleft()
            job.in_policy = False
            self._queued -= 1
            key = op.key
            kcount = job.kcount
            c = kcount.get(key, 0)
            job.remaining = left = round(job.remaining - job.model.profile.charge(key, c),
                                         ESTIMATE_DIGITS)
            kcount[key] = c + 1
            try:
                policy.released(job, op)
            except PLUGIN_ERRORS as e:
                self._policy_failed("released", e)
                policy = self.policy
                admits = tracker.admits if policy.gated else tracker.flow_ok
                pool = streams.mode == "pool"
            # Launch it (inlined: once per kernel).
            if pool:                         # inlined StreamMap.assign, the common case
                s = job.pin                  # (a named stream: submit_group(stream=))
                if s < 0:
                    s = pred.stream if behind else free.popleft()
                op.stream = s
                busy[s] += 1
            else:
                s = streams.assign(op)
            op.launch_id = lid = tracker.release(
                k.demand, op, pred.launch_id if behind and pred.kind == KERNEL else -1)
            op.t_release = now
            if self._late_jobs is not None:
                self._late_jobs[lid] = job
            self._progress += 1
            self._hold_reported = False
            try:
                launch(k, s, lid, op.args, group)
            except DeviceError as e:
                tracker.unrelease(lid)
                self._device_refused(op, e)
            else:
                # The op the job marked, or the wake-up lead reached (docs/dispatcher.md).
                if op.almost_finished or (lead and left <= lead and not job.almost_sent
                                          and job.estimate > 0.0):
                    self._almost_finished(job)
                op.state = RELEASED
                if job.waitlist.eager:
                    job.waitlist.released(op)
                elif ahead > 1:
                    vs = op.vstream
                    vs.ahead += 1
                    vs.tail = op
                    if vs.ahead < ahead:
                        job.waitlist.release_ahead(op)
                if hooked:
                    instr.call("op_released", op, now)
            if self._copies:                 # copies it activated keep their stream order
                self._flush_copies()
            if ready and not job.in_policy:
                self._queue(job)

    # -- releasing ---------------------------------------------------------------------------
    def _launch_copy(self, op: Op, behind: Op | None) -> None:
        s = self.streams.assign(op, behind)
        op.t_release = now = self.now
        self._progress += 1
        if op.almost_finished:
            self._almost_finished(op.job)
        dev = self.device
        instr = self.instruments
        # Copies post no notifications: an event behind each, polled oldest first (and one
        # before it, only while someone listens to op_started).
        q = self._copy_events.get(s)
        if q is None:
            q = self._copy_events[s] = deque()
        try:
            if "op_started" in instr:
                q.append((dev.record_event(s), op, True))
            if op.kind == H2D:
                dev.memcpy_htod(op.dptr, op.host, s)
            else:
                dev.memcpy_dtoh(op.host, op.dptr, s)
        except DeviceError as e:
            if q and q[-1][1] is op:
                q.pop()
            if not q:
                del self._copy_events[s]
            self._device_refused(op, e)
            return
        q.append((dev.record_event(s), op, False))
        wl = op.job.waitlist
        wl.released(op)
        if self.lookahead > 1 and not wl.eager:
            # Lookahead across a copy: its successor may go now, behind it on its stream
            # (an input copy's first kernels wait on the GPU, not for the loop).
            wl.release_ahead(op)
        if "op_released" in instr:
            instr.call("op_released", op, now)

    # -- completions -------------------------------------------------------------------------
    def _poll_copies(self) -> None:
        query = self.device.event_query
        for s in list(self._copy_events):
            q = self._copy_events[s]
            while q and query(q[0][0]):
                _, op, start = q.popleft()
                if start:
                    self.instruments.call("op_started", op, self.now)
                else:
                    self._op_done(op)
                self._progress += 1
            if not q:
                del self._copy_events[s]

    def _kernel_started(self, op: Op) -> None:
        """Tracker callback, only while someone listens to op_started."""
        self.instruments.call("op_started", op, self.now)

    def _op_done(self, op: Op, t_first: float = 0.0) -> None:
        """``op`` completed: its last notification (kernels: the tracker's callback, with
        the time its first block was seen placed) or its event (copies)."""
        job = op.job
        if op.kind == KERNEL:
            job.model.profile.record_kernel(op.key, self.now - t_first)
            if self._faults and op.launch_id in self._faults:   # (one truth test per kernel)
                self._kernel_fault(op)
            if self._kernel_completed is not None:
                try:
                    self._kernel_completed(job, op)
                except PLUGIN_ERRORS as e:
                    self._policy_failed("kernel_completed", e)
        if "op_ended" in self.instruments:
            self.instruments.call("op_ended", op, self.now)
        streams = self.streams
        s = op.stream                        # inlined StreamMap.done
        busy = streams.busy
        busy[s] -= 1
        if not busy[s] and streams.mode == "pool":
            streams.free.append(s)
        wl = job.waitlist
        wl.finish(op)
        if self.lookahead > 1 and op.kind == KERNEL and not wl.eager:
            vs = op.vstream                  # room in the stream's window: its tail's
            vs.ahead -= 1                    # successor may go
            tail = vs.tail
            if tail is op:
                vs.tail = None               # (op and its stream would form a cycle)
            elif tail is not None and tail.state == RELEASED:
                wl.release_ahead(tail)
        if job.blocked and job.wake_if_satisfied():
            job.blocked = False
            self._resume.append(job)
        elif job.returned and wl.pending == 0:
            self._finish(job)

    def op_active(self, op: Node) -> None:
        """JobHost: the waitlist callback, ``op`` has no unmet dependency left."""
        if op.kind == KERNEL:
            job = op.job
            job.ready.append(op)
            if not job.in_policy:
                job.in_policy = True         # inlined _queue
                self._queued += 1
                try:
                    self.policy.kernel_ready(job)
                except PLUGIN_ERRORS as e:
                    self._policy_failed("kernel_ready", e)
        else:
            self._copies.append(op)

    def _queue(self, job: Job) -> None:
        job.in_policy = True
        self._queued += 1
        try:
            self.policy.kernel_ready(job)
        except PLUGIN_ERRORS as e:
            self._policy_failed("kernel_ready", e)   # the fallback re-queues every job

    # -- the rest of JobHost ------------------------------------------------------------------
    def kernel_launch(self, func: Function, grid: Any, block: Any, dyn_smem: int,
                      whole: int = 0) -> KernelLaunch:
        """The checked launch record of a shape (cached: one per shape, shared by jobs).
        ``whole``: the launch is a slice of a kernel of that many blocks (slicing)."""
        key = (func, grid if type(grid) is int else tuple(grid),
               block if type(block) is int else tuple(block), dyn_smem, whole)
        rec = self._launches.get(key)
        if rec is None:
            g, b = dim3(grid, "grid"), dim3(block, "block")
            # An OccupancyError names the kernel and the limit exceeded.
            fp = self.device.block_footprint(func, b, dyn_smem)
            blocks = g[0] * g[1] * g[2]
            need = self.tracker.entries_for(blocks)
            if need > self.tracker.slots:
                raise ValueError(f"kernel {func.name!r} with {blocks} blocks posts {need} notifQ "
                                 f"entries at group {self.group}, more than the ring's "
                                 f"{self.tracker.slots} slots; use a larger notifq_slots or group")
            rec = self._launches[key] = KernelLaunch(func, g, b, dyn_smem, fp,
                                                     self.tracker.demand(fp, blocks), func.name,
                                                     blocks, whole)
        return rec

    def alloc(self, nbytes: int) -> int:
        """Device memory for a job's code (``cudart.malloc``) or a scheduler's own use:
        on a full GPU, every model's idle buffers are freed first and it tries once more
        (then the ``OutOfMemory`` goes to the caller: a job's ``malloc`` may wait, see
        :meth:`memory_blocked`; a scheduler says so)."""
        return self._reclaiming(lambda: self.device.alloc(nbytes))

    def free(self, ptr: int) -> None:
        self.device.free(ptr)

    def job_failed(self, job: Job) -> None:
        """JobHost: the job's code raised (inside its greenlet, or its plan's checks): drop
        what it has not released; its requests fail once its released ops have drained."""
        log.info("job %d (model %s, requests %s) failed: %s", job.seq, job.model.name,
                 [r.req_id for r in job.requests], job.error)
        self._withdraw(job)

    # -- jobs -----------------------------------------------------------------------------------
    def _start_arrivals(self) -> None:
        arrivals = self._arrivals
        instr = self.instruments
        while arrivals:
            job = arrivals.popleft()
            ahead = job.model.answer_ahead
            if ahead is not None and not job.answered and job.bindings is None \
                    and self._await_answer(job, ahead):
                continue
            pool = job.model.pool
            if pool is not None and job.bindings is None:
                try:
                    bindings = self._reclaiming(pool.acquire)
                except OutOfMemory as e:     # rare: the GPU is full
                    self._wait_for_memory(job, e)
                    continue
                if bindings is None:         # every buffer set in use: wait for one
                    pool.waiting.append(job)
                    continue
                job.bindings = bindings
            tell = job.model.answer_owner
            if tell is not None and job.requests:    # (whose answers its kernels compute)
                tell(job.bindings, self.owner_of(job.requests[0].client_id))
            replay = job.model.replay
            if self.core is None:
                try:
                    self.policy.job_arrived(job)
                except PLUGIN_ERRORS as e:
                    self._policy_failed("job_arrived", e)
            self._progress += 1
            job.t_start = self.now
            if "request_started" in instr:
                for req in job.requests:
                    instr.call("request_started", req)
            if self.core is not None:
                self._core_admit(job, replay)
                continue
            if replay is None:
                job.start()                  # the adaptor's run(io) in a greenlet
            else:
                try:
                    replay.issue(job)
                except Exception as e:       # as a greenlet's run(): fail this job only
                    job.fail(e)
                job.returned = True
            self._after_run(job)

    def _await_answer(self, job: Job, ahead: Callable[[np.ndarray], Any]) -> bool:
        """The simulated GPU's answers off the loop (issue 37): ``ahead(job.io)`` starts
        computing the job's outputs from its host inputs when they are new and returns
        the computation's future. Then the job waits here, holding nothing: no buffer
        set, no stream, no kernel in the occupancy tracker, so every other job, on any
        stream and under any policy (``fifo``'s one stream included), runs on. It starts
        when its answer is in (or fails with the computation's failure). Its kernels
        then find the answer cached; the device's own hold (``SimDevice._hold``) stays
        for what this does not cover. Real time only in effect: with answers computed
        in the loop's thread (virtual time) ``ahead`` returns None. True if it waits."""
        owner = self.owner_of(job.requests[0].client_id) if job.requests else None
        timed = "answer_looked_up" in self.instruments
        t0 = time.perf_counter() if timed else 0.0
        try:
            future = ahead(job.io, owner)
        except Exception:  # noqa: BLE001 - a hint only: the device's path decides
            log.exception("answer_ahead of model %r failed; the job runs as usual", job.model.name)
            future = None
        if timed:
            self.instruments.call("answer_looked_up", job, t0, time.perf_counter())
        if future is None:
            return False
        self._wait_for(job, future)
        return True

    def note_tenant(self, req: Request) -> None:
        """Remember ``req``'s client's tenant (until :meth:`cancel_client`): the jobs of
        that client, batched ones included, take that tenant's share of the answer
        workers' queue."""
        if req.tenant >= 0:
            self.tenants[req.client_id] = req.tenant

    def owner_of(self, client_id: int) -> tuple[str, int]:
        """Whose share of the simulated GPU's answer workers a job of ``client_id``'s
        new input takes (``effects.submit(owner=)``, a FairQueue): its tenant when the
        front end said (a tenant opening many connections is still one), else the
        client."""
        tenant = self.tenants.get(client_id)
        return ("client", client_id) if tenant is None else ("tenant", tenant)

    def _wait_for(self, job: Job, future: Any) -> None:
        """``job`` starts once ``future`` is done (:meth:`_take_answered`), holding
        nothing meanwhile."""
        self._answering[job] = future
        answered = self._answered
        device = self.device

        def done(_f: Any) -> None:           # (the workers' thread, or here if done)
            answered.append(job)
            getattr(device, "effect_ready", _no_wake)()
        future.add_done_callback(done)

    def _take_answered(self) -> None:
        """The jobs whose answer came in start (in the order their answers came); one
        whose computation failed fails with the reason, as its kernel would have."""
        answered = self._answered
        while answered:
            job = answered.popleft()
            future = self._answering.pop(job, None)
            if future is None:               # (cancelled meanwhile)
                continue
            exc = RuntimeError("cancelled") if future.cancelled() else future.exception()
            if exc is None:
                job.answered = True
                self._arrivals.append(job)
            else:                            # (a refusal, e.g. a full queue, is told as is)
                self._fail_unstarted(job, str(exc) if getattr(exc, "refusal", False) else
                                     f"answer not computed: {str(exc)[:300]}")

    @property
    def answers_awaited(self) -> int:
        """Jobs waiting for their answer before they start (``paella status``)."""
        return len(self._answering)

    def _reclaiming(self, attempt: Callable[[], _T]) -> _T:
        """``attempt()``; on a full GPU, free every model's idle buffers and attempt once
        more. ``OutOfMemory`` again, or nothing to free: it goes to the caller."""
        try:
            return attempt()
        except OutOfMemory:
            if not self.reclaim_idle_memory():
                raise
            return attempt()

    def _wait_for_memory(self, job: Job, exc: OutOfMemory) -> None:
        """``job``'s buffers do not fit even after reclaiming: it waits while any job
        holds memory it will give back (each one's end retries the waiting), or fails,
        with the device's reason, when none does."""
        if self._others_hold_memory(job):
            self._memory_waiting.append(job)
            self._count_memory_wait(job)
            return
        self.memory_failures += len(job.requests)
        self._fail_unstarted(job, f"{exc}; the model needs more device memory than is free "
                                  f"with nothing else running: serve fewer or smaller models "
                                  f"on this GPU, or give this one a smaller batch or length")

    def _fail_unstarted(self, job: Job, error: str) -> None:
        """``job`` fails with ``error`` before it started (never announced to the policy,
        holding nothing on the device)."""
        job.left_policy = True
        job.error = error
        job.returned = True
        self._progress += 1
        self._finish(job)

    def memory_blocked(self, job: Job) -> bool:
        """JobHost: ``job``'s own ``malloc`` (a greenlet job's) found the device full
        after reclaiming. It waits, like a synchronize, while another job holds memory it
        will give back (every job's end resumes it to try again); with none, it fails.
        Jobs waiting this way do not count as holders: the last of them to find no other
        holder fails and frees what it holds, so they cannot wait on each other forever."""
        if not self._others_hold_memory(job):
            return False
        self._memory_blocked.append(job)
        self._count_memory_wait(job)
        return True

    def _others_hold_memory(self, job: Job) -> bool:
        """Does a job other than ``job``, not itself waiting for memory, hold memory that
        it gives back when it ends (a buffer set of its own, its allocations)?"""
        return any(j is not job and not j.waiting_memory and (
            (j.bindings is not None and j.bindings is not j.model.pool.shared) or j.allocations)
            for j in self.jobs)

    def _count_memory_wait(self, job: Job) -> None:
        if not job.waited_memory:
            job.waited_memory = True
            self.memory_waits += 1

    def device_memory_by_model(self) -> dict[int, int]:
        """Device bytes each model id holds: its weights and its buffer sets or chunks,
        idle or in use (a replaced or retired version still running counts under its id).
        Memory a greenlet job or a scheduler allocates itself (``alloc``) is in the
        device's total only (the daemon's status adds a scheduler's under its model). Safe from another thread (one C-level copy of the set)."""
        held: dict[int, int] = {}
        counted: set[int] = set()
        for m in list(self._live):
            n = m.weights_bytes
            pool = m.pool
            if pool is not None and id(pool.owner) not in counted:   # variants share chunks
                counted.add(id(pool.owner))
                n += pool.held_bytes
            held[m.model_id] = held.get(m.model_id, 0) + n
        return held

    def reclaim_idle_memory(self) -> int:
        """Free the buffers no job holds (idle buffer sets, unused chunks) of every
        model; returns the bytes freed. The dispatcher calls it when the device's memory
        is full; pools then grow again on demand."""
        return sum(m.pool.trim() for m in list(self._live) if m.pool is not None)

    def _resume_jobs(self) -> None:
        # A snapshot (Trio's rule): jobs woken while these run wait for the next pass.
        jobs, self._resume = self._resume, []
        for job in jobs:
            if job.state == FINISHED:
                continue
            self._progress += 1
            job.resume()
            self._after_run(job)

    def _after_run(self, job: Job) -> None:
        if job.returned and job.waitlist.pending == 0 and job.state != FINISHED and job.core < 0:
            self._finish(job)

    def _withdraw(self, job: Job) -> None:
        if job.waitlist.pending:             # (none issued and unfinished: none to drop)
            job.waitlist.drop_unreleased()
        job.ready.clear()
        if not job.left_policy:
            job.left_policy = True
            if job.in_policy:
                self._queued -= 1
            job.in_policy = False
            try:
                self.policy.job_finished(job)
            except PLUGIN_ERRORS as e:
                self._policy_failed("job_finished", e)

    def _give_back(self, pool: Any, bindings: Any) -> None:
        """A finished job's buffer set goes back: to the oldest job waiting for one, or
        to the pool."""
        if pool.waiting and self._memory_waiting:
            # Jobs wait for memory: the set goes back, to be reclaimed if one of them
            # is older (below), instead of straight to this model's queue, which
            # would starve them under a steady load of this model.
            pool.release(bindings)
            self._memory_waiting.extend(pool.waiting)
            pool.waiting.clear()
        elif pool.waiting:                   # straight to the oldest job waiting for one
            nxt = pool.waiting.popleft()
            try:                             # (variants may share a pool)
                nxt.bindings = nxt.model.pool.rebind(bindings)
            except OutOfMemory:              # the set went back: nxt acquires anew
                pass
            self._arrivals.append(nxt)
        else:
            pool.release(bindings)

    def _release_held_sets(self) -> None:
        """The buffer sets of finished jobs that the device still writes (the process
        simulator's kernels held for their answers: ``writes_pending``) go back once it
        no longer does."""
        held, self._held_sets = self._held_sets, []
        for pool, bindings in held:
            if self._writes_pending(_extents(bindings)):
                self._held_sets.append((pool, bindings))
            else:
                self._give_back(pool, bindings)
                self._retry_memory_waiting()

    def _retry_memory_waiting(self) -> None:
        """A job let go of device memory: the jobs that found it full all try again,
        oldest first (what it held may now be reclaimed)."""
        if self._memory_waiting:
            waiting = sorted(self._memory_waiting, key=_BY_SEQ)
            self._memory_waiting.clear()
            self._arrivals.extend(waiting)

    def _finish(self, job: Job) -> None:
        job.state = FINISHED
        self.jobs.discard(job)
        self.in_flight -= len(job.requests)
        for ptr in job.allocations:
            self.device.free(ptr)
        bindings = job.bindings
        if bindings is not None:             # its released ops have all completed
            job.bindings = None
            if self._writes_pending is not None and self._writes_pending(_extents(bindings)):
                self._held_sets.append((job.model.pool, bindings))
            else:
                self._give_back(job.model.pool, bindings)
        self._retry_memory_waiting()
        if self._memory_blocked:             # greenlets in malloc try again, oldest first
            self._resume.extend(sorted(self._memory_blocked, key=_BY_SEQ))
            self._memory_blocked.clear()
        ok = job.error is None
        if ok:
            if self.core is None:            # (the core keeps its models' statistics)
                job.model.profile.record_job(job.kcount)
            self._almost_finished(job)       # at the latest now
        self._withdraw(job)
        job.wait_op = None                   # (a cancelled synchronize leaves its op, and io view)
        job.io = None                        # its work is done; a client's memory must not linger
        now = self.now
        instr = self.instruments
        if "job_finished" in instr:
            instr.call("job_finished", job)
        raised = None
        for req in job.requests:
            if req.cancelled:
                req.status, req.error = STATUS_CANCELLED, req.error or "cancelled"
            elif ok:
                req.status = STATUS_OK
            else:
                req.status = STATUS_CANCELLED if job.cancelled else STATUS_ERROR
                req.error = job.error
            req.t_done = now
            if req.on_complete is not None:
                try:
                    req.on_complete(req, req.status, req.error)
                except Exception as e:       # the caller's bug: its batch-mates are still
                    raised = raised or e     # answered and the model's count kept, then
                                             # it propagates (below)
            if "request_finished" in instr:
                instr.call("request_finished", req)
        model = job.model                    # (after the callbacks: a retry they submit
        model.jobs -= 1                      # to the same model keeps it)
        if model.parent is not None:         # a twin's jobs count in its model too
            model = model.parent
            model.jobs -= 1
        if model.retired and model.jobs == 0:
            self._remove_model(model)
        if raised is not None:
            raise raised

    def _almost_finished(self, job: Job) -> None:
        if not job.almost_sent:
            job.almost_sent = True
            instr = self.instruments
            for req in job.requests:
                if req.cancelled:
                    continue
                cb = req.on_almost_finished
                if cb is not None:
                    cb(req)
                if "request_woken" in instr:
                    instr.call("request_woken", req)

    def _kernel_fault(self, op: Op) -> None:
        """The device reports that ``op`` completed without doing its work
        (``Device.faults``: on the simulator, its functional effect raised): its job
        fails with the reason; its released ops still complete, the rest are dropped."""
        reason = self._faults.pop(op.launch_id)
        job = op.job
        if job.state != FINISHED and job.error is None:
            self._abort(job, reason, cancelled=False)

    def _take_late_faults(self) -> None:
        """Kernels that failed after the device reported them done (``late_faults``:
        the process simulator's answers that failed): each one's job fails with the
        reason, before this pass applies anything else, so that the output copy behind
        the kernel, whose completion the device reports in the same poll or later, ends
        the job as failed, never as answered with stale bytes. (A job gone meanwhile,
        cancelled, is skipped.)"""
        faults = self._late_faults
        while faults:
            lid, reason = faults.popitem()
            if self.core is not None:
                job = self.core.job_of(lid)
            else:
                job = self._late_jobs.get(lid) if self._late_jobs is not None else None
            if job is None or job.state == FINISHED or job.error is not None:
                continue
            if job.core >= 0:                # in the kernel core: it drains there
                job.cancelled, job.error = False, reason
                self._core_events(self.core.abort(job.core, job))
            else:
                self._abort(job, reason, cancelled=False)
                if job.waitlist.pending == 0:
                    self._finish(job)

    def _device_refused(self, op: Op, exc: DeviceError) -> None:
        """The device rejected a released op (a bad pointer, say): fail its job.
        A lost device is not one job's failure: it goes up to the daemon."""
        if isinstance(exc, DeviceLost):
            raise exc
        self.streams.done(op)
        job = op.job
        op.state = RELEASED
        self._abort(job, f"{type(exc).__name__}: {exc}", cancelled=False)
        job.waitlist.finish(op)
        if job.waitlist.pending == 0 and job.state != FINISHED:
            self._finish(job)

    def _abort(self, job: Job, error: str, cancelled: bool) -> None:
        """Stop a job from the loop: kill its greenlet, drop its unreleased ops."""
        job.cancelled = cancelled
        job.error = job.error or error
        if job.waiting_memory and job in self._memory_blocked:
            self._memory_blocked.remove(job)
        if job.glet is not None and not job.glet.dead:
            job.glet.throw(greenlet.GreenletExit)
        job.returned = True
        self._withdraw(job)

    # -- policy fallback -------------------------------------------------------------------------
    def _held_back(self) -> None:
        """After a release pass, jobs are ready and the device runs nothing (no kernel, no
        copy): pick() held them all back. Past POLICY_STALL_SECONDS of that the policy is
        stalled, and fifo takes over."""
        if self._policy_stalled():
            self._policy_failed("pick", PolicyError(
                f"pick() returned None for {POLICY_STALL_SECONDS:g} s while {self._queued} "
                f"job(s) had a ready kernel and the device had nothing to run"))

    def _policy_stalled(self, now: float | None = None) -> bool:
        """True once the policy has held every ready job back, with the device idle, in
        every iteration for POLICY_STALL_SECONDS (``now``: judge at that time instead).
        An iteration in which the device ran something breaks the chain (a release keeps
        it busy for one iteration at least); new arrivals do not."""
        t = time.monotonic()
        if self._held_iter < self.iterations - 1:
            self._held_since = t
        self._held_iter = self.iterations
        return (t if now is None else now) - self._held_since >= POLICY_STALL_SECONDS

    def _bind_policy(self) -> None:
        #: JobHost.eager: the policy's release mode, for new waitlists.
        self.eager = self.policy.eager
        # Speed: kernel_completed runs per kernel and most policies leave it empty.
        kc = self.policy.kernel_completed
        self._kernel_completed = None if type(self.policy).kernel_completed is Policy.kernel_completed else kc

    def _policy_failed(self, hook: str, exc: BaseException) -> None:
        """A policy hook raised: log it, switch to fifo, re-queue every job, go on."""
        failed = self.policy
        if failed.name == FALLBACK_POLICY and type(failed) is get_policy(FALLBACK_POLICY):
            raise RuntimeError(f"the fallback policy {FALLBACK_POLICY!r} raised in {hook}() "
                               f"(internal error, please report)") from exc
        log.error("scheduling policy %r raised in %s(); falling back to %r and serving on",
                  failed.name, hook, FALLBACK_POLICY, exc_info=exc)
        self.policy = policy = get_policy(FALLBACK_POLICY)(self)
        self._bind_policy()
        self.policy_failure = f"{failed.name}.{hook}: {type(exc).__name__}: {exc}"
        self.policy_fallbacks += 1
        self.streams.set_mode(policy.stream_mode)
        self._queued = 0
        for job in sorted(self.jobs, key=_BY_SEQ):
            job.waitlist.eager = policy.eager
            job.policy_state = None          # the failed policy's; the new one starts afresh
            job.in_policy = False
            if job.left_policy or job.state == FINISHED:
                continue
            policy.job_arrived(job)
            if job.ready and not job.in_policy:
                self._queue(job)

    # ======================================================================================
    # The public contract.
    # ======================================================================================
    def register_model(self, name: str, adaptor: JobAdaptor, *, profile_runs: int | None = None,
                       model_id: int | None = None, sets_ahead: int | None = None) -> int:
        """Initialize ``adaptor`` and run ``profile_runs`` jobs (default: the
        dispatcher's ``profile_runs``) to seed the model's kernel statistics. Profiling
        drives the loop itself: call it before serving. ``model_id``: the id requests
        name it by (default: the next free one); an id registered again serves new
        requests with the new adaptor while running jobs finish on the old one.
        ``sets_ahead``: buffer sets made now (default: ``buffer_sets_ahead``; a model a
        scheduler registers while serving passes 0, see :meth:`_reserve_sets`)."""
        if not isinstance(adaptor, JobAdaptor):
            raise TypeError(f"model {name!r}: adaptor must be a JobAdaptor, got {type(adaptor).__name__}")
        if (self.core is not None and adaptor.plan is None
                and not self._leave_core(f"model {name!r} runs its own code")):
            raise ValueError(f"model {name!r} runs its own code (a {type(adaptor).__name__}), "
                             f"and this dispatcher's kernel core replays launch plans only: "
                             f"serve it with kernel_core=None (--kernel-core off)")
        if any(m.name == name for m in self.models.values()):
            raise ValueError(f"model {name!r} is already registered")
        if model_id is None:
            model_id = self.new_model_id()
        elif type(model_id) is not int or model_id < 0:
            raise ValueError(f"model {name!r}: model_id must be an int >= 0, got {model_id!r}")
        self._top_id = max(self._top_id, model_id)
        plan = adaptor.plan
        if (plan is not None and plan.notif_group is not None and plan.notif_group != self.group
                and self.device.posts_by_compiled_group):
            # Its kernels post one notification per notif_group blocks (or none): read in
            # groups of self.group, the notifQ's flow control would be wrong and entries
            # overwritten. (The simulator runs no device code: it posts by self.group.)
            how = (f"with --group {plan.notif_group}" if plan.notif_group else
                   "without the Paella pass (--no-instrument)")
            raise ValueError(f"model {name!r} was compiled {how}, and this dispatcher reads "
                             f"notifications in groups of {self.group}: recompile it with "
                             f"`paella compile` and the default group")
        # A plan's init that failed has cleaned up after itself, so it may try again;
        # another adaptor's may not have, and is tried once.
        dev = self.device

        def init() -> int:                   # the bytes it allocated, measured per attempt
            before = dev.allocated_bytes     # (a reclaim in between frees others' memory)
            adaptor.init(dev)
            return dev.allocated_bytes - before

        weights = self._reclaiming(init) if isinstance(adaptor, PlanAdaptor) else init()
        old = self.models.get(model_id)
        model = Model(model_id, name, adaptor, pool=adaptor.buffer_pool, weights_bytes=weights,
                      answer_ahead=getattr(adaptor, "answer_ahead", None),
                      answer_owner=getattr(adaptor, "answer_owner", None))
        if adaptor.plan is not None:         # a plan is replayed, never run() in a greenlet
            model.replay = ReplayPlan(adaptor.plan, adaptor.funcs, self.kernel_launch,
                                      compiled=self.compiled_replay)
        self._attach_core(model)
        self.models[model_id] = model
        self._live.add(model)
        runs = self.profile_runs if profile_runs is None else profile_runs
        if model.replay is not None and model.replay.refusal is not None:
            # A plan that can never run here is registered all the same, and each of its
            # requests fails with the reason (docs/dispatcher.md): nothing to profile.
            log.warning("model %r is registered but cannot run on this dispatcher: %s",
                        name, model.replay.refusal)
            runs = 0
        for i in range(runs):
            failed: list = []
            ended: list = []

            def on_complete(r: Request, st: int, err: str | None) -> None:
                ended.append(st)
                if st:
                    failed.append(err)
            req = Request(-1 - i, -1, model.model_id, np.zeros(adaptor.io_bytes, np.uint8),
                          on_complete=on_complete)
            self.submit(req)
            try:
                self.run_until_idle(stop=self.profile_stop, done=lambda: bool(ended))
            except (TimeoutError, RunInterrupted) as e:
                failed.append(str(e))
                self._abandon_profiling()
            if failed:
                self.models.pop(model_id)    # not registered: its name stays free, the
                if old is not None and not old.retired:     # id serves the previous model
                    self.models[model_id] = old
                if model.jobs:               # (a profiling job that would not drain: the
                    model.retired = True     # adaptor closes after it, never under it)
                else:                        # (never registered: no model_removed)
                    self._live.discard(model)
                    self._close_adaptor(model)
                raise RuntimeError(f"profiling run of model {name!r} failed: {failed[0]}")
        self.sync_profiles()                 # (the core's statistics after profiling)
        self._reserve_sets(model, self.buffer_sets_ahead if sets_ahead is None else sets_ahead)
        if self.slicer is not None:
            self._add_sliced(model)
        if old is not None:
            self.retire_model(old)           # its running jobs finish on it, then it goes
        return model.model_id

    def _reserve_sets(self, model: Model, ahead: int) -> None:
        """Make the model's pool hold ``buffer_sets_ahead`` per-request buffer sets now, at its
        registration, not on the serving path: a burst of requests larger than any
        before makes a set per job (its device buffers, its bound plan, the kernel
        core's operands: ~8 us of the loop's CPU each), just when the loop is busiest.
        On Figure 2 near its knee, with the CPU charged, those sets were the difference
        between a seed within the SLO and one at 30-120 ms (docs/benchmarks.md, round
        16). Bounded: at most ``SETS_AHEAD_BYTES`` per model, ``SETS_AHEAD_SHARE`` of the
        device's memory for all models together (a bundle of many variants registers
        each), and an eighth of the free memory; idle sets go back when the memory is
        needed (``trim``).
        Not for the models a step scheduler registers as it serves (``ahead`` 0): making
        their sets then would stall the loop it is trying to spare."""
        pool = model.pool
        if not ahead or pool is None or not hasattr(pool, "reserve"):
            return
        size = pool.set_bytes
        if size <= 0:
            return
        n = min(ahead, SETS_AHEAD_BYTES // size)
        capacity = (getattr(getattr(self.device, "memory", None), "capacity", 0)
                    or getattr(getattr(self.device, "props", None), "mem_bytes", 0) or 0)
        if capacity:
            n = min(n, (capacity - self.device.allocated_bytes) // 8 // size,
                    (int(capacity * SETS_AHEAD_SHARE) - self._ahead_bytes) // size)
        made = pool.reserve(n - pool.created)     # (the profiling runs made some)
        self._ahead_bytes += len(made) * size
        cm, replay = model.core, model.replay
        if cm is not None and replay is not None:
            for b in made:                   # the core's operands too (_core_admit's)
                self._set_core_operands(b, cm, replay)

    def _set_core_operands(self, b: Any, cm: Any, replay: ReplayPlan) -> tuple:
        """What the kernel core needs of buffer set ``b`` for model ``cm``, made once per
        set and model and kept on the set (``b.core``)."""
        ops = b.core = (cm, *kc.set_operands(cm, replay, b.bound, self._core_memory))
        return ops

    def _attach_core(self, model: Model) -> None:
        """Register a model's compiled plan with the kernel core, if one runs."""
        if self.core is not None and model.replay.refusal is None:
            dev = self.device
            model.core = kc.register_model(self.core, model.replay, model.profile, dev,
                                           self._core_direct)
            if self._core_driver:
                self.core.cuda_kernels(model.core.plan,
                                       [dev.core_kernel(k.record) for k in model.core.spec.kernels])

    def _add_sliced(self, model: Model) -> None:
        """Give a profiled plan model its sliced twin (paella.dispatcher.slicing), if any of
        its kernels is long enough to be cut: sizes from the profiled kernel times, the
        twin's statistics seeded from the model's (the same work per job, spread over the
        slices), so that SRPT ranks its jobs as it ranks the model's."""
        adaptor, replay = model.adaptor, model.replay
        if (not isinstance(adaptor, PlanAdaptor) or replay is None or replay.refusal is not None
                or not sliceable(adaptor.plan)):
            return
        plan, props = adaptor.plan, self.device.props
        sizes: dict[int, int] = {}
        for i, op in enumerate(plan.ops):
            stat = model.profile.kernels.get(op.kernel) if op.kind == "launch" else None
            if stat is None or op.kernel in plan.effects or op.whole:
                continue
            rec = self.kernel_launch(adaptor.funcs[op.kernel], op.grid, op.block, op.dyn_smem)
            n = self.slicer.slice_blocks(stat.time, rec.blocks, wave_blocks(props, rec.fp))
            if n is not None:
                sizes[i] = n
        if not sizes:
            return
        sliced = slice_plan(plan, sizes, name=f"{plan.name} (sliced)")
        twin_adaptor = SlicedAdaptor(adaptor, sliced)
        twin_adaptor.init(self.device)
        before, after = _launch_counts(plan), _launch_counts(sliced)
        twin = Model(model.model_id, f"{model.name} (sliced)", twin_adaptor,
                     profile=model.profile.split({k: after[k] / n for k, n in before.items()}),
                     pool=twin_adaptor.buffer_pool, parent=model,
                     answer_ahead=model.answer_ahead, answer_owner=model.answer_owner)
        twin.replay = ReplayPlan(sliced, twin_adaptor.funcs, self.kernel_launch,
                                 compiled=self.compiled_replay)
        self._attach_core(twin)
        model.sliced = twin
        self._live.add(twin)

    def _abandon_profiling(self, seconds: float = 5.0) -> None:
        """Cancel the profiling job (client -1) and let what it released drain, for at
        most ``seconds``: what still runs then keeps its model until it ends."""
        self.cancel_client(-1)
        try:
            self.run_until_idle(timeout=seconds)
        except (TimeoutError, RuntimeError):
            pass

    def new_model_id(self) -> int:
        """An id no model of this dispatcher ever had: a removed model's id is not handed
        out again, since a finished job's retry or a stale reference may still name it."""
        return self._top_id + 1

    def retire_model(self, model: int | Model) -> None:
        """Take a model (its id, or the :class:`Model`) out of service: once it has no
        job left (running, or waiting for a buffer set) it is removed and its adaptor
        closed (its device memory freed, its kernels unloaded); now, if it has none. Its
        owner submits nothing more to it but the retries of a failed job's requests,
        which a callback of that job submits (they keep it a while longer). A daemon
        that reloads a changed model retires the old one: a long-lived dispatcher would
        otherwise keep every version it ever served."""
        if not isinstance(model, Model):
            found = self.models.get(model)
            if found is None:
                raise ValueError(f"unknown model id {model!r}; nothing to retire")
            model = found
        if model.retired:
            return
        model.retired = True
        if model.jobs == 0:
            self._remove_model(model)

    def _remove_model(self, model: Model) -> None:
        """A retired model's last job ended: forget it and close its adaptor (its sliced
        twin's first, which shares its kernels and parameters)."""
        if model.sliced is not None:
            twin, model.sliced = model.sliced, None
            self._live.discard(twin)
            twin.replay = None
            self._close_adaptor(twin)
        if self.models.get(model.model_id) is model:
            del self.models[model.model_id]
        self._live.discard(model)
        funcs = {id(f) for f in getattr(model.adaptor, "funcs", {}).values()}
        for key in [k for k in self._launches if id(k[0]) in funcs]:
            del self._launches[key]
        model.replay = None
        self._close_adaptor(model)
        if "model_removed" in self.instruments:
            self.instruments.call("model_removed", model)

    def _close_adaptor(self, model: Model) -> None:
        try:
            model.adaptor.close(self.device)
        except DeviceLost:
            raise
        except Exception as e:  # noqa: BLE001 - a plug-in's adaptor: the rest goes on
            log.error("model %r: its adaptor's close() raised %s: %s; what it holds on the "
                      "device may be lost until the daemon restarts", model.name,
                      type(e).__name__, e)

    def submit(self, req: Request) -> None:
        """Accept a request; its job (serving it alone) starts in the next :meth:`step`.
        (:meth:`submit_group` for one request, written out: once per request.)"""
        mid = req.model_id
        model = self.models.get(mid)
        if model is None:
            raise ValueError(f"request {req.req_id}: unknown model id {mid}; register the "
                             f"model first ({len(self.models)} registered)")
        io = req.io
        if not isinstance(io, np.ndarray) or io.dtype != np.uint8 or io.ndim != 1:
            raise ValueError(f"request {req.req_id}: io must be a 1-D numpy uint8 view of the "
                             f"client's io region")
        req.t_submit = self.device.now()
        if "request_admitted" in self.instruments:
            self.instruments.call("request_admitted", req)
        self._seq += 1
        if self.slicer is not None:
            model = self._runs_on(model, req.priority or DEFAULT_LEVEL)
        job = Job(self, model, [req], io, self._seq)
        self._saw_class(job.level)
        self.jobs.add(job)
        model.jobs += 1
        if model.parent is not None:
            model.parent.jobs += 1
        self.in_flight += 1
        self._arrivals.append(job)

    def _runs_on(self, model: Model, level: int) -> Model:
        """The model a job of class ``level`` runs: its sliced twin if a more urgent class
        has been seen (slicing), else itself."""
        if level < self.urgent_level:
            self.urgent_level = level
        twin = model.sliced
        return twin if twin is not None and level > self.urgent_level else model

    def stream_named(self, name: str) -> int:
        """The real stream reserved for ``name`` (reserved on first use; see
        :meth:`paella.dispatcher.streams.StreamMap.pin`): jobs submitted with
        ``submit_group(stream=name)`` run all their ops on it, in its FIFO order, and
        no other job's op lands on it (pool and sticky modes; a ``single``-stream policy
        keeps everything on stream 0)."""
        new = name not in self.streams.pinned
        s, own = self.streams.pin(name)
        if new and self.core is not None and self.policy.stream_mode != "single":
            self.core.reserve(s)
        if new and not own:
            log.warning("stream %r shares real stream %d with another name: %d of the "
                        "device's %d streams may be reserved", name, s,
                        self.streams.n // 2, self.streams.n)
        return s

    def submit_group(self, requests: list[Request], io: np.ndarray,
                     model_id: int | None = None, stream: str | None = None,
                     bindings: Any = None, ready: Any = None) -> None:
        """Accept requests of one model served by one job whose work reads and writes
        ``io`` (the seam for batchers: how the requests' inputs get into ``io`` and their
        outputs out of it is the batcher's). Each request completes, is woken and can be
        cancelled on its own; the job starts in the next :meth:`step`. ``model_id``: the
        registered model the job runs (a compiled variant of the requests' model, with
        its own plan and SRPT profile); default the requests' own. ``stream``: run
        the job's ops on the real stream reserved under that name (:meth:`stream_named`)
        instead of streams from the pool. ``bindings``: the job's buffer set, bound by
        the caller (a batcher binding a plan's tensors to its own device memory at a row
        offset: DVABatch's stage hand-off); it goes back to the model's pool's
        ``release`` when the job finishes, as an acquired one does. ``ready``: the future
        of what the job's kernels compute on the simulated GPU, being computed elsewhere
        (a step plug-in's effect): the device holds the kernel that needs it on its
        stream until it is done, which under a single-stream policy (``fifo``) would hold
        every other job's work too; there the job waits for it before it starts, holding
        nothing (as :meth:`_await_answer`)."""
        if not requests:
            raise ValueError("submit_group needs at least one request")
        mid = requests[0].model_id
        run = mid if model_id is None else model_id
        if run not in self.models:
            raise ValueError(f"unknown model id {run}; register the model first "
                             f"({len(self.models)} registered)")
        for req in requests:
            if model_id is None and req.model_id not in self.models:
                raise ValueError(f"request {req.req_id}: unknown model id {req.model_id}; "
                                 f"register the model first ({len(self.models)} registered)")
            if req.model_id != mid:
                raise ValueError(f"request {req.req_id}: one job serves one model; model "
                                 f"{req.model_id} differs from {mid}")
            if not isinstance(req.io, np.ndarray) or req.io.dtype != np.uint8 or req.io.ndim != 1:
                raise ValueError(f"request {req.req_id}: io must be a 1-D numpy uint8 view of "
                                 f"the client's io region")
        if not isinstance(io, np.ndarray) or io.dtype != np.uint8 or io.ndim != 1:
            raise ValueError("a job's io must be a 1-D numpy uint8 array")
        t = self.device.now()
        instr = self.instruments
        for req in requests:
            req.t_submit = t
            if "request_admitted" in instr:
                instr.call("request_admitted", req)
        self._seq += 1
        model = self.models[run]
        if self.slicer is not None:
            model = self._runs_on(model, min((r.priority or DEFAULT_LEVEL) for r in requests))
        job = Job(self, model, list(requests), io, self._seq)
        self._saw_class(job.level)
        if stream is not None:
            job.pin = self.stream_named(stream)
        if bindings is not None:
            job.bindings = bindings
        self.jobs.add(job)
        model.jobs += 1
        if model.parent is not None:
            model.parent.jobs += 1
        self.in_flight += len(requests)
        if ready is not None and not ready.done() and self.policy.stream_mode == "single":
            self._wait_for(job, ready)
            return
        self._arrivals.append(job)

    def cancel_client(self, client_id: int) -> int:
        """Cancel every request of ``client_id`` (it went away); returns how many.
        A job whose requests are all cancelled stops: its released work drains first,
        then ``on_complete`` reports STATUS_CANCELLED. A request sharing its job with
        live requests of other clients is marked cancelled: the job goes on for the
        others, and it completes as STATUS_CANCELLED (without its wake-up) with them."""
        reason = f"cancelled: client {client_id} disconnected"
        self.tenants.pop(client_id, None)
        n = 0
        for job in [j for j in self.jobs if any(r.client_id == client_id for r in j.requests)]:
            for req in job.requests:
                if req.client_id == client_id and not req.cancelled:
                    req.cancelled = True
                    req.error = reason
                    n += 1
            if not all(r.cancelled for r in job.requests):
                continue
            parked = job.model.pool.waiting if job.model.pool is not None else ()
            if job in self._arrivals:
                self._arrivals.remove(job)
                job.left_policy = True       # never announced to the policy
            elif job in parked:              # waiting for a buffer set
                parked.remove(job)
                job.left_policy = True
            elif job in self._memory_waiting:
                self._memory_waiting.remove(job)
                job.left_policy = True
            elif self._answering.pop(job, None) is not None:   # waiting for its answer
                job.left_policy = True
            if job.core >= 0:                # in the kernel core: it drains there
                job.cancelled, job.error = True, job.error or reason
                self._core_events(self.core.abort(job.core, job))
                continue
            self._abort(job, reason, cancelled=True)
            if job.waitlist.pending == 0:
                self._finish(job)
        return n

    def abandon_all(self, reason: str, status: int = STATUS_CANCELLED) -> int:
        """Complete every request in flight now, with ``status`` (cancelled, or failed
        when the device is lost) and ``reason``, without waiting for the work already
        on the device; returns how many requests.

        Only for a daemon about to close the device (the drain deadline passed): the
        device may still finish the abandoned kernels and copies, so the dispatcher's
        bookkeeping (occupancy, streams, device buffers) is not valid afterwards and it
        must not be stepped again. The clients' io regions may still be written by a
        copy in flight; a cancelled request's outputs are undefined."""
        jobs = sorted(self.jobs, key=_BY_SEQ)
        n = 0
        raised = None
        for job in jobs:
            if job.glet is not None and not job.glet.dead:
                job.glet.throw(greenlet.GreenletExit)
            job.state = FINISHED
            job.io = None
            self.jobs.discard(job)
            job.model.jobs -= 1              # (the device closes next: nothing to free)
            if job.model.parent is not None:
                job.model.parent.jobs -= 1
            self.in_flight -= len(job.requests)
            for req in job.requests:
                n += 1
                req.status, req.error, req.t_done = status, reason, self.now
                if req.on_complete is not None:
                    try:
                        req.on_complete(req, status, reason)
                    except Exception as e:   # as in _finish: the others are answered
                        raised = raised or e
        self._arrivals.clear()
        self._resume.clear()
        self._memory_waiting.clear()
        self._answering.clear()
        self._memory_blocked.clear()
        if raised is not None:
            raise raised
        return n

    def run_until_idle(self, timeout: float = 60.0,
                       stop: Callable[[], bool] | None = None,
                       done: Callable[[], bool] | None = None) -> None:
        """Step until nothing is in flight (in real time, or until ``done()`` is True: a
        profiling run in a serving daemon waits for its own job, not for a client's whose
        answer the effect workers are still computing). On a virtual-time device the one driver
        (:class:`~paella.dispatcher.virtual_time.VirtualDriver`) steps it, the clock
        jumping to the next device event whenever an iteration changes nothing; in real
        time it steps until done, letting go the kernels whose answers came in
        (``SimDevice.open_answered``). ``timeout`` (seconds of wall time) raises
        TimeoutError; ``stop()`` returning True raises :class:`RunInterrupted`; either
        leaves the work in flight."""
        virtual = hasattr(self.device, "next_event_time") and not getattr(self.device, "realtime", False)
        deadline = time.monotonic() + timeout

        def interrupted() -> bool:
            if stop is not None and stop():
                raise RunInterrupted(f"run_until_idle: stopped with {self.in_flight} "
                                     f"requests in flight")
            if time.monotonic() > deadline:
                raise TimeoutError(f"run_until_idle: {self.in_flight} requests still in "
                                   f"flight after {timeout} s")
            return False

        if virtual:
            VirtualDriver(self, skip_unobserved=False, on_stall=self._unstall,
                          name="dispatcher").run(until=interrupted)
            return
        open_answered = getattr(self.device, "open_answered", None)
        while self.step() or self._arrivals:
            if done is not None and done():
                return
            if open_answered is not None:
                open_answered()
            if self.idle:
                interrupted()
            elif stop is not None and stop():
                interrupted()

    def _unstall(self) -> bool:
        """The virtual-time driver found work in flight and nothing that can ever happen:
        a policy that holds every ready job back with the device idle has stalled, and
        fifo takes over (True: something was done); anything else is a bug (False)."""
        if self._queued and self._policy_stalled(now=float("inf")):
            self._policy_failed("pick", PolicyError(
                f"pick() returned None while {self._queued} job(s) had a ready kernel and "
                f"the device had nothing to run"))
            return True
        return False
