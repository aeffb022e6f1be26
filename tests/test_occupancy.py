"""The occupancy rules (paella.occupancy) against NVIDIA's reference implementation.

The oracle is ``cudaOccMaxActiveBlocksPerMultiprocessor`` from the CUDA toolkit's
host-only header ``cuda_occupancy.h``, driven by ``tests/occupancy_ref/occ_ref.cpp``,
which is compiled with g++ once per session (cached under .pytest_cache, keyed by the
hash of the helper and the header). Every GPU preset is compared over an edge-case
grid and a few thousand seeded random launch configurations: resident blocks per SM,
the per-resource block limits, the allocated registers/shared memory per block,
which limits bind, and that configurations the reference cannot run raise
``OccupancyError`` in ours.

Further: hand-worked cases with the arithmetic written out, the ``paella occupancy``
CLI as a subprocess, ``SMResources`` (the per-SM allocator of the simulator), and the
preset figures against NVIDIA's published specifications (see docs/occupancy.md).
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from paella.gpus import KIB, PRESETS, GpuSpec, preset
from paella.occupancy import (LIMITS, OccupancyError, SMResources, footprint, occupancy,
                              smem_granularity, sub_partitions)

HERE = Path(__file__).resolve().parent
REF_SRC = HERE / "occupancy_ref" / "occ_ref.cpp"
CUDA_HOME = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
HEADER = CUDA_HOME / "include" / "cuda_occupancy.h"

INT_MAX = 2**31 - 1
UNLIMITED = 1 << 30                  # what paella.occupancy reports for "no limit"
# cudaOccLimitingFactor bits -> our limit names
FACTOR_BITS = {"warps": 0x01, "registers": 0x02, "shared_memory": 0x04, "blocks": 0x08}
CUDA_OCC_SUCCESS = 0
PRESET_NAMES = sorted(PRESETS)


# --------------------------------------------------------------------------------------
# The reference oracle
# --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Ref:
    status: int
    blocks: int
    factors: int
    lim_regs: int
    lim_smem: int
    lim_warps: int
    lim_blocks: int
    alloc_regs: int
    alloc_smem: int

    @property
    def runs(self) -> bool:
        return self.status == CUDA_OCC_SUCCESS and self.blocks > 0

    @property
    def binding(self) -> set[str]:
        return {k for k, bit in FACTOR_BITS.items() if self.factors & bit}

    @property
    def per_limit(self) -> dict[str, int]:
        return {"blocks": self.lim_blocks, "warps": self.lim_warps,
                "registers": self.lim_regs, "shared_memory": self.lim_smem}


@pytest.fixture(scope="session")
def occ_ref(request) -> Path:
    """Path of the compiled reference helper (compiled once, cached by content hash)."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ not found: cannot build the cuda_occupancy.h reference")
    if not HEADER.is_file():
        pytest.skip(f"{HEADER} not found (set CUDA_HOME): no reference occupancy calculator")
    digest = hashlib.sha256(REF_SRC.read_bytes() + HEADER.read_bytes()).hexdigest()[:16]
    out_dir = Path(request.config.cache.mkdir("occupancy_ref"))
    exe = out_dir / f"occ_ref-{digest}"
    if not exe.is_file():
        tmp = out_dir / f"occ_ref-{digest}.{os.getpid()}.tmp"
        proc = subprocess.run([gxx, "-O1", "-std=c++17", "-Wall", f"-I{HEADER.parent}",
                               str(REF_SRC), "-o", str(tmp)], capture_output=True, text=True)
        assert proc.returncode == 0, f"building the reference failed:\n{proc.stderr}"
        os.replace(tmp, exe)
    return exe


def spec_fields(spec: GpuSpec) -> list[int]:
    """The cudaOccDeviceProp fields, in the helper's input order."""
    return [spec.major, spec.minor, spec.max_threads_per_block, spec.max_threads_per_sm,
            spec.regs_per_block, spec.regs_per_sm, spec.warp_size, spec.smem_per_block,
            spec.smem_per_sm, spec.sm_count, spec.smem_per_block_optin,
            spec.reserved_smem_per_block]


