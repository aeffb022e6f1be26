"""Hardware check of the cuda backend, for users with an NVIDIA GPU.

    python -m paella.benchmarks.gpu_check [--device N] [--bundle DIR] [--json FILE]

It compiles the test kernels of ``benchmarks/gpu_check_kernels.cu`` with nvcc against
the compiler pass's header (``compiler_pass/include/paella_notif.cuh``), then:

1. **notifQ:** launches an instrumented kernel for several grid sizes G and checks that
   exactly ceil(G/16) PLACEMENT and ceil(G/16) COMPLETION entries arrive, all with the
   launch's id, counts of 16 and one of G % 16, SM ids below the SM count, and that the
   launch's counter pair ends at (G, G); the same with one entry per block (group 1);
2. **arguments:** an instrumented ``x += 1`` kernel round-trips through H2D, launch, D2H;
3. **bundle** (with ``--bundle DIR``): runs a compiled zoo bundle's launch plan on the GPU
   and compares the outputs with the bundle's CPU build;
4. **Figure 15:** per-kernel latency of empty kernels, uninstrumented vs instrumented
   with one entry per block and with aggregation by 16 (p50 and p90 overheads).

It prints a PASS/FAIL line per check and exits 0 only if none failed. The check logic,
argument parsing and report formatting run without a GPU (tests/cuda).
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from paella import protocol

KERNELS_CU = Path(__file__).with_name("gpu_check_kernels.cu")
DEFAULT_GRIDS = (1, 15, 16, 17, 40, 1000)


@dataclass
class CheckResult:
    name: str
    status: str                      # PASS, FAIL or SKIP
    detail: str = ""
    data: dict = field(default_factory=dict)


# --- pure logic (tested without a GPU) -------------------------------------------------

def check_notifications(words: Sequence[int] | np.ndarray, launch_id: int, blocks: int,
                        group: int, sm_count: int) -> list[str]:
    """Problems with the entries one instrumented launch posted (empty list: correct).

    ``words``: the non-INVALID notifQ words read after the launch completed.
    """
    w = np.asarray(words, dtype=np.uint64)
    kind, sm, count, lid = protocol.decode_array(w)
    problems = []
    expected = math.ceil(blocks / group)
    if (lid != launch_id).any():
        problems.append(f"{int((lid != launch_id).sum())} entries carry another launch id "
                        f"({sorted(set(lid[lid != launch_id].tolist()))[:4]}, expected {launch_id})")
    bad_kind = ~np.isin(kind, (protocol.PLACEMENT, protocol.COMPLETION))
    if bad_kind.any():
        problems.append(f"{int(bad_kind.sum())} entries have an unknown kind {sorted(set(kind[bad_kind].tolist()))}")
    if (sm >= sm_count).any():
        problems.append(f"SM ids {sorted(set(sm[sm >= sm_count].tolist()))} are not below the SM count {sm_count}")
    for k in (protocol.PLACEMENT, protocol.COMPLETION):
        name = protocol.KIND_NAMES[k]
        c = count[(kind == k) & (lid == launch_id)]
        if len(c) != expected:
            problems.append(f"{len(c)} {name} entries, expected ceil({blocks}/{group}) = {expected}")
        if int(c.sum()) != blocks:
            problems.append(f"{name} counts sum to {int(c.sum())}, expected {blocks} blocks")
        partial = blocks % group
        allowed = {group} | ({partial} if partial else set())
        odd = sorted(set(c.tolist()) - allowed)
        if odd:
            problems.append(f"{name} counts {odd} are neither {group} nor the remainder {partial}")
        if partial and int((c == partial).sum()) != 1:
            problems.append(f"{int((c == partial).sum())} {name} entries of {partial} blocks, expected 1")
    return problems


def percentile(xs: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs, dtype=float), q)) if len(xs) else float("nan")


def overhead_summary(base: Sequence[float], inst: Sequence[float]) -> dict:
    """p50/p90 per-kernel latency and the instrumentation overhead, in microseconds."""
    b50, b90, i50, i90 = (percentile(base, 50), percentile(base, 90),
                          percentile(inst, 50), percentile(inst, 90))
    return {"base_p50_us": b50 * 1e6, "base_p90_us": b90 * 1e6, "p50_us": i50 * 1e6,
            "p90_us": i90 * 1e6, "overhead_p50_us": (i50 - b50) * 1e6,
            "overhead_p90_us": (i90 - b90) * 1e6}


def nvcc_command(nvcc: str, arch: int, group: int, include: Path, src: Path, out: Path) -> list[str]:
    return [nvcc, "-cubin", f"-arch=sm_{arch}", "-O3", f"-I{include}", f"-DPAELLA_GROUP={group}",
            "-o", str(out), str(src)]


def header_dir() -> Path:
    """Where the compiler pass's device header lives (source tree or installed package)."""
    import paella.compiler_pass as cp
    return Path(cp.__file__).parent / "include"


