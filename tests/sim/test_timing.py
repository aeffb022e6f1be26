"""The timing model (dispatcher/devices/sim/cost.py): a kernel's time emerges from the SMs
its blocks occupy, the warps resident beside them, and the bandwidth every running block
shares. Each test states one principle on the T4 preset (40 SMs, 8.1 TFLOPS, 320 GB/s)."""
from __future__ import annotations

import pytest

from paella.dispatcher.devices.base import KernelInfo, ModuleImage
from paella.dispatcher.devices.sim import SimDevice
from paella.dispatcher.devices.sim.cost import CostModel, warps_to_hide_arithmetic
from paella.gpus import preset

GFLOP = 1e9


def run_alone(launches, gpu="t4"):
    """Launch (KernelInfo, grid, threads, stream) at t=0; return {name: completion time}."""
    dev = SimDevice(gpu, n_streams=8)
    infos = {i.name: i for i, *_ in launches}
    funcs = dev.load_module(ModuleImage("t", list(infos.values())))
    done = {}
    for lid, (info, grid, threads, stream) in enumerate(launches):
        dev.launch(funcs[info.name], grid, threads, stream, lid, instrumented=False,
                   on_complete=lambda n=info.name: done.__setitem__(n, dev.now()))
    dev.run()
    return done, dev


def overhead(dev) -> float:
    """What every kernel pays besides its work: the launch latency and one memory latency."""
    return dev.cost.launch_latency + dev.cost.mem_latency


def test_warps_to_hide_arithmetic_follow_the_programming_guide():
    assert warps_to_hide_arithmetic(preset("t4")) == 16       # 4 cycles x 4 schedulers
    assert warps_to_hide_arithmetic(preset("a100")) == 16
    assert warps_to_hide_arithmetic(preset("titanxp")) == 24  # Pascal: 6 cycles x 4
    assert warps_to_hide_arithmetic(preset("p100")) == 12     # sm_60: 6 cycles x 2
    # ... and 4-way ILP needs a quarter of them ("as few as 4 warps per SM", Volta Tuning Guide)
    assert CostModel().ilp == 4 and CostModel().warps_to_hide_arithmetic(preset("v100")) == 4


def test_a_compute_bound_kernel_that_fills_the_gpu_runs_at_peak():
    spec = preset("t4")
    # 256 threads, 32 registers: 4 blocks (32 warps) per SM, 160 blocks = one full wave.
    done, dev = run_alone([(KernelInfo("gemm", 32, flops=GFLOP, bytes=1e3), 160, 256, 0)])
    assert done["gemm"] == pytest.approx(overhead(dev) + GFLOP / spec.peak_flops, rel=1e-9)


def test_a_memory_bound_kernel_at_full_occupancy_runs_at_the_bandwidth():
    spec = preset("t4")
    nbytes = 64e6
    done, dev = run_alone([(KernelInfo("copy", 32, flops=0.0, bytes=nbytes), 160, 256, 0)])
    # 32 warps x 128 B per 500 ns per SM demand slightly more than the bandwidth: bound by it.
    assert CostModel().warps_to_saturate_memory(spec) < 32
    assert done["copy"] == pytest.approx(overhead(dev) + nbytes / spec.mem_bw, rel=1e-9)


def test_too_few_warps_cannot_reach_peak():
    spec = preset("t4")
    # One 1-warp block per SM: a quarter of the 4 warps that hide arithmetic latency.
    done, dev = run_alone([(KernelInfo("thin", 32, flops=GFLOP), 40, 32, 0)])
    assert done["thin"] - overhead(dev) == pytest.approx(4 * GFLOP / spec.peak_flops, rel=1e-9)
    # with no instruction-level parallelism it would take 16 warps: 16x
    dev = SimDevice("t4", cost=CostModel(ilp=1))
    (f,) = dev.load_module(ModuleImage("t", [KernelInfo("thin", 32, flops=GFLOP)])).values()
    dev.launch(f, 40, 32, 0, 1, instrumented=False)
    dev.run()
    assert dev.now() - overhead(dev) == pytest.approx(16 * GFLOP / spec.peak_flops, rel=1e-9)


def test_a_small_grid_runs_at_the_speed_of_the_sms_it_occupies():
    spec = preset("t4")
    # 2 blocks of 16 warps: 2 SMs at full issue rate, 1/20 of the GPU.
    done, dev = run_alone([(KernelInfo("small", 32, flops=GFLOP), 2, 512, 0)])
    assert done["small"] - overhead(dev) == pytest.approx(20 * GFLOP / spec.peak_flops, rel=1e-9)


def test_kernels_on_disjoint_sms_do_not_slow_each_other():
    info_a = KernelInfo("a", 32, flops=GFLOP)
    info_b = KernelInfo("b", 32, flops=GFLOP)
    alone, _ = run_alone([(info_b, 20, 512, 1)])
    # 20 + 20 blocks of 16 warps, one per SM: breadth-first placement gives each its own SMs.
    both, _ = run_alone([(info_a, 20, 512, 0), (info_b, 20, 512, 1)])
    assert both["b"] == alone["b"] and both["a"] == alone["b"]


