"""The daemon: one thread, one loop, pinned to one core (:meth:`Daemon.run`).

The loop is the paper's dispatcher loop: poll the client request rings in round-robin,
step the execution path (device poll, notifQ, jobs), and look at the control sockets
without blocking. Two idle modes:

* ``spin``: never block. Right on a dedicated core under load.
* ``adaptive`` (default): after ``idle_spin_us`` without work, raise the "sleeping"
  flag in every client segment and block in epoll on the sockets until a client
  speaks (a client that pushes onto a ring while the flag is up sends a KICK frame),
  a signal arrives, or the execution path's next deadline (the simulated GPU's next
  event) comes. Then clear the flag and spin again.

Lifecycle. The signal handlers are installed first, so a signal during model loading
is handled: SIGTERM ends start-up cleanly (exit 0, nothing left behind), a SIGHUP is
remembered and the repository read again once serving. At start-up the daemon removes
the shared-memory segments that dead daemons left (:mod:`paella.segments`). A bad
bundle is logged and skipped; the others are served. SIGTERM drains (stop accepting,
finish in-flight jobs until ``drain_seconds``, then complete the rest as cancelled),
unlinks every segment and exits 0. SIGHUP reloads the model repository in a background
thread and swaps the new models in between two iterations of the loop
(:mod:`.repository`). READY=1 goes to $NOTIFY_SOCKET once the models are loaded and the
socket listens.

Model control (``paella model``, Triton's model-repository extension): REPOSITORY_INDEX
lists the repository's model folders and their states; LOAD reads one folder the same
way off the loop and swaps it in; UNLOAD takes one model out of the table (its requests
in flight finish, as a removed folder's do at a reload). LOADs, UNLOADs and SIGHUP
reloads run one at a time in the order they came, so the last one asked wins; an
explicit UNLOAD holds across reloads until a LOAD of that model.
"""
from __future__ import annotations

import json
import logging
import math
import os
import signal
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from paella import rings, segments, wire
from paella.dispatcher.devices.base import DeviceError, DeviceLost
from paella.dispatcher.frontend import Frontend, FrontendConfig, ModelTable

from . import repository
from .builtin_models import echo_model, noop_adaptor, noop_info
from .bundles import FunctionalCache, bundle_adaptor
from .config import ConfigError, DaemonConfig, shown
from .executors import DispatcherExecutor, HostExecutor, Router
from .traces import TraceSessions
from .system import (freeze_heap, freeze_new_objects, pin_and_prioritize, raise_fd_limit,
                     sd_notify)
from .watchdog import PluginHung, Watchdog

log = logging.getLogger("paella.daemon")


def open_device_for(cfg: DaemonConfig):
    """The device of the dispatcher path, through the one backend choice
    (:func:`paella.dispatcher.devices.open_device`, which logs what ``auto`` chose and
    why): the simulator runs in real time, stepped from the loop or in a process of its
    own (``sim_mode``)."""
    from paella.dispatcher.devices import NoDriverError, open_device
    options: dict[str, Any] = {}
    if cfg.backend != "cuda":                # (auto drops these if it chooses the GPU)
        if cfg.sim_mode == "process":
            options["process"] = True
        else:
            options["realtime"] = True
            lose_after = os.environ.get("PAELLA_SIM_LOSE_DEVICE_AFTER")
            if lose_after is not None:
                log.warning("fault injection: the simulated GPU is lost after %s launches "
                            "(PAELLA_SIM_LOSE_DEVICE_AFTER)", lose_after)
                options["lose_after"] = int(lose_after)
    try:
        dev = open_device(cfg.backend, gpu=cfg.gpu, **options)
    except (NoDriverError, ValueError) as e:
        raise ConfigError(str(e)) from None
    dev.memory_limit = cfg.device_memory
    if dev.backend == "cuda":
        log.info("cuda device %d: %s (%s), %d SMs", dev.ordinal, dev.props.name,
                 dev.props.sm_name, dev.props.sm_count)
    else:
        log.info("simulated GPU %s %s (real time)", cfg.gpu, "in a process of its own"
                 if cfg.sim_mode == "process" else "stepped from the dispatcher loop")
    return dev


#: epoll's timeout unit (seconds). ``selectors`` rounds a timeout *up* to whole
#: milliseconds, so sleeping in epoll until a device event 60 us away sleeps 1 ms: with a
#: wait per kernel that dominated the real-time demo (a ResNet-18 request of 1.2 ms of
#: simulated GPU time answered at a p50 of 7 ms). The loop therefore sleeps the
#: sub-millisecond waits for the device with ``time.sleep`` (``clock_nanosleep``,
#: microsecond-precise; no timer slack under SCHED_FIFO) without raising the clients'
#: sleeping flag, so a request pushed meanwhile is seen when it returns, less than a
#: tick later (the rounding used to add as much); longer waits sleep in epoll for
#: whole ticks, rounded down, and the remainder the same way.
_EPOLL_TICK = 1e-3

#: While work is in flight the loop looks at the sockets (new clients, control frames,
#: hang-ups) at most this often (seconds) instead of every pass: see run().
_IO_PERIOD_BUSY = 1e-3

#: The longest the kernel core spins in C at a time (seconds) before the loop's Python
#: runs again: the daemon's other threads (the effect workers' answers, the watchdog)
#: get the GIL then, on the request CPython makes them wait 5 ms for, so 1 ms adds
#: little to that; signals are handled within the spin (_kcore.c, Core_spin). Why not
#: shorter: each return is a pass of the Python loop (microseconds), which delays the
#: successor of a kernel that ends meanwhile (docs/benchmarks.md, round 17).
_SPIN_MAX = 1e-3

#: The most the model list may take: it travels in every client's WELCOME (and MODELS)
#: frame, whose payload is at most ``wire.MAX_PAYLOAD``; the rest is room for the other
#: fields. (6,000 variants passed the load and then every connection failed.)
MODEL_LIST_BYTES = wire.MAX_PAYLOAD - 64 * 1024


def _listed_bytes(info: wire.ModelInfo) -> int:
    """What a model adds to the WELCOME frame's JSON."""
    return len(json.dumps(info.to_dict(), separators=(",", ":"))) + 1   # (as wire.encode; + a comma)


#: Exit status after a lost device (sticky GPU error): the unit restarts the daemon.
EXIT_DEVICE_LOST = 3
#: Exit status after a plug-in call that could not be interrupted (see ``watchdog``).
EXIT_PLUGIN_HUNG = 4


