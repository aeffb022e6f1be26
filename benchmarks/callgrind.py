"""Instruction counts with callgrind, the benchmarks' repeatable measure: the same
binary, inputs and environment count the same whatever else the machine does."""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile


def instructions(module_args: list[str], *, toggles: tuple[str, ...] = ()) -> int:
    """Instructions callgrind counts running ``python -m <module_args>``: only inside the
    C functions ``toggles`` (``--toggle-collect``), or, without them, only where the
    program switches collection on itself (``callgrind_control -i on``)."""
    opts = [f"--toggle-collect={t}" for t in toggles] or ["--instr-atstart=no"]
    with tempfile.NamedTemporaryFile(suffix=".cg") as f:
        subprocess.run(["valgrind", "--tool=callgrind", *opts, f"--callgrind-out-file={f.name}",
                        sys.executable, "-m", *module_args],
                       check=True, capture_output=True, env=dict(os.environ, PYTHONHASHSEED="0"))
        text = open(f.name).read()
    return int(re.search(r"^(?:summary|totals): (\d+)", text, re.M).group(1))


def per_kernel_arguments(p: argparse.ArgumentParser, plans: tuple[str, ...]) -> None:
    """The per-kernel benchmarks' shared options: timed runs, and the two callgrind runs
    whose difference is counted (each one a ``--count N --plan P`` run of the module)."""
    p.add_argument("--jobs", type=int, default=6000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--instructions", action="store_true", help="also count with callgrind")
    p.add_argument("--small", type=int, default=200)
    p.add_argument("--large", type=int, default=1000)
    p.add_argument("--count", type=int, help=argparse.SUPPRESS)   # one run, for callgrind
    p.add_argument("--plan", choices=plans, help=argparse.SUPPRESS)
