"""``paella serve``: the daemon. One thread, one loop, pinned to one core.

The loop (below, :meth:`Daemon.run`) is the paper's dispatcher loop: poll the client
request rings in round-robin, step the execution path (device poll, notifQ, jobs),
and look at the control sockets without blocking. Two idle modes:

* ``spin``: never block. Right on a dedicated core under load.
* ``adaptive`` (default): after ``idle_spin_us`` without work, raise the "sleeping"
  flag in every client segment and block in epoll on the sockets until a client
  speaks (a client that pushes onto a ring while the flag is up sends a KICK frame),
  a signal arrives, or the execution path's next deadline (the simulated GPU's next
  event) comes. Then clear the flag and spin again.

Configuration comes from a TOML file (``--config``, sections [daemon] [policy]
[access] [limits]; see ``dist/paella.toml``), and every setting can be overridden on
the command line. SIGTERM drains (stop accepting, finish in-flight jobs until
``drain_seconds``, cancel the rest), unlinks every segment and exits 0. SIGHUP
reloads the model repository. READY=1 goes to $NOTIFY_SOCKET once the models are
loaded and the socket listens.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import logging
import os
import signal
import socket
import sys
import time
import tomllib
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from paella import rings, wire
from paella.dispatcher.devices.base import DeviceLost
from paella.dispatcher.frontend import Frontend, FrontendConfig, FrontendError, ModelTable

log = logging.getLogger("paella.daemon")


class ConfigError(ValueError):
    """A bad setting: the message names the setting and what it accepts."""


# --- configuration -------------------------------------------------------------------
@dataclass
class DaemonConfig:
    # [daemon]
    socket: str = "/run/paella/paella.sock"
    models: str = ""                    # model repository: a directory of bundles
    backend: str = "auto"               # auto | sim | cuda
    gpu: str = "t4"                     # GPU preset of the sim backend
    sim_mode: str = "stepped"           # stepped (in the loop) | process (own process)
    cpu: str = "auto"                   # core of the loop: auto (last allowed) | none | N
    rt_priority: int = 1                # SCHED_FIFO priority; 0 keeps normal scheduling
    idle: str = "adaptive"              # adaptive | spin
    idle_spin_us: int = 200             # adaptive: spin this long after the last work
    drain_seconds: float = 10.0         # SIGTERM: how long in-flight jobs may finish
    echo: bool = True                   # serve the built-in "echo" model (host)
    noop: bool = True                   # serve the built-in "noop" model (sim backend)
    log_level: str = "info"
    # [policy]
    policy: str = "paella"
    policy_params: dict[str, Any] = field(default_factory=dict)
    # [access]
    allowed_users: list[str] = field(default_factory=list)
    allowed_groups: list[str] = field(default_factory=list)
    socket_mode: int = 0o666
    # [limits]
    max_clients: int = 256
    max_inflight_per_client: int = 256
    arena_bytes: int = 16 << 20
    max_arena_bytes: int = 256 << 20
    ring_slots: int = 1024
    max_clients_per_uid: int = 64       # connections of one uid, handshaking or ready
    handshake_seconds: float = 5.0      # a connection must send HELLO within this

    def check(self) -> None:
        choices = {"backend": ("auto", "sim", "cuda"), "idle": ("adaptive", "spin"),
                   "sim_mode": ("stepped", "process"),
                   "log_level": ("debug", "info", "warning", "error")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.cpu not in ("auto", "none") and not str(self.cpu).isdigit():
            raise ConfigError(f"cpu must be auto, none or a core number, got {self.cpu!r}")
        if not 0 <= self.rt_priority <= 99:
            raise ConfigError(f"rt_priority must be 0..99, got {self.rt_priority}")
        for name in ("max_clients", "max_inflight_per_client", "arena_bytes", "max_arena_bytes",
                     "max_clients_per_uid", "handshake_seconds"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.arena_bytes > self.max_arena_bytes:
            raise ConfigError(f"arena_bytes ({self.arena_bytes}) exceeds max_arena_bytes "
                              f"({self.max_arena_bytes})")
        try:
            rings.Layout(self.ring_slots, self.ring_slots, self.arena_bytes)
        except ValueError as e:
            raise ConfigError(str(e)) from None


SECTIONS = {
    "daemon": ("socket", "models", "backend", "gpu", "sim_mode", "cpu", "rt_priority", "idle",
               "idle_spin_us", "drain_seconds", "echo", "noop", "log_level"),
    "access": ("allowed_users", "allowed_groups", "socket_mode"),
    "limits": ("max_clients", "max_inflight_per_client", "arena_bytes", "max_arena_bytes",
               "ring_slots", "max_clients_per_uid", "handshake_seconds"),
}


def load_config(path: str | None) -> DaemonConfig:
    """Read a TOML config. Unknown sections or keys are errors, not silently ignored."""
    cfg = DaemonConfig()
    if path is None:
        return cfg
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config {path} is not valid TOML: {e}") from None
    for section, table in data.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: top-level key {section!r} must be a [section]")
        if section == "policy":
            table = dict(table)
            if "name" in table:
                cfg.policy = str(table.pop("name"))
            cfg.policy_params.update(table)
            continue
        if section not in SECTIONS:
            raise ConfigError(f"{path}: unknown section [{section}] (known: daemon, policy, "
                              f"access, limits)")
        for key, value in table.items():
            if key not in SECTIONS[section]:
                raise ConfigError(f"{path}: unknown setting {key!r} in [{section}] "
                                  f"(known: {', '.join(SECTIONS[section])})")
            setattr(cfg, key, _coerce(key, value))
    return cfg


def _coerce(key: str, value: Any) -> Any:
    want = type(getattr(DaemonConfig(), key))
    if key == "socket_mode" and isinstance(value, str):
        return int(value, 8)
    if key == "cpu":
        return str(value)
    if want is float and isinstance(value, int):
        return float(value)
    if not isinstance(value, want) or (want is int and isinstance(value, bool)):
        raise ConfigError(f"setting {key} must be {want.__name__}, got {value!r}")
    return value


def _parse_param(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"policy parameter must be NAME=VALUE, got {text!r}")
    k, v = text.split("=", 1)
    try:
        return k, tomllib.loads(f"v = {v}")["v"]
    except tomllib.TOMLDecodeError:
        return k, v


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the Paella daemon",
                       description="Run the Paella daemon: control socket, per-client shared-"
                                   "memory rings, the dispatcher loop on one core.")
    p.add_argument("--config", help="TOML config file (see dist/paella.toml)")
    p.add_argument("--socket", help="control socket path")
    p.add_argument("--models", help="model repository directory (a directory of bundles)")
    p.add_argument("--backend", choices=("auto", "sim", "cuda"))
    p.add_argument("--gpu", help="GPU preset for the sim backend (e.g. t4)")
    p.add_argument("--sim-mode", dest="sim_mode", choices=("stepped", "process"),
                   help="real-time simulator stepped in the loop or in its own process")
    p.add_argument("--cpu", help="core of the dispatcher loop: auto, none or a number")
    p.add_argument("--rt-priority", type=int, dest="rt_priority",
                   help="SCHED_FIFO priority (0: normal scheduling)")
    p.add_argument("--idle", choices=("adaptive", "spin"), help="idle mode (default adaptive)")
    p.add_argument("--idle-spin-us", type=int, dest="idle_spin_us")
    p.add_argument("--drain-seconds", type=float, dest="drain_seconds")
    p.add_argument("--echo", action=argparse.BooleanOptionalAction, default=None,
                   help="serve the built-in echo model")
    p.add_argument("--noop", action=argparse.BooleanOptionalAction, default=None,
                   help="serve the built-in noop model (one trivial kernel, sim backend)")
    p.add_argument("--log-level", dest="log_level", choices=("debug", "info", "warning", "error"))
    p.add_argument("--policy", help="scheduling policy")
    p.add_argument("--policy-param", dest="policy_param", action="append", type=_parse_param,
                   default=[], metavar="NAME=VALUE", help="policy parameter (repeatable)")
    p.add_argument("--allow-user", dest="allowed_users", action="append", metavar="USER")
    p.add_argument("--allow-group", dest="allowed_groups", action="append", metavar="GROUP")
    p.add_argument("--socket-mode", dest="socket_mode", type=lambda s: int(s, 8))
    for name in SECTIONS["limits"]:
        p.add_argument("--" + name.replace("_", "-"), dest=name,
                       type=type(getattr(DaemonConfig, name)))
    p.set_defaults(func=_serve)


def config_from_args(args: argparse.Namespace) -> DaemonConfig:
    cfg = load_config(args.config)
    for f in dataclasses.fields(DaemonConfig):
        v = getattr(args, f.name, None)
        if v is not None and f.name != "policy_params":
            setattr(cfg, f.name, v)
    cfg.policy_params.update(dict(args.policy_param))
    cfg.check()
    return cfg


def _serve(args: argparse.Namespace) -> int:
    from paella.cli import CLIError
    # The CPU builds that answer for the simulator run inside the dispatcher loop: keep
    # TVM's runtime on this one thread. Its worker pool, pinned with the loop to one
    # core under SCHED_FIFO, would spin-wait on each other and stall for seconds.
    os.environ["TVM_NUM_THREADS"] = "1"
    try:
        cfg = config_from_args(args)
    except ConfigError as e:
        raise CLIError(str(e)) from None
    logging.basicConfig(level=cfg.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s paella[%(process)d] %(levelname)s %(message)s")
    try:
        return Daemon(cfg).serve()
    except (FrontendError, ConfigError) as e:
        raise CLIError(str(e)) from None


# --- models ----------------------------------------------------------------------------
@dataclass
class HostModel:
    """A model the daemon computes on its own CPU, without the device path.

    The only one is the built-in ``echo`` (output = input): a health check for the
    service path (socket, rings, validation, wake-ups) that needs no bundle and no
    GPU. It is what the front-end tests and the round-trip benchmark's baseline use.
    """
    info: wire.ModelInfo
    run: Callable[[np.ndarray], None]


ECHO_FLOATS = 256


def echo_model(model_id: int) -> HostModel:
    n = ECHO_FLOATS * 4
    x = wire.TensorInfo("x", (ECHO_FLOATS,), "float32", 0)
    y = wire.TensorInfo("y", (ECHO_FLOATS,), "float32", n)
    info = wire.ModelInfo(model_id, "echo", (wire.VariantInfo(2 * n, (x,), (y,)),))

    def run(io: np.ndarray) -> None:
        io[n:2 * n] = io[:n]
    return HostModel(info, run)


NOOP_IO = 64
NOOP_KERNEL_SECONDS = 5e-6


def noop_adaptor():
    """The built-in ``noop`` model: 64 input bytes copied to the device, one 1-block
    kernel of 5 us, no output (so the wake-up goes before its only kernel, the paper's
    pinned-output case). It is the smallest job that takes the whole device path
    (dispatcher, policy, notifQ, simulated GPU): the round-trip benchmark's model."""
    from paella.dispatcher.adaptor import PlanAdaptor, synthetic_plan
    return PlanAdaptor(synthetic_plan("noop", [("noop_kernel", 1, 32, 8, NOOP_KERNEL_SECONDS)],
                                      in_bytes=NOOP_IO))


