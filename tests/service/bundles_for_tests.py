"""Bundles for the lifecycle tests, made from the tiny MLP (compiled once, then cached):

* slow to load: its CPU build is a shared object whose constructor sleeps, so reading
  the bundle (which loads the CPU build) takes that long, in whatever thread does it;
* slow to run: its kernels' FLOP estimates are raised, so each lasts ``kernel_seconds``
  on the simulated T4 (the simulator times kernels by their FLOPs and bytes);
* broken: a tensor of an unknown dtype.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

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
    """The bundle's CPU build becomes a library whose constructor sleeps ``seconds``
    (paella.benchmarks.bench_reload); loading it releases the GIL, as loading any
    shared object does."""
    from paella.benchmarks.bench_reload import make_slow_loading as make
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("needs a C compiler to build the slow-loading library")
    make(bdir, seconds)


def make_slow_running(bdir: Path, kernel_seconds: float) -> None:
    """Raise every kernel's FLOP estimate so that it lasts about ``kernel_seconds`` alone on
    the simulated T4. The timing model has no knob for a kernel's time: it follows from the
    work, so the work is scaled by what ``paella profile`` measures (a compute-bound kernel's
    time is linear in its FLOPs; two rounds absorb the fixed latencies)."""
    from paella.bundle import load_bundle
    from paella.dispatcher.devices.sim.bundle_profile import profile

    for _ in range(2):
        launches = profile(load_bundle(bdir), "t4")["variants"][0]["launches"]
        seconds = {r["kernel"]: r["isolated_us"] * 1e-6 for r in launches}

        def edit(m: dict) -> None:
            for k in m["variants"][0]["kernels"]:
                k["flops"] = k["flops"] * kernel_seconds / seconds[k["name"]]
        _edit_manifest(bdir, edit)


def set_dtype(bdir: Path, dtype: str) -> None:
    def edit(m: dict) -> None:
        m["variants"][0]["inputs"][0]["dtype"] = dtype
    _edit_manifest(bdir, edit)


def slow_repository(tmp_path_factory, kernel_seconds: float, name: str = "slow") -> Path:
    """A model repository holding the tiny MLP as ``name``, each kernel lasting about
    ``kernel_seconds`` (:func:`make_slow_running`)."""
    repo = tmp_path_factory.mktemp("slowrepo")
    m = tiny_mlp(tmp_path_factory.mktemp("mlp") / name)
    make_slow_running(m, kernel_seconds)
    shutil.copytree(m, repo / name)
    return repo
