"""``paella profile BUNDLE [--gpu PRESET] [--json F]``: what the simulator thinks of a model.

For each variant of a compiled bundle: the isolated time of one request (its plan on one
stream, copies included), and for each kernel launch its isolated time (the launch alone
on an idle simulated GPU, from reaching the head of its queue to its last block), the
SMs its blocks occupy, its waves, its theoretical and achieved occupancy, and what
bounds it: compute (enough warps, the SMs issue at their peak), memory (the device's
bandwidth is saturated) or latency (too few warps to hide arithmetic or memory latency,
or one memory round trip dominates). The timing model is docs/simulator.md's; nothing in
it is fitted to a model.

Register counts come from the bundle's arch (``ptxas`` for ``manifest.arch``); profiling
on a preset of another architecture keeps them, and says so.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from paella import protocol
from paella.bundle import Bundle, BundleError, load_bundle
from paella.dispatcher.devices.base import KernelInfo, ModuleImage
from paella.gpus import PRESETS, preset
from paella.occupancy import OccupancyError, occupancy

from .cost import CostModel
from .device import SimDevice

BOUNDS = ("compute", "memory", "latency")


def _image(bundle: Bundle, variant: int) -> ModuleImage:
    v = bundle.variants[variant]
    return ModuleImage(bundle.model, [KernelInfo(k.name, k.registers, k.static_smem, float(k.flops),
                                                 float(k.bytes)) for k in v.kernels])


def check_servable(bundle: Bundle, variant: int) -> None:
    """Refuse a launch the daemon would refuse for its size (its notifQ entries at the
    default group exceed the default ring), before simulating it: a legal grid of 2**31
    blocks would otherwise keep the simulator busy for hours."""
    for op in bundle.variants[variant].plan:
        if op.op == "launch":
            blocks = int(np.prod(op.grid, dtype=np.int64))
            need = 2 * -(-blocks // protocol.DEFAULT_GROUP)
            if need > protocol.DEFAULT_NOTIFQ_SLOTS:
                raise ValueError(f"kernel {op.kernel!r} launches {blocks} blocks, whose "
                                 f"{need} notifQ entries exceed the daemon's ring of "
                                 f"{protocol.DEFAULT_NOTIFQ_SLOTS}: the daemon would refuse it")


def run_plan(bundle: Bundle, gpu: str, cost: CostModel | None = None, variant: int = 0,
             record: bool = False) -> tuple[float, list[tuple]]:
    """One request of ``bundle`` alone, its plan on one stream: (seconds, the engine's
    per-kernel records in plan order if ``record``)."""
    check_servable(bundle, variant)
    dev = SimDevice(gpu, cost=cost)
    funcs = dev.load_module(_image(bundle, variant))
    plan = bundle.variants[variant].plan
    largest = max((op.nbytes or 0) for op in plan) or 1
    scratch, host = dev.alloc(largest), np.zeros(largest, dtype=np.uint8)
    if record:
        dev.gpu.record = []
    for lid, op in enumerate(plan):
        if op.op == "launch":
            dev.launch(funcs[op.kernel], tuple(op.grid), tuple(op.block), 0, lid,
                       dyn_smem=op.dyn_smem, instrumented=False)
        elif op.op == "h2d":
            dev.memcpy_htod(scratch, host[:op.nbytes], 0)
        elif op.op == "d2h":
            dev.memcpy_dtoh(host[:op.nbytes], scratch, 0)
        # record / wait: one stream here, where plan order already orders everything
    dev.run()
    return dev.now(), list(dev.gpu.record or [])


def plan_time(bundle: Bundle, gpu: str, variant: int = 0, cost: CostModel | None = None) -> float:
    """Seconds for one request alone: the variant's plan (copies and launches) on one stream."""
    return run_plan(bundle, gpu, cost, variant)[0]


def launch_profile(bundle: Bundle, gpu: str, variant: int, index: int, op,
                   cost: CostModel | None = None) -> dict:
    """One launch alone on an idle GPU, as the engine's per-kernel record sees it."""
    spec = preset(gpu)
    k = bundle.variants[variant].kernel(op.kernel)
    threads, blocks = math.prod(op.block), math.prod(op.grid)
    smem = k.static_smem + op.dyn_smem
    occ = occupancy(spec, threads, k.registers, smem)
    dev = SimDevice(spec, cost=cost)
    f = dev.load_module(ModuleImage("k", [KernelInfo(k.name, k.registers, k.static_smem,
                                                     float(k.flops), float(k.bytes))]))[k.name]
    dev.gpu.record = []
    dev.launch(f, tuple(op.grid), tuple(op.block), 0, index, dyn_smem=op.dyn_smem, instrumented=False)
    dev.run()
    (_, _, t_issue, t_first, t_done, sms, _, warp_area, *by_bound), = dev.gpu.record
    busy = t_done - t_first
    total = sum(by_bound) or 1.0
    return {"index": index, "kernel": k.name, "grid": list(op.grid), "block": list(op.block),
            "blocks": blocks, "threads": threads, "registers": k.registers, "smem": smem,
            "gflop": k.flops / 1e9, "mbytes": k.bytes / 1e6,
            "isolated_us": (t_done - t_issue) * 1e6, "sms": sms,
            "waves": math.ceil(blocks / (occ.blocks_per_sm * spec.sm_count)),
            "blocks_per_sm": occ.blocks_per_sm, "occupancy_limit": occ.limit,
            "theoretical_occupancy": occ.fraction,
            "achieved_occupancy": warp_area / (busy * sms * spec.max_warps_per_sm) if busy > 0 else 0.0,
            "bound": BOUNDS[int(np.argmax(by_bound))],
            "bound_split": {b: x / total for b, x in zip(BOUNDS, by_bound)}}


