"""The timing model's parameters, and calibrate's arithmetic (plan times, bound split, the
feature bound on any cost model built from per-kernel work)."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from paella.dispatcher.devices.sim import CostModel
from paella.experiments import calibrate
from paella.gpus import preset

US = 1e-6


@pytest.mark.parametrize("kw", [{"launch_latency": -1e-6}, {"mem_latency": -1e-9}, {"line_bytes": 0}])
def test_cost_model_rejects_unphysical_parameters(kw):
    with pytest.raises(ValueError, match="must be"):
        CostModel(**kw)


def _bundle(launches, copies=(4096, 4000)):
    """A duck-typed bundle: ``launches`` is [(name, grid, block, registers, flops, bytes)]."""
    kernels = {n: SimpleNamespace(name=n, registers=r, static_smem=0, flops=f, bytes=b)
               for n, _, _, r, f, b in launches}
    plan = [SimpleNamespace(op="h2d", nbytes=copies[0])]
    plan += [SimpleNamespace(op="launch", kernel=n, grid=list(g), block=list(bl), dyn_smem=0, nbytes=None)
             for n, g, bl, *_ in launches]
    plan.append(SimpleNamespace(op="d2h", nbytes=copies[1]))
    variant = SimpleNamespace(kernels=list(kernels.values()), plan=plan, kernel=kernels.__getitem__,
                              launches=lambda: [op for op in plan if op.op == "launch"])
    return SimpleNamespace(model="tiny", variants=[variant])


def test_a_plan_on_one_stream_takes_its_copies_plus_its_kernels_in_sequence():
    spec = preset(calibrate.GPU)
    cost = CostModel()
    # 160 blocks of 8 warps: one full wave at 32 warps per SM, compute-bound at the peak;
    # the second kernel is memory-bound at full occupancy: its time is its bytes at the
    # bandwidth. Each pays one launch latency and one memory latency.
    b = _bundle([("compute", (160,), (256,), 32, spec.peak_flops * 1e-4, 1.0),
                 ("memory", (160,), (256,), 32, 1.0, spec.mem_bw * 2e-4)])
    seconds, records = calibrate.run_plan(b, record=True)
    per_kernel = cost.launch_latency + cost.mem_latency
    copies = cost.copy_time(spec, 4096) + cost.copy_time(spec, 4000)
    assert seconds == pytest.approx(copies + 2 * per_kernel + 1e-4 + 2e-4, rel=1e-6)
    split = calibrate.bound_split(records)
    assert split["compute"] == pytest.approx(1e-4 / 3e-4, rel=0.02)
    assert split["memory"] == pytest.approx(2e-4 / 3e-4, rel=0.02)
    assert calibrate.copies_time(b) == pytest.approx(copies)


def test_features_count_waves_and_the_busiest_sm():
    spec = preset(calibrate.GPU)
    # 1024-thread blocks: one per SM, so 80 blocks are two waves on 40 SMs; 10 blocks
    # leave 30 SMs idle and the busiest SM does a tenth of the work.
    f = calibrate.features(_bundle([("two_waves", (80,), (1024,), 16, 8e6, 1e6),
                                    ("small", (10,), (1024,), 16, 1e6, 0.0)]))
    assert f["launches"] == 2
    assert f["waves"] == 2 + 1
    assert f["blocks"] == 90
    per_sm = spec.peak_flops / spec.sm_count
    assert f["busiest_sm"] == pytest.approx(2 * 8e6 / 80 / per_sm + 1e6 / 10 / per_sm)
    assert f["busiest_sm_occupancy"] == pytest.approx(f["busiest_sm"])     # full occupancy
    assert f["serial"] == pytest.approx(2 * 8e6 / (80 * 1024) + 1e6 / (10 * 1024))
    assert f["flops"] == pytest.approx(9e6 / spec.peak_flops)
    assert set(f) == set(calibrate.FEATURES)


def test_low_occupancy_raises_the_latency_feature():
    # One 128-thread block per SM is 4 of 32 warps: an eighth of the latency hiding.
    f = calibrate.features(_bundle([("thin", (40,), (128,), 32, 1e6, 0.0)]))
    assert f["busiest_sm_occupancy"] == pytest.approx(8 * f["busiest_sm"])


def test_feature_bound_is_zero_when_the_paper_follows_the_work():
    feats = {"a": {"x": 1.0, "y": 2.0}, "b": {"x": 2.0, "y": 4.0}}
    bound = calibrate.feature_bound(feats, {"a": 1e-3, "b": 2e-3}, {"a": 0.0, "b": 0.0})
    assert bound["bound"] == 0.0


def test_feature_bound_when_the_smaller_model_is_slower_in_the_paper():
    # "a" has at most half of "b" in every feature, yet the paper has it 2x slower:
    # sim(a) <= sim(b) / 2, so e >= (2 - 0.5) / (2 + 0.5) = 60% on one of them.
    feats = {"a": {"x": 1.0, "y": 1.0}, "b": {"x": 2.0, "y": 4.0}}
    bound = calibrate.feature_bound(feats, {"a": 2e-3, "b": 1e-3}, {"a": 0.0, "b": 0.0})
    assert bound["bound"] == pytest.approx(0.6)
    assert (bound["slower"], bound["faster"], bound["feature"]) == ("a", "b", "x")
    # The bound is tight: weights that split the error evenly reach it.
    e = bound["bound"]
    assert (1 - e) * 2e-3 == pytest.approx(0.5 * (1 + e) * 1e-3)


def test_feature_bound_ignores_a_pair_one_feature_separates():
    # "a" has some of a feature "b" lacks entirely: a weight on it alone fits any ratio.
    feats = {"a": {"x": 1.0, "y": 1.0}, "b": {"x": 2.0, "y": 0.0}}
    bound = calibrate.feature_bound(feats, {"a": 2e-3, "b": 1e-3}, {"a": 0.0, "b": 0.0})
    assert bound["bound"] == 0.0 and math.isfinite(bound["bound"])
