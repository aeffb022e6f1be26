"""``paella serve``: the command line of the daemon (its options, and ``main`` for running
the daemon alone: ``python -m paella.dispatcher.daemon``)."""
from __future__ import annotations

import argparse
import logging
import os
import sys
import tomllib
from typing import Any, Callable

from paella.dispatcher.frontend import FrontendError

from .config import SECTIONS, ConfigError, DaemonConfig, config_from_args
from .server import Daemon


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
    p.add_argument("--plugin-timeout-seconds", type=float, dest="plugin_timeout_seconds",
                   help="interrupt a plug-in's call (policy, batcher) that runs longer than "
                   "this (default 10; 0: never)")
    p.add_argument("--lookahead", type=int, help="kernels of a job's stream released before "
                   "their predecessor completes, queued behind it (default 1: none)")
    p.add_argument("--kernel-core", dest="kernel_core", choices=("auto", "c", "python", "off"),
                   help="what runs the per-kernel path: the kernel core in C (c), its Python "
                   "reference (python), the dispatcher's own path (off), or auto (default: "
                   "c while every model is a launch plan under a built-in policy)")
    p.add_argument("--buffer-sets-ahead", type=int, dest="buffer_sets_ahead",
                   help="per-request buffer sets each model makes when it is loaded, not while "
                   "serving (default 512, at most 16 MiB of them per model and 1/16 of the "
                   "device memory in all; 0: made as requests need them)")
    p.add_argument("--effect-workers", type=int, dest="effect_workers",
                   help="sim backend: worker processes computing the answers, off the loop "
                   "(default 0: one per core but the loop's, at most 4)")
    p.add_argument("--effect-deadline-seconds", type=float, dest="effect_deadline_seconds",
                   help="sim backend: an answer computing longer than this fails its request "
                   "(default 120)")
    p.add_argument("--effect-queue", type=int, dest="effect_queue",
                   help="sim backend: answers waiting for a worker, at most; past it new "
                   "requests needing one are refused as overloaded (default 64)")
    p.add_argument("--slice-us", type=int, dest="slice_us",
                   help="kernel slicing: a less urgent class's long kernels run in slices of at "
                   "most this many microseconds while a more urgent class is around (default "
                   "100; 0: off)")
    p.add_argument("--wake-lead-us", type=int, dest="wake_lead_us",
                   help="wake a hybrid client when its job's estimated work left drops to "
                   "this many microseconds (default 0: just before the job's last copy)")
    p.add_argument("--echo", action=argparse.BooleanOptionalAction, default=None,
                   help="serve the built-in echo model")
    p.add_argument("--noop", action=argparse.BooleanOptionalAction, default=None,
                   help="serve the built-in noop model (one trivial kernel, sim backend)")
    p.add_argument("--metrics-port", dest="metrics_port", type=int,
                   help="serve Prometheus metrics on this TCP port (GET /metrics; default off)")
    p.add_argument("--metrics-addr", dest="metrics_addr",
                   help="address of the metrics endpoint (default 127.0.0.1)")
    p.add_argument("--log-level", dest="log_level", choices=("debug", "info", "warning", "error"))
    p.add_argument("--policy", help="scheduling policy")
    p.add_argument("--policy-param", dest="policy_param", action="append", type=_parse_param,
                   default=[], metavar="NAME=VALUE", help="policy parameter (repeatable)")
    p.add_argument("--allow-user", dest="allowed_users", action="append", metavar="USER")
    p.add_argument("--allow-group", dest="allowed_groups", action="append", metavar="GROUP")
    p.add_argument("--class-default", dest="class_default", action="append", metavar="WHO=N",
                   type=_parse_class, help="the priority class of a request naming none, for "
                   "WHO (a user, @group, or *); repeatable")
    p.add_argument("--class-highest", dest="class_highest", action="append", metavar="WHO=N",
                   type=_parse_class, help="the most urgent class WHO may ask for (a request "
                   "above it is clamped, logged and counted); repeatable")
    p.add_argument("--trace-user", dest="trace_users", action="append", metavar="USER",
                   help="a user who may take traces (`paella trace`) besides the daemon's "
                        "owner (repeatable): a trace shows every tenant's timing")
    p.add_argument("--control-user", dest="control_users", action="append", metavar="WHO",
                   help="a user (name or uid) or \"@group\" who may load and unload models "
                        "(`paella model load|unload`) besides the daemon's owner and root "
                        "(repeatable)")
    p.add_argument("--socket-mode", dest="socket_mode",
                   help="mode of the socket file, octal (default 0666)")
    for name in SECTIONS["limits"]:
        p.add_argument("--" + name.replace("_", "-"), dest=name,
                       type=type(getattr(DaemonConfig, name)))
    p.set_defaults(func=_serve)


def _parse_class(text: str) -> tuple[str, int]:
    """``WHO=N`` of --class-default / --class-highest (the config checks WHO and N)."""
    who, sep, n = text.partition("=")
    if not sep or not who or not n.strip().isdigit():
        raise argparse.ArgumentTypeError(f"expected WHO=N (a user, @group or *, and a class "
                                         f"0..255), got {text!r}")
    return who, int(n)


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
