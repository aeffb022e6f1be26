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
the command line; a bad setting is refused before anything starts, naming the setting
and what it accepts (``paella: error: ...``, exit 2).

Lifecycle. The signal handlers are installed first, so a signal during model loading
is handled: SIGTERM ends start-up cleanly (exit 0, nothing left behind), a SIGHUP is
remembered and the repository read again once serving. At start-up the daemon removes
the shared-memory segments that dead daemons left (:mod:`paella.segments`). A bad
bundle is logged and skipped; the others are served. SIGTERM drains (stop accepting,
finish in-flight jobs until ``drain_seconds``, then complete the rest as cancelled),
unlinks every segment and exits 0. SIGHUP reloads the model repository in a background
thread and swaps the new models in between two iterations of the loop
(:mod:`paella.dispatcher.repository`). READY=1 goes to $NOTIFY_SOCKET once the models
are loaded and the socket listens.
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
import threading
import time
import tomllib
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from paella import rings, segments, wire
from paella.dispatcher import repository
from paella.dispatcher.devices.base import DeviceLost
from paella.dispatcher.frontend import Frontend, FrontendConfig, FrontendError, ModelTable
from paella.dispatcher.policies import PolicyError, check_options

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
        if not self.drain_seconds >= 0:                   # (also refuses nan)
            raise ConfigError(f"drain_seconds must be >= 0 (seconds in-flight jobs get to "
                              f"finish after SIGTERM), got {self.drain_seconds}")
        if self.idle_spin_us < 0:
            raise ConfigError(f"idle_spin_us must be >= 0 (microseconds), got {self.idle_spin_us}")
        if not 0 <= self.socket_mode <= 0o777:
            raise ConfigError(f"socket_mode must be a file mode 0000..0777, got {self.socket_mode:#o}")
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
        self.check_policy()

    def check_policy(self) -> None:
        """The policy exists and takes these parameters, of these types (the policy's
        own checks of the values run when the dispatcher builds it)."""
        try:
            check_options(self.policy, self.policy_params, {"extra_blocks": int})
        except PolicyError as e:
            raise ConfigError(str(e)) from None
        extra = self.policy_params.get("extra_blocks")
        if extra is not None and extra < 0:
            raise ConfigError(f"policy parameter extra_blocks must be >= 0, got {extra}")


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
                cfg.policy = table.pop("name")
                if not isinstance(cfg.policy, str):
                    raise ConfigError(f"{path}: [policy] name must be a string, got {cfg.policy!r}")
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


def octal_mode(text: str) -> int:
    """A file mode written in octal ("0660", "660")."""
    try:
        mode = int(text, 8)
    except ValueError:
        mode = -1
    if not 0 <= mode <= 0o777:
        raise ValueError(f"socket_mode must be an octal file mode such as \"0660\", got {text!r}")
    return mode


def _coerce(key: str, value: Any) -> Any:
    want = type(getattr(DaemonConfig(), key))
    if key == "socket_mode" and isinstance(value, str):
        try:
            return octal_mode(value)
        except ValueError as e:
            raise ConfigError(str(e)) from None
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
    p.add_argument("--socket-mode", dest="socket_mode",
                   help="mode of the socket file, octal (default 0666)")
    for name in SECTIONS["limits"]:
        p.add_argument("--" + name.replace("_", "-"), dest=name,
                       type=type(getattr(DaemonConfig, name)))
    p.set_defaults(func=_serve)


def config_from_args(args: argparse.Namespace) -> DaemonConfig:
    cfg = load_config(args.config)
    for f in dataclasses.fields(DaemonConfig):
        v = getattr(args, f.name, None)
        if v is not None and f.name != "policy_params":
            setattr(cfg, f.name, _coerce(f.name, v) if f.name == "socket_mode" else v)
    cfg.policy_params.update(dict(args.policy_param))
    cfg.check()
    return cfg


