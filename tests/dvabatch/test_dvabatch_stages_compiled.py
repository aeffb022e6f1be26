"""Compiled DVABatch stages of the BERT-like encoder: each stage a bundle with one
variant per batch size, carrying the whole model's weights, so the stages run one after
the other give the whole model's outputs -- and a sub-range of a batch (a stretch's late
rows) run through the smaller variants gives the same rows. Compiles are cached (the
zoo cache): about 70 s the first time, seconds after."""
from __future__ import annotations

import numpy as np
import pytest

from paella.bundle import load_bundle
from paella.compiler_pass.build import compile_bundle
from paella.models.transformer import bert_encoder, bert_encoder_stage

KW = dict(hidden=16, heads=2, ffn=32)


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    d = tmp_path_factory.mktemp("stages")
    full = bert_encoder(batch=2, seq_len=8, layers=2, **KW)
    full.batch, full.seq_len = 2, 8
    stages = [load_bundle(compile_bundle([bert_encoder_stage(r, b, 8, 2, **KW) for b in (1, 2)],
                                         d / f"s{r.start}"))
              for r in (range(0, 1), range(1, 2))]
    return load_bundle(compile_bundle(full, d / "full")), stages


def out(bundle, inputs, variant):
    return next(iter(bundle.run_cpu(inputs, variant=variant).values()))


@pytest.mark.slow
def test_stages_compose_to_the_whole_model(bundles):
    full, (s0, s1) = bundles
    assert [v.batch for v in s0.variants] == [1, 2] == [v.batch for v in s1.variants]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 8, 16)).astype("float32")
    mask = np.ones((2, 8), "float32")
    mask[1, 5:] = 0
    want = out(full, {"x": x, "mask": mask}, 0)
    h = out(s0, {"x": x, "mask": mask}, 1)
    np.testing.assert_allclose(out(s1, {"x": h, "mask": mask}, 1), want, rtol=1e-5, atol=1e-5)
    # Row 1 alone through the batch-1 variants (a late query catching up).
    h1 = out(s0, {"x": x[1:], "mask": mask[1:]}, 0)
    np.testing.assert_allclose(out(s1, {"x": h1, "mask": mask[1:]}, 0), want[1:],
                               rtol=1e-5, atol=1e-5)


def test_a_stage_must_be_layers_of_the_model():
    with pytest.raises(ValueError, match="not a stage"):
        bert_encoder_stage(range(1, 3), total_layers=2, **KW)
