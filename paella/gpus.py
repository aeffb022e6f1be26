"""GPU presets: the per-SM limits the occupancy rules need, plus the roofline figures.

Figures come from NVIDIA's published specifications (the architecture whitepapers and
the CUDA C Programming Guide's "Technical Specifications per Compute Capability"
table). Per-SM limits follow the compute capability; peak FP32 throughput and memory
bandwidth follow the product's data sheet. ``pcie_gbps`` is an effective pinned-memory
copy bandwidth for the link generation (about 75-80% of the nominal x16 rate), and
``hw_queues`` is the number of hardware work queues (Hyper-Q connections).

The same record describes a real GPU: the ``cuda`` backend fills one in from
``cuDeviceGetAttribute``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

KIB = 1024


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
    peak_flops: float = 0.0         # FP32 FLOP/s
    mem_bw: float = 0.0             # bytes/s
    pcie_bw: float = 12e9           # bytes/s, effective pinned copy bandwidth
    pcie_latency: float = 8e-6      # seconds per copy, fixed part

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


def _turing(name: str, sms: int, flops: float, bw: float) -> GpuSpec:
    return GpuSpec(name=name, arch=75, sm_count=sms, max_threads_per_sm=1024,
                   max_blocks_per_sm=16, regs_per_sm=65536, regs_per_block=65536,
                   smem_per_sm=64 * KIB, smem_per_block=48 * KIB,
                   smem_per_block_optin=64 * KIB, reserved_smem_per_block=0,
                   peak_flops=flops, mem_bw=bw, pcie_bw=12e9)


PRESETS: dict[str, GpuSpec] = {
    # GeForce GTX 1660 SUPER (TU116): 22 SMs, 1408 cores at 1.785 GHz boost, 336 GB/s.
    "gtx1660s": _turing("gtx1660s", 22, 5.03e12, 336e9),
    # Tesla T4 (TU104): 40 SMs, 8.1 TFLOPS FP32, 320 GB/s GDDR6, PCIe 3.0 x16.
    "t4": _turing("t4", 40, 8.1e12, 320e9),
    # Tesla V100 SXM2 (GV100): 80 SMs, 15.7 TFLOPS FP32, 900 GB/s HBM2, PCIe 3.0.
    "v100": GpuSpec(name="v100", arch=70, sm_count=80, max_threads_per_sm=2048,
                    max_blocks_per_sm=32, regs_per_sm=65536, regs_per_block=65536,
                    smem_per_sm=96 * KIB, smem_per_block=48 * KIB,
                    smem_per_block_optin=96 * KIB, reserved_smem_per_block=0,
                    peak_flops=15.7e12, mem_bw=900e9, pcie_bw=12e9),
    # A100 SXM4 40GB (GA100): 108 SMs, 19.5 TFLOPS FP32, 1555 GB/s HBM2, PCIe 4.0.
    "a100": GpuSpec(name="a100", arch=80, sm_count=108, max_threads_per_sm=2048,
                    max_blocks_per_sm=32, regs_per_sm=65536, regs_per_block=65536,
                    smem_per_sm=164 * KIB, smem_per_block=48 * KIB,
                    smem_per_block_optin=163 * KIB, reserved_smem_per_block=1 * KIB,
                    peak_flops=19.5e12, mem_bw=1555e9, pcie_bw=24e9),
    # H100 SXM5 80GB (GH100): 132 SMs, 67 TFLOPS FP32, 3.35 TB/s HBM3, PCIe 5.0.
    "h100": GpuSpec(name="h100", arch=90, sm_count=132, max_threads_per_sm=2048,
                    max_blocks_per_sm=32, regs_per_sm=65536, regs_per_block=65536,
                    smem_per_sm=228 * KIB, smem_per_block=48 * KIB,
                    smem_per_block_optin=227 * KIB, reserved_smem_per_block=1 * KIB,
                    peak_flops=67e12, mem_bw=3350e9, pcie_bw=48e9),
}


def preset(name: str) -> GpuSpec:
    """Look up a preset by name; the error lists the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown GPU preset {name!r}; known presets: "
                         f"{', '.join(sorted(PRESETS))}") from None