def format_report(device: str, results: list[CheckResult]) -> str:
    lines = [f"Paella cuda backend hardware check on {device}"]
    for r in results:
        lines.append(f"  {r.status:<4}  {r.name}" + (f": {r.detail}" if r.detail else ""))
    failed = [r for r in results if r.status == "FAIL"]
    passed = sum(r.status == "PASS" for r in results)
    skipped = sum(r.status == "SKIP" for r in results)
    lines.append(f"{'FAIL' if failed else 'PASS'}: {passed} passed, {len(failed)} failed, {skipped} skipped")
    return "\n".join(lines)


def exit_status(results: list[CheckResult]) -> int:
    return 1 if any(r.status == "FAIL" for r in results) else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m paella.benchmarks.gpu_check",
                                description=__doc__.splitlines()[0])
    p.add_argument("--device", type=int, default=0, help="CUDA device ordinal (default 0)")
    p.add_argument("--grids", default=",".join(map(str, DEFAULT_GRIDS)),
                   help="grid sizes for the notifQ check, comma-separated")
    p.add_argument("--block", type=int, default=128, help="threads per block (default 128)")
    p.add_argument("--bundle", help="a compiled bundle directory to run against its CPU build")
    p.add_argument("--iterations", type=int, default=2000, help="launches per Figure 15 series")
    p.add_argument("--fig15-grids", default="1,80",
                   help="grid sizes of the Figure 15 empty kernels, comma-separated")
    p.add_argument("--skip-fig15", action="store_true", help="skip the Figure 15 measurement")
    p.add_argument("--nvcc", help="nvcc to use (default: the one `paella doctor` finds)")
    p.add_argument("--json", help="also write the results to this JSON file")
    a = p.parse_args(argv)
    try:
        a.grids = [int(g) for g in a.grids.split(",") if g]
        a.fig15_grids = [int(g) for g in a.fig15_grids.split(",") if g]
    except ValueError:
        p.error("--grids and --fig15-grids take comma-separated integers")
    if not a.grids or min(a.grids) < 1 or (a.fig15_grids and min(a.fig15_grids) < 1):
        p.error("grid sizes must be positive")
    if a.iterations < 10:
        p.error("--iterations must be at least 10")
    return a


# --- steps that drive the device (a CudaDevice, or one on the tests' stand-in driver) --------

def drain(dev) -> np.ndarray:
    """The non-INVALID words of the ring, then store INVALID back (as the dispatcher does)."""
    q = dev.notifq
    idx = np.nonzero(q)[0]
    words = q[idx].copy()
    q[idx] = 0
    return words


def notif_check(dev, func, grids: Sequence[int], block: int, group: int, first_id: int) -> CheckResult:
    name = f"notifQ entries, group {group}, grids {list(grids)}"
    problems = []
    for n, g in enumerate(grids):
        if 2 * math.ceil(g / group) > len(dev.notifq):
            problems.append(f"G={g}: {2 * math.ceil(g / group)} entries do not fit a ring of {len(dev.notifq)}")
            continue
        lid = first_id + n
        drain(dev)
        dev.launch(func, g, block, stream=0, launch_id=lid, group=group)
        dev.synchronize()
        words = drain(dev)
        problems += [f"G={g}: {p}" for p in check_notifications(words, lid, g, group, dev.props.sm_count)]
        ctr = tuple(int(c) for c in dev.counters[lid & (len(dev.counters) - 1)])
        if ctr != (g, g):
            problems.append(f"G={g}: counter pair ended at {ctr}, expected ({g}, {g})")
    return CheckResult(name, "FAIL" if problems else "PASS", "; ".join(problems[:6]))


