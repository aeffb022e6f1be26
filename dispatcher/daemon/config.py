"""The daemon's configuration: ``DaemonConfig``, the TOML file and the command line.

A TOML file (``--config``, sections [daemon] [policy] [access] [limits]; see
``dist/paella.toml``) gives the settings, and every setting can be overridden on the
command line; a bad setting is refused before anything starts, naming the setting and
what it accepts (``paella: error: ...``, exit 2).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import stat
import tomllib
from dataclasses import dataclass, field
from typing import Any

from paella import rings
from paella.gpus import preset
from paella.dispatcher.core import MAX_LOOKAHEAD
from paella.dispatcher.frontend import MAX_ID
from paella.dispatcher.policies import PolicyError, check_options


class ConfigError(ValueError):
    """A bad setting: the message names the setting and what it accepts."""


#: The longest a time setting may be (a day): longer ones overflow epoll's timeout or
#: make a stop that never ends.
MAX_SECONDS = 86400.0
#: The most clients, requests in flight per client or clients per uid a limit may allow.
MAX_COUNT = 1 << 20
#: The shortest handshake_seconds: a client's HELLO takes about a millisecond, on a
#: loaded machine tens of them; below this, every connection would be closed.
MIN_HANDSHAKE_SECONDS = 0.1
#: The smallest arena (one page): a client's inputs and outputs live in it.
MIN_ARENA_BYTES = 4096
#: A core number or numeric id: ASCII digits only (str.isdigit also takes "²"), at most 9.
_ASCII_DIGITS = re.compile(r"[0-9]{1,9}")
#: A user or group name as NSS takes it (no NUL, slash, colon or whitespace) or an id.
_NAME = re.compile(r"[^\x00-\x20/:\x7f]{1,256}")


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
    plugin_timeout_seconds: float = 10.0  # a plug-in call running longer is interrupted (0: never)
    lookahead: int = 1                  # kernels of a job's stream released ahead (1: none)
    wake_lead_us: int = 0               # hybrid clients' wake-up this far ahead (0: at the mark)
    slice_us: int = 100                 # kernel slicing's bound on a more urgent class's wait (0: off)
    kernel_core: str = "auto"           # auto | c | python | off (docs/dispatcher.md)
    buffer_sets_ahead: int = 512        # per-request buffer sets a model makes at load
    effect_workers: int = 0             # sim: processes computing answers (0: auto)
    effect_deadline_seconds: float = 120.0  # sim: an answer computing longer fails its job
    effect_queue: int = 64              # sim: answers waiting for a worker, at most
    echo: bool = True                   # serve the built-in "echo" model (host)
    noop: bool = True                   # serve the built-in "noop" model (sim backend)
    log_level: str = "info"
    metrics_port: int = 0               # Prometheus /metrics on this TCP port; 0: off
    metrics_addr: str = "127.0.0.1"     # address the metrics endpoint binds
    # [policy]
    policy: str = "paella"
    policy_params: dict[str, Any] = field(default_factory=dict)
    # [access]
    allowed_users: list[str] = field(default_factory=list)
    allowed_groups: list[str] = field(default_factory=list)
    socket_mode: int = 0o666
    trace_users: list[str] = field(default_factory=list)   # may take traces, besides the owner
    # May load and unload models (`paella model load|unload`: they change what every
    # tenant is served), besides the owner and root: user names, uids, "@group".
    control_users: list[str] = field(default_factory=list)
    # Priority classes (1 the most urgent .. 255; 0 names none), per tenant: a user name
    # or uid, "@group", or "*" for everyone else. class_default: the class of a request
    # that names none; class_highest: the most urgent class a tenant may ask for (a
    # request above it is clamped to it, logged and counted). docs/service.md, "Classes".
    class_default: dict[str, int] = field(default_factory=dict)
    class_highest: dict[str, int] = field(default_factory=dict)
    # [limits]
    max_clients: int = 256
    max_inflight_per_client: int = 256
    arena_bytes: int = 16 << 20
    max_arena_bytes: int = 256 << 20
    ring_slots: int = 1024
    max_clients_per_uid: int = 64       # connections of one uid, handshaking or ready
    handshake_seconds: float = 5.0      # a connection must send HELLO within this
    device_memory: int = 0              # bytes of GPU memory the daemon may use (0: all)
    trace_max_bytes: int = 64 << 20     # a trace stops (noted in it) past about this size

    def check(self) -> None:
        choices = {"backend": ("auto", "sim", "cuda"), "idle": ("adaptive", "spin"),
                   "sim_mode": ("stepped", "process"),
                   "kernel_core": ("auto", "c", "python", "off"),
                   "log_level": ("debug", "info", "warning", "error")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} must be one of {allowed}, got {shown(getattr(self, name))}")
        if self.backend != "cuda":           # (auto may end on the simulator)
            try:
                preset(self.gpu)
            except ValueError as e:
                raise ConfigError(f"gpu: {e} (the simulated GPU; --gpu, [daemon] gpu)") from None
        if self.cpu not in ("auto", "none") and not _ASCII_DIGITS.fullmatch(str(self.cpu)):
            raise ConfigError(f"cpu must be auto, none or a core number, got {shown(self.cpu)}")
        _check_classes(self.class_default, "class_default", 0)
        _check_classes(self.class_highest, "class_highest", 1)
        for who, d in self.class_default.items():
            h = self.class_highest.get(who)
            if d and h is not None and d < h:
                raise ConfigError(f"class_default gives {shown(who)} class {d}, more urgent "
                                  f"than the class_highest it may use ({h}): every request of "
                                  f"theirs would be clamped; give a default of {h} or more")
        for name in ("allowed_users", "allowed_groups", "trace_users"):
            for v in getattr(self, name):
                if not ((type(v) is int and 0 <= v <= MAX_ID)
                        or (type(v) is str and _NAME.fullmatch(v))):
                    raise ConfigError(f"{name} must list user or group names or numeric "
                                      f"ids, got {shown(v)}")
        for v in self.control_users:
            if not ((type(v) is int and 0 <= v <= MAX_ID)
                    or (type(v) is str and _NAME.fullmatch(v.removeprefix("@")))):
                raise ConfigError(f"control_users must list user names, uids or \"@group\" "
                                  f"names (who may load and unload models besides the "
                                  f"daemon's owner and root), got {shown(v)}")
        if not 0 <= self.rt_priority <= 99:
            raise ConfigError(f"rt_priority must be 0..99, got {self.rt_priority}")
        if not 0 <= self.drain_seconds <= MAX_SECONDS:     # (also refuses nan and inf)
            raise ConfigError(f"drain_seconds must be 0..{MAX_SECONDS} (seconds in-flight jobs "
                              f"get to finish after SIGTERM), got {self.drain_seconds}")
        if not (self.plugin_timeout_seconds == 0
                or 0.1 <= self.plugin_timeout_seconds <= MAX_SECONDS):
            raise ConfigError(f"plugin_timeout_seconds must be 0 (never interrupt) or in "
                              f"[0.1, {MAX_SECONDS}] (a plug-in call running longer is "
                              f"interrupted), got {self.plugin_timeout_seconds}")
        if not MIN_HANDSHAKE_SECONDS <= self.handshake_seconds <= MAX_SECONDS:
            raise ConfigError(f"handshake_seconds must be in [{MIN_HANDSHAKE_SECONDS}, "
                              f"{MAX_SECONDS}] (a connection that sends no HELLO by then is "
                              f"closed; less would close every client's), got "
                              f"{self.handshake_seconds}")
        if "\0" in self.socket:
            raise ConfigError(f"socket {self.socket!r:.120} contains a NUL byte; a path cannot")
        if type(self.lookahead) is not int or not 1 <= self.lookahead <= MAX_LOOKAHEAD:
            raise ConfigError(f"lookahead must be an int 1..{MAX_LOOKAHEAD} (kernels of one stream released "
                              f"and not completed; 1 releases a kernel when its predecessor "
                              f"has completed), got {shown(self.lookahead)}")
        if type(self.wake_lead_us) is not int or not 0 <= self.wake_lead_us <= 1_000_000:
            raise ConfigError(f"wake_lead_us must be an int 0..1000000 (microseconds of "
                              f"estimated work left when a hybrid client is woken; 0: only "
                              f"before the job's last copy), got {shown(self.wake_lead_us)}")
        if type(self.buffer_sets_ahead) is not int or not 0 <= self.buffer_sets_ahead <= 1 << 16:
            raise ConfigError(f"buffer_sets_ahead must be an int 0..{1 << 16} (per-request "
                              f"buffer sets each model makes when it is loaded, at most 16 "
                              f"MiB of them; 0: made as requests need them), got "
                              f"{shown(self.buffer_sets_ahead)}")
        if type(self.slice_us) is not int or not 0 <= self.slice_us <= 1_000_000:
            raise ConfigError(f"slice_us must be an int 0..1000000 (microseconds: the longest "
                              f"a kernel slice of a less urgent class may make more urgent "
                              f"work wait; 0 turns kernel slicing off), got {shown(self.slice_us)}")
        if type(self.effect_workers) is not int or not 0 <= self.effect_workers <= 256:
            raise ConfigError(f"effect_workers must be an int 0..256 (processes computing the "
                              f"simulated GPU's answers; 0: one per core but the loop's, at "
                              f"most 4), got {shown(self.effect_workers)}")
        if not 1 <= self.effect_deadline_seconds <= MAX_SECONDS:
            raise ConfigError(f"effect_deadline_seconds must be in [1, {MAX_SECONDS}] (an "
                              f"answer computing longer is killed and its job fails), got "
                              f"{self.effect_deadline_seconds}")
        if type(self.effect_queue) is not int or not 1 <= self.effect_queue <= 1 << 20:
            raise ConfigError(f"effect_queue must be an int 1..{1 << 20} (answers waiting for "
                              f"a worker; a request beyond them is refused as overloaded), got "
                              f"{shown(self.effect_queue)}")
        if self.idle_spin_us < 0:
            raise ConfigError(f"idle_spin_us must be >= 0 (microseconds), got {self.idle_spin_us}")
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port must be a TCP port 1..65535 (0: no metrics), "
                              f"got {self.metrics_port}")
        if not 0 <= self.socket_mode <= 0o777:
            raise ConfigError(f"socket_mode must be a file mode 0000..0777, got {self.socket_mode:#o}")
        for name in ("max_clients", "max_inflight_per_client", "max_clients_per_uid"):
            if not 0 < getattr(self, name) <= MAX_COUNT:
                raise ConfigError(f"{name} must be 1..{MAX_COUNT}, got {getattr(self, name)}")
        for name in ("arena_bytes", "max_arena_bytes"):
            if getattr(self, name) < MIN_ARENA_BYTES:
                raise ConfigError(f"{name} must be at least {MIN_ARENA_BYTES} (one page; a "
                                  f"client's tensors live in its arena), got "
                                  f"{getattr(self, name)}")
        if type(self.trace_max_bytes) is not int or not 1 << 16 <= self.trace_max_bytes <= 1 << 34:
            raise ConfigError(f"trace_max_bytes must be an int from {1 << 16} to {1 << 34} (a "
                              f"trace of the running daemon stops, noting it, past about this "
                              f"size), got {shown(self.trace_max_bytes)}")
        if type(self.device_memory) is not int or self.device_memory < 0:
            raise ConfigError(f"device_memory must be a number of bytes >= 0 (the GPU memory "
                              f"the daemon may use; 0: all of it), got {shown(self.device_memory)}")
        if self.arena_bytes > self.max_arena_bytes:
            raise ConfigError(f"arena_bytes ({self.arena_bytes}) exceeds max_arena_bytes "
                              f"({self.max_arena_bytes})")
        try:
            rings.Layout(self.ring_slots, self.ring_slots, 4096)
        except ValueError as e:              # (the layout names its own fields)
            raise ConfigError(f"ring_slots (each client's request and completion rings): "
                              f"{e}") from None
        try:
            rings.Layout(self.ring_slots, self.ring_slots, self.arena_bytes)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.max_arena_bytes > rings.MAX_ARENA_BYTES:
            raise ConfigError(f"max_arena_bytes must be at most 2**40 (the ring layout's "
                              f"largest arena), got {self.max_arena_bytes}")
        self.check_policy()

    def check_policy(self) -> None:
        """The policy exists and takes these parameters, of these types (the policy's
        own checks of the values run when the dispatcher builds it)."""
        try:
            check_options(self.policy, self.policy_params,
                          {"extra_blocks": int, "saturation_backlog": int})
        except PolicyError as e:
            raise ConfigError(str(e)) from None
        for name in ("extra_blocks", "saturation_backlog"):
            value = self.policy_params.get(name)
            if value is not None and not 0 <= value < 2 ** 31:
                raise ConfigError(f"policy parameter {name} must be >= 0 (and below 2**31), "
                                  f"got {value}")


SECTIONS = {
    "daemon": ("socket", "models", "backend", "gpu", "sim_mode", "cpu", "rt_priority", "idle",
               "idle_spin_us", "drain_seconds", "plugin_timeout_seconds", "lookahead", "wake_lead_us", "slice_us", "kernel_core", "buffer_sets_ahead",
               "effect_workers", "effect_deadline_seconds", "effect_queue", "echo", "noop", "log_level", "metrics_port",
               "metrics_addr"),
    "access": ("allowed_users", "allowed_groups", "socket_mode", "trace_users", "control_users",
               "class_default", "class_highest"),
    "limits": ("max_clients", "max_inflight_per_client", "arena_bytes", "max_arena_bytes",
               "ring_slots", "max_clients_per_uid", "handshake_seconds", "device_memory",
               "trace_max_bytes"),
}


def load_config(path: str | None) -> DaemonConfig:
    """Read a TOML config. Unknown sections or keys are errors, not silently ignored."""
    cfg = DaemonConfig()
    if path is None:
        return cfg
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):   # a fifo would block, /dev/zero fill memory
            raise ConfigError(f"config {path} is not a regular file; give the path of a TOML "
                              f"file (dist/paella.toml is an example)")
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config {path} is not valid TOML (UTF-8 text): {e}") from None
    except RecursionError:
        raise ConfigError(f"config {path} is not valid TOML: nested too deeply to read") from None
    for section, table in data.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: top-level key {shown(section)} must be a [section]")
        if section == "policy":
            table = dict(table)
            if "name" in table:
                cfg.policy = table.pop("name")
                if not isinstance(cfg.policy, str):
                    raise ConfigError(f"{path}: [policy] name must be a string, got {shown(cfg.policy)}")
            cfg.policy_params.update(table)
            continue
        if section not in SECTIONS:
            raise ConfigError(f"{path}: unknown section {shown(section)} (known: daemon, policy, "
                              f"access, limits)")
        for key, value in table.items():
            if key not in SECTIONS[section]:
                raise ConfigError(f"{path}: unknown setting {shown(key)} in [{section}] "
                                  f"(known: {', '.join(SECTIONS[section])})")
            setattr(cfg, key, _coerce(key, value))
    return cfg


def _check_classes(table: dict, name: str, lowest: int) -> None:
    """``[access] class_default`` / ``class_highest``: tenant -> class."""
    if not isinstance(table, dict):
        raise ConfigError(f"{name} must be a table of tenant = class, got {shown(table)}")
    for who, n in table.items():
        ok_who = isinstance(who, str) and (who == "*" or _NAME.fullmatch(who.removeprefix("@"))
                                           or who.isdigit())
        if not ok_who:
            raise ConfigError(f"{name}: {shown(who)} is not a tenant: name a user (or uid), "
                              f"\"@group\", or \"*\" for everyone else")
        if type(n) is not int or not lowest <= n <= 255:
            raise ConfigError(f"{name}: {shown(who)} = {shown(n)}: a class is an int "
                              f"{lowest}..255 (1 the most urgent{', 0 none' if lowest == 0 else ''})")


def shown(value: Any, limit: int = 80) -> str:
    """``value`` as an error message shows it: its repr, cut to ``limit`` characters (a
    100 MB setting is not echoed whole into the log)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def octal_mode(text: str) -> int:
    """A file mode written in octal ("0660", "660")."""
    try:
        mode = int(text, 8)
    except ValueError:
        mode = -1
    if not 0 <= mode <= 0o777:
        raise ValueError(f"socket_mode must be an octal file mode such as \"0660\", got {shown(text)}")
    return mode


def _coerce(key: str, value: Any) -> Any:
    want = type(getattr(DaemonConfig(), key))
    if key == "socket_mode":
        if not isinstance(value, str):       # TOML reads 0o660 and 432 alike: ambiguous
            raise ConfigError(f"socket_mode must be a string holding an octal file mode, "
                              f"such as \"0660\", got {shown(value)} (an integer cannot say "
                              f"whether it was written in octal: 440 would mean 0o670)")
        try:
            return octal_mode(value)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if key == "cpu":
        return str(value)
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, want) or (want is int and isinstance(value, bool)):
        raise ConfigError(f"setting {key} must be {want.__name__}, got {shown(value)}")
    return value


def config_from_args(args: argparse.Namespace) -> DaemonConfig:
    cfg = load_config(args.config)
    for f in dataclasses.fields(DaemonConfig):
        v = getattr(args, f.name, None)
        if v is not None and f.name in ("class_default", "class_highest"):
            getattr(cfg, f.name).update(dict(v))         # (merged into the file's table)
        elif v is not None and f.name != "policy_params":
            setattr(cfg, f.name, _coerce(f.name, v) if f.name == "socket_mode" else v)
    cfg.policy_params.update(dict(args.policy_param))
    cfg.check()
    return cfg