def _serve(args: argparse.Namespace) -> int:
    from paella.cli import CLIError
    # The CPU builds that answer for the simulator run inside the dispatcher loop: keep
    # TVM's runtime on this one thread. Its worker pool, pinned with the loop to one
    # core under SCHED_FIFO, would spin-wait on each other and stall for seconds.
    os.environ["TVM_NUM_THREADS"] = "1"
    # Logging first: checking the configuration loads the policy plug-ins, which may log.
    logging.basicConfig(level=(args.log_level or "info").upper(), stream=sys.stderr,
                        format="%(asctime)s paella[%(process)d] %(levelname)s %(message)s")
    try:
        cfg = config_from_args(args)
    except ConfigError as e:
        raise CLIError(str(e)) from None
    logging.getLogger().setLevel(cfg.log_level.upper())
    try:
        return Daemon(cfg, instruments=getattr(args, "instruments", ()),
                      open_device=getattr(args, "open_device", None)).serve()
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

    def __init__(self, front: Frontend, models: dict[int, HostModel], instruments: Any = None):
        from paella.dispatcher.instruments import Instruments
        self.front = front
        self.models = models
        self.queue: deque = deque()
        # The dispatcher's hooks on requests, fired for host models too.
        self.instruments = Instruments() if instruments is None else instruments

    def _hook(self, hook: str, cid: int, rid: int, mid: int, io: np.ndarray,
              status: int = -1) -> None:
        from paella.dispatcher.core import Request
        req = Request(rid, cid, mid, io)
        req.status = status
        self.instruments.call(hook, req)

    def submit(self, client_id: int, req_id: int, model_id: int, variant: int,
               io: np.ndarray) -> None:
        self.queue.append((client_id, req_id, model_id, io))
        if "request_admitted" in self.instruments:
            self._hook("request_admitted", client_id, req_id, model_id, io)

    def step(self) -> bool:
        q = self.queue
        n = len(q)                     # a snapshot: work queued meanwhile waits a pass
        instr = self.instruments
        while n and q:                 # (cancel_client may shrink q under us)
            n -= 1
            cid, rid, mid, io = q.popleft()
            self.front.almost_finished(cid, rid)
            if "request_woken" in instr:
                self._hook("request_woken", cid, rid, mid, io)
            try:
                self.models[mid].run(io)
            except Exception as e:  # noqa: BLE001 - a model failure fails its request only
                log.exception("host model %d failed on request %d of client %d", mid, rid, cid)
                self.front.complete(cid, rid, rings.E_FAILED, f"{type(e).__name__}: {e}")
                status = rings.E_FAILED
            else:
                self.front.complete(cid, rid, rings.OK, None)
                status = rings.OK
            if "request_finished" in instr:
                self._hook("request_finished", cid, rid, mid, io, status)
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

    def abandon_all(self, reason: str, status: int = rings.E_CANCELLED) -> None:
        while self.queue:
            cid, rid, _, _ = self.queue.popleft()
            self.front.complete(cid, rid, status, reason)

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
        # The loop and a background model load (the profiling input's outputs) share the
        # cache. The lock covers the dictionary only, never a CPU run, so the loop waits
        # for no computation but its own.
        self._lock = threading.Lock()

    def outputs(self, name: str, bundle, inputs: dict[str, np.ndarray],
                where: str = "the dispatcher loop waited") -> dict[str, np.ndarray]:
        # A private copy first: the inputs are views of a client's arena, which it may
        # rewrite at any moment; hashing one content and computing another would cache
        # wrong outputs under a digest that another client's request can match.
        inputs = {k: np.array(v) for k, v in inputs.items()}
        h = hashlib.blake2b(digest_size=16)
        for k in sorted(inputs):
            h.update(np.ascontiguousarray(inputs[k]).view(np.uint8).data)
        key = (name, h.digest())
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self.hits += 1
                self._entries.move_to_end(key)
                return hit
            self.misses += 1
        t0 = time.perf_counter()
        outs = {k: np.array(v) for k, v in bundle.run_cpu(inputs).items()}
        log.info("model %s: computed reference outputs for a new input on the CPU in %.0f ms "
                 "(%s; repeated inputs are answered from the cache)",
                 name, (time.perf_counter() - t0) * 1e3, where)
        size = sum(v.nbytes for v in outs.values())
        with self._lock:
            if size <= self.max_bytes and key not in self._entries:
                self._entries[key] = outs
                self._bytes += size
                while self._bytes > self.max_bytes:
                    _, old = self._entries.popitem(last=False)
                    self._bytes -= sum(v.nbytes for v in old.values())
        return outs


