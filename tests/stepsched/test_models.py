"""The step scheduler's models compiled with TVM (tiny configurations) against numpy
references from the same weights; selective batching with a KV cache against a
from-scratch recomputation."""
import numpy as np
import pytest

from paella.bundle import load_bundle
from paella.models.gpt import (NEG, GPTConfig, generate_reference, gpt_iteration, gpt_weights,
                               selective_iteration)
from paella.models.rnn import (RNNConfig, decoder_cell, decoder_reference, lstm_cell,
                               lstm_reference)


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    from paella.compiler_pass.build import compile_bundle
    root = tmp_path_factory.mktemp("steps")
    return lambda m: load_bundle(compile_bundle(m, root / m.name))


def test_lstm_cell_matches_numpy(build):
    m = lstm_cell(3, RNNConfig.tiny())
    rng = np.random.default_rng(1)
    x, h, c = (rng.standard_normal((3, 16)).astype(np.float32) for _ in range(3))
    out = list(build(m).run_cpu({"x": x, "h": h, "c": c}).values())
    for got, want in zip(out, lstm_reference(x, h, c, *m.params)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_decoder_cell_feeds_its_argmax(build):
    m = decoder_cell(2, RNNConfig.tiny())
    rng = np.random.default_rng(2)
    tok = np.array([0, 31], np.int32)
    h, c = (rng.standard_normal((2, 16)).astype(np.float32) for _ in range(2))
    nxt, h2, c2 = build(m).run_cpu({"tok": tok, "h": h, "c": c}).values()
    want = decoder_reference(tok, h, c, m.params)
    np.testing.assert_array_equal(nxt, want[0])
    np.testing.assert_allclose(h2, want[1], rtol=1e-4, atol=1e-5)


def test_selective_batching_with_kv_cache_equals_recomputation():
    cfg = GPTConfig.tiny()
    w = gpt_weights(cfg)
    kv = np.zeros((2 * cfg.n_layer, 40, cfg.d), np.float32)
    prompts = {"a": [3, 7, 1, 9], "b": [5, 2], "c": [11]}
    slots = {"a": list(range(0, 12)), "b": list(range(30, 38)), "c": list(range(12, 20))}
    out = {k: [] for k in prompts}
    # a and b start together; c joins on the third iteration; b leaves after 3 tokens
    live = ["a", "b"]
    for step in range(6):
        if step == 2:
            live.append("c")
        reqs = []
        for k in live:
            new = prompts[k] if not out[k] else [out[k][-1]]
            first = 0 if not out[k] else len(prompts[k]) + len(out[k]) - 1
            reqs.append((new, first, slots[k]))
        for k, t in zip(live, selective_iteration(cfg, w, kv, reqs)):
            out[k].append(t)
        if len(out["b"]) == 3 and "b" in live:
            live.remove("b")
    for k in prompts:
        assert out[k] == generate_reference(cfg, w, prompts[k], len(out[k])), k


def test_compiled_iteration_matches_selective_numpy(build):
    cfg = GPTConfig.tiny()
    S = 16
    a, b = [3, 7, 1, 9], [5, 2]
    slots = [0, 1, 2, 3, 8, 9]
    write = np.zeros((6, S), np.float32)
    write[np.arange(6), slots] = 1
    mask = np.full((6, S), NEG, np.float32)
    for i in range(4):
        mask[i, :i + 1] = 0
    for i in range(2):
        mask[4 + i, 8:9 + i] = 0
    kv = np.zeros((2 * cfg.n_layer, S, cfg.d), np.float32)
    bundle = build(gpt_iteration(cfg, 6, S))
    nxt, kv2 = bundle.run_cpu({"tok": np.array(a + b, np.int32), "pos": np.array([0, 1, 2, 3, 0, 1], np.int32),
                               "write": write, "mask": mask, "kv": kv}).values()
    ref_kv = np.zeros_like(kv)
    want = selective_iteration(cfg, gpt_weights(cfg), ref_kv, [(a, 0, [0, 1, 2, 3]), (b, 0, [8, 9])])
    assert [int(nxt[3]), int(nxt[5])] == want
    np.testing.assert_allclose(kv2, ref_kv, rtol=1e-4, atol=1e-4)


def test_treelstm_cells_and_the_encoder_match_numpy(build):
    """The cells the ``cellular`` plug-in serves: compiled by TVM, against the numpy
    references its effects compute, on the same seeded weights."""
    from paella.models.rnn import (encoder_cell, tree_internal_cell, tree_internal_reference,
                                   tree_leaf_cell, tree_leaf_reference)
    cfg, rng = RNNConfig.tiny(), np.random.default_rng(3)
    f = lambda: rng.standard_normal((4, 16)).astype(np.float32)      # noqa: E731
    m = tree_leaf_cell(4, cfg)
    x = f()
    for got, want in zip(build(m).run_cpu({"x": x}).values(), tree_leaf_reference(x, *m.params)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    m = tree_internal_cell(4, cfg)
    hl, cl, hr, cr = f(), f(), f(), f()
    got = build(m).run_cpu({"hl": hl, "cl": cl, "hr": hr, "cr": cr}).values()
    for got, want in zip(got, tree_internal_reference(hl, cl, hr, cr, *m.params)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    m = encoder_cell(4, cfg)
    tok, h, c = np.array([0, 5, 31, 7], np.int32), f(), f()
    emb, w, b = m.params
    got = build(m).run_cpu({"tok": tok, "h": h, "c": c}).values()
    for got, want in zip(got, lstm_reference(emb[tok], h, c, w, b)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
