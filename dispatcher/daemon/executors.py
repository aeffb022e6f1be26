"""The execution paths behind the front end: host models in the loop, the Dispatcher on a
device, and the router that sends each model's requests to the path serving it."""
from __future__ import annotations

import logging
from collections import deque
from typing import Any


from paella import rings
from paella.dispatcher.batchers import ModelVariants, VariantSpec, make_batcher
from paella.dispatcher.batchers.stage import BatchingStage, ServedModel, ServedVariant, layout_of
from paella.dispatcher.core import Request
from paella.dispatcher.frontend import Frontend
from paella.dispatcher.instruments import Instruments
from paella.dispatcher.policies import PolicyError
from paella.plugins import PLUGIN_ERRORS

from .builtin_models import HostModel
from .config import ConfigError, DaemonConfig

log = logging.getLogger("paella.daemon")


class HostExecutor:
    """Runs host models in the loop: wake-up, compute, complete, one per request."""

    def __init__(self, front: Frontend, models: dict[int, HostModel], instruments: Any = None):
        self.front = front
        self.models = models
        self.queue: deque[Request] = deque()
        # The dispatcher's hooks on requests, fired for host models too.
        self.instruments = Instruments() if instruments is None else instruments

    def submit(self, req: Request) -> None:
        self.queue.append(req)
        if "request_admitted" in self.instruments:
            self.instruments.call("request_admitted", req)

    def step(self, spin_until: float = 0.0) -> bool:
        q = self.queue
        n = len(q)                     # a snapshot: work queued meanwhile waits a pass
        instr = self.instruments
        while n and q:                 # (cancel_client may shrink q under us)
            n -= 1
            req = q.popleft()
            req.on_almost_finished(req)
            if "request_woken" in instr:
                instr.call("request_woken", req)
            try:
                self.models[req.model_id].run(req.io)
            except Exception as e:  # noqa: BLE001 - a model failure fails its request only
                log.exception("host model %d failed on request %d of client %d", req.model_id,
                              req.req_id, req.client_id)
                self._complete(req, rings.E_FAILED, f"{type(e).__name__}: {e}")
            else:
                self._complete(req, rings.OK, None)
        return bool(q)

    def _complete(self, req: Request, status: int, error: str | None) -> None:
        req.status, req.error = status, error
        req.on_complete(req, status, error)
        if "request_finished" in self.instruments:
            self.instruments.call("request_finished", req)

    def cancel_client(self, client_id: int) -> None:
        gone = [r for r in self.queue if r.client_id == client_id]
        if not gone:
            return
        keep = [r for r in self.queue if r.client_id != client_id]
        self.queue.clear()             # in place: step() holds a reference
        self.queue.extend(keep)
        for req in gone:
            self._complete(req, rings.E_CANCELLED, "client disconnected")

    def abandon_all(self, reason: str, status: int = rings.E_CANCELLED) -> None:
        while self.queue:
            self._complete(self.queue.popleft(), status, reason)

    def deadline(self) -> float | None:
        return 0.0 if self.queue else None

    @property
    def in_flight(self) -> int:
        return len(self.queue)


class Router:
    """The front end's executor: sends each model's requests to the path serving it."""

    def __init__(self) -> None:
        self.paths: list = []
        self.by_model: dict[int, Any] = {}

    def submit(self, req: Request) -> None:
        self.by_model[req.model_id].submit(req)

    def step(self, spin_until: float = 0.0) -> bool:
        """One pass of every path. ``spin_until`` (CLOCK_MONOTONIC seconds, 0: none): a
        path may keep working in C until then (:meth:`DispatcherExecutor.step`), given
        only while it is the one path with work, so that no other path's requests wait."""
        busy = False
        paths = self.paths
        if spin_until and len(paths) > 1 and sum(p.in_flight > 0 for p in paths) > 1:
            spin_until = 0.0
        for p in paths:
            busy |= p.step(spin_until)
        return busy

    def cancel_client(self, client_id: int) -> None:
        for p in self.paths:
            p.cancel_client(client_id)

    def abandon_all(self, reason: str, status: int = rings.E_CANCELLED) -> None:
        """Complete everything in flight now with ``status`` and ``reason``, without
        waiting for the device (the daemon is about to exit): every accepted request
        gets its one completion."""
        for p in self.paths:
            p.abandon_all(reason, status)

    def deadline(self) -> float | None:
        ds = [d for d in (p.deadline() for p in self.paths) if d is not None]
        return min(ds) if ds else None

    @property
    def in_flight(self) -> int:
        return sum(p.in_flight for p in self.paths)