def functional_adaptor(bundle, name: str, cache: FunctionalCache | None = None):
    """Sim backend: the plan's timing on the simulated GPU, the CPU build's answers.

    The simulated kernels compute nothing, so the plan's last kernel carries the CPU
    build as its functional effect (:mod:`paella.dispatcher.devices.sim.functional`): when
    it completes, the simulated device reads the request's inputs from the device buffers
    the H2D copies filled, computes the outputs through ``cache`` and writes them into the
    output buffers, which the plan's D2H copies then bring back. The dispatcher replays
    the plan as on any backend (the path the benchmarks measure).
    """
    from paella.dispatcher.adaptor import BufferArg, PlanAdaptor, plan_from_bundle
    from paella.dispatcher.devices.sim.functional import model_effect

    v = bundle.variants[0]
    cache = cache or FunctionalCache()
    plan = plan_from_bundle(bundle, 0, name=name)
    last = [op for op in plan.ops if op.kind == "launch"][-1]
    effect = model_effect(v.inputs, v.outputs, lambda x: cache.outputs(name, bundle, x),
                          len(last.args))
    operands = [BufferArg(str(t.buffer), t.buffer_offset) for t in (*v.inputs, *v.outputs)]

    class FunctionalBundleAdaptor(PlanAdaptor):
        """The plan with the CPU build as its last kernel's effect (replayed like any plan)."""

        def warm(self) -> None:
            """Off the loop, before registration: load the CPU build and answer the
            profiling runs' input (zeros), so that registering costs the loop no CPU run."""
            zeros = np.zeros(self.io_bytes, np.uint8)
            cache.outputs(name, bundle, {t.name: zeros[t.offset:t.offset + t.nbytes].view(
                t.dtype).reshape(t.shape) for t in v.inputs},
                where="while loading, off the dispatcher loop")

    return FunctionalBundleAdaptor(plan.with_effect(effect, operands))


def bundle_adaptor(bundle, name: str, device, cache: FunctionalCache | None = None):
    """The adaptor serving ``bundle`` (variant 0) on ``device``.

    Every backend gets the same plan with real device memory (params uploaded once,
    per-request buffer sets, bound kernel arguments: see ``paella.dispatcher.adaptor``),
    replayed by the dispatcher. On the simulator, whose kernels compute nothing, the
    plan's last kernel carries the CPU build's outputs as its effect
    (:func:`functional_adaptor`); on a real GPU the kernels compute them.
    """
    if device.backend == "sim":
        return functional_adaptor(bundle, name, cache)
    from paella.dispatcher.adaptor import PlanAdaptor
    return PlanAdaptor.from_bundle(bundle, name=name)


