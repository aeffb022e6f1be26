"""``paella experiment cellular`` and ``orca``: the workload generators, the equal-latency
interpolation, and small runs through the step runtime (tiny models, virtual time)."""
import numpy as np
import pytest

from paella.experiments import cellular, orca
from paella.models.rnn import RNNConfig, lstm_cell
from paella.stepsched.step_kernels import compile_steps


def test_wmt_like_lengths_have_the_papers_mean_and_maximum():
    L = cellular.wmt_like_lengths(20000, seed=3)
    assert abs(L.mean() - 24) < 1.0 and L.max() <= 330 and L.min() >= 1
    a = cellular.poisson_arrivals(1000.0, 20000, seed=3)
    assert abs(np.mean(np.diff(a)) - 1e-3) < 5e-5 and np.all(np.diff(a) > 0)


def test_orca_trace_is_uniform_in_the_chapters_ranges():
    p, o = orca.trace(5000, seed=2)
    assert p.min() >= 32 and p.max() <= 512 and o.min() >= 1 and o.max() <= 128
    assert abs(p.mean() - 272) < 8 and abs(o.mean() - 64.5) < 3


def test_throughput_at_equal_latency_interpolates_along_the_sweep():
    pts = [{"offered": 10, "throughput": 10.0, "median_norm_latency_ms": 4.0},
           {"offered": 20, "throughput": 20.0, "median_norm_latency_ms": 6.0},
           {"offered": 30, "throughput": 24.0, "median_norm_latency_ms": 10.0}]
    assert orca.throughput_at(pts, 8.0) == pytest.approx(22.0)
    assert orca.throughput_at(pts, 12.0) == 24.0
    assert orca.throughput_at(pts, 3.0) == 0.0          # never that fast: nothing sustained


@pytest.fixture(scope="module")
def tiny_lstm(tmp_path_factory):
    root = tmp_path_factory.mktemp("cells")
    return compile_steps(lambda n: lstm_cell(n, RNNConfig.tiny()), (1, 2, 4, 8), root)


def test_cellular_beats_graph_batching_on_variable_lengths(tiny_lstm, monkeypatch):
    monkeypatch.setattr(cellular, "BSIZES", (1, 2, 4, 8))
    L = cellular.wmt_like_lengths(120, seed=1)
    pts = {s: cellular.run_point(s, 20000.0, L, tiny_lstm, cpu_scale=0.0) for s in ("cellular", "graph")}
    assert pts["cellular"]["p90_ms"] < pts["graph"]["p90_ms"]
    assert pts["graph"]["padded_cells"] > 0 and pts["cellular"]["padded_cells"] == 0
    assert pts["cellular"]["rows"] == L.sum()             # every cell once, no padding


def test_orca_streams_first_tokens_long_before_request_level_batching():
    p, o = orca.trace(24, seed=1)
    kw = dict(max_bs=8, n_slots=8192)
    pts = {s: orca.run_point(s, 200.0, p // 8, o // 8 + 1, **kw) for s in ("orca", "request")}
    assert pts["orca"]["ttft_p50_ms"] < pts["request"]["ttft_p50_ms"]
    assert pts["orca"]["median_norm_latency_ms"] < pts["request"]["median_norm_latency_ms"]
    assert pts["orca"]["inter_token_p50_ms"] > 0 and "inter_token_p50_ms" not in pts["request"]


@pytest.mark.parametrize("model", ["seq2seq", "treelstm"])
def test_cellular_beats_graph_batching_on_seq2seq_and_trees_with_the_served_engine(model, tmp_path_factory):
    """The experiment drives the engine the daemon serves (timing only), tiny cells."""
    from paella.stepsched.cellular_plugin import compile_cells
    k = compile_cells(model, RNNConfig.tiny(), (1, 2, 4, 8), bundle_dir=tmp_path_factory.mktemp("c"))
    wl = cellular.seq2seq_lengths(80, 1) if model == "seq2seq" else cellular.treebank_like(80, 1)
    pts = {s: cellular.run_point(s, 5000.0, wl, k, model=model, cpu_scale=0.0)
           for s in ("cellular", "graph")}
    assert pts["cellular"]["p90_ms"] < pts["graph"]["p90_ms"]
    cells = wl.sum() if model == "seq2seq" else sum(len(p) for p in wl)
    assert pts["cellular"]["rows"] == cells                 # every cell once
    assert len(cellular.full_binary_tree(np.random.default_rng(0), 7)) == 13
