"""The variants of one model share one copy of its weights in the bundle."""
from __future__ import annotations

import numpy as np

from paella.bundle import load_bundle
from paella.compiler_pass.build import compile_bundle
from paella.models.transformer import tiny_encoder


def test_variants_share_one_params_file(tmp_path):
    models = [tiny_encoder(batch=b, seq_len=8) for b in (1, 2)]
    assert models[0].params[0] is not models[1].params[0] or not models[0].params[0].flags.writeable
    out = compile_bundle(models, tmp_path / "enc", cache_dir=tmp_path / "cache")
    b = load_bundle(out)
    assert len(b.variants) == 2 and "params" not in b.variants[1].files
    assert not (out / "variants" / b.variants[1].name / "params.npz").exists()
    assert b.file("params", 1) == b.file("params", 0)
    # Each variant still computes with them: the CPU build of variant 1 on two rows.
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 8, 16)).astype(np.float32)
    mask = np.ones((2, 8), np.float32)
    y1 = b.run_cpu({"x": x, "mask": mask}, variant=1)
    y0 = b.run_cpu({"x": x[:1], "mask": mask[:1]}, variant=0)
    name = b.variants[0].outputs[0].name
    np.testing.assert_allclose(y1[name][:1], y0[name], rtol=1e-4, atol=1e-5)
