"""How long a kernel takes alone: a roofline with an efficiency factor.

    time = launch_overhead + max(flops / peak_flops, bytes / mem_bw) / efficiency

The simulator divides that time over the kernel's waves (blocks / (resident blocks per
SM x SMs)), so each block lasts ``time / waves``. Kernels with an explicit duration
(synthetic workloads) use it as given.

The defaults are fitted once, by ``paella experiment calibrate``, against the paper's
Table 2 (TVM on a T4): one efficiency and one per-kernel overhead for every kernel of
every model (docs/EXPERIMENTS.md has the fit and its limits). The overhead comes out
near 50 us, ten times a real launch latency: it absorbs the per-kernel inefficiency of
untuned schedules that FLOPs and bytes do not show. Nothing is tuned per model.
Per-SM, occupancy and latency terms built from the kernels' grids, blocks and registers
fit Table 2 no better, and ``calibrate`` shows why no such model can (docs/simulator.md).
"""
from __future__ import annotations

from dataclasses import dataclass

from paella.gpus import GpuSpec


@dataclass(frozen=True)
class CostModel:
    efficiency: float = 0.4668       # fraction of the roofline a TVM kernel reaches (fitted)
    launch_overhead: float = 48.75e-6  # seconds per kernel (fitted; see above)

    def __post_init__(self) -> None:
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"efficiency must be in (0, 1], got {self.efficiency}")
        if self.launch_overhead < 0:
            raise ValueError(f"launch overhead must be >= 0, got {self.launch_overhead}")

    def kernel_time(self, spec: GpuSpec, flops: float, nbytes: float, duration: float | None) -> float:
        if duration is not None:
            return duration
        roof = max(flops / spec.peak_flops if spec.peak_flops else 0.0,
                   nbytes / spec.mem_bw if spec.mem_bw else 0.0)
        return self.launch_overhead + roof / self.efficiency

    def copy_time(self, spec: GpuSpec, nbytes: int) -> float:
        return spec.pcie_latency + nbytes / spec.pcie_bw