def run_ref(exe: Path, spec: GpuSpec, cases, barriers: int = 0) -> list[Ref]:
    """Evaluate (threads, regs, smem) cases on ``spec`` with the reference."""
    dev = " ".join(map(str, spec_fields(spec)))
    text = "".join(f"{dev} {t} {r} {s} {barriers}\n" for t, r, s in cases)
    proc = subprocess.run([str(exe)], input=text, capture_output=True, text=True, check=True)
    lines = proc.stdout.splitlines()
    assert len(lines) == len(cases), proc.stdout[-2000:]
    return [Ref(*map(int, line.split())) for line in lines]


# --------------------------------------------------------------------------------------
# Launch configurations
# --------------------------------------------------------------------------------------

EDGE_THREADS = [1, 2, 31, 32, 33, 63, 64, 65, 96, 127, 128, 129, 160, 192, 224, 256, 288,
                320, 384, 448, 512, 576, 640, 704, 768, 800, 896, 928, 992, 1023, 1024]
EDGE_REGS = [0, 1, 2, 7, 8, 9, 16, 23, 24, 25, 32, 33, 40, 48, 56, 63, 64, 65, 72, 80, 96,
             104, 128, 168, 200, 232, 254, 255, 256]


def edge_smem(spec: GpuSpec) -> list[int]:
    g = smem_granularity(spec)
    res = spec.reserved_smem_per_block
    pb, opt, sm = spec.smem_per_block, spec.smem_per_block_optin, spec.smem_per_sm
    vals = {0, 1, g - 1, g, g + 1, 2 * g, 2 * g + 1, 1000, 4 * KIB, 8 * KIB, 12 * KIB,
            16 * KIB, 32 * KIB, pb - res - 1, pb - res, pb - res + 1, pb - 1, pb, pb + 1,
            pb + g, opt - g, opt - res, opt - 1, opt, opt + 1, sm - res, sm, sm + 1}
    return sorted(v for v in vals if v >= 0)


def edge_cases(spec: GpuSpec) -> list[tuple[int, int, int]]:
    return [(t, r, s) for t in EDGE_THREADS for r in EDGE_REGS for s in edge_smem(spec)]


# Configurations that must be rejected by both (the reference returns 0 blocks or
# CUDA_OCC_ERROR_INVALID_INPUT): no threads, too many threads, too many registers,
# negative registers, more shared memory than the opt-in limit.
def invalid_cases(spec: GpuSpec) -> list[tuple[int, int, int]]:
    return [(0, 32, 0), (spec.max_threads_per_block + 1, 32, 0), (2048, 32, 0),
            (128, 257, 0), (128, 300, 0), (128, -1, 0), (32, -5, 0),
            (128, 32, spec.smem_per_block_optin + 1), (128, 32, spec.smem_per_sm + 1),
            (1024, 65, 0), (800, 80, 0)]


