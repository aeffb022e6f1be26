"""GPU presets: the per-SM limits the occupancy rules need, plus the throughput figures
the simulator's timing model uses (docs/simulator.md).

Per-SM limits follow the compute capability (CUDA C++ Programming Guide, "Technical
Specifications per Compute Capability"). SM counts, peak FP32 throughput (CUDA cores x
2 FLOPs x boost clock) and memory bandwidth follow each product's data sheet or
architecture whitepaper, cited beside the preset. ``pcie_bw`` is an effective
pinned-memory copy bandwidth for the link generation (about 75-80% of the nominal x16
rate: 12, 24, 48 GB/s for PCIe 3.0, 4.0, 5.0), ``hw_queues`` the number of hardware work
queues (Hyper-Q: 32 since Kepler). ``mem_bytes`` is the data sheet's memory size (its "GB"
are GiB: the DRAM parts come in powers of two); a real board leaves somewhat less to
``cuMemAlloc`` (ECC, the driver's and the context's own), which the presets ignore.

The presets cover every GPU the seed papers measure on: Paella (GTX 1660 SUPER, T4,
P100), TurboTransformers (RTX 2060, V100), BatchMaker (V100), DVABatch (Titan RTX),
Nimble (V100, Titan RTX, Titan Xp), Orca (A100), plus H100.

The same record describes a real GPU: the ``cuda`` backend fills one in from
``cuDeviceGetAttribute``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

KIB = 1024
GIB = 1 << 30


@dataclass(frozen=True)
class GpuSpec:
    name: str
    arch: int                       # compute capability as major*10+minor, e.g. 75
    sm_count: int
    max_threads_per_sm: int
    max_blocks_per_sm: int
    regs_per_sm: int
    regs_per_block: int
    smem_per_sm: int                # bytes, the largest carveout
    smem_per_block: int             # bytes, default per-block limit (48 KiB)
    smem_per_block_optin: int       # bytes, opt-in per-block limit
    reserved_smem_per_block: int    # bytes the system reserves per block (sm_80+: 1 KiB)
    max_threads_per_block: int = 1024
    warp_size: int = 32
    hw_queues: int = 32
    peak_flops: float = 0.0         # FP32 FLOP/s at the boost clock
    mem_bw: float = 0.0             # bytes/s, DRAM
    pcie_bw: float = 12e9           # bytes/s, effective pinned copy bandwidth
    pcie_latency: float = 8e-6      # seconds per copy, fixed part
    mem_bytes: int = 0              # DRAM capacity, bytes (0: not known, no limit)

    @property
    def major(self) -> int:
        return self.arch // 10

    @property
    def minor(self) -> int:
        return self.arch % 10

    @property
    def sm_name(self) -> str:
        return f"sm_{self.arch}"

    @property
    def max_warps_per_sm(self) -> int:
        return self.max_threads_per_sm // self.warp_size

    def with_(self, **changes) -> "GpuSpec":
        """A copy with some fields changed (e.g. ``hw_queues=8``)."""
        return replace(self, **changes)


def _pascal(name: str, arch: int, sms: int, smem_per_sm: int, flops: float, bw: float,
            mem: int) -> GpuSpec:
    # sm_60/61: 2048 threads, 32 blocks, 64K registers per SM; 48 KiB per block, no opt-in.
    return GpuSpec(name=name, arch=arch, sm_count=sms, max_threads_per_sm=2048,
                   max_blocks_per_sm=32, regs_per_sm=65536, regs_per_block=65536,
                   smem_per_sm=smem_per_sm, smem_per_block=48 * KIB,
                   smem_per_block_optin=48 * KIB, reserved_smem_per_block=0,
                   peak_flops=flops, mem_bw=bw, pcie_bw=12e9, mem_bytes=mem)


def _turing(name: str, sms: int, flops: float, bw: float, mem: int) -> GpuSpec:
    # sm_75: 1024 threads, 16 blocks, 64K registers, 64 KiB shared memory per SM.
    return GpuSpec(name=name, arch=75, sm_count=sms, max_threads_per_sm=1024,
                   max_blocks_per_sm=16, regs_per_sm=65536, regs_per_block=65536,
                   smem_per_sm=64 * KIB, smem_per_block=48 * KIB,
                   smem_per_block_optin=64 * KIB, reserved_smem_per_block=0,
                   peak_flops=flops, mem_bw=bw, pcie_bw=12e9, mem_bytes=mem)


PRESETS: dict[str, GpuSpec] = {
    # Tesla P100 PCIe 16 GB (GP100, sm_60): 56 SMs, 3584 cores, 9.3 TFLOPS FP32, 732 GB/s
    # HBM2, PCIe 3.0 (NVIDIA Tesla P100 data sheet; Pascal GP100 whitepaper). Paella §7.
    "p100": _pascal("p100", 60, 56, 64 * KIB, 9.3e12, 732e9, 16 * GIB),
    # TITAN Xp (GP102, sm_61): 30 SMs, 3840 cores at 1582 MHz boost = 12.1 TFLOPS, 11.4 Gbps
    # GDDR5X on 384 bits = 547.7 GB/s, 12 GB, 96 KiB shared memory per SM (NVIDIA TITAN Xp
    # product page; Programming Guide, cc 6.1). Nimble, appendix A.2.
    "titanxp": _pascal("titanxp", 61, 30, 96 * KIB, 12.15e12, 547.7e9, 12 * GIB),
    # GeForce GTX 1660 SUPER (TU116): 22 SMs, 1408 cores at 1785 MHz boost = 5.03 TFLOPS,
    # 14 Gbps GDDR6 on 192 bits = 336 GB/s, 6 GB (NVIDIA product page). Paella Figure 2.
    "gtx1660s": _turing("gtx1660s", 22, 5.03e12, 336e9, 6 * GIB),
    # GeForce RTX 2060 (TU106): 30 SMs, 1920 cores at 1680 MHz boost = 6.45 TFLOPS, 14 Gbps
    # GDDR6 on 192 bits = 336 GB/s, 6 GB (NVIDIA product page; Turing whitepaper).
    # TurboTransformers.
    "rtx2060": _turing("rtx2060", 30, 6.45e12, 336e9, 6 * GIB),
    # Tesla T4 (TU104): 40 SMs, 2560 cores, 8.1 TFLOPS FP32, 16 GB of 320 GB/s GDDR6, PCIe
    # 3.0 x16 (NVIDIA T4 data sheet). Paella Table 2 and every figure.
    "t4": _turing("t4", 40, 8.1e12, 320e9, 16 * GIB),
    # TITAN RTX (TU102): 72 SMs, 4608 cores at 1770 MHz boost = 16.3 TFLOPS, 14 Gbps GDDR6 on
    # 384 bits = 672 GB/s, 24 GB (NVIDIA TITAN RTX product page; Turing whitepaper). DVABatch,
    # Nimble.
    "titanrtx": _turing("titanrtx", 72, 16.3e12, 672e9, 24 * GIB),
    # Tesla V100 SXM2 (GV100): 80 SMs, 15.7 TFLOPS FP32, 900 GB/s HBM2 (the 16 GB model; the
    # data sheet also lists 32 GB), PCIe 3.0 host link (NVIDIA V100 data sheet). BatchMaker,
    # Nimble, TurboTransformers.
    "v100": GpuSpec(name="v100", arch=70, sm_count=80, max_threads_per_sm=2048,
                    max_blocks_per_sm=32, regs_per_sm=65536, regs_per_block=65536,
                    smem_per_sm=96 * KIB, smem_per_block=48 * KIB,
                    smem_per_block_optin=96 * KIB, reserved_smem_per_block=0,
                    peak_flops=15.7e12, mem_bw=900e9, pcie_bw=12e9, mem_bytes=16 * GIB),
    # A100 SXM4 40GB (GA100): 108 SMs, 19.5 TFLOPS FP32, 1555 GB/s HBM2, PCIe 4.0 (NVIDIA A100
    # data sheet). Orca.
    "a100": GpuSpec(name="a100", arch=80, sm_count=108, max_threads_per_sm=2048,
                    max_blocks_per_sm=32, regs_per_sm=65536, regs_per_block=65536,
                    smem_per_sm=164 * KIB, smem_per_block=48 * KIB,
                    smem_per_block_optin=163 * KIB, reserved_smem_per_block=1 * KIB,
                    peak_flops=19.5e12, mem_bw=1555e9, pcie_bw=24e9, mem_bytes=40 * GIB),
    # H100 SXM5 80GB (GH100): 132 SMs, 67 TFLOPS FP32, 3.35 TB/s HBM3, PCIe 5.0 (NVIDIA H100
    # data sheet).
    "h100": GpuSpec(name="h100", arch=90, sm_count=132, max_threads_per_sm=2048,
                    max_blocks_per_sm=32, regs_per_sm=65536, regs_per_block=65536,
                    smem_per_sm=228 * KIB, smem_per_block=48 * KIB,
                    smem_per_block_optin=227 * KIB, reserved_smem_per_block=1 * KIB,
                    peak_flops=67e12, mem_bw=3350e9, pcie_bw=48e9, mem_bytes=80 * GIB),
}


def preset(name: str) -> GpuSpec:
    """Look up a preset by name; the error lists the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown GPU preset {name!r}; known presets: "
                         f"{', '.join(sorted(PRESETS))}") from None
