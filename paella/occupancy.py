"""Per-SM resource rules of the CUDA Occupancy Calculator, shared by the simulator,
the dispatcher's occupancy tracker and ``paella occupancy``.

The rules are those of NVIDIA's ``cuda_occupancy.h`` (CUDA 13), with partitioned
global caching off and the default shared-memory carveout:

* threads are allocated in whole warps;
* registers are allocated per warp, rounded up to 256, and each SM's register file is
  split evenly over its sub-partitions (4 on every architecture we model); a warp's
  registers come from one sub-partition, so the register limit is
  ``floor(regs_per_sm / 4 / regs_per_warp) * 4`` warps;
* shared memory (static + dynamic + the per-block system reservation, 1 KiB on sm_80
  and later) is rounded up to the allocation unit: 256 B before sm_80, 128 B after;
* at most ``max_blocks_per_sm`` blocks are resident.

A :class:`Footprint` is what one block of a kernel takes from an SM once rounded; it is
computed once per kernel so that placement is integer arithmetic only.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from paella.gpus import GpuSpec

REG_ALLOC_UNIT = 256
LIMITS = ("blocks", "warps", "registers", "shared_memory")
UNLIMITED = 1 << 30           # "no limit from this resource"


class OccupancyError(ValueError):
    """A launch configuration that can never run on the device."""


def sub_partitions(spec: GpuSpec) -> int:
    if spec.major == 6 and spec.minor == 0:
        return 2
    return 4


def smem_granularity(spec: GpuSpec) -> int:
    return 256 if spec.major < 8 else 128


def max_regs_per_thread(spec: GpuSpec) -> int:
    return 255 if spec.major < 7 else 256


def _round_up(x: int, unit: int) -> int:
    return -(-x // unit) * unit


@dataclass(frozen=True, slots=True)
class Footprint:
    """What one resident block takes from an SM, in allocation granules."""
    threads: int
    warps: int
    regs_per_thread: int
    regs_per_warp: int      # allocated registers per warp (multiple of 256)
    smem: int               # allocated shared memory per block, bytes

    @property
    def regs(self) -> int:
        """Registers allocated to the whole block."""
        return self.regs_per_warp * self.warps


def footprint(spec: GpuSpec, threads: int, regs_per_thread: int, smem: int = 0) -> Footprint:
    """Round a block's demands to allocation granules; raise if it can never fit.

    ``smem`` is the block's static plus dynamic shared memory in bytes. Blocks that
    need more than the default 48 KiB are treated as having opted in, as the CUDA
    backend does with ``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES``.
    """
    for name, value in (("threads per block", threads), ("registers per thread", regs_per_thread),
                        ("shared memory per block", smem)):
        if not isinstance(value, int) or value < 0:
            raise OccupancyError(f"{name} must be a non-negative integer, got {value!r}")
    if threads == 0:
        raise OccupancyError("a block needs at least one thread")
    if threads > spec.max_threads_per_block:
        raise OccupancyError(f"{threads} threads per block exceeds the {spec.name} maximum of "
                             f"{spec.max_threads_per_block}; use smaller blocks")
    if regs_per_thread > max_regs_per_thread(spec):
        raise OccupancyError(f"{regs_per_thread} registers per thread exceeds the {spec.sm_name} "
                             f"maximum of {max_regs_per_thread(spec)}")
    warps = -(-threads // spec.warp_size)
    rpw = _round_up(regs_per_thread * spec.warp_size, REG_ALLOC_UNIT)
    parts = sub_partitions(spec)
    # Hardware check: the per-block register limit assumes warps spread over all
    # sub-partitions, so warps are rounded up to a multiple of the partition count.
    if rpw * _round_up(warps, parts) > spec.regs_per_block or rpw * warps > spec.regs_per_block:
        raise OccupancyError(f"a block of {threads} threads at {regs_per_thread} registers needs "
                             f"{rpw * _round_up(warps, parts)} registers, over the per-block limit "
                             f"of {spec.regs_per_block}; use fewer registers or threads")
    if spec.arch == 60 and rpw and ((spec.regs_per_sm // 4 // rpw) * 4 // warps == 0
                                     or rpw * _round_up(warps, 4) > spec.regs_per_block):
        # cuda_occupancy.h: GP100 (sm_60, 2 sub-partitions) refuses what GP10x (4) could not
        # run, "for forward compatibility within Pascal family".
        raise OccupancyError(f"a block of {threads} threads at {regs_per_thread} registers cannot "
                             f"run on sm_61 (4 register sub-partitions), so sm_60 refuses it too; "
                             f"use fewer registers or threads")
    smem_alloc = _round_up(smem + spec.reserved_smem_per_block, smem_granularity(spec)) if (
        smem or spec.reserved_smem_per_block) else 0
    limit = (spec.smem_per_block if smem <= spec.smem_per_block else spec.smem_per_block_optin)
    if spec.major >= 8:
        limit += spec.reserved_smem_per_block
    if smem_alloc > limit or smem_alloc > spec.smem_per_sm:
        raise OccupancyError(f"{smem} bytes of shared memory per block (allocated: {smem_alloc}) "
                             f"exceeds the {spec.name} per-block limit of {limit} bytes; use less "
                             f"shared memory per block")
    return Footprint(threads, warps, regs_per_thread, rpw, smem_alloc)


@dataclass(frozen=True)
class Occupancy:
    blocks_per_sm: int
    limit: str                      # the first binding limit, in LIMITS order
    binding: tuple[str, ...]        # every limit that binds
    per_limit: dict[str, int]       # blocks allowed by each resource alone
    active_warps: int
    max_warps: int

    @property
    def fraction(self) -> float:
        return self.active_warps / self.max_warps


def limits_per_resource(spec: GpuSpec, fp: Footprint) -> dict[str, int]:
    parts = sub_partitions(spec)
    if fp.regs_per_warp:
        reg_warps = (spec.regs_per_sm // parts // fp.regs_per_warp) * parts
        reg_blocks = reg_warps // fp.warps
    else:
        reg_blocks = UNLIMITED
    return {
        "blocks": spec.max_blocks_per_sm,
        "warps": spec.max_warps_per_sm // fp.warps,
        "registers": reg_blocks,
        "shared_memory": spec.smem_per_sm // fp.smem if fp.smem else UNLIMITED,
    }


def wave_blocks(spec: GpuSpec, fp: Footprint) -> int:
    """Blocks of footprint ``fp`` the whole GPU holds at once (one wave)."""
    return max(1, min(limits_per_resource(spec, fp).values())) * spec.sm_count


def occupancy(spec: GpuSpec, threads: int, regs_per_thread: int, smem: int = 0) -> Occupancy:
    """Resident blocks per SM for one kernel alone, and which limit binds."""
    fp = footprint(spec, threads, regs_per_thread, smem)
    per = limits_per_resource(spec, fp)
    n = min(per.values())
    binding = tuple(k for k in LIMITS if per[k] == n)
    return Occupancy(n, binding[0], binding, per, n * fp.warps, spec.max_warps_per_sm)


class SMResources:
    """Free resources of every SM, with the Occupancy Calculator's granularity.

    The simulator's ground truth. State is plain lists of ints (one entry per SM;
    registers per sub-partition in a flat list, ``sm * parts + p``): scalar updates on
    lists are several times cheaper than on numpy arrays, and most placements touch an
    SM or two. A kernel's whole wave goes through :meth:`fit_all`, :meth:`take_many` and
    :meth:`give_many`, which do the arithmetic as vector operations.
    """

    __slots__ = ("spec", "parts", "part_regs", "blocks", "warps", "smem", "regs")

    def __init__(self, spec: GpuSpec):
        self.spec = spec
        self.parts = sub_partitions(spec)
        self.part_regs = spec.regs_per_sm // self.parts
        n = spec.sm_count
        self.blocks = [spec.max_blocks_per_sm] * n
        self.warps = [spec.max_warps_per_sm] * n
        self.smem = [spec.smem_per_sm] * n
        self.regs = [self.part_regs] * (n * self.parts)

    # -- one SM -------------------------------------------------------------------------
    def fit(self, sm: int, fp: Footprint) -> int:
        """How many more blocks of ``fp`` fit on ``sm`` right now."""
        n = self.blocks[sm]
        w = self.warps[sm] // fp.warps
        if w < n:
            n = w
        if fp.smem:
            s = self.smem[sm] // fp.smem
            if s < n:
                n = s
        rpw = fp.regs_per_warp
        if rpw and n:
            base = sm * self.parts
            reg_warps = 0
            for p in range(base, base + self.parts):
                reg_warps += self.regs[p] // rpw
            r = reg_warps // fp.warps
            if r < n:
                n = r
        return n

    def take(self, sm: int, fp: Footprint, n: int) -> tuple[int, ...]:
        """Allocate ``n`` blocks on ``sm``; returns the warps taken from each
        sub-partition, which :meth:`give` needs to free the registers again. Call
        :meth:`fit` first: a request that does not fit raises before anything changes."""
        if self.fit(sm, fp) < n:
            raise AssertionError("take() called for blocks that do not fit; call fit() first")
        rpw = fp.regs_per_warp
        base = sm * self.parts
        regs = self.regs
        split = [0] * self.parts
        if rpw:
            # Sub-partitions in order, each up to what it holds: a warp's registers come
            # from one sub-partition, and this order places as many warps as any other.
            need = n * fp.warps
            for i in range(self.parts):
                k = regs[base + i] // rpw
                if k > need:
                    k = need
                split[i] = k
                regs[base + i] -= k * rpw
                need -= k
                if not need:
                    break
        self.blocks[sm] -= n
        self.warps[sm] -= n * fp.warps
        self.smem[sm] -= n * fp.smem
        return tuple(split)

    def give(self, sm: int, fp: Footprint, n: int, split: tuple[int, ...]) -> None:
        self.blocks[sm] += n
        self.warps[sm] += n * fp.warps
        self.smem[sm] += n * fp.smem
        rpw = fp.regs_per_warp
        if rpw:
            base = sm * self.parts
            for i, k in enumerate(split):
                self.regs[base + i] += k * rpw

    # -- every SM at once ----------------------------------------------------------------
    def fit_all(self, fp: Footprint) -> np.ndarray:
        """:meth:`fit` for every SM: an array of block counts."""
        n = np.minimum(np.array(self.blocks), np.array(self.warps) // fp.warps)
        if fp.smem:
            np.minimum(n, np.array(self.smem) // fp.smem, out=n)
        if fp.regs_per_warp:
            regs = np.array(self.regs).reshape(-1, self.parts)
            np.minimum(n, (regs // fp.regs_per_warp).sum(axis=1) // fp.warps, out=n)
        return n

    def take_many(self, sms: np.ndarray, fp: Footprint, ns: np.ndarray) -> np.ndarray:
        """Allocate ``ns[i]`` blocks on SM ``sms[i]`` (distinct SMs, each fitting, as
        :meth:`fit_all` said); returns the per-sub-partition warp split of each.

        Speed: whole-list round trips through numpy (``np.array``, update, ``tolist``)
        cost a few microseconds each, far less than a Python loop over the SMs."""
        regs = np.array(self.regs).reshape(-1, self.parts)
        split = _split_warps(regs[sms], fp, ns * fp.warps)
        if fp.regs_per_warp:
            regs[sms] -= split * fp.regs_per_warp
            self.regs[:] = regs.ravel().tolist()
        self._add(sms, -ns, fp)
        return split

    def give_many(self, sms: np.ndarray, fp: Footprint, ns: np.ndarray, split: np.ndarray) -> None:
        if fp.regs_per_warp:
            regs = np.array(self.regs).reshape(-1, self.parts)
            regs[sms] += split * fp.regs_per_warp
            self.regs[:] = regs.ravel().tolist()
        self._add(sms, ns, fp)

    def _add(self, sms: np.ndarray, ns: np.ndarray, fp: Footprint) -> None:
        for values, per_block in ((self.blocks, 1), (self.warps, fp.warps), (self.smem, fp.smem)):
            if per_block:
                a = np.array(values)
                a[sms] += ns * per_block
                values[:] = a.tolist()

    def used(self) -> dict[str, int]:
        """Totals in use over all SMs: blocks, warps, registers, shared memory."""
        spec = self.spec
        n = spec.sm_count
        return {
            "blocks": n * spec.max_blocks_per_sm - sum(self.blocks),
            "warps": n * spec.max_warps_per_sm - sum(self.warps),
            "registers": n * self.parts * self.part_regs - sum(self.regs),
            "shared_memory": n * spec.smem_per_sm - sum(self.smem),
        }


def _split_warps(free_regs: np.ndarray, fp: Footprint, need: np.ndarray) -> np.ndarray:
    """Warps to take from each sub-partition (rows: SMs) to place ``need`` warps.

    A warp's registers come from one sub-partition; partitions are filled in order,
    each up to what it can hold, which places as many warps as any other order would.
    """
    rows = free_regs.shape[0]
    if not fp.regs_per_warp:
        return np.zeros((rows, free_regs.shape[1]), dtype=np.int64)
    cap = free_regs // fp.regs_per_warp
    before = np.cumsum(cap, axis=1) - cap                 # capacity of earlier partitions
    split = np.clip(need.reshape(rows, 1) - before, 0, cap)
    if (split.sum(axis=1) != need).any():
        raise AssertionError("blocks placed where their registers do not fit; call fit() first")
    return split