def noop_info(model_id: int) -> wire.ModelInfo:
    x = wire.TensorInfo("x", (NOOP_IO,), "uint8", 0)
    return wire.ModelInfo(model_id, "noop", (wire.VariantInfo(NOOP_IO, (x,), ()),))


# --- execution paths -------------------------------------------------------------------
class HostExecutor:
    """Runs host models in the loop: wake-up, compute, complete, one per request."""

    def __init__(self, front: Frontend, models: dict[int, HostModel]):
        self.front = front
        self.models = models
        self.queue: deque = deque()

    def submit(self, client_id: int, req_id: int, model_id: int, variant: int,
               io: np.ndarray) -> None:
        self.queue.append((client_id, req_id, model_id, io))

    def step(self) -> bool:
        q = self.queue
        n = len(q)                     # a snapshot: work queued meanwhile waits a pass
        while n and q:                 # (cancel_client may shrink q under us)
            n -= 1
            cid, rid, mid, io = q.popleft()
            self.front.almost_finished(cid, rid)
            try:
                self.models[mid].run(io)
            except Exception as e:  # noqa: BLE001 - a model failure fails its request only
                log.exception("host model %d failed on request %d of client %d", mid, rid, cid)
                self.front.complete(cid, rid, rings.E_FAILED, f"{type(e).__name__}: {e}")
                continue
            self.front.complete(cid, rid, rings.OK, None)
        return bool(q)

    def cancel_client(self, client_id: int) -> None:
        gone = [x for x in self.queue if x[0] == client_id]
        if not gone:
            return
        keep = [x for x in self.queue if x[0] != client_id]
        self.queue.clear()             # in place: step() holds a reference
        self.queue.extend(keep)
        for cid, rid, _, _ in gone:
            self.front.complete(cid, rid, rings.E_CANCELLED, "client disconnected")

    def cancel_all(self, reason: str) -> None:
        while self.queue:
            cid, rid, _, _ = self.queue.popleft()
            self.front.complete(cid, rid, rings.E_CANCELLED, reason)

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

    def submit(self, client_id: int, req_id: int, model_id: int, variant: int,
               io: np.ndarray) -> None:
        self.by_model[model_id].submit(client_id, req_id, model_id, variant, io)

    def step(self) -> bool:
        busy = False
        for p in self.paths:
            busy |= p.step()
        return busy

    def cancel_client(self, client_id: int) -> None:
        for p in self.paths:
            p.cancel_client(client_id)

    def cancel_all(self, reason: str) -> None:
        for p in self.paths:
            p.cancel_all(reason)

    def deadline(self) -> float | None:
        ds = [d for d in (p.deadline() for p in self.paths) if d is not None]
        return min(ds) if ds else None

    @property
    def in_flight(self) -> int:
        return sum(p.in_flight for p in self.paths)