class DispatcherExecutor:
    """The Dispatcher (issue 4) on a device: the execution path of bundle models, each
    behind its batcher (:class:`~paella.dispatcher.batchers.stage.BatchingStage`)."""

    #: Spin instead of sleeping when the next device event is this close (seconds), and
    #: wake this much before a farther one, then spin: a sleep here overshoots by 25-40 us
    #: under SCHED_FIFO and 80-100 us without it (``time.sleep``, medians measured on
    #: this VM), and an overshoot at each of a model's kernels is GPU time lost (the next
    #: kernel is released when the previous one's completion is seen).
    SPIN_BELOW = 250e-6
    WAKE_EARLY = 150e-6
    #: Dispatcher model ids of compiled variants start here (the clients' ids are small).
    VARIANT_IDS = 1 << 20

    def __init__(self, front: Frontend, device, cfg: DaemonConfig, instruments: Any = (),
                 stage_instruments: Any = ()):
        from paella.dispatcher.core import Dispatcher
        params = dict(cfg.policy_params)
        extra = params.pop("extra_blocks", None)
        backlog = params.pop("saturation_backlog", None)
        fair = params.pop("fairness_threshold", None)
        self.front = front
        self.device = device
        try:
            self.disp = Dispatcher(device, cfg.policy, extra_blocks=extra,
                                   saturation_backlog=backlog,
                                   fairness_threshold=fair, policy_options=params or None,
                                   instruments=instruments, lookahead=cfg.lookahead,
                                   wake_lead=cfg.wake_lead_us * 1e-6,
                                   slice_us=cfg.slice_us,
                                   buffer_sets_ahead=cfg.buffer_sets_ahead,
                                   kernel_core=None if cfg.kernel_core == "off"
                                   else cfg.kernel_core)
        except PolicyError as e:           # the policy refused its parameters
            raise ConfigError(str(e)) from None
        except PLUGIN_ERRORS as e:  # a plug-in's __init__ may raise anything
            # Start-up refuses (nothing is served yet, so nothing is lost, and the
            # operator sees the cause at once); mid-service a failing policy falls back.
            raise ConfigError(f"scheduling policy {cfg.policy!r} failed to start: "
                              f"{type(e).__name__}: {e}; fix the plug-in or choose another "
                              f"policy (--policy, [policy] name)") from None
        self._next_event = getattr(device, "next_event_time", None)
        #: A device that cannot tell its next event may still tell it has nothing that
        #: can complete (``quiet``: the simulator in its own process with no op there).
        self._quiet = None if self._next_event is not None else \
            (lambda: getattr(device, "quiet", False))
        self.stage = BatchingStage(self.disp, stage_instruments)
        self._next_vid = self.VARIANT_IDS
        self.stage.new_model_id = self._new_vid      # schedulers' internal models
        #: Client model ids whose new inputs are refused at their job's start when the
        #: answer workers' queue is full, not at admission (see register_variants).
        self._asks_ahead: set[int] = set()

    def _new_vid(self) -> int:
        vid = self._next_vid
        self._next_vid += 1
        return vid

    def register(self, model_id: int, name: str, adaptor) -> None:
        """Serve ``adaptor`` as ``model_id`` unbatched (the client-visible id: requests
        keep it all the way into the dispatcher); a model registered again takes new
        requests, the running ones finish on the old."""
        self.disp.register_model(name, adaptor, model_id=model_id)

    def register_variants(self, model_id: int, name: str, label: str, bundle, adaptors: list,
                          batcher, profile_runs: int | None = None, config: Any = None) -> None:
        """Serve a bundle's variants (one adaptor each) as the clients' ``model_id``
        through ``batcher``: each variant is a dispatcher model of its own (its plan, its
        SRPT profile), named ``label/variant``. Registered again: new requests take the
        new variants, running batches finish on the old. ``bundle`` None: a standalone
        scheduler (``SchedulerBatcher.standalone``, e.g. orca) that registers its own
        internal models when the stage starts it. ``batcher`` None: built here from
        ``config`` (its ModelConfig) once the variants are profiled (a batcher that plans
        with their costs, e.g. ``turbo-dp``)."""
        served = {}
        try:
            for k, (v, adaptor) in enumerate(zip(bundle.variants if bundle is not None else (),
                                                 adaptors)):
                vid = self._new_vid()
                self.disp.register_model(f"{label}/{v.name}", adaptor, model_id=vid,
                                         profile_runs=profile_runs)
                # The variant's time as the profiling runs measured it (its kernels
                # alone): the cost table of batchers that plan by cost.
                cost = self.disp.models[vid].profile.total
                served[k] = ServedVariant(VariantSpec(k, v.rows, v.seq_len, f"{label}/{v.name}",
                                                      cost_s=cost, stage=getattr(v, "stage", -1)),
                                          vid, layout_of(v.inputs, v.outputs, v.io_bytes))
            if batcher is None:
                if config is None:
                    raise ValueError(f"model {name!r}: no batcher and no config to build one")
                batcher = make_batcher(config.batcher,
                                       ModelVariants(name, tuple(s.spec for s in served.values())),
                                       config.batcher_options)
            self.stage.add_model(model_id, ServedModel(name, batcher.model, served, batcher))
            # A compiled model (not cut into stages, whose jobs bind their own buffers)
            # whose every variant asks for a new input's answer before its job starts
            # (Dispatcher._await_answer): a full queue of the answer workers refuses only
            # its new inputs, there; its cached ones are served. The others are refused
            # at admission while it is full (_overloaded).
            if served and all(self.disp.models[sv.model_id].answer_ahead is not None
                              and getattr(v, "stage", -1) < 0
                              for v, sv in zip(bundle.variants, served.values())):
                self._asks_ahead.add(model_id)
            else:
                self._asks_ahead.discard(model_id)
        except BaseException:
            # Not served (the previous version stays): what it registered goes, or every
            # SIGHUP that tries this bundle again would leave another copy behind.
            for sv in served.values():
                if sv.model_id in self.disp.models:
                    self.disp.retire_model(sv.model_id)
            raise

    def remove_model(self, model_id: int) -> None:
        """Serve ``model_id`` no more (its folder left the repository): its requests
        finish, then its variants are freed."""
        self._asks_ahead.discard(model_id)
        self.stage.remove_model(model_id)

    def submit(self, req: Request) -> None:
        self.disp.note_tenant(req)
        if req.model_id in self.stage.models:
            if req.model_id not in self._asks_ahead and self._effects_full(req):
                self._overloaded(req)
                return
            self.stage.submit(req)
        else:
            self.disp.submit(req)

    def _effects_full(self, req: Request) -> bool:
        """The simulated GPU's answer workers have a full queue, and ``req``'s tenant
        holds the largest share of it: a model that computes its answers there (every
        bundle and scheduler of the stage; not the built-in noop) takes no more of that
        tenant's requests until it drains, so memory stays bounded, while a tenant with
        less waiting is still served (``FairQueue``: one tenant's flood of new inputs is
        its own problem)."""
        effects = getattr(self.device, "effects", None)
        if getattr(effects, "max_queue", None) is None:
            return False                     # (none, or computed in the loop's thread)
        return effects.refuses(self.disp.owner_of(req.client_id))

    def _overloaded(self, req: Request) -> None:
        from paella.dispatcher.devices.sim.effect_workers import overloaded_reason
        error = overloaded_reason(self.device.effects)
        req.status, req.error = rings.E_FAILED, error
        req.on_complete(req, rings.E_FAILED, error)
        instruments = self.stage.instruments
        if "request_finished" in instruments:
            instruments.call("request_finished", req)

    def step(self, spin_until: float = 0.0) -> bool:
        """The dispatcher's pass, then the batching stage's. With ``spin_until`` and
        nothing in the batching stage, the dispatcher may spin in its kernel core until
        then (``Dispatcher.spin_until``): at each of a job's kernel boundaries the GPU
        then waits for a C pass, not for a pass of the Python loop."""
        disp = self.disp
        if spin_until and not self.stage.queued:
            disp.spin_until, disp.spin_probe = spin_until, self.front.ring_probe()
        else:
            disp.spin_until = 0.0
        busy = disp.step()
        return self.stage.step() or busy

    def cancel_client(self, client_id: int) -> None:
        self.stage.cancel_client(client_id)          # queued ones, then the dispatcher's

    def abandon_all(self, reason: str, status: int = rings.E_CANCELLED) -> None:
        self.stage.flush()
        self.stage.abandon(reason, status)           # schedulers: closed, held answered
        self.disp.abandon_all(reason, status)        # a lost device fails them: E_FAILED

    def deadline(self) -> float | None:
        """Seconds the loop may sleep: None when idle, 0 when work is runnable now."""
        batch_at = self.stage.deadline()
        if self.disp.in_flight == 0 and batch_at is None:
            return None
        if self.disp.in_flight:
            idle = self.disp.idle
            # A device that cannot tell its next event may complete something at any
            # moment: spin, unless it is quiet while the jobs wait for their answers
            # (the workers wake the loop). Spinning there kept the SCHED_FIFO loop busy
            # for whole seconds, and the kernel's real-time throttling, 50 ms in every
            # second by default, then stalled every client (session 28).
            unknown = self._next_event is None and not (idle and self._quiet is not None
                                                        and self._quiet())
            if not idle or unknown:
                return 0.0
        at = min(self._next_event() if self.disp.in_flight and self._next_event else float("inf"),
                 float("inf") if batch_at is None else batch_at)
        wait = (at - self.device.now()) / getattr(self.device, "speed", 1.0)
        return 0.0 if wait < self.SPIN_BELOW else min(wait - self.WAKE_EARLY, 0.1)

    @property
    def in_flight(self) -> int:
        return self.disp.in_flight + self.stage.queued