class DispatcherExecutor:
    """The Dispatcher (issue 4) on a device: the execution path of bundle models."""

    #: Spin instead of sleeping when the next device event is this close (seconds).
    SPIN_BELOW = 50e-6

    def __init__(self, front: Frontend, device, cfg: DaemonConfig, instruments: Any = ()):
        from paella.dispatcher.core import (STATUS_CANCELLED, STATUS_ERROR, STATUS_OK,
                                            Dispatcher, Request)
        params = dict(cfg.policy_params)
        extra = params.pop("extra_blocks", None)
        fair = params.pop("fairness_threshold", None)
        self.front = front
        self.device = device
        try:
            self.disp = Dispatcher(device, cfg.policy, extra_blocks=extra,
                                   fairness_threshold=fair, policy_options=params or None,
                                   instruments=instruments)
        except PolicyError as e:           # the policy refused its parameters
            raise ConfigError(str(e)) from None
        except Exception as e:  # noqa: BLE001 - a plug-in's __init__ may raise anything
            # Start-up refuses (nothing is served yet, so nothing is lost, and the
            # operator sees the cause at once); mid-service a failing policy falls back.
            raise ConfigError(f"scheduling policy {cfg.policy!r} failed to start: "
                              f"{type(e).__name__}: {e}; fix the plug-in or choose another "
                              f"policy (--policy, [policy] name)") from None
        self.Request = Request
        self.status = {STATUS_OK: rings.OK, STATUS_ERROR: rings.E_FAILED,
                       STATUS_CANCELLED: rings.E_CANCELLED}
        self._cancelled = STATUS_CANCELLED
        self.ids: dict[int, int] = {}     # client-visible model id -> dispatcher model id
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
        self.front.complete(req.client_id, req.req_id, self.status.get(status, rings.E_INTERNAL),
                            error)

    def step(self) -> bool:
        return self.disp.step()

    def cancel_client(self, client_id: int) -> None:
        self.disp.cancel_client(client_id)

    def abandon_all(self, reason: str, status: int = rings.E_CANCELLED) -> None:
        key = self._cancelled
        self.status[key] = status                    # a lost device fails them: E_FAILED
        try:
            self.disp.abandon_all(reason)
        finally:
            self.status[key] = rings.E_CANCELLED

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
    loop allocated since. It unfreezes first, so that cycles frozen earlier and dropped
    since can be collected. Returns the objects frozen."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def freeze_new_objects() -> int:
    """After a reload: collect and freeze only what was allocated since the last freeze
    (the new models, the loop's own objects). Unfreezing first, as :func:`freeze_heap`
    does, would walk the whole ~100k-object heap (46-124 ms of stalled loop measured
    after a reload) to free nothing: the dispatcher keeps every registered version of a
    model (jobs may still run the old one), so a reload drops no model. Returns the
    garbage objects collected. (Not ``gc.get_freeze_count()``: it walks the frozen
    heap, 8-12 ms.)"""
    n = gc.collect()
    gc.freeze()
    return n


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


