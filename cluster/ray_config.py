"""The config of ``paella cluster``: a TOML file naming the models, the GPUs, the
placement rule and the router, read and checked before anything starts.

Every mistake is a :class:`ConfigError` naming the key and what it takes, so that the
command says ``paella: error: ...`` instead of failing later inside a Ray replica::

    models = ["echo"]            # built-ins (echo, noop) or folders of model_repository
    model_repository = "/srv/paella/models"     # optional
    placement = "all"            # "all", a count per model, or {resnet18 = 2, "*" = 1}
    router = "p2c-work"          # random, round-robin, p2c-queue, p2c-work

    [gpus]
    backend = "sim"              # "cuda": real GPUs (Ray's num_gpus); "sim": simulated
    count = 2                    # replicas, one per GPU; "auto": every GPU Ray has
    preset = "t4"                # the simulated GPU (sim only)

    [http]
    host = "127.0.0.1"
    port = 8000

    [grpc]                       # optional: KServe v2 over gRPC too (off without it)
    port = 8001
    host = "127.0.0.1"           # default: http.host

    [daemon]
    args = []                    # more `paella serve` options, for every daemon
    timeout_s = 30               # an inference's limit, retry included
"""
from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from typing import Any

from .placement import ALL, Rule, place
from .router import ROUTERS

#: The models every daemon has without a bundle.
BUILTIN_MODELS = ("echo", "noop")
#: Ray's custom resource a node offers for each simulated GPU (``ray start --resources``).
SIM_GPU_RESOURCE = "paella_sim_gpu"
BACKENDS = ("sim", "cuda")

_TOP = {"models", "model_repository", "placement", "router", "gpus", "http", "grpc",
        "daemon", "app_name", "run_dir"}
_TABLES = {"gpus": {"backend", "count", "preset"}, "http": {"host", "port"},
           "grpc": {"host", "port"},
           "daemon": {"args", "timeout_s", "health_check_period_s", "stats_period_s"}}


class ConfigError(ValueError):
    """A config that cannot run; the message names the key."""


@dataclass(frozen=True)
class ClusterConfig:
    """A checked config. ``gpus`` is None for "auto" (every GPU Ray's cluster has, read
    when the application starts)."""
    models: tuple[str, ...]
    gpus: int | None = None
    backend: str = "sim"
    preset: str = "t4"
    placement: Rule = ALL
    placement_default: int | str = ALL
    router: str = "p2c-work"
    model_repository: str | None = None
    http_host: str = "127.0.0.1"
    http_port: int = 8000
    #: The ingress's KServe v2 gRPC port; None: no gRPC (no ``[grpc]`` table).
    grpc_port: int | None = None
    grpc_host: str = "127.0.0.1"
    daemon_args: tuple[str, ...] = ()
    timeout_s: float = 30.0
    health_check_period_s: float = 2.0
    stats_period_s: float = 0.5
    app_name: str = "paella"
    run_dir: str = field(default_factory=lambda: os.path.join(
        os.environ.get("XDG_RUNTIME_DIR") or "/tmp", "paella-cluster"))

    @property
    def resource(self) -> dict[str, Any]:
        """What one replica asks Ray for: one GPU, real or simulated."""
        if self.backend == "cuda":
            return {"num_gpus": 1}
        return {"num_gpus": 0, "resources": {SIM_GPU_RESOURCE: 1}}

    def placed(self, n_replicas: int) -> list[frozenset[str]]:
        """The models of each replica rank (:func:`paella.cluster.placement.place`)."""
        return place(self.models, n_replicas, self.placement, self.placement_default)


