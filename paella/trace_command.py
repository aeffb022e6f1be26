"""``paella trace``: a kernel-level trace in the Trace Event format (Perfetto,
``chrome://tracing``), of a running daemon or of a run in virtual time.

* ``paella trace [--seconds 2] [-o FILE] [--socket S]`` attaches to the running daemon
  (client/trace.py: the daemon's owner and its ``trace_users`` only);
* ``paella trace --experiment NAME -o FILE [-- EXPERIMENT OPTIONS]`` runs ``paella
  experiment NAME`` with ``--trace FILE``;
* ``paella trace --benchmark NAME -o FILE [-- BENCHMARK OPTIONS]`` runs ``python -m
  paella.benchmarks.NAME`` in this process with its first dispatchers traced.

``--runs N``: how many of a run's dispatchers to trace (default 2), in the order it
makes them. docs/service.md, "Traces".
"""
from __future__ import annotations

import argparse
import re
import runpy
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("trace", help="a kernel-level trace (Perfetto, chrome://tracing) of "
                                     "the daemon, or of an experiment or benchmark run",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=2.0,
                   help="the daemon: how long to record (default 2)")
    p.add_argument("-o", "--output", default="paella-trace.json",
                   help="the trace file to write (default paella-trace.json)")
    p.add_argument("--socket", help="the daemon's socket (default: $PAELLA_SOCKET or the "
                                    "system one)")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--experiment", metavar="NAME", help="trace `paella experiment NAME`")
    what.add_argument("--benchmark", metavar="NAME",
                      help="trace `python -m paella.benchmarks.NAME`")
    p.add_argument("--runs", type=int, default=2,
                   help="an experiment or benchmark: dispatchers to trace (default 2)")
    p.add_argument("rest", nargs=argparse.REMAINDER,
                   help="after --: the experiment's or benchmark's own options")
    p.set_defaults(func=_trace)


def _trace(args: argparse.Namespace) -> int:
    from paella.cli import CLIError
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    if args.runs < 1:
        raise CLIError(f"--runs must be >= 1, got {args.runs}")
    if args.experiment:
        from paella.cli import main
        return main(["experiment", args.experiment, *rest, "--trace", args.output,
                     "--trace-runs", str(args.runs)])
    if args.benchmark:
        return _benchmark(args.benchmark, rest, args.output, args.runs)
    if rest:
        raise CLIError(f"unexpected arguments {' '.join(rest)} (options after -- are for "
                       f"--experiment or --benchmark)")
    return _daemon(args)


def _daemon(args: argparse.Namespace) -> int:
    from paella.cli import CLIError
    from paella.client.errors import DaemonError, DaemonUnavailable
    from paella.client.trace import take_trace
    try:
        info = take_trace(args.output, args.seconds, args.socket)
    except (ValueError, DaemonUnavailable) as e:
        raise CLIError(str(e)) from None
    except DaemonError as e:
        raise CLIError(f"the daemon refused the trace: {e}") from None
    except OSError as e:
        raise CLIError(f"cannot write {args.output}: {e}") from None
    note = " (stopped at its size limit: trace_max_bytes)" if info.get("truncated") else ""
    print(f"wrote {args.output}: {info['requests']} request(s), {info['kernels']} kernel(s), "
          f"{info['bytes']} bytes{note}; open it in https://ui.perfetto.dev")
    return 0


def _benchmark(name: str, rest: list[str], output: str, runs: int) -> int:
    import importlib.util
    from paella.cli import CLIError
    from paella.dispatcher.trace import trace_every_dispatcher
    module = f"paella.benchmarks.{name}"
    if not re.fullmatch(r"[a-z0-9_]+", name) or importlib.util.find_spec(module) is None:
        raise CLIError(f"no benchmark {name!r}: name a module of paella.benchmarks "
                       f"(bench_dispatcher, bench_kernel_core, ...)")
    argv, sys.argv = sys.argv, [module, *rest]
    code = 0
    try:
        with trace_every_dispatcher(output, runs, f"python -m {module}") as traced:
            try:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = argv
    print(f"trace: {output}: {len(traced)} dispatcher run(s)", file=sys.stderr)
    return code