def random_cases(spec: GpuSpec, n: int, seed: int) -> list[tuple[int, int, int]]:
    rng = random.Random(seed)
    g = smem_granularity(spec)
    out = []
    for _ in range(n):
        u = rng.random()
        if u < 0.5:
            t = 32 * rng.randint(1, spec.max_threads_per_block // 32)
        elif u < 0.97:
            t = rng.randint(1, spec.max_threads_per_block)
        else:
            t = rng.randint(spec.max_threads_per_block + 1, 2 * spec.max_threads_per_block)
        r = rng.randint(0, 256) if rng.random() < 0.97 else rng.randint(257, 320)
        u = rng.random()
        if u < 0.3:
            s = 0
        elif u < 0.7:
            s = rng.randint(0, spec.smem_per_block)
        elif u < 0.9:
            s = rng.randint(spec.smem_per_block, spec.smem_per_block_optin + 2 * g)
        else:
            s = max(0, g * rng.randint(0, spec.smem_per_block_optin // g) + rng.choice((-1, 0, 1)))
        out.append((t, r, s))
    return out


N_RANDOM = 1500      # per preset


def all_cases(spec: GpuSpec, name: str) -> list[tuple[int, int, int]]:
    seed = int(hashlib.sha256(name.encode()).hexdigest()[:8], 16)
    return edge_cases(spec) + invalid_cases(spec) + random_cases(spec, N_RANDOM, seed)


# --------------------------------------------------------------------------------------
# Comparison with the reference
# --------------------------------------------------------------------------------------

def compare(spec: GpuSpec, case, ref: Ref) -> str | None:
    """None when ours agrees with the reference on ``case``, else a description."""
    t, r, s = case
    try:
        occ = occupancy(spec, t, r, s)
    except OccupancyError as e:
        if ref.runs:
            return f"{case}: ours raises OccupancyError({e}) but reference gives {ref.blocks} blocks"
        return None
    if not ref.runs:
        return (f"{case}: ours gives {occ.blocks_per_sm} blocks but reference says it cannot "
                f"run (status={ref.status}, blocks={ref.blocks}, factors={ref.factors:#x})")
    problems = []
    if occ.blocks_per_sm != ref.blocks:
        problems.append(f"blocks/SM ours={occ.blocks_per_sm} ref={ref.blocks}")
    for k, rv in ref.per_limit.items():
        ov = occ.per_limit[k]
        same = (ov >= UNLIMITED) if rv == INT_MAX else ov == rv
        if not same:
            problems.append(f"{k} limit ours={ov} ref={rv}")
    if set(occ.binding) != ref.binding:
        problems.append(f"binding ours={sorted(occ.binding)} ref={sorted(ref.binding)}")
    if occ.limit != occ.binding[0] or occ.limit not in ref.binding:
        problems.append(f"limit ours={occ.limit!r} not a binding limit of the reference")
    fp = footprint(spec, t, r, s)
    if fp.regs != ref.alloc_regs:
        problems.append(f"allocated regs/block ours={fp.regs} ref={ref.alloc_regs}")
    if fp.smem != ref.alloc_smem:
        problems.append(f"allocated smem/block ours={fp.smem} ref={ref.alloc_smem}")
    if occ.active_warps != ref.blocks * fp.warps or occ.max_warps != spec.max_warps_per_sm:
        problems.append(f"active warps ours={occ.active_warps}/{occ.max_warps}")
    return f"{case}: " + "; ".join(problems) if problems else None


@pytest.fixture(scope="session")
def reference_results(occ_ref):
    """{preset: (cases, refs)} for every preset, computed once."""
    out = {}
    for name in PRESET_NAMES:
        spec = PRESETS[name]
        cases = all_cases(spec, name)
        out[name] = (cases, run_ref(occ_ref, spec, cases))
    return out


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_matches_reference(name, reference_results):
    spec = PRESETS[name]
    cases, refs = reference_results[name]
    assert len(cases) > 5000
    bad = [m for c, ref in zip(cases, refs) if (m := compare(spec, c, ref))]
    assert not bad, (f"{len(bad)} of {len(cases)} configurations on {name} disagree with "
                     f"cuda_occupancy.h:\n  " + "\n  ".join(bad[:25]))


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_reference_exercises_every_limit(name, reference_results):
    """The case mix is useful: every limit binds somewhere and some cases cannot run."""
    cases, refs = reference_results[name]
    seen = set()
    for ref in refs:
        if ref.runs:
            seen |= ref.binding
    assert seen == set(LIMITS)
    assert sum(not ref.runs for ref in refs) >= 50


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_block_barriers_do_not_change_presets(name, occ_ref, reference_results):
    """We ignore the Hopper+ block-barrier limit (cudaOccFuncAttributes defaults to 0
    barriers; real kernels report 1). With 1 barrier per block the reference's answers
    are the same on every preset: sm_90 has 2 barriers per block slot."""
    spec = PRESETS[name]
    cases, refs = reference_results[name]
    refs1 = run_ref(occ_ref, spec, cases, barriers=1)
    diff = [(c, a, b) for c, a, b in zip(cases, refs, refs1)
            if (a.status, a.blocks) != (b.status, b.blocks)]
    assert not diff, diff[:5]


def test_preset_block_limit_matches_reference_table(occ_ref):
    """max_blocks_per_sm is a compute-capability fact the reference hard-codes
    (cudaOccMaxBlocksPerMultiprocessor): sm_75 16, sm_70/80/90 32."""
    for name, spec in PRESETS.items():
        (ref,) = run_ref(occ_ref, spec, [(32, 0, 0)])
        assert ref.lim_blocks == spec.max_blocks_per_sm, name


# --------------------------------------------------------------------------------------
# Hand-worked cases
# --------------------------------------------------------------------------------------

HAND_WORKED = [
    # Paella Figure 2 kernel on a GTX 1660 SUPER (sm_75: 32 warps, 16 blocks, 64 Ki regs):
    #   warps/block = ceil(128/32) = 4                  -> warps: 32 // 4 = 8 blocks
    #   regs/warp   = 9*32 = 288 -> round up to 256s = 512
    #   per sub-partition 65536/4 = 16384 -> 16384 // 512 = 32 warps, x4 = 128 warps
    #                                                   -> registers: 128 // 4 = 32 blocks
    #   blocks: 16; shared memory: 0 B and no reservation on sm_75 -> unlimited
    #   => 8 blocks/SM, warp-bound.
    ("gtx1660s", 128, 9, 0, 8, ("warps",)),
    # Register-bound on a T4: 128 threads x 128 regs
    #   regs/warp = 128*32 = 4096; 16384 // 4096 = 4 warps per sub-partition, x4 = 16 warps
    #   registers: 16 // 4 = 4 blocks; warps: 32 // 4 = 8; blocks: 16  => 4, register-bound.
    ("t4", 128, 128, 0, 4, ("registers",)),
    # The sub-partition split matters on an A100: 32 threads (1 warp) x 96 regs
    #   regs/warp = 96*32 = 3072; 16384 // 3072 = 5 warps per sub-partition (1024 regs
    #   stranded in each), x4 = 20 warps -> 20 blocks. (The whole register file would
    #   naively give 65536 // 3072 = 21.) warps: 64; blocks: 32;
    #   shared memory: 0 + 1 KiB reservation = 1024 B -> 167936 // 1024 = 164.
    #   => 20, register-bound.
    ("a100", 32, 96, 0, 20, ("registers",)),
    # Shared-memory-bound on an A100, where the 1 KiB per-block reservation costs 2 blocks:
    #   64 threads x 32 regs, 8 KiB: allocated = roundup(8192 + 1024, 128) = 9216 B
    #   shared memory: 167936 // 9216 = 18 (without the reservation 167936 // 8192 = 20)
    #   warps: 64 // 2 = 32; registers: 1024/warp -> 16*4 = 64 warps -> 32; blocks: 32
    #   => 18, shared-memory-bound.
    ("a100", 64, 32, 8 * KIB, 18, ("shared_memory",)),
    # A100 at exactly the default 48 KiB (no opt-in needed; limit 48 KiB + 1 KiB reserved):
    #   allocated = 49152 + 1024 = 50176; 167936 // 50176 = 3; warps 64 // 4 = 16  => 3.
    ("a100", 128, 32, 48 * KIB, 3, ("shared_memory",)),
    # A100 at the opt-in maximum, 163 KiB: 166912 + 1024 = 167936 = the whole SM => 1.
    ("a100", 256, 32, 163 * KIB, 1, ("shared_memory",)),
    # H100 with 100 KiB opt-in: allocated 102400 + 1024 = 103424; 233472 // 103424 = 2.
    ("h100", 128, 32, 100 * KIB, 2, ("shared_memory",)),
    # Two limits bind at once (the CLI example): T4, 256 threads x 64 regs
    #   warps: 32 // 8 = 4; registers: 2048/warp -> 8 per sub-partition, 32 warps -> 4
    #   => 4 blocks, binding warps and registers (reported in LIMITS order).
    ("t4", 256, 64, 0, 4, ("warps", "registers")),
    # Block-slot bound on a V100: 32 threads x 16 regs
    #   warps: 64 // 1 = 64; registers: 512/warp -> 32*4 = 128 warps -> 128; blocks: 32
    ("v100", 32, 16, 0, 32, ("blocks",)),
    # The largest block on Turing: 1024 threads x 64 regs = 32 warps x 2048 = 65536 regs,
    # exactly the per-block and per-SM register files; 32 warps fill the SM  => 1.
    ("t4", 1024, 64, 0, 1, ("warps", "registers")),
    # T4 shared memory at the 256 B granularity: 257 B -> 512 B; 65536 // 512 = 128, so
    # 32 threads x 8 regs stay block-slot bound at 16.
    ("t4", 32, 8, 257, 16, ("blocks",)),
    # T4 opt-in maximum 64 KiB: one block per SM; 64 KiB + 1 is rejected (below).
    ("t4", 64, 16, 64 * KIB, 1, ("shared_memory",)),
]


@pytest.mark.parametrize("gpu,threads,regs,smem,blocks,binding", HAND_WORKED)
def test_hand_worked(gpu, threads, regs, smem, blocks, binding):
    occ = occupancy(preset(gpu), threads, regs, smem)
    assert occ.blocks_per_sm == blocks
    assert occ.binding == binding
    assert occ.limit == binding[0]


@pytest.mark.parametrize("gpu,threads,regs,smem", [
    # 1024 threads x 65 regs: 65*32 = 2080 -> 2304/warp x 32 warps = 73728 > 65536.
    ("t4", 1024, 65, 0),
    # 800 threads (25 warps) x 80 regs: 2560/warp; the hardware check rounds the block to
    # 28 warps: 71680 > 65536 (and one sub-partition holds only 16384 // 2560 = 6 warps,
    # 24 per SM < 25).
    ("a100", 800, 80, 0),
    ("t4", 1025, 1, 0),          # over max threads per block
    ("t4", 2048, 32, 0),
    ("t4", 0, 32, 0),            # no threads
    ("t4", 128, 257, 0),         # over 256 regs/thread (sm_70+)
    ("t4", 128, -1, 0),          # negative
    ("t4", 128, 32, -1),
    ("t4", 64, 16, 64 * KIB + 1),            # over the opt-in per-block limit
    ("v100", 64, 16, 96 * KIB + 1),
    ("a100", 64, 16, 163 * KIB + 1),          # 163 KiB + 1 + 1 KiB -> 164 KiB + 128 > limit
    ("h100", 64, 16, 227 * KIB + 1),
])
def test_hand_worked_rejected(gpu, threads, regs, smem):
    with pytest.raises(OccupancyError):
        occupancy(preset(gpu), threads, regs, smem)


def test_granularities_and_partitions():
    for name, spec in PRESETS.items():
        assert sub_partitions(spec) == (2 if spec.arch == 60 else 4), name
        assert smem_granularity(spec) == (256 if spec.major < 8 else 128), name


# --------------------------------------------------------------------------------------
# The CLI
# --------------------------------------------------------------------------------------

def _paella_cmd() -> list[str]:
    exe = Path(sys.executable).parent / "paella"
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "paella.cli"]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(_paella_cmd() + list(args), capture_output=True, text=True, timeout=120)


def test_cli_json():
    p = run_cli("occupancy", "--gpu", "t4", "--threads", "256", "--regs", "64", "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    # 256 threads = 8 warps: warps 32 // 8 = 4; regs 64*32 = 2048/warp ->
    # 16384 // 2048 = 8 warps per sub-partition, 32 per SM -> 4 blocks.
    assert d["gpu"] == "t4"
    assert (d["threads"], d["regs"], d["smem"]) == (256, 64, 0)
    assert d["blocks_per_sm"] == 4
    assert d["limit"] == "warps"
    assert d["binding"] == ["warps", "registers"]
    assert {k: d["per_limit"][k] for k in ("blocks", "warps", "registers")} == {
        "blocks": 16, "warps": 4, "registers": 4}
    assert d["per_limit"]["shared_memory"] is None       # no shared memory: no limit
    assert (d["active_warps"], d["max_warps"]) == (32, 32)
    assert d["occupancy"] == pytest.approx(1.0)


def test_cli_text_and_smem():
    p = run_cli("occupancy", "--gpu", "a100", "--threads", "64", "--regs", "32",
                "--smem", str(8 * KIB))
    assert p.returncode == 0, p.stderr
    assert "resident blocks per SM: 18" in p.stdout
    assert "shared_memory" in p.stdout


@pytest.mark.parametrize("args,needle", [
    (["--gpu", "nosuch", "--threads", "128", "--regs", "32"], "unknown GPU preset 'nosuch'"),
    (["--gpu", "t4", "--threads", "2048", "--regs", "32"], "2048 threads per block"),
    (["--gpu", "t4", "--threads", "128", "--regs", "-1"], "registers per thread"),
    (["--gpu", "t4", "--threads", "128", "--regs", "300"], "300 registers per thread"),
    (["--gpu", "t4", "--threads", "128", "--regs", "32", "--smem", "70000"], "shared memory"),
    (["--gpu", "t4", "--threads", "abc", "--regs", "32"], "invalid int value"),
    (["--gpu", "t4", "--regs", "32"], "--threads"),
])
def test_cli_bad_arguments(args, needle):
    p = run_cli("occupancy", *args)
    assert p.returncode != 0
    assert needle in p.stderr
    assert "Traceback" not in p.stderr
    assert p.stdout == ""


def test_cli_unknown_preset_lists_known_ones():
    p = run_cli("occupancy", "--gpu", "nosuch", "--threads", "128", "--regs", "32")
    assert p.returncode == 2
    assert p.stderr.startswith("paella: error:")
    for name in PRESETS:
        assert name in p.stderr


# --------------------------------------------------------------------------------------
# SMResources: the per-SM allocator
# --------------------------------------------------------------------------------------

def _state(res: SMResources):
    return (list(res.blocks), list(res.warps), list(res.smem), list(res.regs))


def _valid_sample(spec: GpuSpec, name: str, n: int):
    out = []
    for c in random_cases(spec, 4 * n, seed=len(name) * 7919) + [
            (128, 9, 0), (32, 96, 0), (1024, 64, 0), (96, 168, 0), (64, 32, 8 * KIB),
            (256, 0, 0), (1, 0, 0), (32, 255, spec.smem_per_block_optin)]:
        try:
            occupancy(spec, *c)
        except OccupancyError:
            continue
        out.append(c)
    return out[:n] + out[-8:]


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_smresources_fill_one_sm(name):
    spec = PRESETS[name].with_(sm_count=3)
    for case in _valid_sample(spec, name, 150):
        occ = occupancy(spec, *case)
        fp = footprint(spec, *case)
        res = SMResources(spec)
        initial = _state(res)
        assert res.fit(1, fp) == occ.blocks_per_sm, case
        splits = []
        while res.fit(1, fp) > 0:
            splits.append(res.take(1, fp, 1))
            assert len(splits) <= occ.blocks_per_sm, case
        assert len(splits) == occ.blocks_per_sm, case
        # the other SMs are untouched and still fit a full complement
        assert res.fit(0, fp) == res.fit(2, fp) == occ.blocks_per_sm
        assert res.used()["blocks"] == occ.blocks_per_sm
        assert res.used()["warps"] == occ.blocks_per_sm * fp.warps
        assert res.used()["registers"] == occ.blocks_per_sm * fp.regs
        assert res.used()["shared_memory"] == occ.blocks_per_sm * fp.smem
        for split in reversed(splits):
            res.give(1, fp, 1, split)
        assert _state(res) == initial, case
        # all at once: same count, and nothing more fits afterwards
        split = res.take(1, fp, occ.blocks_per_sm)
        assert res.fit(1, fp) == 0
        res.give(1, fp, occ.blocks_per_sm, split)
        assert _state(res) == initial, case
        assert all(v == 0 for v in res.used().values())


def _check_invariants(res: SMResources, live) -> None:
    spec = res.spec
    for sm in range(spec.sm_count):
        assert 0 <= res.blocks[sm] <= spec.max_blocks_per_sm
        assert 0 <= res.warps[sm] <= spec.max_warps_per_sm
        assert 0 <= res.smem[sm] <= spec.smem_per_sm
        for p in range(sm * res.parts, (sm + 1) * res.parts):
            assert 0 <= res.regs[p] <= res.part_regs
    # the free counters agree with what the live allocations hold
    for sm in range(spec.sm_count):
        mine = [(fp, n, split) for s, fp, n, split in live if s == sm]
        assert spec.max_blocks_per_sm - res.blocks[sm] == sum(n for _, n, _ in mine)
        assert spec.max_warps_per_sm - res.warps[sm] == sum(n * fp.warps for fp, n, _ in mine)
        assert spec.smem_per_sm - res.smem[sm] == sum(n * fp.smem for fp, n, _ in mine)
        regs_by_part = [0] * res.parts
        for fp, n, split in mine:
            # split: warps taken from each of the SM's sub-partitions
            assert len(split) == res.parts
            assert sum(split) == (n * fp.warps if fp.regs_per_warp else 0)
            for i, k in enumerate(split):
                regs_by_part[i] += int(k) * fp.regs_per_warp
        for i, used in enumerate(regs_by_part):
            assert res.part_regs - res.regs[sm * res.parts + i] == used
    u = res.used()
    assert u["blocks"] == sum(n for _, _, n, _ in live)
    assert u["registers"] == sum(n * fp.regs for _, fp, n, _ in live)


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_smresources_mixed_kernels(name):
    spec = PRESETS[name].with_(sm_count=2)
    rng = random.Random(sum(map(ord, name)))
    kernels = [footprint(spec, *c) for c in _valid_sample(spec, name, 40)]
    res = SMResources(spec)
    initial = _state(res)
    live = []                                   # (sm, fp, n, split)
    for step in range(3000):
        if live and (rng.random() < 0.45 or step % 97 == 0):
            sm, fp, n, split = live.pop(rng.randrange(len(live)))
            res.give(sm, fp, n, split)
        else:
            sm = rng.randrange(spec.sm_count)
            fp = rng.choice(kernels)
            k = res.fit(sm, fp)
            if k == 0:
                continue
            n = rng.randint(1, k) if rng.random() < 0.7 else k
            live.append((sm, fp, n, res.take(sm, fp, n)))
            if n == k:
                assert res.fit(sm, fp) == 0, "fit() promised more than take() left room for"
        _check_invariants(res, live)
    for sm, fp, n, split in reversed(live):
        res.give(sm, fp, n, split)
    assert _state(res) == initial


def test_smresources_subpartition_packing():
    """Registers are accounted per sub-partition: a 3072-register warp (96 regs/thread)
    strands 1024 registers in each 16384-register sub-partition, so an A100 SM holds 20
    such warps, not 21; afterwards 4 warps of 32 regs (1024 each) still fit, one in each
    stranded remainder, though the SM has no 3072-register hole left."""
    spec = preset("a100").with_(sm_count=1)
    res = SMResources(spec)
    big = footprint(spec, 32, 96)
    small = footprint(spec, 32, 32)
    assert res.fit(0, big) == 20
    res.take(0, big, 20)
    assert res.fit(0, big) == 0
    assert list(res.regs) == [1024] * 4
    assert res.fit(0, small) == 4
    res.take(0, small, 4)
    assert list(res.regs) == [0] * 4 and res.fit(0, small) == 0


# --------------------------------------------------------------------------------------
# Preset figures against NVIDIA's published specifications (sources in docs/occupancy.md)
# --------------------------------------------------------------------------------------

# Per compute capability: CUDA C++ Programming Guide, "Technical Specifications per
# Compute Capability"; the Ampere and Hopper tuning guides (shared memory capacity, the
# 1 KiB per-block reservation).
#   (threads/SM, blocks/SM, regs/SM, regs/block, smem/SM, smem/block, opt-in/block, reserved)
PER_CC = {
    60: (2048, 32, 65536, 65536, 64 * KIB, 48 * KIB, 48 * KIB, 0),
    61: (2048, 32, 65536, 65536, 96 * KIB, 48 * KIB, 48 * KIB, 0),
    75: (1024, 16, 65536, 65536, 64 * KIB, 48 * KIB, 64 * KIB, 0),
    70: (2048, 32, 65536, 65536, 96 * KIB, 48 * KIB, 96 * KIB, 0),
    80: (2048, 32, 65536, 65536, 164 * KIB, 48 * KIB, 163 * KIB, 1 * KIB),
    90: (2048, 32, 65536, 65536, 228 * KIB, 48 * KIB, 227 * KIB, 1 * KIB),
}
# Per product (datasheets / whitepapers):
#   (cc, SMs, FP32 cores per SM, boost clock Hz, FP32 FLOP/s as published, memory B/s)
PRODUCT = {
    # Tesla P100 PCIe 16 GB: GP100, 56 SMs x 64 = 3584 cores, 1303 MHz boost; 9.3 TFLOPS;
    # 732 GB/s HBM2.
    "p100": (60, 56, 64, 1.303e9, 9.3e12, 732e9),
    # TITAN Xp: GP102, 30 SMs x 128 = 3840 cores, 1582 MHz boost; 12.1 TFLOPS; 11.4 Gbps
    # GDDR5X x 384 bit = 547.7 GB/s.
    "titanxp": (61, 30, 128, 1.582e9, 12.1e12, 547.7e9),
    # GeForce RTX 2060: TU106, 30 SMs x 64 = 1920 cores, 1680 MHz boost; 6.45 TFLOPS;
    # 14 Gbps GDDR6 x 192 bit = 336 GB/s.
    "rtx2060": (75, 30, 64, 1.680e9, 6.45e12, 336e9),
    # TITAN RTX: TU102, 72 SMs x 64 = 4608 cores, 1770 MHz boost; 16.3 TFLOPS; 14 Gbps
    # GDDR6 x 384 bit = 672 GB/s.
    "titanrtx": (75, 72, 64, 1.770e9, 16.3e12, 672e9),
    # GeForce GTX 1660 SUPER: TU116, 22 SMs x 64 = 1408 cores, 1785 MHz boost,
    # 6 GB GDDR6 14 Gbps x 192 bit = 336 GB/s; 1408 x 2 x 1.785 GHz = 5.03 TFLOPS.
    "gtx1660s": (75, 22, 64, 1.785e9, 5.03e12, 336e9),
    # Tesla T4: TU104, 40 SMs, 2560 cores, 1590 MHz boost; 8.1 TFLOPS FP32; 320 GB/s GDDR6.
    "t4": (75, 40, 64, 1.590e9, 8.1e12, 320e9),
    # Tesla V100 SXM2: GV100, 80 SMs, 5120 cores, 1530 MHz boost; 15.7 TFLOPS; 900 GB/s.
    "v100": (70, 80, 64, 1.530e9, 15.7e12, 900e9),
    # A100 SXM4 40GB: GA100, 108 SMs, 6912 cores, 1410 MHz boost; 19.5 TFLOPS; 1555 GB/s.
    "a100": (80, 108, 64, 1.410e9, 19.5e12, 1555e9),
    # H100 SXM5 80GB: GH100, 132 SMs, 16896 cores, 1980 MHz boost; 67 TFLOPS; 3.35 TB/s.
    "h100": (90, 132, 128, 1.980e9, 67e12, 3.35e12),
}


def test_every_preset_is_checked():
    assert set(PRESETS) == set(PRODUCT)


@pytest.mark.parametrize("name", sorted(PRODUCT))
def test_preset_matches_published_specs(name):
    spec = PRESETS[name]
    cc, sms, cores_per_sm, clock, flops, bw = PRODUCT[name]
    assert spec.name == name
    assert spec.arch == cc
    assert spec.sm_count == sms
    assert (spec.max_threads_per_sm, spec.max_blocks_per_sm, spec.regs_per_sm,
            spec.regs_per_block, spec.smem_per_sm, spec.smem_per_block,
            spec.smem_per_block_optin, spec.reserved_smem_per_block) == PER_CC[cc]
    assert spec.max_threads_per_block == 1024
    assert spec.warp_size == 32
    assert spec.peak_flops == pytest.approx(flops, rel=0.005)
    # and the published figure is cores x 2 FLOP (FMA) x boost clock
    assert spec.peak_flops == pytest.approx(sms * cores_per_sm * 2 * clock, rel=0.01)
    assert spec.mem_bw == pytest.approx(bw, rel=0.005)
    assert spec.hw_queues == 32                     # Hyper-Q: 32 hardware work queues
