"""A small BERT-like encoder cut into stages (``paella compile --stages``), for the
DVABatch tests: 2 layers, hidden 16, length 8, batch sizes 1, 2, 4 (about 15 s to
compile the first time, then from the zoo cache)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

SIZES = (1, 2, 4)
KW = dict(layers=2, hidden=16, heads=2, ffn=32)
SEQ = 8


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
