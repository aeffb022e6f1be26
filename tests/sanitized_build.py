"""Building C modules under AddressSanitizer and UndefinedBehaviorSanitizer and running a
driver script against them in a subprocess (the sanitized-module tests share this).

The subprocess preloads the sanitizer runtimes and runs with ``PYTHONMALLOC=malloc``:
Python's small-object allocator would otherwise serve most objects (and the modules'
PyMem_* arrays) from its own arenas, where ASan sees neither a use after free nor an
overflow into a neighbour."""
from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def sanitizer_libs() -> list[str]:
    """gcc's ASan and UBSan runtimes; skips the test where gcc has none (a reason a user
    can act on: install libasan/libubsan)."""
    out = []
    for lib in ("libasan.so", "libubsan.so"):
        path = subprocess.run(["gcc", f"-print-file-name={lib}"], capture_output=True,
                              text=True).stdout.strip()
        if not os.path.isabs(path) or not os.path.exists(path):
            pytest.skip(f"gcc has no {lib} here (install libasan/libubsan) to run the sanitized build")
        out.append(path)
    return out


def build(source: Path, out_dir: Path, name: str) -> Path:
    """``source`` built as extension module ``name`` with both sanitizers."""
    out = out_dir / f"{name}{sysconfig.get_config_var('EXT_SUFFIX')}"
    subprocess.run(["gcc", "-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
                    "-fno-omit-frame-pointer", "-shared", "-fPIC",
                    f"-I{sysconfig.get_paths()['include']}", "-o", str(out), str(source)], check=True)
    return out


def run_driver(driver: str, *args: str) -> subprocess.CompletedProcess:
    """``python -c driver args...`` with the sanitizer runtimes preloaded."""
    env = dict(os.environ, LD_PRELOAD=":".join(sanitizer_libs()), ASAN_OPTIONS="detect_leaks=0",
               UBSAN_OPTIONS="print_stacktrace=1", PYTHONMALLOC="malloc")
    return subprocess.run([sys.executable, "-c", driver, *args], env=env, capture_output=True,
                          text=True, timeout=600)


def check_sim_module(name: str, driver: str, tmp_path: Path, done: str) -> None:
    """Build ``dispatcher/devices/sim/<name>.c`` with both sanitizers, run ``driver`` with
    the build's path as its argument, and require a clean exit that printed ``done``."""
    sanitizer_libs()
    out = build(ROOT / "dispatcher" / "devices" / "sim" / f"{name}.c", tmp_path, name)
    r = run_driver(driver, str(out))
    assert r.returncode == 0 and done in r.stdout, (r.stdout[-2000:], r.stderr[-6000:])


def sim_module_preamble(name: str) -> str:
    """Driver code that loads the build given as ``sys.argv[1]`` as
    ``paella.dispatcher.devices.sim.<name>`` (as ``mod``), before anything imports it."""
    return f'''
import gc, importlib.util, random, sys
import numpy as np
name, path = "paella.dispatcher.devices.sim.{name}", sys.argv[1]
spec = importlib.util.spec_from_file_location(name, path)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
sys.modules[name] = mod
'''
