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


#: The length buckets of :func:`staged_bert_buckets`.
BUCKETS = (4, SEQ)


def staged_bert_buckets(dest: str | Path, stages: int = 2) -> Path:
    """The same encoder compiled for two length buckets (4 and 8) in one stage bundle
    (``paella compile --stages 2 --seq-lens 4,8``), each bucket cut on its own."""
    from paella.compiler_pass.build import compile_bundle
    from paella.models.transformer import bert_encoder
    models = []
    for s in BUCKETS:
        for b in SIZES:
            m = bert_encoder(batch=b, seq_len=s, **KW)
            m.batch, m.seq_len = b, s
            models.append(m)
    return Path(compile_bundle(models, str(dest), stages=stages))


def bucket_reference(bundle, x: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The whole model's CPU-build output for one row of length ``n <= 8``: padded with
    zeros (masked out) to the smallest bucket taking it, run by the CPU build of that
    bucket's whole model (the stage-0 variant's files are the whole model's), cut back
    to ``n``."""
    n = x.shape[1]
    bucket = next(b for b in BUCKETS if n <= b)
    px, pm = np.zeros((1, bucket, KW["hidden"]), np.float32), np.zeros((1, bucket), np.float32)
    px[:, :n], pm[:, :n] = x, mask
    first = next(i for i, v in enumerate(bundle.variants)
                 if v.stage == 0 and v.rows == 1 and v.seq_len == bucket)
    last = next(v for v in bundle.variants
                if v.stage == bundle.n_stages - 1 and v.rows == 1 and v.seq_len == bucket)
    # (Bundle.run_cpu_model picks a stage variant by batch size only: one bucket.)
    return bundle._cpu(first, [px, pm], last.outputs)["output0"][:, :n]
