"""The timing model: how long a block runs, given what runs beside it.

A kernel's time is not a parameter: it emerges from where its blocks are placed, how
many waves they take, and what they share. Each block of a kernel of ``B`` blocks does
``F/B`` FLOPs and moves ``M/B`` DRAM bytes (the bundle's ``flops`` and ``bytes``). When
the block scheduler places it on SM ``s`` (the engine, ``_engine.c``), its duration is
set from the state at the end of that virtual instant, so that every block placed at one
instant sees the others:

* **compute**: the SM issues ``P_sm = peak_flops / sm_count`` FLOP/s when enough warps
  are resident to hide arithmetic latency, ``W_c`` of them; the resident warps ``W_s``
  share that rate, each warp getting ``P_sm / max(W_s, W_c)``:
  ``t_c = (F/B) * max(W_s, W_c) / (w * P_sm)`` for a block of ``w`` warps. With
  ``W_c = 4`` (sm_70 and later), a 2-warp block alone on an SM reaches half of it; 32
  resident warps share it.
* **memory, latency-bound**: a warp keeps ``ilp`` 128-byte lines (32 coalesced 4-byte
  words each) in flight per DRAM latency ``L``, so a block streams at most
  ``w * ilp * 128 B / L``: ``t_m0 = (M/B) * L / (w * ilp * 128 B)``. A block alone that
  way demands ``d = (M/B) / max(t_c, t_m0)`` bytes/s.
* **memory, bandwidth-bound**: every running block's demand ``d`` adds up to ``D``;
  when ``D`` exceeds the device's bandwidth ``BW``, every block's memory stream slows by
  ``D / BW``: ``t_m = t_m0 * max(1, D / BW)``. Bandwidth is shared by the whole device,
  not per SM.
* the block lasts ``L + max(t_c, t_m)``: one memory latency before its first operands
  arrive, then compute and memory traffic overlapped.

A kernel may place blocks ``launch_latency`` after it reaches the head of its hardware
queue with its stream ready (the GPU's front end; the host's own cost of a launch call
is the dispatcher's CPU time, charged by the experiment harness). A kernel with an
explicit ``duration`` (synthetic workloads) is a timed kernel: its blocks last
``duration / waves`` whatever runs beside them and they add nothing to the SM's warps
or the device's demand.

Sources (every figure is a spec-sheet number or a published measurement; none is fitted
to a model):

* ``peak_flops``, ``mem_bw``, SM counts: the products' data sheets (``paella/gpus.py``).
* ``W_c``, warps that hide arithmetic latency: the CUDA C++ Programming Guide,
  "Multiprocessor Level": the warp schedulers issue one instruction per warp per clock
  (four schedulers; on compute capability 6.0 two), and a dependent FMA waits for the
  previous one: 4 cycles from compute capability 7.0, 6 cycles on Pascal (Volta Tuning
  Guide, "Instruction Scheduling"). Without instruction-level parallelism that takes
  16 warps on sm_70 and later (the Guide: "16 active warps per multiprocessor (4
  cycles, 4 warp schedulers)"); the Volta Tuning Guide: "execution latencies of core
  math operations can be hidden by as few as 4 warps per SM, assuming 4-way
  instruction-level parallelism ILP per warp". ``W_c = schedulers * latency / ilp``.
* ``ilp`` = 4: independent operations a warp keeps in flight, the Tuning Guide's 4-way
  figure. It is what the bundles' kernels do where the term binds: DLight's matmul and
  convolution schedules give each thread a register tile of independent accumulators
  (8 ``float2``, 16 chains, in ResNet-18's convolutions) and several independent loads
  per step (``kernels.cu``). The same 4 applies to loads in flight (below). With
  ``ilp = 1`` the small-grid convolutions run 2-4x longer; ``paella experiment
  fidelity`` reports that sensitivity.
* ``mem_latency`` ``L`` = 500 ns: the DRAM latency of a global load. Pointer-chasing
  microbenchmarks report a few hundred to ~700 core cycles on these GPUs (Jia et al.,
  "Dissecting the NVIDIA Volta GPU Architecture via Microbenchmarking", 2018, and
  "Dissecting the NVidia Turing T4 GPU via Microbenchmarking", 2019); at their 1.4-1.8
  GHz clocks that is 300-500 ns, and the Programming Guide says "hundreds of clock
  cycles". 500 ns is a round figure at the top of that range, one value for every
  preset; ``paella experiment fidelity`` reports how its validation moves with 350 ns.
* ``line_bytes`` = 128: one warp-wide coalesced load of 4-byte words, the unit the
  Programming Guide's coalescing rules describe. Little's law then says how many warps
  an SM needs to stream its share of the bandwidth: ``BW / sm_count * L / (ilp * 128 B)``
  (8 on a T4). With one line per warp it is Volkov's streaming case ("Understanding
  Latency Hiding on GPUs", PhD thesis, UC Berkeley, 2016, §4.3: ~30 warps per SM hide
  memory latency on his GPU, against 24 for arithmetic), which the formula reproduces.
* ``launch_latency`` = 0.5 us: the per-kernel front-end cost measured back to back on a
  V100 (A. Gray, "Getting Started with CUDA Graphs", NVIDIA Technical Blog, 2019: a
  2.9 us kernel takes 3.4 us per launch when the launches are queued ahead in a graph).
* copies: ``pcie_latency + bytes / pcie_bw`` (``paella/gpus.py``).

What it cannot capture is in docs/simulator.md ("What it does not model").
"""
from __future__ import annotations

