"""Block placement against the occupancy rules, and synthetic kernels' waves."""
from __future__ import annotations

import random

import pytest

from paella.dispatcher.devices.base import KernelInfo
from paella.dispatcher.devices.sim import SimDevice
from paella.occupancy import OccupancyError, occupancy

US = 1e-6


@pytest.mark.parametrize("gpu,threads,regs,smem", [("gtx1660s", 128, 9, 0), ("t4", 256, 64, 0),
                                                   ("a100", 128, 32, 40 * 1024), ("v100", 1024, 32, 0)])
def test_first_wave_fills_exactly_the_occupancy(gpu, threads, regs, smem, kernels):
    dev = SimDevice(gpu)
    (k,) = kernels(dev, KernelInfo("k", regs, static_smem=smem, duration=100 * US))
    per_sm = occupancy(dev.props, threads, regs, smem).blocks_per_sm
    dev.launch(k, 3 * per_sm * dev.props.sm_count + 5, threads, 0, 1, instrumented=False)
    dev.run_until(dev.cost.launch_latency)                 # the front end has issued it
    assert dev.gpu.resident == per_sm * dev.props.sm_count
    assert all(dev.resources.fit(s, dev.block_footprint(k, (threads, 1, 1), 0)) == 0
               for s in range(dev.props.sm_count))
    dev.run()
    assert dev.gpu.resident == 0


def test_kernel_time_is_divided_over_waves(kernels):
    dev = SimDevice("t4")
    (k,) = kernels(dev, KernelInfo("k", 32, duration=300 * US))
    per_wave = occupancy(dev.props, 1024, 32).blocks_per_sm * dev.props.sm_count
    dev.launch(k, 3 * per_wave, 1024, 0, 1, instrumented=False)
    dev.run()
    assert dev.now() == pytest.approx(dev.cost.launch_latency + 300 * US)


@pytest.mark.parametrize("info,block,msg", [
    (KernelInfo("fat", 255), 1024, "registers"),
    (KernelInfo("smem", 16, static_smem=70 * 1024), 128, "shared memory"),
    (KernelInfo("wide", 16), 2048, "threads per block"),
])
def test_a_kernel_that_can_never_fit_is_refused_at_launch(info, block, msg, kernels):
    dev = SimDevice("t4")
    (k,) = kernels(dev, info)
    with pytest.raises(OccupancyError, match=msg):
        dev.launch(k, 1, block, 0, 1)
    assert dev.next_event_time() == float("inf")          # nothing was queued: no hang


def test_mixed_kernels_never_overallocate_and_always_drain(kernels):
    rng = random.Random(7)
    dev = SimDevice("a100", n_streams=64, seed=3, jitter=0.1)
    infos = [KernelInfo(f"k{i}", rng.choice([16, 32, 64, 128]), static_smem=rng.choice([0, 8192, 40000]),
                        duration=rng.uniform(10, 300) * US) for i in range(12)]
    funcs = kernels(dev, *infos)
    res = dev.resources
    state = lambda: (list(res.blocks), list(res.warps), list(res.smem), list(res.regs))  # noqa: E731
    start = state()
    for i in range(300):
        f = rng.choice(funcs)
        dev.launch(f, rng.randint(1, 400), rng.choice([32, 96, 128, 256, 512]), rng.randrange(64), i,
                   instrumented=False)
        if i % 10 == 0:
            for _ in range(rng.randint(0, 50)):
                if dev.next_event_time() == float("inf"):
                    break
                dev.step()
                assert min(res.blocks) >= 0 and min(res.warps) >= 0 and min(res.smem) >= 0
                assert min(res.regs) >= 0
    dev.run()
    assert state() == start
    assert dev.gpu.resident == 0 and not dev.gpu.busy()