def test_kernels_sharing_the_sms_share_their_issue_rate():
    spec = preset("t4")
    info_a = KernelInfo("a", 32, flops=GFLOP)
    info_b = KernelInfo("b", 32, flops=GFLOP)
    # 40 blocks of 16 warps each: alone, one per SM at full rate; together 32 warps per SM
    # share it, so both take twice as long: the hardware is not counted twice.
    alone, dev = run_alone([(info_a, 40, 512, 0)])
    both, _ = run_alone([(info_a, 40, 512, 0), (info_b, 40, 512, 1)])
    assert alone["a"] - overhead(dev) == pytest.approx(GFLOP / spec.peak_flops, rel=1e-9)
    assert both["a"] - overhead(dev) == pytest.approx(2 * GFLOP / spec.peak_flops, rel=1e-9)
    assert both["b"] == both["a"]


def test_memory_bandwidth_is_shared_by_every_running_block():
    spec = preset("t4")
    nbytes = 32e6
    # Two memory-bound kernels on disjoint halves of the GPU: each alone streams at the
    # latency-bound rate of its 20 SMs (8 warps x 4 lines x 128 B per 500 ns each, about
    # half the bandwidth); together they exceed the bandwidth and share it.
    a, b = KernelInfo("a", 32, bytes=nbytes), KernelInfo("b", 32, bytes=nbytes)
    alone, dev = run_alone([(a, 20, 256, 0)])
    both, _ = run_alone([(a, 20, 256, 0), (b, 20, 256, 1)])
    latency_bound = 20 * 8 * 4 * 128 / dev.cost.mem_latency
    assert latency_bound < spec.mem_bw
    assert alone["a"] - overhead(dev) == pytest.approx(nbytes / latency_bound, rel=1e-9)
    assert both["a"] - overhead(dev) == pytest.approx(2 * nbytes / spec.mem_bw, rel=1e-9)
    assert both["a"] > alone["a"]


def test_waves_emerge_from_placement():
    spec = preset("t4")
    # 161 blocks of the same work, 4 per SM: a full wave, then one more block alone on its
    # SM, where it has the whole SM: a second wave, a quarter as long as the first, that a
    # flat roofline (161/160 of the first) would not see.
    one, dev = run_alone([(KernelInfo("k", 32, flops=GFLOP), 160, 256, 0)])
    more, _ = run_alone([(KernelInfo("k", 32, flops=GFLOP * 161 / 160), 161, 256, 0)])
    per_block = GFLOP / 160
    tail = per_block / (spec.peak_flops / spec.sm_count)
    assert more["k"] == pytest.approx(one["k"] + dev.cost.mem_latency + tail, rel=1e-9)


def test_runs_are_deterministic_to_the_bit():
    def run():
        launches = [(KernelInfo(f"k{i}", 32 + 8 * i, flops=GFLOP * (i + 1), bytes=1e6 * (7 - i)),
                     37 * (i + 1), 128 * (1 + i % 3), i % 4) for i in range(6)]
        return run_alone(launches)[0]
    assert run() == run()


def test_the_profile_record_splits_time_by_bound():
    dev = SimDevice("t4")
    f = dev.load_module(ModuleImage("t", [KernelInfo("gemm", 32, flops=GFLOP),
                                          KernelInfo("copy", 32, bytes=64e6),
                                          KernelInfo("thin", 32, flops=GFLOP)]))
    dev.gpu.record = []
    dev.launch(f["gemm"], 160, 256, 0, 1, instrumented=False)
    dev.launch(f["copy"], 160, 256, 0, 2, instrumented=False)
    dev.launch(f["thin"], 40, 32, 0, 3, instrumented=False)
    dev.run()
    recs = {r[0]: r for r in dev.gpu.record}
    bound = {lid: max(range(3), key=lambda i: r[8 + i]) for lid, r in recs.items()}
    assert bound == {1: 0, 2: 1, 3: 2}               # compute, memory, latency
    assert recs[1][5] == 40 and recs[3][5] == 40     # SMs used


def test_a_block_speeds_up_when_its_co_runner_ends():
    spec = preset("t4")
    # Both kernels share every SM (32 warps) at half rate until the shorter one ends at
    # F/P; the longer one then has the SM to itself: 1.5 F/P in all, the work the SMs did
    # at their full rate (a rate fixed when a block starts would give 2 F/P). The block's
    # one memory latency is part of its progress, hence the tolerance.
    a, b = KernelInfo("a", 32, flops=GFLOP), KernelInfo("b", 32, flops=GFLOP / 2)
    both, dev = run_alone([(a, 40, 512, 0), (b, 40, 512, 1)])
    assert both["b"] - overhead(dev) == pytest.approx(GFLOP / spec.peak_flops, rel=1e-9)
    assert both["a"] - overhead(dev) == pytest.approx(1.5 * GFLOP / spec.peak_flops,
                                                      abs=dev.cost.mem_latency)
    assert both["a"] - overhead(dev) < 1.6 * GFLOP / spec.peak_flops
