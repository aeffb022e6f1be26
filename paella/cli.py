"""The one ``paella`` command. Each component contributes its sub-commands.

A component module listed in :data:`COMMANDS` exposes ``register(subparsers)``, which
adds its parser(s) and sets ``func`` to a callable taking the parsed arguments and
returning the exit status. Modules keep heavy imports (TVM, matplotlib) inside their
command functions so that ``paella --help`` stays fast.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from importlib.util import find_spec

#: Modules that add sub-commands, in the order ``--help`` lists them: (module, the
#: commands it adds, the install extra its imports need). In an install without that
#: extra (the base install is only the client), the commands are still listed and say
#: which extra to install.
COMMANDS = [
    ("paella.demo", ("demo",), "all"),
    ("paella.dispatcher.daemon", ("serve",), "serve"),
    ("paella.dispatcher.daemon.unit", ("unit",), "serve"),
    ("paella.client.status", ("status",), ""),
    ("paella.client.repository", ("model",), ""),
    ("paella.client.perf", ("perf",), ""),
    ("paella.trace_command", ("trace",), ""),
    ("paella.kserve.command", ("kserve",), "kserve"),
    ("paella.cluster.ray_command", ("cluster",), "ray"),
    ("paella.compiler_pass.cli", ("compile",), "compile"),
    ("paella.experiments.cli", ("experiment",), "all"),
    ("paella.cli", ("occupancy",), ""),
    ("paella.dispatcher.devices.sim.bundle_profile", ("profile",), "serve"),
    ("paella.doctor", ("doctor",), ""),
]


#: What each extra brings that the commands import (looked up, not imported, so that
#: ``paella --help`` stays fast).
EXTRA_MODULES = {"serve": ("greenlet", "posix_ipc"), "compile": ("tvm", "onnx"),
                 "kserve": ("grpc", "google.protobuf", "uvicorn", "httptools"),
                 "ray": ("ray", "uvicorn"),
                 "all": ("greenlet", "posix_ipc", "tvm", "onnx", "matplotlib")}


class CLIError(Exception):
    """A user error: printed as ``paella: error: ...`` with exit status 2."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("occupancy", help="occupancy calculator (CUDA Occupancy Calculator rules)",
                       description="Resident blocks per SM for one kernel, and which limit binds.")
    p.add_argument("--gpu", default="t4", help="GPU preset (default: t4)")
    p.add_argument("--threads", type=int, required=True, help="threads per block")
    p.add_argument("--regs", type=int, required=True, help="registers per thread")
    p.add_argument("--smem", type=int, default=0, help="shared memory per block, bytes (static + dynamic)")
    p.add_argument("--json", action="store_true", help="print a JSON object")
    p.set_defaults(func=_occupancy)


def _occupancy(args: argparse.Namespace) -> int:
    from paella.gpus import preset
    from paella.occupancy import UNLIMITED
    from paella.occupancy import OccupancyError, occupancy
    try:
        spec = preset(args.gpu)
        occ = occupancy(spec, args.threads, args.regs, args.smem)
    except (OccupancyError, ValueError) as e:
        raise CLIError(str(e)) from None
    if args.json:
        print(json.dumps({"gpu": spec.name, "threads": args.threads, "regs": args.regs,
                          "smem": args.smem, "blocks_per_sm": occ.blocks_per_sm, "limit": occ.limit,
                          "binding": list(occ.binding),
                          "per_limit": {k: (v if v < UNLIMITED else None) for k, v in occ.per_limit.items()},
                          "active_warps": occ.active_warps, "max_warps": occ.max_warps,
                          "occupancy": occ.fraction}))
    else:
        print(f"GPU {spec.name} ({spec.sm_name}), {args.threads} threads, {args.regs} regs/thread, "
              f"{args.smem} B shared memory")
        print(f"resident blocks per SM: {occ.blocks_per_sm}")
        print(f"binding limit:          {', '.join(occ.binding)}")
        for k, v in occ.per_limit.items():
            print(f"  {k:<14} allows {v if v < UNLIMITED else 'unlimited'}")
        print(f"occupancy:              {occ.active_warps}/{occ.max_warps} warps ({occ.fraction:.0%})")
    return 0


def version() -> str:
    """The installed distribution's version (``paella.__version__`` is kept equal to it)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version
    try:
        return dist_version("paella-py")
    except PackageNotFoundError:        # (run from a source tree, not installed)
        return "unknown (not installed)"


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The ``paella`` command line. ``only``: a command's name, to register that command
    alone (each command's module is imported to register it: a command line that names
    one does not pay for importing the others'; :func:`main` passes the first word)."""
    parser = argparse.ArgumentParser(prog="paella", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"paella {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    if only is not None and not any(only in names for _, names, _ in COMMANDS):
        only = None
    for mod, names, extra in COMMANDS:
        if only is not None and only not in names:
            continue
        missing = next((m for m in EXTRA_MODULES.get(extra, ()) if find_spec(m) is None), None)
        if missing is not None:
            for name in names:
                _missing_extra(sub, name, extra, missing)
            continue
        importlib.import_module(mod).register(sub)
    return parser


def _missing_extra(sub: argparse._SubParsersAction, name: str, extra: str, missing: str) -> None:
    """A stand-in for a command whose dependencies are not installed."""
    def refuse(_args: argparse.Namespace) -> int:
        raise CLIError(f"paella {name} needs the '{extra}' extra ({missing} is not installed): "
                       f"pip install 'paella-py[{extra}]'")
    # (no option prefix: every argument lands in "rest", so any command line gets here)
    p = sub.add_parser(name, help=f"(needs: pip install 'paella-py[{extra}]')", add_help=False,
                       prefix_chars="\0")
    p.add_argument("rest", nargs="*")
    p.set_defaults(func=refuse)


def run_command(args: argparse.Namespace) -> int:
    """Run a parsed sub-command; a :class:`CLIError` becomes a message and status 2."""
    try:
        return int(args.func(args) or 0)
    except CLIError as e:
        print(f"paella: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (`paella status | head -3`): what it wanted it has. Point
        # stdout at /dev/null so that the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141                           # 128 + SIGPIPE, as a shell reports it
    except OSError as e:
        # A path the user named that cannot be read or written (compile -o /proc/x, a
        # report's input): the system's reason and the path, not a traceback.
        where = f": {e.filename}" if e.filename else ""
        print(f"paella: error: {e.strerror or e}{where}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    first = argv[0] if argv and not argv[0].startswith("-") else None
    return run_command(build_parser(only=first).parse_args(argv))


if __name__ == "__main__":
    # Run through the package module, not this __main__ copy, so that sub-commands and
    # this file share one CLIError class.
    from paella.cli import main as _main
    sys.exit(_main())