# --- bundles on the dispatcher ---------------------------------------------------------
def model_info_from_bundle(model_id: int, bundle) -> wire.ModelInfo:
    """The client-facing description of a loaded bundle."""
    def tensors(ts) -> tuple[wire.TensorInfo, ...]:
        return tuple(wire.TensorInfo(t.name, tuple(t.shape), t.dtype, t.offset) for t in ts)
    # Only variant 0 is served for now: the functional adaptor runs that one, so
    # announcing the others would accept requests it would answer wrongly.
    return wire.ModelInfo(model_id, bundle.model, tuple(
        wire.VariantInfo(v.io_bytes, tensors(v.inputs), tensors(v.outputs))
        for v in bundle.variants[:1]))


class FunctionalCache:
    """Reference outputs by (model, input digest), least recently used first out.

    The CPU build is slow (about 1 s for MobileNetV2, 4 s for ResNet-18 on these
    machines) and runs in the dispatcher loop, so an input the daemon has already
    answered is answered again from here: only a first-seen input stalls the loop, and
    the log says so. Bounded by ``max_bytes`` of outputs.
    """

    def __init__(self, max_bytes: int = 256 << 20):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[str, bytes], dict[str, np.ndarray]] = OrderedDict()
        self._bytes = 0
        self.hits = self.misses = 0

    def outputs(self, name: str, bundle, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        # A private copy first: the inputs are views of a client's arena, which it may
        # rewrite at any moment; hashing one content and computing another would cache
        # wrong outputs under a digest that another client's request can match.
        inputs = {k: np.array(v) for k, v in inputs.items()}
        h = hashlib.blake2b(digest_size=16)
        for k in sorted(inputs):
            h.update(np.ascontiguousarray(inputs[k]).view(np.uint8).data)
        key = (name, h.digest())
        hit = self._entries.get(key)
        if hit is not None:
            self.hits += 1
            self._entries.move_to_end(key)
            return hit
        self.misses += 1
        t0 = time.perf_counter()
        outs = {k: np.array(v) for k, v in bundle.run_cpu(inputs).items()}
        log.info("model %s: computed reference outputs for a new input on the CPU in %.0f ms "
                 "(the dispatcher loop waited; repeated inputs are answered from the cache)",
                 name, (time.perf_counter() - t0) * 1e3)
        size = sum(v.nbytes for v in outs.values())
        if size <= self.max_bytes:
            self._entries[key] = outs
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, old = self._entries.popitem(last=False)
                self._bytes -= sum(v.nbytes for v in old.values())
        return outs


def functional_adaptor(bundle, name: str, cache: FunctionalCache | None = None):
    """Sim backend: the plan's timing on the simulated GPU, the CPU build's answers.

    The simulated kernels compute nothing, so the outputs come from the bundle's CPU
    (llvm) build, through ``cache``: computed from the request's inputs when the job
    starts (before any copy can touch the io region) and written into the client's
    arena after the job's final synchronize, i.e. once its D2H copy completed and before
    the completion is pushed.
    """
    from paella.dispatcher.adaptor import PlanAdaptor, plan_from_bundle

    v = bundle.variants[0]
    cache = cache or FunctionalCache()

    class FunctionalBundleAdaptor(PlanAdaptor):
        def run(self, io: np.ndarray) -> None:
            inputs = {t.name: io[t.offset:t.offset + t.nbytes].view(t.dtype).reshape(t.shape)
                      for t in v.inputs}
            outs = cache.outputs(name, bundle, inputs)
            super().run(io)
            for t in v.outputs:
                io[t.offset:t.offset + t.nbytes] = np.ascontiguousarray(
                    outs[t.name], dtype=t.dtype).view(np.uint8).reshape(-1)

    return FunctionalBundleAdaptor(plan_from_bundle(bundle, 0, name=name))


def bundle_adaptor(bundle, name: str, device, cache: FunctionalCache | None = None):
    """The adaptor serving ``bundle`` (variant 0) on ``device``.

    Every backend gets the same plan with real device memory (params uploaded once,
    per-request buffer sets, bound kernel arguments: see ``paella.dispatcher.adaptor``).
    On the simulator, whose kernels compute nothing, the outputs come from the CPU build
    (:func:`functional_adaptor`); on a real GPU the kernels compute them, and the plain
    adaptor keeps the dispatcher's plan-template fast path (no greenlet per request).
    """
    if device.backend == "sim":
        return functional_adaptor(bundle, name, cache)
    from paella.dispatcher.adaptor import PlanAdaptor
    return PlanAdaptor.from_bundle(bundle, name=name)


class DispatcherExecutor:
    """The Dispatcher (issue 4) on a device: the execution path of bundle models."""

    #: Spin instead of sleeping when the next device event is this close (seconds).
    SPIN_BELOW = 50e-6

    def __init__(self, front: Frontend, device, cfg: DaemonConfig):
        from paella.dispatcher.core import (STATUS_CANCELLED, STATUS_ERROR, STATUS_OK,
                                            Dispatcher, Request)
        params = dict(cfg.policy_params)
        extra = params.pop("extra_blocks", None)
        fair = params.pop("fairness_threshold", None)
        self.front = front
        self.device = device
        self.disp = Dispatcher(device, cfg.policy, extra_blocks=extra, fairness_threshold=fair,
                               policy_options=params or None)
        self.Request = Request
        self.status = {STATUS_OK: rings.OK, STATUS_ERROR: rings.E_FAILED,
                       STATUS_CANCELLED: rings.E_CANCELLED}
        self.ids: dict[int, int] = {}     # client-visible model id -> dispatcher model id
        self._failing: str | None = None  # the reason while cancel_all fails everything
        self._next_event = getattr(device, "next_event_time", None)

    def register(self, model_id: int, name: str, adaptor) -> None:
        self.ids[model_id] = self.disp.register_model(name, adaptor)

    def submit(self, client_id: int, req_id: int, model_id: int, variant: int,
               io: np.ndarray) -> None:
        self.disp.submit(self.Request(req_id, client_id, self.ids[model_id], io, variant,
                                      self._almost, self._done))

    def _almost(self, req) -> None:
        self.front.almost_finished(req.client_id, req.req_id)

    def _done(self, req, status: int, error: str | None) -> None:
        req.io = None   # its job may linger in a policy's lazy heap; the client's memory may not
        code = self.status.get(status, rings.E_INTERNAL)
        if self._failing is not None and code == rings.E_CANCELLED:
            code, error = rings.E_FAILED, self._failing      # cancel_all(reason): say why
        self.front.complete(req.client_id, req.req_id, code, error)

    def step(self) -> bool:
        return self.disp.step()

    def cancel_client(self, client_id: int) -> None:
        self.disp.cancel_client(client_id)

    def cancel_all(self, reason: str) -> None:
        self._failing = reason
        try:
            for cid in {j.client_id for j in self.disp.jobs}:
                self.disp.cancel_client(cid)
        finally:
            self._failing = None

    def deadline(self) -> float | None:
        """Seconds the loop may sleep: None when idle, 0 when work is runnable now."""
        if self.disp.in_flight == 0:
            return None
        if not self.disp.idle or self._next_event is None:
            return 0.0
        wait = (self._next_event() - self.device.now()) / getattr(self.device, "speed", 1.0)
        return 0.0 if wait < self.SPIN_BELOW else min(wait, 0.1)

    @property
    def in_flight(self) -> int:
        return self.disp.in_flight


# --- process setup ---------------------------------------------------------------------
def freeze_heap() -> int:
    """Put what start-up loaded (TVM, the bundles, the models: ~100k objects) out of the
    cyclic collector's reach, after collecting what is already garbage. A full collection
    over that heap takes ~50 ms here, a stall every request in flight would pay whenever
    the loop's own allocations trigger one; frozen, the collector only walks what the
    loop allocated since. A reload unfreezes first, so the models it drops can still be
    collected. Returns the objects frozen."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def sd_notify(message: str) -> bool:
    """Send one sd_notify datagram to $NOTIFY_SOCKET; False when not under systemd."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr[0] == "@":
        addr = "\0" + addr[1:]      # abstract namespace
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall(message.encode())
    except OSError as e:
        # The service manager went away; serving clients matters more than telling it.
        log.warning("sd_notify %r to %s failed: %s", message.split("\n")[0], addr, e)
        return False
    return True


def pin_and_prioritize(cpu: str, rt_priority: int) -> None:
    """Pin the loop to its core and ask for SCHED_FIFO; say what was granted."""
    if cpu != "none":
        allowed = sorted(os.sched_getaffinity(0))
        core = allowed[-1] if cpu == "auto" else int(cpu)
        if core not in allowed:
            raise ConfigError(f"cpu {core} is not among this process's cores {allowed}")
        os.sched_setaffinity(0, {core})
        log.info("dispatcher loop pinned to core %d (of %s)", core, allowed)
    else:
        log.info("dispatcher loop not pinned (cpu = none)")
    if rt_priority <= 0:
        log.info("real-time priority off (rt_priority = 0): normal scheduling")
        return
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(rt_priority))
        log.info("running SCHED_FIFO priority %d", rt_priority)
    except PermissionError:
        log.warning("SCHED_FIFO priority %d not permitted (needs CAP_SYS_NICE or "
                    "LimitRTPRIO); running with normal scheduling", rt_priority)


