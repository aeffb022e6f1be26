"""Synthetic workloads: jobs described by their kernels' launch shapes and durations.

They need no compiler and no weights, so experiments and tests can run them on the
simulated GPU at once. Durations are each kernel's isolated execution time.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SyntheticKernel:
    name: str
    grid: int
    block: int
    regs_per_thread: int
    duration: float            # seconds, isolated
    smem: int = 0


@dataclass(frozen=True)
class SyntheticJob:
    """A job of kernels that run one after the other (each depends on the previous)."""
    name: str
    kernels: tuple[SyntheticKernel, ...]

    @property
    def isolated_time(self) -> float:
        return sum(k.duration for k in self.kernels)


def figure2_job(n_kernels: int = 8, duration: float = 300e-6) -> SyntheticJob:
    """The paper's Figure 2 job: 8 dependent kernels of one 128-thread block each,
    9 registers per thread, no shared memory, about 300 us each."""
    k = SyntheticKernel("fig2_kernel", grid=1, block=128, regs_per_thread=9, duration=duration)
    return SyntheticJob("figure2", (k,) * n_kernels)


def chain_job(name: str, n_kernels: int, grid: int, block: int, regs: int,
              duration: float, smem: int = 0) -> SyntheticJob:
    """A job of ``n_kernels`` identical dependent kernels (for tests and fairness runs)."""
    k = SyntheticKernel(f"{name}_kernel", grid, block, regs, duration, smem)
    return SyntheticJob(name, (k,) * n_kernels)
