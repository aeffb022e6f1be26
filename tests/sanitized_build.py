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
