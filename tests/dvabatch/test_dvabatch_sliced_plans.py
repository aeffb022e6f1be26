"""DVABatch stages cut from the compiled (fused) model: ``paella compile --stages``.

The small U-Net-like and ResNet-152-like networks are compiled for batch sizes 1, 2
and 4 and cut into stages; each stage variant's plan is replayed on the CPU
(``Bundle.run_stage_cpu``: the plan's own buffers, copies and storage
reuse, each fused call run by its llvm build), so what is checked is the cut plans'
dataflow. Bundles come from the compile cache after the first run (about a minute for
both models the first time, seconds after).
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from paella.bundle import (BufferSpec, CallSpec, KernelArg, KernelSpec, Op, TensorSpec, Variant,
                           ViewSpec, load_bundle, split_rows)
from paella.compiler_pass.build import compile_bundle
from paella.compiler_pass.stage_variants import allowed_cuts, boundaries, call_times
from paella.compiler_pass.stages import OpProfile, preferred_batch, slice_stages
from paella.models import zoo

SIZES = (1, 2, 4)
STAGES = {"unet_small": 3, "resnet152_small": 4}
TOL = dict(rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def sliced(tmp_path_factory):
    d = tmp_path_factory.mktemp("sliced")
    out = {}
    for name, n in STAGES.items():
        models = [zoo.get(name, batch=b) for b in SIZES]
        whole = load_bundle(compile_bundle(models, d / f"{name}_whole"))
        out[name] = (load_bundle(compile_bundle(models, d / name, stages=n)), whole)
    return out


def _inputs(bundle, batch, seed=0):
    rng = np.random.default_rng(seed)
    v = bundle.variants[bundle.stage_variant(0, batch)]
    return {t.name: rng.standard_normal(t.shape).astype(t.dtype) for t in v.inputs}


def _chain(bundle, inputs, batch):
    h = inputs
    for s in range(bundle.n_stages):
        h = bundle.run_stage_cpu(h, bundle.stage_variant(s, batch))
    return h


@pytest.mark.slow
@pytest.mark.parametrize("name", list(STAGES))
def test_chained_stages_give_the_whole_models_outputs(sliced, name):
    bundle, _ = sliced[name]
    assert bundle.n_stages == STAGES[name]
    assert [(v.stage, v.rows) for v in bundle.variants] == \
        [(s, b) for s in range(STAGES[name]) for b in SIZES]
    for b in SIZES:
        x = _inputs(bundle, b)
        want = bundle.run_cpu_model(x, b)
        got = _chain(bundle, x, b)
        assert got.keys() == want.keys()
        for k in want:
            np.testing.assert_allclose(got[k], want[k], **TOL)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(STAGES))
def test_every_boundary_tensor_has_a_buffer_of_its_own(sliced, name):
    """``own_boundary_buffers``: each stage variant's ins and outs are alone in their
    buffer (byte 0, the buffer exactly their size), so the daemon can bind that buffer
    to rows of a pair's device memory; an out that only passes through shares its in's.
    (TVM's static plan had them beside intermediates; the chained stages above still
    give the whole model's outputs, and a row range at an offset its rows': below.)"""
    bundle, _ = sliced[name]
    for v in bundle.variants:
        ts = [*v.inputs, *v.outputs]
        for t in ts:
            assert t.buffer_offset == 0 and v.buffers[t.buffer].nbytes == t.nbytes, (v.name, t)
        for t in v.outputs:
            twin = [u for u in v.inputs if u.buffer == t.buffer]
            assert not twin or twin[0].nbytes == t.nbytes, (v.name, t.name)
        assert len({t.buffer for t in v.inputs}) == len(v.inputs), v.name


@pytest.mark.parametrize("name", list(STAGES))
def test_stage_io_is_boundary_in_then_out_and_batch_major(sliced, name):
    bundle, _ = sliced[name]
    n = bundle.n_stages
    for b in SIZES:
        vs = [bundle.variants[bundle.stage_variant(s, b)] for s in range(n)]
        for s in range(n - 1):           # stage s's outs are stage s+1's ins, same layout
            assert [(t.name, t.shape, t.dtype) for t in vs[s].outputs] == \
                [(t.name, t.shape, t.dtype) for t in vs[s + 1].inputs]
            assert all(t.name.startswith(f"cut{s + 1}.") for t in vs[s].outputs)
        assert [t.name for t in vs[0].inputs] == ["x"] and [t.name for t in vs[-1].outputs] == ["output0"]
        for v in vs:
            ends = [t.offset for t in v.inputs + v.outputs]
            assert ends == sorted(ends) and v.cuts == vs[0].cuts and v.stage_seconds > 0
            for t in v.inputs + v.outputs:
                assert t.shape[0] % b == 0
    one = bundle.variants[bundle.stage_variant(1, 1)]
    four = bundle.variants[bundle.stage_variant(1, 4)]
    assert [t.nbytes * 4 for t in one.inputs] == [t.nbytes for t in four.inputs]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(STAGES))
def test_a_row_range_runs_through_smaller_variants_at_its_offset(sliced, name):
    """Rows 1..3 of a batch of 4, run stage by stage as split_rows says (a batch-2
    variant at row 1, a batch-1 at row 3) on the rows of each boundary's batch buffer,
    give those rows' outputs of the whole batch."""
    bundle, _ = sliced[name]
    cap, start, num = 4, 1, 3
    x = _inputs(bundle, cap, seed=1)
    want = _chain(bundle, x, cap)
    pieces = split_rows(start, num, SIZES)
    assert pieces == [(1, 2), (3, 1)]
    # One buffer per boundary tensor, holding `cap` rows: (cap, row...) arrays.
    bufs = {k: a.reshape(cap, -1) for k, a in x.items()}
    for s in range(bundle.n_stages):
        for off, size in pieces:
            v = bundle.variants[bundle.stage_variant(s, size)]
            ins = {t.name: bufs[t.name][off:off + size].reshape(t.shape) for t in v.inputs}
            outs = bundle.run_stage_cpu(ins, bundle.stage_variant(s, size))
            for t in v.outputs:
                bufs.setdefault(t.name, np.zeros((cap, t.nbytes // size // np.dtype(t.dtype).itemsize), t.dtype))
                bufs[t.name][off:off + size] = outs[t.name].reshape(size, -1)
    for k, w in want.items():
        np.testing.assert_allclose(bufs[k][start:start + num].reshape(w[start:start + num].shape),
                                   w[start:start + num], **TOL)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(STAGES))
def test_cuts_obey_slice_stages(sliced, name):
    """Every cut is at an allowed place, the cuts are slice_stages' on the slicing
    units' profiles (the calls between allowed cuts), and the stage times add up to the
    whole model's."""
    bundle, whole = sliced[name]
    cuts = bundle.variants[0].cuts
    n = bundle.n_stages
    assert len(cuts) == n - 1 and cuts == sorted(set(cuts))
    ok, _ = allowed_cuts(whole.variants)
    assert all(ok[c] for c in cuts)
    units = [0] + [c for c in range(1, len(ok) - 1) if ok[c]] + [len(ok) - 1]
    times = {v.rows: call_times(whole, i, "t4") for i, v in enumerate(whole.variants)}
    profs = [OpProfile(str(a), tuple((b, sum(times[b][a:e])) for b in SIZES)) for a, e in zip(units, units[1:])]
    assert [units[r.start] for r in slice_stages(profs, n)[1:]] == cuts
    for b in SIZES:
        total = sum(bundle.variants[bundle.stage_variant(s, b)].stage_seconds for s in range(n))
        assert total == pytest.approx(sum(times[b]), rel=1e-9)


def _op(name: str, pref: int, t: float) -> OpProfile:
    """Flat up to batch ``pref``, then proportional."""
    return OpProfile(name, tuple((b, t * max(b, pref) / pref) for b in (1, 2, 4, 8, 16, 32, 64)))


def test_slicing_is_even_in_time_and_moves_a_cut_to_a_preference_change_within_tolerance():
    """The paper's rule first: stages even in time. A cut moves to where the preferred
    batch size changes only if the longest stage stays within the tolerance."""
    ops = [_op("stem", 64, 0.01)] + [_op(f"a{i}", 8, 1) for i in range(4)] + \
          [_op(f"b{i}", 2, 1) for i in range(4)]
    assert [preferred_batch(o) for o in ops] == [64] + [8] * 4 + [2] * 4
    # at batch 64: a_i 8, b_i 32; the change (index 5) would leave stages of 32 and 128
    assert slice_stages(ops, 2) == [range(0, 6), range(6, 9)]            # 64 | 96
    assert slice_stages(ops, 2, tolerance=0.4) == [range(0, 5), range(5, 9)]
    # A run of identical operators (ResNet's third stage) is cut evenly, not left whole.
    blocks = [_op("stem", 64, 10)] + [_op(f"r{i}", 4, 1) for i in range(30)]   # 10, 16 x 30
    stages = slice_stages(blocks, 4)
    times = [sum(blocks[i].time(64) for i in r) for r in stages]
    assert times == [122, 112, 128, 128]
    with pytest.raises(ValueError):
        slice_stages(ops, 2, tolerance=-1)


def test_even_cuts_minimise_the_longest_stage():
    from paella.compiler_pass.stages import even_cuts
    import itertools
    t = [5.0, 1.0, 1.0, 7.0, 2.0, 2.0, 3.0, 1.0]
    best = min(max(sum(t[a:b]) for a, b in zip((0, *c), (*c, len(t))))
               for c in itertools.combinations(range(1, len(t)), 2))
    cuts = even_cuts(t, 3)
    assert max(sum(t[a:b]) for a, b in zip((0, *cuts), (*cuts, len(t)))) == best
    assert even_cuts(t, 1) == [] and len(even_cuts(t, len(t))) == len(t) - 1
    with pytest.raises(ValueError):
        even_cuts(t, len(t) + 1)


@pytest.mark.parametrize("seed", range(20))
def test_even_cuts_match_brute_force_on_random_profiles(seed):
    """The shortest longest stage, then the least sum of squares, as exhaustive search
    finds them (times with ties and zeros included)."""
    from paella.compiler_pass.stages import even_cuts
    import itertools
    import random
    rng = random.Random(seed)
    t = [rng.choice([0.0, 1.0, 2.0, rng.random() * 5]) for _ in range(rng.randint(1, 9))]
    n = rng.randint(1, len(t))

    def cost(c):
        segs = [sum(t[a:b]) for a, b in zip((0, *c), (*c, len(t)))]
        return max(segs), sum(x * x for x in segs)
    want = min(cost(c) for c in itertools.combinations(range(1, len(t)), n - 1))
    got = cost(tuple(even_cuts(t, n)))
    assert got[0] == pytest.approx(want[0], abs=1e-9)
    assert got[1] == pytest.approx(want[1], abs=1e-9)


def _kernel(name: str, access: list[str]) -> KernelSpec:
    return KernelSpec(name, [1, 1, 1], [32, 1, 1], 0, 0, 16, 0.0, 0,
                      [{"name": f"a{i}", "kind": "buffer", "dtype": "float32", "access": a}
                       for i, a in enumerate(access)], False)


def test_boundaries_follow_storage_reuse():
    """One storage (buffer 1) holds A at 0, B at 16, then C at 0 again (A's bytes):
    across each cut, exactly the tensors written before and read after are live."""
    def view(buf, off):
        return ViewSpec(buf, off, [1, 4], "float32")
    calls = [(view(0, 0), view(1, 0)),      # c0: A = f(x)
             (view(1, 0), view(1, 16)),     # c1: B = f(A)
             (view(1, 16), view(1, 0)),     # c2: C = f(B), over A
             (view(1, 0), view(2, 0))]      # c3: y = f(C)  (B is dead by now)
    kernels = [_kernel("k", ["r", "w"])]
    plan = [Op("h2d", buffer=0, io_offset=0, nbytes=16)]
    plan += [Op("launch", kernel="k", grid=[1, 1, 1], block=[32, 1, 1],
                args=[KernelArg(a.buffer, a.offset), KernelArg(b.buffer, b.offset)]) for a, b in calls]
    plan.append(Op("d2h", buffer=2, io_offset=64, nbytes=16))
    v = Variant("v", [TensorSpec("x", [1, 4], "float32", 0, 16, 0)],
                [TensorSpec("y", [1, 4], "float32", 64, 16, 2)],
                [BufferSpec(0, "x", 16, "input"), BufferSpec(1, "s", 32, "intermediate"),
                 BufferSpec(2, "y", 16, "intermediate")], kernels, plan, 80, batch=1,
                calls=[CallSpec("f", [i, i + 1], list(c)) for i, c in enumerate(calls)])
    key = lambda ts: [(t.buffer, t.offset) for t in ts]  # noqa: E731
    assert key(boundaries(v, 1)) == [(1, 0)]            # A
    assert key(boundaries(v, 2)) == [(1, 16)]           # B (A is dead, C not yet written)
    assert key(boundaries(v, 3)) == [(1, 0)]            # C, in A's old bytes
    assert key(boundaries(v, 4)) == [(2, 0)]            # y, for its D2H


def test_split_rows_is_the_binary_decomposition():
    assert split_rows(5, 13, (1, 2, 4, 8, 16, 32, 64)) == [(5, 8), (13, 4), (17, 1)]
    assert split_rows(0, 64, (1, 2, 4, 8, 16, 32, 64)) == [(0, 64)]
    assert split_rows(3, 7, range(1, 65)) == [(3, 7)]
    assert split_rows(2, 0, (1, 2)) == []
    with pytest.raises(ValueError, match="lack 1"):
        split_rows(0, 3, (2, 4))


def _paella(*args: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / "paella"
    cmd = [str(exe)] if exe.is_file() else [sys.executable, "-m", "paella.cli"]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("value, message", [("0", "positive integer"), ("two", "positive integer"),
                                            ("50", "at most")])
def test_bad_stages_values_are_errors(tmp_path, value, message):
    r = _paella("compile", "tiny_cnn", "-o", str(tmp_path / "b"), "-q", "--stages", value)
    assert r.returncode == 2, r.stderr
    assert "paella: error:" in r.stderr and message in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "b").exists()


@pytest.fixture(scope="module")
def experiment_model(sliced, tmp_path_factory):
    """The small ResNet-152-like network as ``paella experiment dvabatch`` serves it: its
    4-stage bundle (DVABatch) and its 1-stage bundle (the baselines)."""
    from paella.experiments import dvabatch as exp
    bundle, _ = sliced["resnet152_small"]
    models = [zoo.get("resnet152_small", batch=b) for b in SIZES]
    one = load_bundle(compile_bundle(models, tmp_path_factory.mktemp("one") / "r", stages=1))
    return exp.StagedModel("resnet152", bundle, one)


@pytest.mark.slow
def test_the_experiment_serves_through_the_daemons_batcher(experiment_model):
    """Every system of ``paella experiment dvabatch`` is the ``dvabatch`` batcher behind
    the batching stage, on the compiled variants' launch plans: DVABatch's stage jobs
    bound to the pairs' device memory (no boundary byte through the host), runs of rows
    between compiled sizes in pieces, and no query faster than its kernels allow."""
    from paella.stepsched.dvabatch.batcher import DvaBatcher
    from paella.experiments import dvabatch as exp
    m = experiment_model
    assert m.n_stages == 4 and m.sizes == list(SIZES) and m.buckets == ()
    assert m.time(1, 3, 0) == pytest.approx(m.time(1, 2, 0) + m.time(1, 1, 0)) and m.time(1, 1, 0) > 0
    assert m.time(-1, 2, 0) == pytest.approx(sum(m.time(s, 2, 0) for s in range(4)), rel=1e-6)
    rec = m.record()
    assert rec["stages"][1][0] == m.staged.variants[0].cuts[0] and rec["source"] == "compiled"
    srv = exp.Server(m, "dvabatch", 0.0, seed=1)
    assert isinstance(srv.batcher, DvaBatcher) and srv.stage.models[exp.MODEL_ID].ctx is not None
    rate = 0.8 * 4 / m.time(-1, 4, 0)               # busy enough to batch
    for system in ("dvabatch", "zerobatch", "delaybatch"):
        pt = exp.run_point(m, system, rate=rate, n=80, seed=1, window=1e-3)
        assert pt["handoff"] == "device" and pt["boundary_host_bytes"] == 0, pt
        assert pt["throughput"] > 0 and pt["jobs"] >= pt["new"] > 0, pt
        # No answer before its kernels can have run (the simulator's timing, not a
        # fixed duration): the whole model's isolated time at batch 1.
        assert pt["p50_ms"] >= 1e3 * m.time(-1, 1, 0) * 0.95, pt
        if system == "dvabatch":
            assert pt["mean_stage_batch"] > 1 and pt["new"] < 80, pt     # it batched
        else:
            assert pt["stretch"] == pt["split"] == 0, pt


@pytest.mark.slow
def test_the_experiment_writes_the_issue_keys(experiment_model, monkeypatch):
    """``run`` (what the command runs), small: every summary key the issue names, finite,
    for every load."""
    from paella.experiments import dvabatch as exp
    monkeypatch.setattr(exp, "compiled_model", lambda name, zoo_dir, log: experiment_model)
    data = exp.run(["resnet152"], n=60, seed=1, windows_ms=[1.0], steps=1, log=lambda m: None)
    s = data["summary"]
    for key in ("avg_latency_reduction_vs_zerobatch", "p99_latency_reduction_vs_zerobatch",
                "avg_latency_reduction_vs_delaybatch"):
        assert set(s[key]) == {"low", "medium", "high"}
        assert all(np.isfinite(v) for v in s[key].values())
    assert s["peak_throughput_ratio"]["resnet152"] > 0
    assert data["setting"]["path"].startswith("daemon batcher")
    pts = data["models"]["resnet152"]["loads"]["high"]
    assert pts["dvabatch"]["handoff"] == "device" and pts["zerobatch"]["mean_ms"] > 0


def test_a_peak_probe_stops_only_when_its_p99_must_miss():
    """The probe's early stop (``_late_count`` latencies over the limit) never changes
    the verdict: with that many over, numpy's p99 is over; with one fewer, it can be
    under."""
    from paella.experiments import dvabatch as exp
    rng = np.random.default_rng(3)
    for m in (54, 360, 1350):
        k = exp._late_count(m)
        lat = rng.uniform(0, 1, m)
        lat[:k] = 1.0 + 1e-9
        assert np.percentile(lat, 99) > 1.0
        lat = np.full(m, 0.5)
        lat[:k - 1] = 1.0 + 1e-9
        assert np.percentile(lat, 99) <= 1.0
    done = np.array([0.1, np.nan, np.nan, 0.5])
    arr = np.zeros(4)
    assert exp._late(done, arr, 4, now=0.3, stop_late=(0, 2, 0.2))        # one unanswered counts
    assert not exp._late(done, arr, 4, now=0.15, stop_late=(1, 2, 0.2))


def test_the_peak_search_reuses_a_bracket(monkeypatch):
    """A bracket another system met at ``lo`` and missed at ``hi`` is kept in two
    probes; one met at ``hi`` too is searched upward; below, None when not wanted."""
    from paella.experiments import dvabatch as exp
    probes: list[float] = []

    def point(cap):
        def run_point(m, system, rate, n, seed, window=0.0, probe=False):
            probes.append(rate)
            return None if rate > cap else {"p99_ms": 1.0, "throughput": rate}
        return run_point
    m = type("M", (), {"time": lambda self, s, r, l: 1.0, "max_len": 0})()
    monkeypatch.setattr(exp, "run_point", point(105.0))
    assert exp.peak(m, "zerobatch", 10, 1, steps=3, bracket=(100.0, 110.0)) == (100.0, 110.0)
    assert probes == [100.0, 110.0]
    probes.clear()
    monkeypatch.setattr(exp, "run_point", point(250.0))
    lo, hi = exp.peak(m, "dvabatch", 10, 1, steps=3, bracket=(100.0, 110.0))
    assert lo <= 250.0 < hi and hi - lo == pytest.approx(220.0 / 8) and probes[:3] == [100.0, 110.0, 220.0]
    monkeypatch.setattr(exp, "run_point", point(50.0))
    assert exp.peak(m, "delaybatch", 10, 1, steps=3, bracket=(100.0, 110.0), below=False) is None
    lo, hi = exp.peak(m, "delaybatch", 10, 1, steps=3, bracket=(100.0, 110.0))
    assert lo <= 50.0 < hi and hi - lo == pytest.approx(100.0 / 8)


@pytest.mark.slow
def test_a_stopped_probe_is_only_an_overloaded_one(experiment_model, monkeypatch):
    """A probe (``run_point(probe=True)``) within the QoS runs to the end, point for
    point the same as an ordinary run; one far past it stops (None) -- the small model
    is fast, so the QoS target is made small enough for its queue to pass it."""
    from paella.experiments import dvabatch as exp
    m = experiment_model
    rate = 0.3 * 4 / m.time(-1, 4, 0)
    assert exp.run_point(m, "dvabatch", rate, 60, 1, probe=True) == exp.run_point(m, "dvabatch", rate, 60, 1)
    monkeypatch.setattr(exp, "QOS_MS", 1e3 * m.time(-1, 1, 0))
    over = 20 * 64 / m.time(-1, 64, 0)
    assert exp.run_point(m, "zerobatch", over, 300, 1)["p99_ms"] > exp.QOS_MS
    assert exp.run_point(m, "zerobatch", over, 300, 1, probe=True) is None


def test_a_timing_only_bundle_has_kernels_and_plan_but_no_weights(tmp_path):
    """What the experiment compiles its full-size networks as: enough to time, nothing
    to serve -- and it says so instead of failing obscurely."""
    from paella.bundle import BundleError
    b = load_bundle(compile_bundle(zoo.get("tiny_cnn"), tmp_path / "t", timing_only=True))
    assert sorted(b.manifest.files) == ["cubin", "cuda_source", "ptx"]
    assert not (tmp_path / "t" / "params.npz").exists() and b.variants[0].launches()
    with pytest.raises(BundleError, match="no 'params' file"):
        b.params()


def test_a_manifest_without_the_stage_fields_still_loads(sliced):
    """Bundles from before stages (no calls, stage, cuts, stage_seconds) load as
    whole-model variants."""
    import json

    from paella.bundle import manifest_from_dict
    bundle, _ = sliced["unet_small"]
    d = json.loads((bundle.path / "manifest.json").read_text())
    for v in d["variants"]:
        for key in ("calls", "stage", "cuts", "stage_seconds"):
            del v[key]
    m = manifest_from_dict(d)
    assert all(v.stage == -1 and v.calls == [] and v.cuts == [] and v.stage_seconds == 0.0
               for v in m.variants)
