"""Per-boundary cost of a DVABatch stage hand-off, before (host copies) and after
(the pairs' device memory), side by side in one run.

One boundary is the hand-off of ``rows`` rows from stage ``s`` to stage ``s + 1``:

* **host** (``handoff = "host"``, the old path): stage ``s``'s job copies its outs to
  its io (the plan's D2H), the batcher copies them into the host pair buffer
  (``StageModel.store``), then out of it into stage ``s + 1``'s io
  (``StageModel.load``), and that job copies them to the device (the plan's H2D);
* **device** (``handoff = "device"``): the batcher binds stage ``s + 1``'s job to the
  rows of the pair's device memory stage ``s`` wrote (``HandoffPool.bind``, a cached
  buffer set) and gives the set back when it ends: no byte moves.

Measured on the host (wall clock, median of ``--repeat`` x ``--n`` calls): the
batcher's part of each. Added on the device (the simulated GPU's copy model, the same
for every experiment: ``pcie_latency + bytes / pcie_bw`` per copy): the host path's D2H
and H2D, which the device path does not issue. The boundary is BERT-base's (length
128 x hidden 768, float32: 393 KB a row) by default.

Run: ``python -m paella.benchmarks.bench_dvabatch_handoff [--rows 1,8,64] [--gpu titanrtx]``
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import numpy as np

from paella.dispatcher.adaptor import BufferArg, Plan, PlanAdaptor, PlanOp
from paella.stepsched.dvabatch.handoff import HandoffAdaptor
from paella.stepsched.dvabatch.stage_io import PairData, StageModel, StageVariant
from paella.dispatcher.devices.base import KernelInfo
from paella.dispatcher.devices.sim import SimDevice
from paella.gpus import preset
from paella.shapes import Slot

SEQ, HIDDEN = 128, 768


def _model(row_shape: tuple[int, ...], sizes: tuple[int, ...]) -> StageModel:
    """Two stages chained by one float32 boundary tensor ``cut1.0`` of ``row_shape`` a row."""
    out = []
    for rows in sizes:
        shape = (rows, *row_shape)
        nb = int(np.prod(shape)) * 4
        for s in range(2):
            a = Slot("x" if s == 0 else "cut1.0", shape, "float32", 0)
            b = Slot("cut1.0" if s == 0 else "y", shape, "float32", nb)
            out.append(StageVariant(len(out), s, rows, 0, (a,), (b,), 2 * nb))
    return StageModel("bench", out)


def _median(fn: Callable[[], None], n: int, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t) / n)
    return statistics.median(times)


def _handoff_pool(dev: SimDevice, nbytes: int, ptr: int):
    """A hand-off model of a one-kernel stage whose in and out are bound at ``ptr``."""
    plan = Plan("bench/s1", [KernelInfo("k", 32, duration=1e-6)],
                [PlanOp("launch", kernel="k", args=(BufferArg("in"), BufferArg("out"),
                                                    BufferArg("tmp")))],
                {"in": nbytes, "out": nbytes, "tmp": 4096}, 0)
    base = PlanAdaptor(plan)
    base.init(dev)
    ad = HandoffAdaptor(plan, base, frozenset({"in", "out"}),
                        lambda pair, row: {"in": ptr + row, "out": ptr + nbytes + row})
    ad.init(dev)
    return ad.buffer_pool


def measure(rows: int, gpu: str, n: int, repeat: int) -> dict:
    """One boundary of ``rows`` rows: host and device paths, their ratio."""
    sizes = tuple(2 ** k for k in range(7) if 2 ** k <= max(rows, 1))
    sm = _model((SEQ, HIDDEN), sizes if rows in sizes else (*sizes, rows))
    data = PairData(sm, 1, max(64, rows))
    out_v, in_v = sm.variant(0, rows, 0), sm.variant(1, rows, 0)
    io_out, io_in = np.ones(out_v.io_bytes, np.uint8), np.zeros(in_v.io_bytes, np.uint8)

    def host() -> None:
        sm.store(data, out_v, 0, 0, io_out)
        sm.load(data, in_v, 0, 0, io_in)
    nbytes = in_v.in_bytes
    dev = SimDevice(gpu, seed=1)
    ptr = dev.alloc(2 * nbytes * 64)
    pool = _handoff_pool(dev, nbytes, ptr)

    def device() -> None:
        pool.release(pool.bind(0, 0))
    spec = preset(gpu)
    copy = 2 * (spec.pcie_latency + nbytes / spec.pcie_bw)      # its D2H, then its H2D
    h = _median(host, n, repeat)
    d = _median(device, n, repeat)
    return {"rows": rows, "bytes": nbytes, "host_us": h * 1e6, "device_us": d * 1e6,
            "host_ratio": h / d, "pcie_us": copy * 1e6,
            "total_ratio": (h + copy) / d}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8,64", help="rows per boundary (comma list)")
    ap.add_argument("--gpu", default="titanrtx", help="the simulated GPU (its PCIe model)")
    ap.add_argument("--n", type=int, default=20, help="calls per timing")
    ap.add_argument("--repeat", type=int, default=7, help="timings (the median is shown)")
    a = ap.parse_args(argv)
    print(f"one stage boundary of BERT-base (length {SEQ} x {HIDDEN} float32 a row), "
          f"median of {a.repeat} x {a.n}; PCIe as the simulated {a.gpu}")
    print(f"{'rows':>5} {'bytes':>10} {'host path (us)':>15} {'device path (us)':>17} "
          f"{'ratio':>9} {'+ its PCIe copies (us)':>23} {'ratio with them':>16}")
    for r in (int(x) for x in a.rows.split(",")):
        m = measure(r, a.gpu, a.n, a.repeat)
        print(f"{m['rows']:>5} {m['bytes']:>10} {m['host_us']:>15.1f} {m['device_us']:>17.2f} "
              f"{m['host_ratio']:>8.0f}x {m['pcie_us']:>23.1f} {m['total_ratio']:>15.0f}x")


if __name__ == "__main__":
    main()
