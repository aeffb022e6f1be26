"""Benchmark (not a test): what making one per-request buffer set costs the dispatcher's
loop, and its parts, the compiled forms beside their step-by-step references.

    .venv/bin/python -m paella.benchmarks.bench_buffer_sets [--sets 2000] [--repeat 5]

A set is made when a model is registered (``buffer_sets_ahead``) or, past those, when a
burst needs one more (docs/dispatcher.md, "Sets made ahead"). Per set, on Figure 2's
plan (an input copy, 8 kernels, an output copy) registered with the C kernel core on the
simulated GTX 1660 SUPER:

* ``make``: ``PlanAdaptor._new_set`` (its two device buffers and the bound plan);
* ``bind``: the plan bound by the compiled binder (``compile_binder``), and
  ``bind_reference``, step by step;
* ``operands``: the kernel core's operands (``set_operands``, compiled per model), and
  ``set_operands_reference``; most of either is the two copies' device views and their
  addresses.

Each figure: microseconds per set (``time.perf_counter`` over ``--sets`` sets), the
median of ``--repeat`` runs, the compiled form and its reference alternated.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import numpy as np

from paella.dispatcher import kernel_core as kc
from paella.dispatcher.core import Dispatcher, Request
from paella.dispatcher.devices.sim import SimDevice
from paella.experiments.harness import adaptor_for
from paella.models.synthetic import figure2_job


def per_set(fn: Callable[[object], object], items: list) -> float:
    t0 = time.perf_counter()
    for x in items:
        fn(x)
    return (time.perf_counter() - t0) / len(items) * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sets", type=int, default=2000)
    p.add_argument("--repeat", type=int, default=5)
    a = p.parse_args(argv)
    dev = SimDevice("gtx1660s", n_streams=32, seed=1)
    d = Dispatcher(dev, "paella", profile_runs=1, kernel_core="c", buffer_sets_ahead=0)
    mid = d.register_model("fig2", adaptor_for(figure2_job(), 64, 64)())
    m = d.models[mid]
    d.submit(Request(0, 0, mid, np.zeros(m.adaptor.io_bytes, np.uint8)))
    d.run_until_idle()
    ad, cm, memory = m.adaptor, m.core, dev.memory
    rows: dict[str, list[float]] = {}
    for _ in range(a.repeat):
        sets = [ad._new_set() for _ in range(a.sets)]     # (warm the allocator)
        for s in sets:
            ad._free_set(s)
        made: list = []
        rows.setdefault("make", []).append(per_set(lambda _: made.append(ad._new_set()),
                                                   range(a.sets)))
        rows.setdefault("bind", []).append(per_set(lambda s: ad.bind(s.ptrs), made))
        rows.setdefault("bind_reference", []).append(
            per_set(lambda s: ad.bind_reference(s.ptrs), made))
        rows.setdefault("operands", []).append(
            per_set(lambda s: kc.set_operands(cm, m.replay, s.bound, memory), made))
        rows.setdefault("operands_reference", []).append(
            per_set(lambda s: kc.set_operands_reference(cm, m.replay, s.bound, memory), made))
        for s in made:
            ad._free_set(s)
    print(f"us per buffer set, Figure 2's plan, median of {a.repeat} runs of {a.sets} sets:")
    for name, xs in rows.items():
        print(f"  {name:20s} {statistics.median(xs):6.2f}   (runs: "
              + ", ".join(f"{x:.2f}" for x in xs) + ")")
    make = statistics.median(rows["make"])
    ops = statistics.median(rows["operands"])
    ref = (make - statistics.median(rows["bind"]) + statistics.median(rows["bind_reference"])
           + statistics.median(rows["operands_reference"]))
    print(f"  a set with the core's operands: {make + ops:.2f} us (step by step: {ref:.2f} us)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
