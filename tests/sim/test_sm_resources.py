"""The engine's SM state answers exactly what SMResources (the Occupancy Calculator's
rules, checked against NVIDIA's header in tests/test_occupancy.py) answers."""
from __future__ import annotations

import random

import numpy as np
import pytest

from paella.dispatcher.devices.sim import CostModel
from paella.dispatcher.devices.sim.hardware import Shapes, SMView, build_engine
from paella.gpus import preset
from paella.occupancy import OccupancyError, SMResources, footprint


def _view(r) -> tuple:
    return (list(r.blocks), list(r.warps), list(r.smem), list(r.regs), r.used())


def _engine_view(spec) -> SMView:
    engine = build_engine(spec, CostModel(), 4, np.zeros(64, np.uint64))
    return SMView(spec, engine, Shapes(engine))


@pytest.mark.parametrize("gpu", ["t4", "a100", "gtx1660s", "p100", "titanxp", "h100"])
def test_random_placements_match_smresources_step_by_step(gpu):
    spec = preset(gpu).with_(sm_count=4)
    rng = random.Random(11)
    fps = []
    while len(fps) < 12:
        try:
            fps.append(footprint(spec, rng.choice([32, 96, 128, 256, 1024]), rng.choice([0, 16, 40, 72, 96]),
                                 rng.choice([0, 0, 4096, 30000])))
        except OccupancyError:
            continue
    ref, eng = SMResources(spec), _engine_view(spec)
    live = []                                    # (sm, fp, n, split)
    for step in range(4000):
        if live and rng.random() < 0.45:
            sm, fp, n, split = live.pop(rng.randrange(len(live)))
            ref.give(sm, fp, n, split)
            eng.give(sm, fp, n, split)
        else:
            sm, fp = rng.randrange(spec.sm_count), rng.choice(fps)
            k = ref.fit(sm, fp)
            assert eng.fit(sm, fp) == k, step
            if k:
                n = rng.randint(1, k)
                split = ref.take(sm, fp, n)
                assert eng.take(sm, fp, n) == split, step
                live.append((sm, fp, n, split))
        assert _view(eng) == _view(ref), step


def test_take_that_does_not_fit_raises_and_changes_nothing():
    spec = preset("t4").with_(sm_count=1)
    eng = _engine_view(spec)
    fp = footprint(spec, 1024, 32)
    before = _view(eng)
    with pytest.raises(AssertionError, match="fit"):
        eng.take(0, fp, 2)
    assert _view(eng) == before


def test_a_spec_without_throughput_figures_is_refused_with_the_cause():
    with pytest.raises(ValueError, match="peak_flops"):
        build_engine(preset("t4").with_(peak_flops=0.0), CostModel(), 4, np.zeros(64, np.uint64))
