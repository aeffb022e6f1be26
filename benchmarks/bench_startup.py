"""Benchmark (not a test): how long a daemon serving a bundle takes to start, and how long
the compiler takes to import.

    .venv/bin/python -m paella.benchmarks.bench_startup [--runs 5] [--json F]

Compiles the tiny MLP into a temporary model repository (from the compile cache after the
first time), then, per run, in fresh processes: ``paella serve --models REPO`` from its
start to READY=1 (its sd_notify, as systemd waits for it: the bundle read, its effect
worker started and the profiling input's answer computed there), and ``import
paella.compiler_pass.build`` (what ``paella compile`` imports before it compiles
anything). Medians over ``--runs``. What moves both is importing TVM, which imported
torch until :mod:`paella.tvm_loader` (docs/benchmarks.md, "Start-up").
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from paella.child_daemon import start_daemon, stop_daemon


def _repository() -> str:
    from paella.compiler_pass.build import compile_bundle
    from paella.models import zoo
    d = tempfile.mkdtemp(prefix="plstart")
    compile_bundle([zoo.get("tiny_mlp", batch=1)], os.path.join(d, "tiny_mlp"))
    return d


def daemon_start(repo: str) -> float:
    """Seconds from spawning ``paella serve --models repo`` to its READY=1."""
    t = time.monotonic()
    proc, _, d = start_daemon("--models", repo, "--cpu", "none", "--rt-priority", "0")
    took = time.monotonic() - t
    stop_daemon(proc)
    shutil.rmtree(d, ignore_errors=True)
    return took


def compiler_import() -> float:
    """Seconds a fresh interpreter takes to import the compiler."""
    t = time.monotonic()
    subprocess.run([sys.executable, "-c", "import paella.compiler_pass.build"], check=True)
    return time.monotonic() - t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    repo = _repository()
    try:
        starts = [daemon_start(repo) for _ in range(args.runs)]
        imports = [compiler_import() for _ in range(args.runs)]
    finally:
        shutil.rmtree(repo, ignore_errors=True)
    out = {"daemon_start_to_ready_s": statistics.median(starts),
           "compiler_import_s": statistics.median(imports),
           "runs": args.runs, "daemon_start_s_each": starts, "compiler_import_s_each": imports}
    print(f"daemon start to READY (tiny_mlp bundle): median {out['daemon_start_to_ready_s']:.2f} s "
          f"({', '.join(f'{x:.2f}' for x in starts)})")
    print(f"import paella.compiler_pass.build: median {out['compiler_import_s']:.2f} s "
          f"({', '.join(f'{x:.2f}' for x in imports)})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
