"""The simulator's memoized SM states answer exactly what SMResources answers."""
from __future__ import annotations

import random

import pytest

from paella.dispatcher.devices.sim.smstate import SMStates
from paella.gpus import preset
from paella.occupancy import OccupancyError, SMResources, footprint


def _view(r) -> tuple:
    return (list(r.blocks), list(r.warps), list(r.smem), list(r.regs), r.used())


@pytest.mark.parametrize("gpu", ["t4", "a100", "gtx1660s"])
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
    ref, memo = SMResources(spec), SMStates(spec)
    live = []                                    # (sm, fp, n, split)
    for step in range(4000):
        if live and rng.random() < 0.45:
            sm, fp, n, split = live.pop(rng.randrange(len(live)))
            ref.give(sm, fp, n, split)
            memo.give(sm, fp, n, split)
        else:
            sm, fp = rng.randrange(spec.sm_count), rng.choice(fps)
            k = ref.fit(sm, fp)
            assert memo.fit(sm, fp) == k, step
            if k:
                n = rng.randint(1, k)
                split = ref.take(sm, fp, n)
                assert memo.take(sm, fp, n) == split, step
                live.append((sm, fp, n, split))
        assert _view(memo) == _view(ref), step
    # a revisited state is looked up, not recomputed: far fewer states than steps
    assert len(memo.states) < 4000


def test_take_that_does_not_fit_raises_and_changes_nothing():
    spec = preset("t4").with_(sm_count=1)
    memo = SMStates(spec)
    fp = footprint(spec, 1024, 32)
    before = _view(memo)
    with pytest.raises(AssertionError, match="fit"):
        memo.take(0, fp, 2)
    assert _view(memo) == before