from dataclasses import dataclass

from paella.gpus import GpuSpec


def arithmetic_latency_cycles(spec: GpuSpec) -> int:
    """Dependent-issue latency of an FP32 FMA: 6 cycles on Pascal (and earlier), 4 from
    Volta on (Volta Tuning Guide, "Instruction Scheduling")."""
    return 6 if spec.major < 7 else 4


def warp_schedulers(spec: GpuSpec) -> int:
    """Warps that issue an instruction per clock: 4 per SM, 2 on compute capability 6.0
    (CUDA C++ Programming Guide, "Multiprocessor Level": 4L versus 2L)."""
    return 2 if spec.arch == 60 else 4


def warps_to_hide_arithmetic(spec: GpuSpec, ilp: int = 1) -> float:
    """``W_c``: resident warps an SM needs to issue at its peak when each warp keeps
    ``ilp`` independent FMAs in flight (16 from sm_70 without ILP, 4 with 4-way ILP)."""
    return arithmetic_latency_cycles(spec) * warp_schedulers(spec) / ilp


@dataclass(frozen=True)
class CostModel:
    """The generic timing figures (per-GPU ones are in :class:`paella.gpus.GpuSpec`).

    ``launch_latency=0`` gives the idealized front end that some tests use to state
    timelines exactly."""
    launch_latency: float = 0.5e-6      # s, GPU front end per kernel (Gray 2019)
    mem_latency: float = 500e-9         # s, a global load's DRAM latency (see above)
    line_bytes: int = 128               # bytes of one coalesced warp access
    ilp: int = 4                        # independent operations a warp keeps in flight

    def __post_init__(self) -> None:
        if self.launch_latency < 0:
            raise ValueError(f"launch latency must be >= 0, got {self.launch_latency}")
        if self.mem_latency < 0:
            raise ValueError(f"memory latency must be >= 0, got {self.mem_latency}")
        if self.line_bytes <= 0:
            raise ValueError(f"line bytes must be > 0, got {self.line_bytes}")
        if self.ilp < 1:
            raise ValueError(f"ilp must be >= 1, got {self.ilp}")

    def copy_time(self, spec: GpuSpec, nbytes: int) -> float:
        return spec.pcie_latency + nbytes / spec.pcie_bw

    def warps_to_hide_arithmetic(self, spec: GpuSpec) -> float:
        return warps_to_hide_arithmetic(spec, self.ilp)

    def bytes_in_flight_per_warp(self) -> int:
        return self.ilp * self.line_bytes

    def warps_to_saturate_memory(self, spec: GpuSpec) -> float:
        """Resident warps per SM at which the latency-bound streams of one SM reach its
        share of the bandwidth (Little's law): ``BW / sm_count * L / (ilp * line)``."""
        return spec.mem_bw / spec.sm_count * self.mem_latency / self.bytes_in_flight_per_warp()


def slice_cost(flops: float, nbytes: float, duration: float | None, blocks: int, whole: int,
               wave: int) -> tuple[float, float, float | None]:
    """(FLOPs, bytes, duration) of a slice of ``blocks`` blocks of a kernel of ``whole``
    blocks (paella.dispatcher.slicing), ``wave`` blocks per wave: its share of the
    kernel's work, so that each block does what it did in the whole kernel; a timed
    kernel's blocks keep their time (duration / its waves), so the slice lasts its waves
    of it."""
    share = blocks / whole
    if duration is None:
        return flops * share, nbytes * share, None
    return flops * share, nbytes * share, duration / -(-whole // wave) * -(-blocks // wave)