class StartupInterrupted(Exception):
    """SIGTERM arrived while the daemon was starting: stop before serving."""


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
        self.open_device = open_device or open_device_for
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
        self.host = HostExecutor(self.front, {}, Instruments(self.instruments))
        self.router.paths.append(self.host)
        self.front.executor = self.router
        self.front.on_arena_mapped = self._arena_mapped
        self.front.on_arena_released = self._arena_released
        self._arenas: dict[int, np.ndarray] = {}     # client id -> arena, while mapped
        self._pinned: set[int] = set()               # clients whose arena is page-locked
        self.dispatcher: DispatcherExecutor | None = None
        self.device = None
        self._builtins: list[wire.ModelInfo] = []    # echo, noop
        self._served: dict[str, ServedBundle] = {}   # bundle models by name
        #: Bundles not served at the last load, directory -> why (the log says it too).
        self.unserved: dict[str, str] = {}
        self._functional = FunctionalCache()
        self._loader: repository.BackgroundScan | None = None
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
                import tvm.relax  # noqa: F401 - now, not in a reload's thread: importing
                #                   TVM holds the GIL for ~0.5 s, a stall of the loop
            scan = repository.scan(self.cfg.models, {}, self._make_adaptor,
                                   stop=lambda: self.draining)
            if scan.interrupted or self.draining:
                raise StartupInterrupted()
        self._swap(scan)
        if scan is not None and scan.found and not self._served:
            raise ConfigError(f"no bundle of the model repository {self.cfg.models} can be "
                              f"served: " + "; ".join(f"{d}: {why}" for d, why in
                                                      sorted(self.unserved.items())))

    def _make_adaptor(self, bundle, label: str):
        return bundle_adaptor(bundle, label, self.device, self._functional)

    def _swap(self, scan: repository.Scan | None) -> None:
        """Register what ``scan`` prepared and replace the model table. The loop calls
        it between two iterations, so a client sees the old models or the new ones;
        requests already running keep the version they started with."""
        if scan is not None:
            failed = dict(scan.failed)
            ex = self._dispatcher() if scan.prepared else None
            for p in scan.prepared:
                mid = self.table.id_for(p.model)
                t0 = time.monotonic()
                try:
                    ex.register(mid, p.label, p.adaptor)        # init + profiling runs
                except DeviceLost:
                    raise
                except Exception as e:  # noqa: BLE001 - this bundle only
                    failed[p.directory] = f"cannot be served: {type(e).__name__}: {e}"
                    continue
                self.router.by_model[mid] = ex
                self._served[p.model] = ServedBundle(p.directory, p.key,
                                                     model_info_from_bundle(mid, p.bundle))
                log.info("registered %s (%d variant(s), %d io bytes): read in %.2f s, "
                         "registered in %.3f s", p.model, len(p.bundle.variants),
                         p.bundle.io_bytes, p.seconds, time.monotonic() - t0)
            for d, model in scan.kept.items():
                self._served[model].directory = d
            current = ({p.directory for p in scan.prepared} | set(scan.kept) | set(failed))
            for model, sb in list(self._served.items()):
                if sb.directory not in current:
                    del self._served[model]          # its directory is gone
            for d, why in sorted(failed.items()):
                old = next((m for m, sb in self._served.items() if sb.directory == d), None)
                log.error("bundle %s not served: %s%s", d, why,
                          f" (still serving the previous version of {old})" if old else "")
            self.unserved = failed
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
        ex.register(mid, "noop", noop_adaptor())
        self.router.by_model[mid] = ex
        return noop_info(mid)

    def _dispatcher(self) -> DispatcherExecutor:
        """The dispatcher path, made on first need (no bundles: no device opened)."""
        if self.dispatcher is None:
            self.device = self.open_device(self.cfg)
            self.dispatcher = DispatcherExecutor(self.front, self.device, self.cfg,
                                                 self.instruments)
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
        try:
            return self._serve()
        except StartupInterrupted:
            log.info("SIGTERM during start-up: stopped before serving")
            return 0
        finally:
            self.front.close()
            if self.device is not None:
                self.device.close()
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
        try:
            self.front.listen()      # raises FrontendError if another daemon holds it
        except OSError as e:
            raise ConfigError(f"cannot listen on {self.cfg.socket}: {e.strerror}") from None
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
        pin_and_prioritize(self.cfg.cpu, self.cfg.rt_priority)
        log.info("listening on %s (idle mode %s)", self.cfg.socket, self.cfg.idle)
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
            n = self.router.in_flight
            log.warning("drain deadline passed: completing %d request(s) still in flight as "
                        "cancelled", n)
            # Every accepted request gets one completion before the daemon goes, also one
            # whose kernels are still on the device: it is not waited for.
            self.router.abandon_all(f"cancelled: the daemon stopped (its drain deadline of "
                                    f"{self.cfg.drain_seconds:g} s passed) before the job "
                                    f"finished")
            for _ in range(self.cfg.ring_slots):      # what is still in the rings: refused
                if not self.front.poll_rings(admit=False):
                    break
            self.front.poll_io(0)                     # send the wake-ups
            return True
        return False

    # -- reloads -----------------------------------------------------------------------
    def _housekeeping(self) -> None:
        """Between two iterations: finish a background load, start one for a SIGHUP,
        freeze the heap once nothing is in flight after a swap."""
        self.housekeeping = False
        loader = self._loader
        if loader is not None and loader.done:
            self._loader = None
            self._finish_reload(loader)
        if self._hup and self._loader is None and not self.draining:
            self._hup = False
            self._start_reload()
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
                                                 self._make_adaptor)

    def _finish_reload(self, loader: repository.BackgroundScan) -> None:
        if loader.error is not None:
            log.error("SIGHUP reload failed, keeping the previous models: %s: %s",
                      type(loader.error).__name__, loader.error)
        else:
            scan = loader.result
            log.info("SIGHUP: repository read in %.2f s off the loop (%d new or changed, "
                     "%d unchanged, %d not served)", scan.seconds, len(scan.prepared),
                     len(scan.kept), len(scan.failed))
            self._swap(scan)
            self._refreeze = True
            self.housekeeping = True
        sd_notify("READY=1")


def main(argv: list[str] | None = None, *, instruments: Any = (),
         open_device: Callable[[DaemonConfig], Any] | None = None) -> int:
    """``python -m paella.dispatcher.daemon [serve options]``: the daemon alone, without
    loading the other sub-commands of ``paella`` (what the tests and the unit run).
    ``instruments`` and ``open_device``: see :class:`Daemon` (experiments that trace it)."""
    from paella.cli import run_command
    parser = argparse.ArgumentParser(prog="paella-daemon")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    register(sub)
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    args.instruments, args.open_device = instruments, open_device
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
