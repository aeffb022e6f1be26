"""Benchmark: how fast the simulated GPU runs in virtual time.

    python -m paella.benchmarks.bench_sim [--repeat 5]     (make bench)

Workloads, each repeated; medians are reported:

* ``hol``: the Figure 2 jobs (8 dependent one-block kernels), submitted naively at
  45k jobs/s on the gtx1660s preset, one ``SimDevice.launch`` call per kernel: one
  placement event and one completion per kernel, Python's launch path included;
* ``hol-engine``: the same jobs handed to the engine in one ``bulk`` call (the engine
  launches each kernel at its arrival time): the engine's own cost per one-block kernel;
* ``heavy``: 1000-block kernels (256 threads, 32 registers) on 8 streams of the t4
  preset, instrumented with groups of 16; the notifQ (65,536 slots) holds all 50,000
  entries, read and cleared at the end;
* ``mnv2``: a realistic compiled model: 16 MobileNetV2 requests (55 kernels, 6,842
  blocks each) from the zoo bundle, on 8 streams of the t4 preset, instrumented with
  groups of 16 and drained, four requests at a time. Skipped when the bundle is not in
  the zoo cache (``paella experiment calibrate`` compiles it). Also reported: CPU ms
  per request.

Figures: simulated GPU-seconds per second, events (block-group completions and copies)
per second, and block placements per second, all per second of this process's CPU time
(``time.process_time``), so other work on the machine disturbs them less.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from paella import protocol
from paella.dispatcher.devices.base import KernelInfo, ModuleImage
from paella.dispatcher.devices.sim import SimDevice
from paella.experiments.workload import lognormal_arrivals
from paella.models.synthetic import figure2_job


def bench_hol(n_jobs: int = 4000) -> dict:
    dev = SimDevice("gtx1660s", n_streams=1024)
    k = figure2_job().kernels[0]
    f = dev.load_module(ModuleImage("f2", [KernelInfo(k.name, k.regs_per_thread, duration=k.duration)]))[k.name]
    arrivals = lognormal_arrivals(45e3, 1.5, n_jobs, 1)
    t0 = time.process_time()
    for i, t in enumerate(arrivals):
        dev.run_until(t)
        for j in range(8):
            dev.launch(f, 1, 128, i % 1024, i * 8 + j, instrumented=False)
    dev.run()
    return _figures(dev, time.process_time() - t0)


def bench_hol_engine(n_jobs: int = 20000) -> dict:
    dev = SimDevice("gtx1660s", n_streams=1024)
    k = figure2_job().kernels[0]
    f = dev.load_module(ModuleImage("f2", [KernelInfo(k.name, k.regs_per_thread, duration=k.duration)]))[k.name]
    shape = dev._shapes[dev.block_footprint(f, (128, 1, 1), 0)]
    arrivals = lognormal_arrivals(45e3, 1.5, n_jobs, 1)
    times = np.repeat(arrivals, 8).astype(np.float64)
    streams = np.repeat(np.arange(n_jobs, dtype=np.int32) % 1024, 8)
    ids = np.arange(8 * n_jobs, dtype=np.uint32)
    t0 = time.process_time()
    dev.gpu.bulk(times.tobytes(), streams.tobytes(), ids.tobytes(), shape, 1, 0.0, 0.0,
                 k.duration, False, 16)
    dev.run()
    return _figures(dev, time.process_time() - t0)


def bench_heavy(n_kernels: int = 400) -> dict:
    dev = SimDevice("t4", n_streams=8)
    f = dev.load_module(ModuleImage("h", [KernelInfo("big", 32, flops=4e9, bytes=64e6)]))["big"]
    assert 2 * n_kernels * -(-1000 // 16) <= dev.notifq.size
    t0 = time.process_time()
    for i in range(n_kernels):
        dev.launch(f, 1000, 256, i % 8, i)
    dev.run()
    ring = dev.notifq                     # every entry fits: read and clear them at once
    words = int(np.count_nonzero(ring))
    ring[:] = protocol.INVALID
    out = _figures(dev, time.process_time() - t0)
    assert words == 2 * n_kernels * -(-1000 // 16)
    return out


def bench_mnv2(n_requests: int = 16) -> dict | None:
    from paella.experiments.zoo import DEFAULT_ZOO_DIR, load_bundle, module_image
    path = DEFAULT_ZOO_DIR / "mobilenetv2"
    if not (path / "manifest.json").exists():
        return None
    bundle = load_bundle(path)
    dev = SimDevice("t4", n_streams=8)
    funcs = dev.load_module(module_image(bundle))
    plan = [op for op in bundle.variants[0].plan if op.op == "launch"]
    ring, mask, head, lid = dev.notifq, dev.notifq.size - 1, 0, 0
    t0 = time.process_time()
    for r in range(n_requests):
        for op in plan:
            lid += 1
            dev.launch(funcs[op.kernel], tuple(op.grid), tuple(op.block), r % 8, lid,
                       dyn_smem=op.dyn_smem, group=16)
        if r % 4 == 3:
            while dev.next_event_time() != float("inf"):
                dev.step()
                while ring[head & mask]:
                    ring[head & mask] = protocol.INVALID
                    head += 1
    out = _figures(dev, time.process_time() - t0)
    out["ms_per_request"] = 1e3 * out["wall_s"] / n_requests
    return out


def _figures(dev: SimDevice, wall: float) -> dict:
    g = dev.gpu
    return {"wall_s": wall, "sim_s": dev.now(), "sim_per_wall": dev.now() / wall,
            "events_per_s": g.events / wall, "placements_per_s": g.placements / wall,
            "placements": g.placements, "events": g.events}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    for name, fn in (("hol", bench_hol), ("hol-engine", bench_hol_engine), ("heavy", bench_heavy),
                     ("mnv2", bench_mnv2)):
        runs = [fn() for _ in range(args.repeat)]
        if runs[0] is None:
            print(f"{name:10s} skipped: no mobilenetv2 bundle in the zoo cache")
            continue
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        per = f", {med['ms_per_request']:.1f} ms CPU per request" if "ms_per_request" in med else ""
        print(f"{name:10s} median of {args.repeat}: {med['sim_per_wall']:8.3f} simulated GPU-s per CPU-s, "
              f"{med['events_per_s']:10,.0f} events/s, {med['placements_per_s']:10,.0f} block placements/s "
              f"({med['placements']:,.0f} placements in {med['wall_s']:.2f} s{per})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
