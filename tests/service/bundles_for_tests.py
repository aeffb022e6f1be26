"""Bundles for the lifecycle tests, made from the tiny MLP (compiled once, then cached):

* slow to load: its CPU build is a shared object whose constructor sleeps, so reading
  the bundle (which loads the CPU build) takes that long, in whatever thread does it;
* slow to run: its kernels' FLOP estimates are raised, so each lasts ``kernel_seconds``
  on the simulated T4 (the simulator times kernels by their FLOPs and bytes);
* broken: a tensor of an unknown dtype.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

SLOW_SOURCE = r"""
#include <unistd.h>
__attribute__((constructor)) static void paella_test_slow_load(void) { usleep(%d); }
"""


def tiny_mlp(dest: str | Path) -> Path:
    """A fresh copy of the tiny MLP bundle at ``dest``."""
    from paella.compiler_pass.build import compile_bundle
    from paella.models.tiny import tiny_mlp as model
    compile_bundle(model(), str(dest))
    return Path(dest)


def _edit_manifest(bdir: Path, edit) -> None:
    path = bdir / "manifest.json"
    m = json.loads(path.read_text())
    edit(m)
    path.write_text(json.dumps(m, indent=1))


def make_slow_loading(bdir: Path, seconds: float) -> None:
    """Point the bundle's CPU build at a wrapper library whose constructor sleeps
    ``seconds`` and which needs the real one (TVM finds the module's symbols through
    the dependency). Loading it releases the GIL, as loading any shared object does."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("needs a C compiler to build the slow-loading library")
    src = bdir / "slow_load.c"
    src.write_text(SLOW_SOURCE % int(seconds * 1e6))
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(bdir / "cpu_slow.so"), str(src),
                    "-Wl,--no-as-needed", f"-L{bdir}", "-l:cpu.so", "-Wl,-rpath,$ORIGIN"],
                   check=True, capture_output=True)

    def edit(m: dict) -> None:
        m["files"]["cpu_lib"] = "cpu_slow.so"
    _edit_manifest(bdir, edit)


def make_slow_running(bdir: Path, kernel_seconds: float) -> None:
    """Raise every kernel's FLOP estimate so that it lasts ``kernel_seconds`` on the
    simulated T4 (roofline with the fitted efficiency: paella.dispatcher.devices.sim.cost)."""
    from paella.dispatcher.devices.sim.cost import CostModel
    from paella.gpus import preset
    cost = CostModel()
    flops = (kernel_seconds - cost.launch_overhead) * cost.efficiency * preset("t4").peak_flops

    def edit(m: dict) -> None:
        for k in m["variants"][0]["kernels"]:
            k["flops"] = flops
    _edit_manifest(bdir, edit)


def set_dtype(bdir: Path, dtype: str) -> None:
    def edit(m: dict) -> None:
        m["variants"][0]["inputs"][0]["dtype"] = dtype
    _edit_manifest(bdir, edit)


def touch(bdir: Path) -> None:
    """Make the daemon see the bundle as changed (its key includes the manifest's mtime)."""
    st = os.stat(bdir / "manifest.json")
    os.utime(bdir / "manifest.json", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