def load_config(path: str) -> ClusterConfig:
    """Read and check a TOML config; :class:`ConfigError` on anything wrong."""
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a TOML file") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    try:
        return parse_config(raw)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def parse_config(raw: dict[str, Any]) -> ClusterConfig:
    """A :class:`ClusterConfig` from the parsed TOML document."""
    _known_keys(raw)
    models = _models(raw.get("models"))
    repo = raw.get("model_repository")
    if repo is not None:
        if not isinstance(repo, str) or not os.path.isdir(repo):
            raise ConfigError(f"model_repository {repo!r} is not a directory")
        repo = os.path.abspath(repo)
    for m in models:
        if m not in BUILTIN_MODELS and (repo is None or not os.path.isdir(os.path.join(repo, m))):
            where = f"a folder of {repo}" if repo else "set model_repository to its folder"
            raise ConfigError(f"model {m!r} is not a built-in ({', '.join(BUILTIN_MODELS)}) "
                              f"and not {where}")
    gpus, daemon, http = raw.get("gpus", {}), raw.get("daemon", {}), raw.get("http", {})
    http_host = _string("http.host", http.get("host", "127.0.0.1"))
    http_port = _int("http.port", http.get("port", 8000), 0, 65535)
    cfg = ClusterConfig(
        models=models, gpus=_count(gpus.get("count", "auto")),
        backend=_choice("gpus.backend", gpus.get("backend", "sim"), BACKENDS),
        preset=_string("gpus.preset", gpus.get("preset", "t4")),
        router=_choice("router", raw.get("router", "p2c-work"), tuple(ROUTERS)),
        model_repository=repo,
        http_host=http_host, http_port=http_port, **_grpc(raw, http_host, http_port),
        daemon_args=_args(daemon.get("args", [])),
        timeout_s=_number("daemon.timeout_s", daemon.get("timeout_s", 30.0)),
        health_check_period_s=_number("daemon.health_check_period_s",
                                      daemon.get("health_check_period_s", 2.0)),
        stats_period_s=_number("daemon.stats_period_s", daemon.get("stats_period_s", 0.5)),
        app_name=_string("app_name", raw.get("app_name", "paella")),
        **({"run_dir": _string("run_dir", raw["run_dir"])} if "run_dir" in raw else {}),
        **_placement(raw.get("placement", ALL)))
    if cfg.gpus is not None:
        try:
            cfg.placed(cfg.gpus)
        except ValueError as e:
            raise ConfigError(f"placement: {e}") from None
    return cfg


def _grpc(raw: dict[str, Any], http_host: str, http_port: int) -> dict[str, Any]:
    """``[grpc]``: the port (no default: the table turns gRPC on) and the host."""
    if "grpc" not in raw:
        return {}
    grpc = raw["grpc"]
    if "port" not in grpc:
        raise ConfigError("[grpc] needs a port (e.g. port = 8001), or leave the table out "
                          "for no gRPC")
    port = _int("grpc.port", grpc["port"], 1, 65535)
    host = _string("grpc.host", grpc.get("host", http_host))
    if port == http_port:
        raise ConfigError(f"grpc.port {port} is http.port too; give gRPC a port of its own")
    return {"grpc_port": port, "grpc_host": host}


def _known_keys(raw: dict[str, Any]) -> None:
    unknown = sorted(set(raw) - _TOP)
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join(unknown)}; the keys are "
                          f"{', '.join(sorted(_TOP))}")
    for table, keys in _TABLES.items():
        sub = raw.get(table, {})
        if not isinstance(sub, dict):
            raise ConfigError(f"{table} must be a table ([{table}])")
        bad = sorted(set(sub) - keys)
        if bad:
            raise ConfigError(f"unknown key(s) {', '.join(f'{table}.{k}' for k in bad)}; "
                              f"[{table}] takes {', '.join(sorted(keys))}")


def _models(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(m, str) and m
                                                           for m in value):
        raise ConfigError("models must be a non-empty list of model names, "
                          "e.g. models = [\"echo\"]")
    if len(set(value)) != len(value):
        raise ConfigError(f"a model is named twice in models = {value}")
    return tuple(value)


def _placement(value: Any) -> dict[str, Any]:
    if value == ALL or (type(value) is int and value >= 1):
        return {"placement": value}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        rule = {k: v for k, v in value.items() if k != "*"}
        for k, v in value.items():
            if not (v == ALL or (type(v) is int and v >= 1)):
                raise ConfigError(f"placement.{k}: a count of replicas (>= 1) or \"all\", "
                                  f"got {v!r}")
        return {"placement": rule, "placement_default": value.get("*", ALL)}
    raise ConfigError(f"placement must be \"all\", a count, or a table of counts per model "
                      f"({{resnet18 = 2, \"*\" = 1}}), got {value!r}")


def _count(value: Any) -> int | None:
    if value == "auto":
        return None
    return _int("gpus.count", value, 1, 4096)


def _int(key: str, value: Any, lo: int, hi: int) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise ConfigError(f"{key} must be an integer from {lo} to {hi}, got {value!r}")
    return value


def _number(key: str, value: Any) -> float:
    if type(value) not in (int, float) or not 0 < value < 1e6:
        raise ConfigError(f"{key} must be a positive number of seconds, got {value!r}")
    return float(value)


def _string(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{key} must be a non-empty string, got {value!r}")
    return value


def _choice(key: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ConfigError(f"{key} must be one of {', '.join(choices)}, got {value!r}")
    return value


def _args(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
        raise ConfigError("daemon.args must be a list of strings (paella serve options)")
    reserved = {"--socket", "--backend", "--gpu", "--models", "--echo", "--no-echo",
                "--noop", "--no-noop"}
    clash = sorted({a.split("=", 1)[0] for a in value} & reserved)
    if clash:
        raise ConfigError(f"daemon.args may not set {', '.join(clash)}: the replica sets "
                          f"them from [gpus] and models")
    return tuple(value)