def profile(bundle: Bundle, gpu: str, cost: CostModel | None = None) -> dict:
    out = {"bundle": bundle.model, "arch": bundle.manifest.arch, "gpu": gpu,
           "timing_model": "docs/simulator.md (nothing fitted)", "variants": []}
    for vi, v in enumerate(bundle.variants):
        launches = [launch_profile(bundle, gpu, vi, i, op, cost)
                    for i, op in enumerate(v.plan) if op.op == "launch"]
        by_bound = dict.fromkeys(BOUNDS, 0.0)
        for r in launches:
            by_bound[r["bound"]] += r["isolated_us"]
        out["variants"].append({"name": v.name, "isolated_us": plan_time(bundle, gpu, vi, cost) * 1e6,
                                "kernels_isolated_us": sum(r["isolated_us"] for r in launches),
                                "launches": launches, "time_by_bound_us": by_bound})
    return out


def _print(data: dict) -> None:
    print(f"{data['bundle']} on the simulated {data['gpu']} (timing model: {data['timing_model']})")
    for v in data["variants"]:
        print(f"\nvariant {v['name']}: one request alone {v['isolated_us']:.1f} us "
              f"({len(v['launches'])} launches, {v['kernels_isolated_us']:.1f} us of kernels alone)")
        print(f"{'#':>4} {'kernel':<44} {'grid':>6} {'thr':>5} {'us':>9} {'SMs':>4} {'waves':>5} "
              f"{'occ':>5} {'ach':>5}  bound")
        for r in v["launches"]:
            name = r["kernel"] if len(r["kernel"]) <= 44 else r["kernel"][:41] + "..."
            print(f"{r['index']:>4} {name:<44} {r['blocks']:>6} {r['threads']:>5} {r['isolated_us']:>9.2f} "
                  f"{r['sms']:>4} {r['waves']:>5} {r['theoretical_occupancy']:>5.0%} "
                  f"{r['achieved_occupancy']:>5.0%}  {r['bound']}")
        split = ", ".join(f"{b} {t:.0f} us" for b, t in v["time_by_bound_us"].items())
        print(f"kernel time by bound: {split}")


def _resolve(path: str) -> Path:
    p = Path(path)
    if (p / "manifest.json").exists():
        return p
    from paella.bundle import DEFAULT_ZOO_DIR
    if not p.exists() and (DEFAULT_ZOO_DIR / path / "manifest.json").exists():
        return DEFAULT_ZOO_DIR / path        # a zoo model's name, compiled in the cache
    return p


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="the simulated time of a bundle's variants and kernels",
                       description=__doc__.split("\n\n")[1])
    p.add_argument("bundle", metavar="BUNDLE",
                   help="a bundle directory (paella compile -o DIR), or a zoo model compiled in the cache")
    p.add_argument("--gpu", default="t4", help=f"GPU preset (default t4; one of {', '.join(PRESETS)})")
    p.add_argument("--json", metavar="FILE", help="write the profile as JSON")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from paella.cli import CLIError
    if args.json:
        out = Path(args.json)
        if out.is_dir() or not out.parent.is_dir():
            raise CLIError(f"--json {args.json}: not a file in an existing directory")
    try:
        preset(args.gpu)
        bundle = load_bundle(_resolve(args.bundle))
        for vi in range(len(bundle.variants)):
            check_servable(bundle, vi)
        data = profile(bundle, args.gpu)
    except (ValueError, BundleError, OccupancyError, FileNotFoundError) as e:
        raise CLIError(str(e)) from None
    if data["arch"] and data["arch"] != preset(args.gpu).sm_name:
        print(f"note: {data['bundle']} was compiled for {data['arch']}; its register counts are kept "
              f"on {args.gpu} ({preset(args.gpu).sm_name})")
    _print(data)
    if args.json:
        try:
            Path(args.json).write_text(json.dumps(data, indent=1))
        except OSError as e:
            raise CLIError(f"--json {args.json}: {e.strerror}") from None
    return 0