def open_device_for(cfg: DaemonConfig):
    """The device of the dispatcher path. ``auto`` says in the log which it chose."""
    from paella.dispatcher.devices import NoDriverError, open_device, pick_backend
    backend = cfg.backend
    if backend == "auto":
        backend, reason = pick_backend()
        log.info("backend auto: %s (%s)", backend, reason)
    if backend == "cuda":
        try:
            dev = open_device("cuda")
        except NoDriverError as e:
            raise ConfigError(str(e)) from None
        log.info("cuda device %d: %s (%s), %d SMs", dev.ordinal, dev.props.name, dev.props.sm_name,
                 dev.props.sm_count)
        return dev
    if cfg.sim_mode == "process":
        from paella.dispatcher.devices.sim import SimProcessDevice
        log.info("simulated GPU %s in a process of its own (real time)", cfg.gpu)
        return SimProcessDevice(cfg.gpu)
    lose_after = os.environ.get("PAELLA_SIM_LOSE_DEVICE_AFTER")
    if lose_after is not None:
        log.warning("fault injection: the simulated GPU is lost after %s launches "
                    "(PAELLA_SIM_LOSE_DEVICE_AFTER)", lose_after)
    try:
        dev = open_device("sim", gpu=cfg.gpu, realtime=True,
                          lose_after=int(lose_after) if lose_after is not None else None)
    except (NoDriverError, ValueError) as e:
        raise ConfigError(str(e)) from None
    log.info("simulated GPU %s stepped from the dispatcher loop (real time)", cfg.gpu)
    return dev