#: LOAD and UNLOAD operations that may wait their turn; one more is refused "busy".
MAX_CONTROL_QUEUE = 64
#: Repository listings (REPOSITORY_INDEX) running at once; one more is refused "busy".
MAX_LISTINGS = 4
#: The longest reason an index entry carries (a load error can be long): an index of
#: thousands of models must fit one frame.
MAX_REASON_CHARS = 500


class StartupInterrupted(Exception):
    """SIGTERM arrived while the daemon was starting: stop before serving."""


@dataclass(eq=False)
class ControlJob:
    """A LOAD or UNLOAD of one model, waiting its turn or under way, and the clients
    (the front end's ClientConns) its one answer goes to."""
    op: int                    # wire.LOAD or wire.UNLOAD
    name: str                  # the model (its folder's name)
    clients: list[Any]


@dataclass
class ServedBundle:
    """A bundle model the table lists: where it was read from, which version."""
    directory: str
    key: tuple
    info: wire.ModelInfo


class Daemon:
    """The service. ``instruments`` (:mod:`paella.dispatcher.instruments`) see every request
    of every execution path and the dispatcher's ops; ``open_device(cfg)`` replaces
    :func:`open_device_for` (experiments that trace the device)."""

    def __init__(self, cfg: DaemonConfig, *, instruments: Any = (),
                 open_device: Callable[[DaemonConfig], Any] | None = None):
        from paella.dispatcher.instruments import Instruments
        self.cfg = cfg
        self.instruments = list(instruments)
        #: Counters of the Prometheus metrics (``--metrics-port``), None when off.
        self.metrics = None
        self._metrics_server = None
        host_instruments = list(self.instruments)
        self._stage_instruments: list[Any] = list(self.instruments)
        if cfg.metrics_port:
            from .metrics import MetricsCounts
            self.metrics = MetricsCounts()
            job_metrics, host_metrics, stage_metrics = self.metrics.instruments()
            self.instruments.append(job_metrics)          # the dispatcher path's
            host_instruments.append(host_metrics)
            self._stage_instruments.append(stage_metrics)  # what the batching stage answers
        self.open_device = open_device or open_device_for
        self.table = ModelTable()
        fcfg = FrontendConfig(
            socket_path=cfg.socket, allowed_users=tuple(cfg.allowed_users),
            allowed_groups=tuple(cfg.allowed_groups), socket_mode=cfg.socket_mode,
            layout=rings.Layout(cfg.ring_slots, cfg.ring_slots, cfg.arena_bytes),
            max_arena_bytes=cfg.max_arena_bytes, max_clients=cfg.max_clients,
            max_inflight_per_client=cfg.max_inflight_per_client,
            max_clients_per_uid=cfg.max_clients_per_uid, handshake_seconds=cfg.handshake_seconds,
            trace_users=tuple(cfg.trace_users), control_users=tuple(cfg.control_users),
            class_default=dict(cfg.class_default),
            class_highest=dict(cfg.class_highest))
        self.front = Frontend(fcfg, self.table)
        self.router = Router()
        self.host = HostExecutor(self.front, {}, Instruments(host_instruments))
        self.router.paths.append(self.host)
        self.front.executor = self.router
        self.front.on_arena_mapped = self._arena_mapped
        self.front.on_arena_released = self._arena_released
        self.front.on_status = self.status
        #: Traces being taken (``paella trace``): see traces.py.
        self.traces = TraceSessions(self.front, self._wake_loop, cfg.trace_max_bytes)
        self.front.on_trace = self._on_trace
        self.front.on_model_control = self._on_model_control
        self.started = time.monotonic()
        self._arenas: dict[int, np.ndarray] = {}     # client id -> arena, while mapped
        self._pinned: set[int] = set()               # clients whose arena is page-locked
        self.dispatcher: DispatcherExecutor | None = None
        self.device = None
        self._builtins: list[wire.ModelInfo] = []    # echo, noop
        self._served: dict[str, ServedBundle] = {}   # bundle models by name
        #: Bundles not served at the last load, directory -> why (the log says it too).
        self.unserved: dict[str, str] = {}
        self._functional = FunctionalCache()
        #: The answer workers of a simulator in its own process (``--sim-mode process``):
        #: the functional cache's, which this daemon closes (a stepped simulator owns its
        #: own, ``SimDevice.effects``).
        self._own_workers: Any = None
        #: The background load running: a SIGHUP reload's scan or a LOAD's (_loading).
        self._loader: repository.Background | None = None
        #: The LOAD the running background load serves; None while it is a reload.
        self._loading: ControlJob | None = None
        #: LOADs and UNLOADs waiting their turn: model operations run one at a time (a
        #: reload among them) in the order they came, so the last one asked wins.
        self._controls: deque[ControlJob] = deque()
        #: Models UNLOADed explicitly: a reload skips their folders until a LOAD of them.
        self.unloaded: set[str] = set()
        #: Of those, the dispatcher models each left, still finishing requests in flight.
        self._unloading: dict[str, frozenset[int]] = {}
        #: Repository listings (REPOSITORY_INDEX) running off the loop, and who asked.
        self._listings: list[tuple[repository.Background, Any]] = []
        self.draining = False        # SIGTERM seen (set by the handler)
        self.admitting = True        # cleared by the loop once the final sweep is done
        self.drain_deadline = 0.0
        self._hup = False            # SIGHUP seen, reload not started yet
        self._refreeze = False       # a reload swapped models: freeze the heap when idle
        #: Work for the loop between two iterations: a SIGHUP, a finished background
        #: load, a deferred heap freeze. One flag, so the loop reads one attribute.
        self.housekeeping = False
        self._sig_r, self._sig_w = os.pipe()

    # -- models ----------------------------------------------------------------------
    def load_models(self) -> None:
        """Start-up: the built-in models, then the repository, read in this thread.
        Raises :class:`StartupInterrupted` when SIGTERM arrives meanwhile."""
        if self.cfg.models and not os.path.isdir(self.cfg.models):
            raise ConfigError(f"model repository {self.cfg.models} is not a directory; create "
                              f"it or point --models / [daemon] models at one")
        if self.cfg.models and os.path.isfile(os.path.join(self.cfg.models, "manifest.json")):
            parent = os.path.dirname(os.path.abspath(self.cfg.models))
            raise ConfigError(f"--models {self.cfg.models} is a bundle, not a model repository "
                              f"(a directory of bundles); point --models at the directory that "
                              f"holds it ({parent}) or move it into one")
        if self.cfg.models or self.cfg.noop:
            self._dispatcher()       # opens the device and builds the policy: fail early
        if self.cfg.echo:
            m = echo_model(self.table.id_for("echo"))
            self.host.models[m.info.model_id] = m
            self.router.by_model[m.info.model_id] = self.host
            self._builtins.append(m.info)
        if self.cfg.noop:
            noop = self._load_noop()
            if noop is not None:
                self._builtins.append(noop)
        if self.draining:
            raise StartupInterrupted()
        scan = None
        if self.cfg.models:
            log.info("loading the model repository %s", self.cfg.models)
            if self.device.backend == "sim":
                self._check_tvm()
            scan = repository.scan(self.cfg.models, {}, self._make_adaptor,
                                   stop=lambda: self.draining, reserved=self._reserved())
            if scan.interrupted or self.draining:
                raise StartupInterrupted()
        self._swap(scan)
        if scan is not None and scan.found and not self._served:
            raise ConfigError(f"no bundle of the model repository {self.cfg.models} can be "
                              f"served: " + "; ".join(f"{d}: {why}" for d, why in
                                                      sorted(self.unserved.items())))

    def _check_tvm(self) -> None:
        """Bundles on the simulated GPU need TVM: their answers come from each bundle's
        CPU build. With effect workers (real time) the workers import it, so this
        process only checks it is there; computing answers in this process (virtual
        time), it imports it now, not in a reload's thread, where importing TVM would
        hold the GIL for a stall of the loop."""
        import importlib.util
        if importlib.util.find_spec("tvm") is None:
            raise ConfigError("serving bundles on the simulated GPU needs TVM (their answers "
                              "come from each bundle's CPU build): pip install "
                              "'paella-py[compile]'")
        if not self._answers_off_loop():
            from paella.tvm_loader import load_tvm
            load_tvm()

    def _answers_off_loop(self) -> bool:
        """The simulated GPU's answers are computed in effect workers (real time, the
        simulator stepped from the loop or in its own process)."""
        dev = self.device
        return bool(getattr(dev, "realtime", False) and hasattr(dev, "effect_ready")) \
            or self._process_sim()

    def _process_sim(self) -> bool:
        """The simulator runs in a process of its own (it applies the effects as its
        completions arrive: ``late_effects``)."""
        dev = self.device
        return getattr(dev, "backend", "") == "sim" and bool(getattr(dev, "late_effects", False))

    def _make_adaptor(self, bundle, label: str, variant: int = 0):
        # The last kernel waits for its answer off the loop whatever the dispatcher's
        # release rule: the simulated device asks for it once the kernel's stream has
        # done what comes before it (docs/service.md, "Answers off the loop").
        return bundle_adaptor(bundle, label, self.device, self._functional, variant)

    def _reserved(self) -> tuple[str, ...]:
        """Names a repository folder may not take: the built-in models'."""
        return tuple(m.name for m in self._builtins)

    def _swap(self, scan: repository.Scan | None, whole: bool = True) -> None:
        """Register what ``scan`` prepared and replace the model table. The loop calls
        it between two iterations, so a client sees the old models or the new ones;
        requests already running keep the version they started with. ``whole``: the scan
        read the whole repository (a model whose folder it did not see goes); else it
        read one folder (a LOAD), and the other models stay as they are."""
        if scan is not None:
            failed = dict(scan.failed)
            ex = self._dispatcher() if scan.prepared else None
            replaced = {p.model for p in scan.prepared}
            listed = sum(map(_listed_bytes, self._builtins)) + sum(
                _listed_bytes(sb.info) for m, sb in self._served.items() if m not in replaced)
            for p in scan.prepared:
                mid = self.table.id_for(p.model)
                t0 = time.monotonic()
                try:
                    info = p.model_info(mid)           # (a plug-in's io is checked first)
                    need = _listed_bytes(info)
                    if listed + need > MODEL_LIST_BYTES:
                        raise ValueError(
                            f"its entry in the model list ({need} bytes: {len(p.variant_names)} "
                            f"variant(s)) would make the list every client receives at "
                            f"connection exceed {MODEL_LIST_BYTES} bytes; serve fewer variants "
                            f"or models")
                    ex.register_variants(mid, p.model, p.label, p.bundle, p.adaptors,
                                         p.batcher, p.config.profile_runs,  # init + profiling
                                         config=p.config)
                except DeviceLost:
                    raise
                except Exception as e:  # noqa: BLE001 - this bundle only
                    failed[p.directory] = f"cannot be served: {type(e).__name__}: {e}"
                    continue
                listed += need
                self.router.by_model[mid] = ex
                self._served[p.model] = ServedBundle(p.directory, p.key, info)
                log.info("registered %s%s (%d variant(s): %s; batcher %s): read in %.2f s, "
                         "registered in %.3f s", p.model,
                         f" version {p.version}" if p.version else "", len(p.variant_names),
                         ", ".join(p.variant_names), p.config.batcher,
                         p.seconds, time.monotonic() - t0)
            for d, model in scan.kept.items():
                self._served[model].directory = d
            if whole:
                current = ({p.directory for p in scan.prepared} | set(scan.kept) | set(failed))
                for model, sb in list(self._served.items()):
                    if sb.directory not in current:
                        del self._served[model]          # its directory is gone
                        if self.dispatcher is not None:  # (its requests finish, then it goes)
                            self.dispatcher.remove_model(sb.info.model_id)
            for d, why in sorted(failed.items()):
                old = next((m for m, sb in self._served.items() if sb.directory == d), None)
                log.error("bundle %s not served: %s%s", d, why,
                          f" (still serving the previous version of {old})" if old else "")
            if whole:
                self.unserved = failed
            else:
                for d in {p.directory for p in scan.prepared} | set(scan.kept):
                    self.unserved.pop(d, None)
                self.unserved.update(failed)
        self._publish()

    def _publish(self) -> None:
        """Replace the model table clients see: the built-ins and the bundles served."""
        self.table.replace(self._builtins + [sb.info for sb in self._served.values()])
        log.info("serving %d model(s): %s", len(self.table.by_id),
                 ", ".join(m.name for m in self.table.by_id.values()) or "none")

    def _load_noop(self) -> wire.ModelInfo | None:
        mid = self.table.id_for("noop")
        ex = self._dispatcher()
        if self.device.backend != "sim":
            log.info("built-in model noop not served: its kernel exists only on the "
                     "simulated GPU (--backend sim)")
            return None
        try:
            ex.register(mid, "noop", noop_adaptor())
        except (DeviceError, RuntimeError) as e:   # e.g. a device_memory below its buffers
            raise ConfigError(f"the built-in model noop cannot be served ({e}); raise "
                              f"device_memory or serve without it (--no-noop)") from None
        self.router.by_model[mid] = ex
        return noop_info(mid)

    def _dispatcher(self) -> DispatcherExecutor:
        """The dispatcher path, made on first need (no bundles: no device opened)."""
        if self.dispatcher is None:
            self.device = self.open_device(self.cfg)
            self._start_effect_workers()
            self.dispatcher = DispatcherExecutor(self.front, self.device, self.cfg,
                                                 self.instruments, self._stage_instruments)
            # SIGTERM while a model's profiling runs: it gives up at once (it waited up to
            # 60 s), the load reports the model as not served, and start-up stops.
            self.dispatcher.disp.profile_stop = lambda: self.draining
            self.router.paths.append(self.dispatcher)
            for cid, arena in self._arenas.items():     # clients that came first
                self._pin_arena(cid, arena)
        return self.dispatcher

    def _start_effect_workers(self) -> None:
        """On the real-time simulated GPU, the processes that compute its answers (the
        bundles' CPU builds, orca's tokens), so that no client's computation runs on the
        loop (docs/service.md, "Answers off the loop"). Started now, before the loop is
        pinned and raised to SCHED_FIFO: they and their thread keep every core and
        normal scheduling."""
        dev = self.device
        if not self._answers_off_loop():
            return
        from paella.dispatcher.devices.sim.effect_workers import EffectWorkers, default_workers
        cfg = self.cfg
        workers = EffectWorkers(cfg.effect_workers or default_workers(),
                                deadline=cfg.effect_deadline_seconds, max_queue=cfg.effect_queue)
        if self._process_sim():
            # The compiled models' answers only: a new input is computed before its job
            # starts (Dispatcher._await_answer), and found cached when the simulator's
            # completion applies the effect; one the lookup ahead did not cover holds
            # that kernel's completion, and what reads its output, until it is in
            # (SimProcessDevice._arrived).
            self._own_workers = workers
        else:
            dev.effects = workers
        if cfg.models:               # (bundles and plug-ins compute answers: start them now;
            workers.warm()           # a daemon of built-in models only never needs them)
        else:
            workers.start()
        dev.effect_ready = self._effect_ready
        self._functional.use_effects(workers)

    def _effect_ready(self) -> None:
        """A held kernel's answer is in (the workers' thread): the loop opens its gate at
        its next housekeeping, woken if it sleeps."""
        self.housekeeping = True
        self._wake_loop()

    # -- status ------------------------------------------------------------------------
    def status(self) -> dict:
        """``paella status`` and the metrics: the front end's view plus the device's
        (per-SM occupancy from the notifQ, notifQ depth, policy). Called on the loop for
        STATUS, and from the metrics thread at scrape time: it only reads, and copies
        each container in one C-level call first."""
        st = self.front.status()
        st.update(uptime_s=round(time.monotonic() - self.started, 3), in_flight=self.router.in_flight,
                  backend=self.device.backend if self.device is not None else "none",
                  draining=self.draining)
        per_model: dict[int, int] = {}
        memory: dict[int, int] = {}              # device bytes per client model id
        ex = self.dispatcher
        if ex is not None:
            # A batched model runs as one dispatcher model per variant: count its jobs (and
            # the requests its batcher holds) under the clients' model id.
            client_id: dict[int, int] = {}
            for cid, served in list(ex.stage.models.items()):
                per_model[cid] = len(served.waiting)
                for sv in list(served.served.values()):
                    client_id[sv.model_id] = cid
                if served.ctx is not None:       # a scheduler's own models and memory
                    for mid in served.ctx.own_models:
                        client_id[mid] = cid
                    memory[cid] = served.ctx.held_bytes
            for job in list(ex.disp.jobs):
                mid = client_id.get(job.model.model_id, job.model.model_id)
                per_model[mid] = per_model.get(mid, 0) + len(job.requests)
            for mid, n in ex.disp.device_memory_by_model().items():
                cid = client_id.get(mid, mid)
                memory[cid] = memory.get(cid, 0) + n
        for m in st["models"]:
            m["in_flight"] = per_model.get(m["id"], 0)
            m["device_memory_bytes"] = memory.get(m["id"], 0)
            served = ex.stage.models.get(m["id"]) if ex is not None else None
            stats = getattr(served.batcher, "stats_dict", None) if served is not None else None
            if stats is not None:                 # a batcher's own counters (dvabatch's)
                m["batcher"] = {"name": served.batcher.name, **stats()}
        st["dispatcher"] = None if ex is None else self._device_status(ex, self._own_workers)
        st["queued_work_us"] = 0 if ex is None else queued_work_us(ex.disp)
        return st

    @staticmethod
    def _device_status(ex: DispatcherExecutor, own_workers: Any = None) -> dict:
        disp, tracker = ex.disp, ex.disp.tracker
        spec = tracker.spec
        warps = tracker.sm_warps
        return {"policy": disp.policy.name, "gpu": spec.name, "sm_count": spec.sm_count,
                "models": len(disp.models), "device_memory_bytes": disp.device.allocated_bytes,
                "device_memory_total_bytes": disp.device.memory_capacity,
                "memory_waits": disp.memory_waits, "memory_failures": disp.memory_failures,
                "sm_occupancy": [round(w / spec.max_warps_per_sm, 4) for w in warps],
                "resident_blocks": tracker.blocks, "resident_warps": tracker.warps,
                "notifq_depth": tracker.pending_entries, "notifications": tracker.notifications,
                "policy_fallbacks": disp.policy_fallbacks,
                "policy_failure": getattr(disp, "policy_failure", None),
                "effects": _effects_status(disp, own_workers)}

    # -- client arenas -----------------------------------------------------------------
    def _arena_mapped(self, client_id: int, arena: np.ndarray) -> None:
        self._arenas[client_id] = arena
        if self.device is not None:
            self._pin_arena(client_id, arena)

    def _pin_arena(self, client_id: int, arena: np.ndarray) -> None:
        """Page-lock a client's arena for DMA (a no-op on the simulator). A failure only
        costs speed (the driver stages pageable copies), so it is logged, not fatal."""
        from paella.dispatcher.devices.base import DeviceError
        try:
            self.device.register_host(arena)
        except DeviceError as e:
            log.warning("client %d: arena of %d bytes not page-locked (%s); its copies are "
                        "staged by the driver", client_id, arena.nbytes, e)
            return
        self._pinned.add(client_id)

    def _arena_released(self, client_id: int, arena: np.ndarray) -> None:
        """The client's mapping is about to go (no job of it is left): unpin it first."""
        from paella.dispatcher.devices.base import DeviceError
        self._arenas.pop(client_id, None)
        if client_id in self._pinned:
            self._pinned.discard(client_id)
            try:
                self.device.unregister_host(arena)
            except DeviceError as e:
                log.warning("client %d: unpinning its arena failed: %s", client_id, e)

    # -- signals ---------------------------------------------------------------------
    def _install_signals(self) -> None:
        """First thing in :meth:`serve`: a signal during model loading must reach these
        handlers, not the default action (which would leave the socket behind)."""
        os.set_blocking(self._sig_w, False)
        os.set_blocking(self._sig_r, False)
        signal.set_wakeup_fd(self._sig_w, warn_on_full_buffer=False)
        signal.signal(signal.SIGTERM, self._on_term)
        signal.signal(signal.SIGINT, self._on_term)
        signal.signal(signal.SIGHUP, self._on_hup)
        self.front.watch(self._sig_r, self._drain_sigpipe)

    def _restore_signals(self) -> None:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)

    def _drain_sigpipe(self) -> None:
        try:
            os.read(self._sig_r, 4096)
        except BlockingIOError:
            pass  # already drained

    def _on_term(self, signum: int, frame) -> None:
        if not self.draining:
            self.draining = True
            self.drain_deadline = time.monotonic() + self.cfg.drain_seconds

    def _on_hup(self, signum: int, frame) -> None:
        self._hup = True
        self.housekeeping = True

    def _on_trace(self, client: Any, seconds: float) -> None:
        """TRACE from a client the front end allowed: record the dispatcher's events."""
        self.traces.start(client, seconds,
                          self.dispatcher.disp if self.dispatcher is not None else None)

    def _wake_loop(self) -> None:
        """Called by the background load's thread when it is done."""
        self.housekeeping = True
        try:
            os.write(self._sig_w, b"\0")     # wakes the loop out of epoll
        except OSError:
            pass  # the pipe is full: the loop is awake anyway

    # -- lifecycle -------------------------------------------------------------------
    def serve(self) -> int:
        """Start, run the loop until drained, clean up. Returns the exit status."""
        self._install_signals()
        watchdog = Watchdog(self.cfg.plugin_timeout_seconds, self._last_resort)
        watchdog.start()
        try:
            return self._serve()
        except StartupInterrupted:
            log.info("SIGTERM during start-up: stopped before serving")
            return 0
        except PluginHung as e:
            return self._plugin_hung(e)
        finally:
            watchdog.stop()
            self.traces.close()
            if self._metrics_server is not None:
                self._metrics_server.shutdown()
                self._metrics_server.server_close()
            self.front.close()
            if self.dispatcher is not None:
                # Every scheduler closes (after a drain they hold nothing): what they own
                # outside the device, such as orca's shared KV segment, goes now.
                self.dispatcher.stage.abandon("cancelled: the daemon stopped")
            if self.device is not None:
                self.device.close()
            if self._own_workers is not None:
                self._own_workers.close()
            self._restore_signals()
            if self._loader is not None and not self._loader.done:
                # Its thread writes to the pipe when done: leave the pipe open (the
                # process is about to exit) rather than let the number be reused.
                log.info("a model load was still running in the background: abandoned")
            else:
                os.close(self._sig_r)
                os.close(self._sig_w)

    def _serve(self) -> int:
        sock_dir = os.path.dirname(os.path.abspath(self.cfg.socket))
        if not os.path.isdir(sock_dir):
            raise ConfigError(f"the directory of the socket {self.cfg.socket} does not exist; "
                              f"create {sock_dir} (the systemd unit's RuntimeDirectory=paella "
                              f"makes /run/paella) or choose another --socket")
        if len(os.fsencode(self.cfg.socket)) > 107:      # sockaddr_un's sun_path
            raise ConfigError(f"the socket path {self.cfg.socket} is longer than a Unix "
                              f"socket's limit of 107 bytes; choose a shorter --socket")
        try:
            self.front.listen()      # raises FrontendError if another daemon holds it
        except OSError as e:
            raise ConfigError(f"cannot listen on {self.cfg.socket}: {e.strerror or e}") from None
        if self.metrics is not None:
            from .metrics import start_metrics_server
            self._metrics_server = start_metrics_server(
                self.cfg.metrics_port, self.cfg.metrics_addr, self.metrics, self.status)
        removed = segments.sweep()
        if removed:
            log.warning("removed %d shared-memory segment(s) left by dead daemons: %s",
                        len(removed), ", ".join(removed))
        try:
            self.load_models()
        except DeviceLost as e:              # (profiling runs use the device)
            return self._device_lost(e)
        if self.draining:
            raise StartupInterrupted()
        log.info("froze %d start-up objects out of the garbage collector's way", freeze_heap())
        core = pin_and_prioritize(self.cfg.cpu, self.cfg.rt_priority)
        keep_off = getattr(self.device, "keep_off_core", None)
        if core is not None and keep_off is not None:
            keep_off(core)                   # (the simulator's own process: not the loop's core)
        fds = raise_fd_limit()
        log.info("listening on %s (idle mode %s, %d file descriptors)", self.cfg.socket,
                 self.cfg.idle, fds)
        status = f"serving {len(self.table.by_id)} models"
        if self.unserved:
            status += f"; {len(self.unserved)} bundle(s) not served (see the log)"
        sd_notify(f"READY=1\nSTATUS={status}\nMAINPID={os.getpid()}")
        if self._hup:
            log.info("SIGHUP during start-up: reading the model repository again now")
        try:
            self.run()
        except DeviceLost as e:
            return self._device_lost(e)
        log.info("stopped cleanly; stats %s", self.front.stats)
        stats = self.dispatcher.stage.stats if self.dispatcher is not None else None
        if stats is not None and (stats.batches or stats.scheduler_jobs):
            log.info("batching stats %s", self.dispatcher.stage.stats.to_dict())
        return 0

    def _device_lost(self, exc: DeviceLost) -> int:
        """The GPU can run nothing more: fail every in-flight request with the reason,
        tell the clients, and exit non-zero so that the service manager restarts us."""
        n = self.router.in_flight
        log.critical("the device is lost (%s): failing %d in-flight request(s) and exiting with "
                     "status %d so that the service manager restarts the daemon", exc, n,
                     EXIT_DEVICE_LOST)
        sd_notify(f"STATUS=device lost: {exc}")
        self.router.abandon_all(f"the GPU failed ({exc}); the daemon is restarting", rings.E_FAILED)
        self._refuse_rings()
        return EXIT_DEVICE_LOST

    def _refuse_rings(self) -> None:
        """The daemon is going: what clients pushed and it never admitted is refused
        (each entry gets its one completion), then every wake-up is sent."""
        self.admitting = False
        for _ in range(self.cfg.ring_slots):          # bounded: a client may keep pushing
            if not self.front.poll_rings(admit=False):
                break
        self.front.poll_io(0)

    def _plugin_hung(self, exc: PluginHung) -> int:
        """A plug-in call would not stop (see :mod:`.watchdog`): the loop's state is
        unknown after it unwound, so answer every accepted request and exit non-zero for
        the service manager to restart the daemon."""
        n = self.router.in_flight
        log.critical("%s; failing %d in-flight request(s) and exiting with status %d: fix or "
                     "remove that plug-in", exc, n, EXIT_PLUGIN_HUNG)
        sd_notify(f"STATUS=a plug-in hung: {exc}")
        self.router.abandon_all(f"the daemon stopped: {exc}", rings.E_FAILED)
        self._refuse_rings()
        return EXIT_PLUGIN_HUNG

    def _last_resort(self, what: str) -> None:
        """From the watchdog's thread: the loop is stuck in a plug-in call that nothing
        can unwind (it catches ``BaseException``, or sits in C). Exit now: no lock may be
        taken (the loop may hold logging's), so the line goes straight to stderr; the
        socket and lock files are removed, and a client sees the daemon gone."""
        line = (f"paella[{os.getpid()}] CRITICAL {what}; exiting now with status "
                f"{EXIT_PLUGIN_HUNG}, in-flight requests unanswered: fix or remove that "
                f"plug-in\n")
        try:
            os.write(2, line.encode(errors="replace"))
            self.front.unlink_paths()
        finally:
            os._exit(EXIT_PLUGIN_HUNG)

    def run(self) -> None:
        """The dispatcher loop. This while loop right here is the daemon.

        Timeout rule (adaptive mode): spin while anything can run now; with work in
        flight that only waits for the device, sleep until the device's next event
        (less than a millisecond away: in ``time.sleep``, see ``_EPOLL_TICK``);
        with nothing in flight, spin ``idle_spin_us`` more, then sleep until a client
        or a signal speaks. Every sleep in epoll is preceded by raising the clients'
        "sleeping" flag and re-checking the rings, so a push that raced the flag is not
        missed; a sub-millisecond sleep raises none (a push waits for its end).
        """
        front, router, cfg = self.front, self.router, self.cfg
        idle_spin = cfg.idle_spin_us / 1e6
        adaptive = cfg.idle == "adaptive"
        last_work = time.monotonic()
        monotonic = time.monotonic
        io_due = 0.0
        spin = self.cfg.kernel_core != "off"
        while True:
            taken = front.poll_rings(admit=self.admitting)
            # The kernel core may spin in C until the sockets are due (Core.spin): it
            # returns at once when a client pushes a request (the probe), when a job has
            # news for the control plane, or when the device's next event is far.
            if router.step(min(io_due, monotonic() + _SPIN_MAX) if spin and not
                           (taken or self.housekeeping or self.draining) else 0.0):
                # Work in flight: the sockets every _IO_PERIOD_BUSY, not every pass.
                # Speed (a trick, labelled): nothing on them is urgent to the microsecond
                # (handshakes, control requests, signals, a client's hang-up), while each
                # look is an epoll_wait syscall plus the selector's Python, ~1.3 us; a
                # request's kernels take one pass each, so looking every pass cost
                # SqueezeNet ~50 us of loop time per request (docs/benchmarks.md, round 9).
                t = monotonic()
                if t >= io_due:
                    io_due = t + _IO_PERIOD_BUSY
                    front.poll_io(0)
            else:
                front.poll_io(0)
            if self.housekeeping:
                self._housekeeping()
            if self.draining and self._drain_step():
                return
            if taken or not adaptive:
                last_work = time.monotonic() if taken else last_work
                continue
            deadline = router.deadline()
            if deadline is not None:              # in flight: the idle spin starts after it
                last_work = time.monotonic()
                if deadline == 0.0:
                    continue                      # runnable work: spin
                if deadline < _EPOLL_TICK:
                    time.sleep(deadline)          # precise: see _EPOLL_TICK
                    continue
                # whole ticks, rounded down (selectors rounds up what it is given)
                deadline = (math.floor(deadline / _EPOLL_TICK) - 0.5) * _EPOLL_TICK
            else:                                 # nothing in flight
                if time.monotonic() - last_work < idle_spin:
                    continue
                if self.draining:
                    deadline = 0.05
            front.set_sleeping(True)
            if not front.any_pending():
                front.poll_io(deadline)
            front.set_sleeping(False)
            last_work = time.monotonic()

    def _drain_step(self) -> bool:
        """SIGTERM: True once nothing is left in flight (or the deadline passed)."""
        if self.front.accepting:
            log.info("SIGTERM: draining %d in-flight request(s), deadline %.1f s",
                     self.router.in_flight, self.cfg.drain_seconds)
            sd_notify("STOPPING=1")
            self.front.stop_accepting()
            self._refuse_controls()
            # Requests already on the rings were sent before we stopped: serve them.
            # Anything pushed from now on is answered "shutting down".
            for _ in range(self.cfg.ring_slots):      # bounded: a client may keep pushing
                if not self.front.poll_rings(admit=True):
                    break
                self.router.step()
            self.admitting = False
        if self.router.in_flight == 0 and not self.front.any_pending():
            return True     # (entries still in rings get "shutting down" next pass)
        if time.monotonic() > self.drain_deadline:
            n = self.router.in_flight
            log.warning("drain deadline passed: completing %d request(s) still in flight as "
                        "cancelled", n)
            # Every accepted request gets one completion before the daemon goes, also one
            # whose kernels are still on the device: it is not waited for.
            self.router.abandon_all(f"cancelled: the daemon stopped (its drain deadline of "
                                    f"{self.cfg.drain_seconds:g} s passed) before the job "
                                    f"finished")
            self._refuse_rings()                      # what is still in the rings
            return True
        return False

    # -- reloads -----------------------------------------------------------------------
    def _housekeeping(self) -> None:
        """Between two iterations: finish a background load (a reload's or a LOAD's) and
        answer the repository listings done, start the next model operation (a SIGHUP's
        reload first, then the LOADs and UNLOADs waiting), freeze the heap once nothing
        is in flight after a swap."""
        self.housekeeping = False
        open_answered = getattr(self.device, "open_answered", None)
        if open_answered is not None and getattr(self.device, "effect_ready", None) is not None:
            open_answered()
        if self.traces.sessions:
            self.traces.service()
        loader = self._loader
        if loader is not None and loader.done:
            self._loader = None
            job, self._loading = self._loading, None
            if job is None:
                self._finish_reload(loader)
            else:
                self._finish_load(job, loader)
        if self._listings:
            self._finish_listings()
        if self._loader is None and not self.draining:
            if self._hup:
                self._hup = False
                self._start_reload()
            self._run_controls()
        if self._refreeze:
            if self.router.in_flight == 0 and not self.front.any_pending():
                self._refreeze = False
                t0 = time.perf_counter()
                n = freeze_new_objects()
                log.info("collected %d garbage objects and froze what the reload made, in "
                         "%.1f ms", n, (time.perf_counter() - t0) * 1e3)
            else:
                self.housekeeping = True     # look again next iteration

    def _start_reload(self) -> None:
        sd_notify("RELOADING=1")
        if not self.cfg.models:
            log.info("SIGHUP: no model repository configured, nothing to reload")
            self._swap(None)
            sd_notify("READY=1")
            return
        log.info("SIGHUP: reading the model repository %s in the background", self.cfg.models)
        known = {model: sb.key for model, sb in self._served.items()}
        self._loader = repository.BackgroundScan(self._wake_loop, self.cfg.models, known,
                                                 self._make_adaptor, reserved=self._reserved(),
                                                 skip=frozenset(self.unloaded))

    def _finish_reload(self, loader: repository.BackgroundScan) -> None:
        if loader.error is not None:
            log.error("SIGHUP reload failed, keeping the previous models: %s: %s",
                      type(loader.error).__name__, loader.error)
        else:
            scan = loader.result
            log.info("SIGHUP: repository read in %.2f s off the loop (%d new or changed, "
                     "%d unchanged, %d not served%s)", scan.seconds, len(scan.prepared),
                     len(scan.kept), len(scan.failed),
                     f", {len(scan.skipped)} unloaded by UNLOAD and skipped" if scan.skipped
                     else "")
            self._swap(scan)
            self._refreeze = True
            self.housekeeping = True
        sd_notify("READY=1")

    # -- model control (paella model) ------------------------------------------------------
    def _on_model_control(self, client: Any, kind: int, msg: dict) -> None:
        """REPOSITORY_INDEX, LOAD or UNLOAD from a client the front end let through. The
        front end counts the answer owed: every path ends in one :meth:`_answer`."""
        if kind == wire.REPOSITORY_INDEX:
            self._start_listing(client)
            return
        name = msg["name"]
        refused = self._refusal(name)
        if refused is not None:
            log.info("%s of %s refused: %s", wire.NAMES[kind], shown(name, 60), refused[1])
            self._answer(client, wire.error(*refused))
            return
        self._enqueue(kind, name, client)

    def _refusal(self, name: str) -> tuple[str, str] | None:
        """Why a LOAD or UNLOAD of ``name`` is refused at once (error code, message), or
        None. Nothing here touches the file system: the name is checked first."""
        why = repository.name_problem(name)
        if why is not None:
            return "bad_name", f"{shown(name, 60)} is not a model name: {why}"
        if name in self._reserved():
            return "builtin", (f"{name} is a built-in model of the daemon, not a folder of its "
                               f"repository: it is neither loaded nor unloaded (`paella serve "
                               f"--no-{name}` serves without it)")
        if not self.cfg.models:
            return "no_repository", ("the daemon serves no model repository: start it with "
                                     "--models DIR ([daemon] models)")
        if self.draining:
            return "shutting_down", "the daemon is stopping (SIGTERM)"
        if len(self._controls) >= MAX_CONTROL_QUEUE:
            return "busy", (f"{MAX_CONTROL_QUEUE} model operations are waiting their turn "
                            f"already; try again once they are done")
        return None

    def _enqueue(self, kind: int, name: str, client: Any) -> None:
        """Queue a LOAD or UNLOAD. One of the same kind already waiting for that model,
        with no other operation on it after, takes this client too: one load (or unload)
        answers both, and both were asked before it started."""
        last = next((j for j in reversed(self._controls) if j.name == name), None)
        if last is not None and last.op == kind:
            last.clients.append(client)
        else:
            self._controls.append(ControlJob(kind, name, [client]))
        self.housekeeping = True

    def _run_controls(self) -> None:
        """Start the waiting operations, in order, until one needs the background load."""
        while self._controls and self._loader is None:
            job = self._controls.popleft()
            if job.op == wire.UNLOAD:
                self._unload(job)
            else:
                self._start_load(job)

    def _refuse_controls(self) -> None:
        """SIGTERM: the operations still waiting their turn will not run; say so."""
        for job in self._controls:
            self._answer_job(job, wire.error("shutting_down", "the daemon is stopping "
                                             "(SIGTERM) before this model operation's turn"))
        self._controls.clear()

    def _start_load(self, job: ControlJob) -> None:
        """A LOAD's turn: read its folder off the loop, as a reload reads the repository."""
        name = job.name
        log.info("LOAD %s: reading %s in the background", name,
                 os.path.join(self.cfg.models, name))
        known = {model: sb.key for model, sb in self._served.items()}
        taken = {m.lower(): sb.directory for m, sb in self._served.items() if m != name}
        self._loading = job
        self._loader = repository.Background(
            self._wake_loop, repository.scan_one, self.cfg.models, name, known,
            self._make_adaptor, reserved=self._reserved(), taken=taken)

    def _finish_load(self, job: ControlJob, loader: repository.Background) -> None:
        """A LOAD's folder is read: swap it in (the rest stays as it is) and answer."""
        name, folder = job.name, os.path.join(self.cfg.models, job.name)
        if isinstance(loader.error, repository.NoModelFolder):
            log.warning("LOAD %s refused: %s", name, loader.error)
            self._answer_job(job, wire.error("unknown_model", str(loader.error)))
            return
        if loader.error is not None:
            log.error("LOAD %s failed: %s: %s", name, type(loader.error).__name__, loader.error)
            self._answer_job(job, wire.error(
                "load_failed", f"{name}: {type(loader.error).__name__}: {loader.error}"))
            return
        self.unloaded.discard(name)          # (this LOAD is the operator's last word on it)
        self._unloading.pop(name, None)
        self._swap(loader.result, whole=False)
        self._refreeze = True
        self.housekeeping = True
        why = self.unserved.get(folder)
        if why is not None:
            still = " (its previous version is still served)" if name in self._served else ""
            self._answer_job(job, wire.error("load_failed", f"{name} is not served: {why}{still}"))
            return
        log.info("LOAD %s: served", name)
        self._answer_job(job, wire.encode(wire.LOAD_REPLY, {"model": self._entry(name)}))

    def _unload(self, job: ControlJob) -> None:
        """An UNLOAD's turn, on the loop: the model leaves the table at once (a request
        for it is then refused as for any unknown model), its requests in flight finish
        on it, then its device memory goes (the path of a folder removed at a reload)."""
        name = job.name
        sb = self._served.get(name)
        if sb is None:
            state, reason = self._state(name)
            known = name in self.unloaded or os.path.join(self.cfg.models, name) in self.unserved
            served = ", ".join(sorted(self._served)) or "none"
            self._answer_job(job, wire.error(
                "unknown_model", f"the daemon serves no model {name!r}"
                                 f"{f' ({state}: {reason})' if known else ''}; nothing to "
                                 f"unload (served from its repository: {served[:400]})"))
            return
        mid = sb.info.model_id
        left = self._dispatcher_models(mid)
        del self._served[name]
        self.dispatcher.remove_model(mid)             # (a served bundle has the dispatcher)
        self.unloaded.add(name)
        if left:
            self._unloading[name] = left
        self._publish()
        log.info("UNLOAD %s: not served any more; its requests in flight finish", name)
        self._answer_job(job, wire.encode(wire.UNLOAD_REPLY, {"model": self._entry(name)}))

    def _dispatcher_models(self, model_id: int) -> frozenset[int]:
        """The dispatcher's models behind a client's model: its variants, a scheduler's
        own models. Once none is left in the dispatcher, its requests have all finished."""
        served = self.dispatcher.stage.models.get(model_id) if self.dispatcher else None
        if served is None:
            return frozenset()
        ids = {sv.model_id for sv in served.served.values()}
        if served.ctx is not None:
            ids |= served.ctx.own_models
        return frozenset(ids)

    def _finishing(self, name: str) -> bool:
        """An unloaded model still has requests in flight (its dispatcher models remain)."""
        left = self._unloading.get(name)
        if left is None:
            return False
        if self.dispatcher is None or left.isdisjoint(self.dispatcher.disp.models):
            del self._unloading[name]
            return False
        return True

    def _state(self, name: str) -> tuple[str, str]:
        """A repository model's state (wire.MODEL_STATES) and why it is not served."""
        if name in self._served:
            return "READY", ""
        if self._loading is not None and self._loading.name == name:
            return "LOADING", "loading"
        if any(j.name == name and j.op == wire.LOAD for j in self._controls):
            return "LOADING", "its LOAD waits for the model operations before it"
        if self._finishing(name):
            return "UNLOADING", "unloaded; its requests in flight are finishing"
        if name in self.unloaded:
            return "UNAVAILABLE", "unloaded"
        why = self.unserved.get(os.path.join(self.cfg.models, name))
        if why is not None:
            return "UNAVAILABLE", why
        return "UNAVAILABLE", ("not loaded: the folder is newer than the last load (LOAD it, "
                               "or reload the repository with SIGHUP)")

    def _entry(self, name: str) -> dict:
        """One model's entry in REPOSITORY_INDEX_REPLY, LOAD_REPLY and UNLOAD_REPLY."""
        state, reason = self._state(name)
        if len(reason) > MAX_REASON_CHARS:
            reason = reason[:MAX_REASON_CHARS - 3] + "..."
        return {"name": name, "version": wire.MODEL_VERSION, "state": state, "reason": reason}

    def _start_listing(self, client: Any) -> None:
        """REPOSITORY_INDEX: list the repository's model folders off the loop (it may sit
        on slow storage); :meth:`_finish_listings` answers."""
        if not self.cfg.models:
            self._answer(client, wire.encode(wire.REPOSITORY_INDEX_REPLY, {"models": []}))
            return
        if len(self._listings) >= MAX_LISTINGS:
            self._answer(client, wire.error("busy", f"{MAX_LISTINGS} repository listings are "
                                                    f"running already; try again in a moment"))
            return
        task = repository.Background(self._wake_loop, repository.model_folders, self.cfg.models,
                                     thread_name="paella-repository-index")
        self._listings.append((task, client))

    def _finish_listings(self) -> None:
        """Answer the listings done: each folder with its state now, and the models still
        served whose folder has gone (until a reload)."""
        done = [(t, c) for t, c in self._listings if t.done]
        if not done:
            return
        self._listings = [(t, c) for t, c in self._listings if not t.done]
        for task, client in done:
            if task.error is not None:
                self._answer(client, wire.error(
                    "repository", f"cannot list the model repository {self.cfg.models}: "
                                  f"{type(task.error).__name__}: {task.error}"))
                continue
            entries = [self._entry(n) for n in sorted(set(task.result) | set(self._served))]
            try:
                frame = wire.encode(wire.REPOSITORY_INDEX_REPLY, {"models": entries})
            except wire.WireError:
                frame = wire.error("too_large", f"the index of {len(entries)} models exceeds "
                                                f"one frame ({wire.MAX_PAYLOAD} bytes)")
            self._answer(client, frame)

    def _answer(self, client: Any, frame: bytes) -> None:
        self.front.control_reply(client, frame)

    def _answer_job(self, job: ControlJob, frame: bytes) -> None:
        for client in job.clients:
            self._answer(client, frame)


def queued_work_us(disp) -> int:
    """The work a dispatcher holds, in microseconds of its own GPU: the sum over its live
    jobs of the policy's remaining-time estimates (SRPT, dispatcher/profile.py), what a
    router reads from STATUS to weigh replicas (paella.cluster.router, ``p2c-work``).
    Requests a batcher still holds are not jobs yet and are not counted. Under the kernel
    core (``--kernel-core``, the default) a job's own estimate is not charged as it runs,
    so a started job counts at its whole estimate: an over-estimate by the work its
    kernels have done. Reads only (one C-level copy of the job set)."""
    return round(sum([j.remaining for j in list(disp.jobs)]) * 1e6)


def _effects_status(disp, own_workers: Any = None) -> dict | None:
    """The simulated GPU's answer workers (None elsewhere): their counters and queue, the
    jobs waiting for their answer before they start, and the kernels held back on the
    device for one (what the jobs' wait does not cover: a step plug-in's effects, an
    input rewritten after its job was submitted)."""
    device = disp.device
    effects = getattr(device, "effects", None) or own_workers
    if effects is None:
        return None
    return {**effects.stats(), "awaiting_jobs": disp.answers_awaited,
            "held_kernels": getattr(device, "gates", 0)}
