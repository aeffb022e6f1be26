"""A small BERT-like encoder cut into stages (``paella compile --stages``), for the
DVABatch tests: 2 layers, hidden 16, length 8, batch sizes 1, 2, 4 (about 15 s to
compile the first time, then from the zoo cache).

Until ``Bundle.run_stage_cpu`` (the CPU replay of a stage's plan, which answers stage
variants on the simulated GPU) is reachable from ``paella.bundle`` (s6-16c's side),
:func:`replay_shim_env` gives a daemon process a ``sitecustomize`` that adds it from
``paella.compiler_pass.plan_replay``; it does nothing once the method exists."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

SIZES = (1, 2, 4)
KW = dict(layers=2, hidden=16, heads=2, ffn=32)
SEQ = 8

_SHIM = '''
import paella.bundle as _b
if not hasattr(_b.Bundle, "run_stage_cpu"):
    def run_stage_cpu(self, inputs, variant):
        from paella.compiler_pass.plan_replay import replay_cpu
        return replay_cpu(self, inputs, variant)
    _b.Bundle.run_stage_cpu = run_stage_cpu
'''


def install_replay_shim() -> None:
    """The same, in this process."""
    exec(_SHIM, {})


def replay_shim_env() -> dict[str, str]:
    d = tempfile.mkdtemp(prefix="plshim")
    Path(d, "sitecustomize.py").write_text(_SHIM)
    return {"PYTHONPATH": os.pathsep.join(p for p in (d, os.environ.get("PYTHONPATH")) if p)}


def staged_bert(dest: str | Path, stages: int = 2) -> Path:
    from paella.compiler_pass.build import compile_bundle
    from paella.models.transformer import bert_encoder
    models = []
    for b in SIZES:
        m = bert_encoder(batch=b, seq_len=SEQ, **KW)
        m.batch, m.seq_len = b, SEQ
        models.append(m)
    return Path(compile_bundle(models, str(dest), stages=stages))


def query(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """One row: ``x`` (1, 8, 16) and ``mask`` (1, 8) with a random number of padded
    positions masked out."""
    x = rng.standard_normal((1, SEQ, KW["hidden"])).astype(np.float32)
    mask = np.ones((1, SEQ), np.float32)
    mask[0, int(rng.integers(3, SEQ + 1)):] = 0
    return x, mask


def reference(bundle, x: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The whole model's CPU-build output for one row."""
    return bundle.run_cpu_model({"x": x, "mask": mask}, 1)["output0"]