def add1_check(dev, func, n: int, launch_id: int) -> CheckResult:
    host = np.arange(n, dtype=np.float32)
    out = np.zeros_like(host)
    x = dev.alloc(host.nbytes)
    try:
        dev.memcpy_htod(x, host, stream=0)
        dev.launch(func, -(-n // 128), 128, stream=0, launch_id=launch_id, args=(x, n))
        dev.memcpy_dtoh(out, x, stream=0)
        dev.synchronize()
    finally:
        dev.free(x)
    drain(dev)
    bad = int((out != host + 1).sum())
    return CheckResult("arguments: H2D, instrumented x += 1, D2H", "FAIL" if bad else "PASS",
                       f"{bad}/{n} elements wrong" if bad else "")


def run_bundle(dev, bundle, inputs: dict[str, np.ndarray], first_id: int = 1,
               pieces: int = 0) -> dict[str, np.ndarray]:
    """Run a bundle's launch plan (variant 0) on ``dev``; returns its outputs.
    ``pieces`` > 0: launch every instrumented kernel as that many slices of its grid (1-D
    launches, the block offset its last argument: paella.dispatcher.slicing), as the
    dispatcher does for a less urgent job."""
    from paella.dispatcher.slicing import slices
    from paella.dispatcher.devices.base import KernelInfo, ModuleImage
    v = bundle.variants[0]
    files = bundle.manifest.files
    image = ModuleImage(bundle.model, [KernelInfo(k.name, k.registers, k.static_smem, k.flops, k.bytes)
                                       for k in v.kernels],
                        cubin=bundle.file("cubin").read_bytes() if "cubin" in files else None,
                        ptx=bundle.file("ptx").read_bytes() if "ptx" in files else None)
    funcs = dev.load_module(image)
    ptrs = {b.id: dev.alloc(b.nbytes) for b in v.buffers}
    try:
        for bid, data in bundle.param_bytes().items():
            dev.memcpy_htod(ptrs[bid], np.frombuffer(data, dtype=np.uint8).copy(), stream=0)
        io = bundle.pack_inputs(inputs)
        streams = len(dev.streams)
        lid = first_id
        for op in v.plan:
            s = op.stream % streams
            if op.op == "h2d":
                dev.memcpy_htod(ptrs[op.buffer] + op.buffer_offset, io[op.io_offset:op.io_offset + op.nbytes], s)
            elif op.op == "d2h":
                dev.memcpy_dtoh(io[op.io_offset:op.io_offset + op.nbytes], ptrs[op.buffer] + op.buffer_offset, s)
            elif op.op == "launch":
                args = [ptrs[a.buffer] + a.offset if a.buffer is not None else np.dtype(a.dtype).type(a.scalar)
                        for a in op.args]
                instrumented = v.kernel(op.kernel).instrumented
                total = int(np.prod(op.grid))
                cut = slices(total, -(-total // pieces)) if pieces and instrumented else None
                for offset, count in cut or [(0, 0)]:
                    if cut is not None:
                        args[-1] = np.uint32(offset)
                    dev.launch(funcs[op.kernel], (count, 1, 1) if cut else tuple(op.grid), tuple(op.block),
                               s, lid, dyn_smem=op.dyn_smem, args=args, instrumented=instrumented,
                               group=bundle.manifest.group)
                    lid += 1
                    dev.synchronize()    # one kernel at a time: no notifQ flow control here
                    drain(dev)
            else:
                raise ValueError(f"unknown plan op {op.op!r}")
        dev.synchronize()
    finally:
        for p in ptrs.values():
            dev.free(p)
    return bundle.unpack_outputs(io)


def bundle_check(dev, bundle, *, seed: int = 0, rtol: float = 1e-3, atol: float = 1e-4) -> CheckResult:
    rng = np.random.default_rng(seed)
    inputs = {t.name: rng.standard_normal(t.shape).astype(t.dtype) for t in bundle.inputs}
    got = run_bundle(dev, bundle, inputs)
    want = bundle.run_cpu(inputs)
    problems = []
    for name, ref in want.items():
        if not np.allclose(got[name], ref, rtol=rtol, atol=atol):
            err = float(np.max(np.abs(got[name] - ref)))
            problems.append(f"{name}: max abs error {err:.3g}")
    return CheckResult(f"bundle {bundle.model}: GPU vs CPU build", "FAIL" if problems else "PASS",
                       "; ".join(problems))


def sliced_check(dev, bundle, *, pieces: int = 3, seed: int = 0) -> CheckResult:
    """Every kernel launched as ``pieces`` slices gives the same bytes as launched whole
    (the compiler pass's block offset; issue 38)."""
    rng = np.random.default_rng(seed)
    inputs = {t.name: rng.standard_normal(t.shape).astype(t.dtype) for t in bundle.inputs}
    whole = run_bundle(dev, bundle, inputs)
    cut = run_bundle(dev, bundle, inputs, pieces=pieces)
    bad = [name for name in whole if not np.array_equal(whole[name], cut[name])]
    return CheckResult(f"bundle {bundle.model}: every kernel in {pieces} slices vs whole",
                       "FAIL" if bad else "PASS",
                       "; ".join(f"{n}: {int((whole[n] != cut[n]).sum())} elements differ" for n in bad))


def time_launches(dev, func, grid: int, iterations: int, *, instrumented: bool, group: int,
                  first_id: int, clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """Per-kernel latency: launch one kernel, wait for it, repeat (the ring is drained each time)."""
    out = []
    for i in range(iterations):
        t = clock()
        dev.launch(func, grid, 32, stream=0, launch_id=(first_id + i) & protocol.LAUNCH_MASK,
                   instrumented=instrumented, group=group)
        dev.synchronize()
        out.append(clock() - t)
        if instrumented:
            drain(dev)
    return out


def fig15(dev, plain, per_block, aggregated, grids: Sequence[int], iterations: int) -> list[CheckResult]:
    results = []
    for g in grids:
        base = time_launches(dev, plain, g, iterations, instrumented=False, group=16, first_id=0)
        data = {}
        for label, func, group in (("per-block", per_block, 1), ("aggregated", aggregated, 16)):
            lat = time_launches(dev, func, g, iterations, instrumented=True, group=group, first_id=1 << 20)
            data[label] = overhead_summary(base, lat)
        detail = ", ".join(f"{k} +{v['overhead_p90_us']:.1f} us p90 (+{v['overhead_p50_us']:.1f} p50)"
                           for k, v in data.items())
        results.append(CheckResult(f"Figure 15, empty kernel of {g} blocks", "PASS",
                                   f"uninstrumented p90 {data['aggregated']['base_p90_us']:.1f} us; {detail}",
                                   data))
    return results


# --- the script ----------------------------------------------------------------------------------

def compile_kernels(nvcc: str, arch: int, group: int, workdir: Path) -> bytes:
    out = workdir / f"gpu_check_g{group}.cubin"
    cmd = nvcc_command(nvcc, arch, group, header_dir(), KERNELS_CU, out)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{proc.stderr}")
    return out.read_bytes()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from paella.doctor import find_nvcc
    from paella.dispatcher.devices import NoDriverError, open_device
    from paella.dispatcher.devices.base import KernelInfo, ModuleImage
    if not (header_dir() / "paella_notif.cuh").is_file():
        print(f"gpu_check: {header_dir() / 'paella_notif.cuh'} is missing: the compiler pass's header "
              "is needed to build the instrumented test kernels", file=sys.stderr)
        return 2
    nvcc = args.nvcc or find_nvcc()
    if nvcc is None:
        print("gpu_check: nvcc not found: put it on PATH or set CUDA_HOME (or pass --nvcc)", file=sys.stderr)
        return 2
    try:
        dev = open_device("cuda", device=args.device)
    except NoDriverError as e:
        print(f"gpu_check: {e}", file=sys.stderr)
        return 2
    results: list[CheckResult] = []
    try:
        infos = [KernelInfo("paella_check_empty", 0), KernelInfo("paella_check_empty_plain", 0),
                 KernelInfo("paella_check_add1", 0)]
        with tempfile.TemporaryDirectory() as tmp:
            mods = {g: dev.load_module(ModuleImage(f"gpu_check_g{g}", infos,
                                                   cubin=compile_kernels(nvcc, dev.props.arch, g, Path(tmp))))
                    for g in (1, 16)}
        results.append(notif_check(dev, mods[16]["paella_check_empty"], args.grids, args.block, 16, 1000))
        results.append(notif_check(dev, mods[1]["paella_check_empty"], args.grids, args.block, 1, 2000))
        results.append(add1_check(dev, mods[16]["paella_check_add1"], 1000, 3000))
        if args.bundle:
            from paella.bundle import load_bundle
            bundle = load_bundle(args.bundle)
            results.append(bundle_check(dev, bundle))
            results.append(sliced_check(dev, bundle))
        else:
            results.append(CheckResult("bundle vs CPU build", "SKIP", "pass --bundle DIR (from `paella compile`)"))
        if args.skip_fig15:
            results.append(CheckResult("Figure 15", "SKIP", "--skip-fig15"))
        else:
            results += fig15(dev, mods[16]["paella_check_empty_plain"], mods[1]["paella_check_empty"],
                             mods[16]["paella_check_empty"], args.fig15_grids, args.iterations)
    except Exception as e:          # report what broke, then fail: the report is the product
        results.append(CheckResult("unexpected error", "FAIL", f"{type(e).__name__}: {e}"))
    finally:
        dev.close()
    device = f"{dev.props.name} ({dev.props.sm_name}, {dev.props.sm_count} SMs)"
    print(format_report(device, results))
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device, "results": [asdict(r) for r in results]},
                                              indent=2))
    return exit_status(results)


if __name__ == "__main__":
    sys.exit(main())