# --- the daemon ------------------------------------------------------------------------
#: Exit status after a lost device (sticky GPU error): the unit restarts the daemon.
EXIT_DEVICE_LOST = 3


class Daemon:
    def __init__(self, cfg: DaemonConfig):
        self.cfg = cfg
        self.table = ModelTable()
        fcfg = FrontendConfig(
            socket_path=cfg.socket, allowed_users=tuple(cfg.allowed_users),
            allowed_groups=tuple(cfg.allowed_groups), socket_mode=cfg.socket_mode,
            layout=rings.Layout(cfg.ring_slots, cfg.ring_slots, cfg.arena_bytes),
            max_arena_bytes=cfg.max_arena_bytes, max_clients=cfg.max_clients,
            max_inflight_per_client=cfg.max_inflight_per_client,
            max_clients_per_uid=cfg.max_clients_per_uid, handshake_seconds=cfg.handshake_seconds)
        self.front = Frontend(fcfg, self.table)
        self.router = Router()
        self.host = HostExecutor(self.front, {})
        self.router.paths.append(self.host)
        self.front.executor = self.router
        self.front.on_arena_mapped = self._arena_mapped
        self.front.on_arena_released = self._arena_released
        self._arenas: dict[int, np.ndarray] = {}     # client id -> arena, while mapped
        self._pinned: set[int] = set()               # clients whose arena is page-locked
        self.dispatcher: DispatcherExecutor | None = None
        self.device = None
        self._bundle_keys: dict[str, tuple] = {}
        self._generation = 0
        self._functional = FunctionalCache()
        self.draining = False        # SIGTERM seen (set by the handler)
        self.admitting = True        # cleared by the loop once the final sweep is done
        self.drain_deadline = 0.0
        self.reload_requested = False
        self._sig_r, self._sig_w = os.pipe()

    # -- models ----------------------------------------------------------------------
    def load_models(self) -> None:
        """(Re)load the repository; requests already running keep their model."""
        host: dict[int, HostModel] = {}
        if self.cfg.echo:
            m = echo_model(self.table.id_for("echo"))
            host[m.info.model_id] = m
        bundles = self._load_repository(self.cfg.models) if self.cfg.models else []
        if self.cfg.noop:
            noop = self._load_noop()
            if noop is not None:
                bundles.append(noop)
        self.host.models = host
        for mid in host:
            self.router.by_model[mid] = self.host
        self.table.replace([m.info for m in host.values()] + bundles)
        log.info("serving %d model(s): %s", len(self.table.by_id),
                 ", ".join(m.name for m in self.table.by_id.values()) or "none")

    def _load_repository(self, path: str) -> list[wire.ModelInfo]:
        """Every bundle under ``path``; new or changed ones are registered with the
        dispatcher (which profiles them), unchanged ones are kept as they are."""
        from paella.bundle import BundleError, load_bundle
        if not os.path.isdir(path):
            raise ConfigError(f"model repository {path} is not a directory")
        found = []
        for d in sorted(os.listdir(path)):
            bdir = os.path.join(path, d)
            if not os.path.isfile(os.path.join(bdir, "manifest.json")):
                continue
            try:
                bundle = load_bundle(bdir)
            except BundleError as e:
                raise ConfigError(f"cannot load bundle {bdir}: {e}") from None
            found.append(bundle)
        infos = []
        for bundle in found:
            key = (bundle.manifest.cache_key, os.path.getmtime(bundle.path / "manifest.json"))
            mid = self.table.id_for(bundle.model)
            if self._bundle_keys.get(bundle.model) != key:
                self._register_bundle(mid, bundle)
                self._bundle_keys[bundle.model] = key
            infos.append(model_info_from_bundle(mid, bundle))
        return infos

    def _load_noop(self) -> wire.ModelInfo | None:
        mid = self.table.id_for("noop")
        if "noop" not in self._bundle_keys:
            ex = self._dispatcher()
            if self.device.backend != "sim":
                log.info("built-in model noop not served: its kernel exists only on the "
                         "simulated GPU (--backend sim)")
                return None
            ex.register(mid, "noop", noop_adaptor())
            self.router.by_model[mid] = ex
            self._bundle_keys["noop"] = ()
        return noop_info(mid)

    def _register_bundle(self, model_id: int, bundle) -> None:
        ex = self._dispatcher()
        gen = self._generation = self._generation + 1
        name = f"{bundle.model}#{gen}"     # a changed bundle registers anew
        t0 = time.monotonic()
        try:
            ex.register(model_id, name, bundle_adaptor(bundle, name, self.device, self._functional))
        except (ValueError, RuntimeError) as e:
            raise ConfigError(f"bundle {bundle.path} cannot be served: {e}") from None
        self.router.by_model[model_id] = ex
        log.info("registered %s (%d variant(s), %d io bytes) in %.2f s", bundle.model,
                 len(bundle.variants), bundle.io_bytes, time.monotonic() - t0)

    def _dispatcher(self) -> DispatcherExecutor:
        """The dispatcher path, made on first need (no bundles: no device opened)."""
        if self.dispatcher is None:
            self.device = open_device_for(self.cfg)
            self.dispatcher = DispatcherExecutor(self.front, self.device, self.cfg)
            self.router.paths.append(self.dispatcher)
            for cid, arena in self._arenas.items():     # clients that came first
                self._pin_arena(cid, arena)
        return self.dispatcher

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
        os.set_blocking(self._sig_w, False)
        os.set_blocking(self._sig_r, False)
        signal.set_wakeup_fd(self._sig_w, warn_on_full_buffer=False)
        signal.signal(signal.SIGTERM, self._on_term)
        signal.signal(signal.SIGINT, self._on_term)
        signal.signal(signal.SIGHUP, self._on_hup)
        self.front.watch(self._sig_r, self._drain_sigpipe)

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
        self.reload_requested = True

    # -- lifecycle -------------------------------------------------------------------
    def serve(self) -> int:
        """Start, run the loop until drained, clean up. Returns the exit status."""
        self.front.listen()          # raises FrontendError if another daemon holds it
        try:
            self.load_models()
            log.info("froze %d start-up objects out of the garbage collector's way", freeze_heap())
            pin_and_prioritize(self.cfg.cpu, self.cfg.rt_priority)
            self._install_signals()
            log.info("listening on %s (idle mode %s)", self.cfg.socket, self.cfg.idle)
            sd_notify(f"READY=1\nSTATUS=serving {len(self.table.by_id)} models\n"
                      f"MAINPID={os.getpid()}")
            try:
                self.run()
            except DeviceLost as e:
                return self._device_lost(e)
        finally:
            self.front.close()
            if self.device is not None:
                self.device.close()
            os.close(self._sig_r)
            os.close(self._sig_w)
        log.info("stopped cleanly; stats %s", self.front.stats)
        return 0

    def _device_lost(self, exc: DeviceLost) -> int:
        """The GPU can run nothing more: fail every in-flight request with the reason,
        tell the clients, and exit non-zero so that the service manager restarts us."""
        n = self.router.in_flight
        log.critical("the device is lost (%s): failing %d in-flight request(s) and exiting with "
                     "status %d so that the service manager restarts the daemon", exc, n,
                     EXIT_DEVICE_LOST)
        sd_notify(f"STATUS=device lost: {exc}")
        self.router.cancel_all(f"the GPU failed ({exc}); the daemon is restarting")
        self.front.poll_io(0)                 # deliver the completions' wake-ups
        return EXIT_DEVICE_LOST

    def run(self) -> None:
        """The dispatcher loop. This while loop right here is the daemon.

        Timeout rule (adaptive mode): spin while anything can run now; with work in
        flight that only waits for the device, sleep until the device's next event;
        with nothing in flight, spin ``idle_spin_us`` more, then sleep until a client
        or a signal speaks. Every sleep is preceded by raising the clients' "sleeping"
        flag and re-checking the rings, so a push that raced the flag is not missed.
        """
        front, router, cfg = self.front, self.router, self.cfg
        idle_spin = cfg.idle_spin_us / 1e6
        adaptive = cfg.idle == "adaptive"
        last_work = time.monotonic()
        while True:
            taken = front.poll_rings(admit=self.admitting)
            router.step()
            front.poll_io(0)
            if self.reload_requested:
                self._reload()
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
            log.warning("drain deadline passed: cancelling %d request(s)", self.router.in_flight)
            self.router.cancel_all("the daemon stopped before the job finished")
            return True
        return False

    def _reload(self) -> None:
        self.reload_requested = False
        sd_notify("RELOADING=1")
        try:
            self.load_models()
        except ConfigError as e:
            log.error("SIGHUP reload failed, keeping the previous models: %s", e)
        freeze_heap()                # (the dropped models' cycles are collected first)
        sd_notify("READY=1")


def main(argv: list[str] | None = None) -> int:
    """``python -m paella.dispatcher.daemon [serve options]``: the daemon alone, without
    loading the other sub-commands of ``paella`` (what the tests and the unit run)."""
    from paella.cli import run_command
    parser = argparse.ArgumentParser(prog="paella-daemon")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    register(sub)
    return run_command(parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    sys.exit(main())
