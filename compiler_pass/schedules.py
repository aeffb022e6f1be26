"""DLight schedule rules of our own, run before TVM's default GPU rules.

:class:`SmallReduction` catches PrimFuncs whose single reduction is short (a 3x3 or
7x7 window: depthwise convolution, max/avg pooling, a 7x7 global average pool) and
schedules them like an elementwise kernel: one thread per output element, the window
reduced serially in a register. TVM's default rules have nothing for this shape:
``GeneralReduction`` takes it and launches one 256-thread block per *output element*
to reduce 9 values, e.g. 451,584 blocks for MobileNetV2's first depthwise convolution.

:func:`cuda_schedule_rules` is the rule list ``paella compile`` uses: ours first, then
TVM's defaults (Matmul, GEMV, Reduction, GeneralReduction, Fallback) unchanged.
"""
from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir import dlight as dl
from tvm.s_tir.dlight.analysis import SBlockInfo, normalize_prim_func
from tvm.s_tir.dlight.base.utils import max_threads_per_block
from tvm.s_tir.dlight.gpu.base import GPUScheduleRule
from tvm.s_tir.dlight.gpu.matmul import get_index_map
from tvm.s_tir.schedule import ScheduleError
from tvm.target import Target

#: largest total reduction extent (product of the reduction loops) we take: 8x8
MAX_REDUCTION_EXTENT = 64


def _static_extent(doms) -> int | None:
    """Product of the extents, or None if one is symbolic."""
    total = 1
    for d in doms:
        if isinstance(d, int):
            total *= d
        elif isinstance(d, tirx.IntImm):
            total *= int(d.value)
        else:
            return None
    return total


def _block_extent(block: tirx.SBlock, kind: int) -> int | None:
    """Product of the extents of ``block``'s iterators of type ``kind`` (DataPar / CommReduce)."""
    return _static_extent(iv.dom.extent for iv in block.iter_vars if iv.iter_type == kind)


class SmallReduction(GPUScheduleRule):
    """One thread per output element for a PrimFunc with one short reduction.

    Applies when, after DLight's normalization, the PrimFunc has exactly one reduction
    block, every other block is spatial, the reduction's total extent is static and at
    most ``max_extent``, and the reduction is not GEMM-shaped (``C[i, j] += A[i, k] *
    B[j, k]``: a 1x1 convolution or a matmul with a short K is left to ``Matmul``, which
    tiles it for data reuse). Schedule:

    - spatial producers (padding) and intermediate epilogue stages (batch-norm multiply /
      add, clip, relu, the pooling average's division) are computed inline;
    - the one remaining spatial block, the stage that writes the output, has its loops
      fused and split into ``blockIdx.x`` x ``threadIdx.x``: ``threads`` per block, by
      default the target's maximum (1024 on CUDA) like DLight's elementwise ``Fallback``
      (which already scheduled standalone max-pools this way), fewer if fewer outputs;
      with no epilogue, a ``cache_write`` stage is that block;
    - the reduction is computed at the thread into a ``local`` (register) accumulator;
      its window loops stay serial inside the thread.

    The epilogue must be elementwise on the reduction (as many outputs as the reduction
    has), otherwise each thread would recompute a reduction that is broadcast; such a
    PrimFunc, and any whose stages cannot be inlined, is left to the next rule (``None``).
    """

    def __init__(self, max_extent: int = MAX_REDUCTION_EXTENT, threads: int | None = None):
        if max_extent < 1 or (threads is not None and threads < 1):
            raise ValueError(f"SmallReduction needs max_extent >= 1 and threads >= 1, got "
                             f"{max_extent}, {threads}")
        self.max_extent = max_extent
        self.threads = threads

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        sch = s_tir.Schedule(func)
        infos = normalize_prim_func(sch)
        if not infos:
            return None
        red = self._small_reduction(sch, infos)
        if red is None:
            return None
        try:
            out = self._inline_all_but(sch, infos, red)
            if out is None:
                return None
            red_stmt, out_stmt = sch.get(red), sch.get(out)
            n_red = _block_extent(red_stmt, tirx.IterVar.DataPar)
            n_out = _block_extent(out_stmt, tirx.IterVar.DataPar)
            if n_red is None or n_red != n_out:
                return None
            if any(iv.iter_type != tirx.IterVar.DataPar for iv in out_stmt.iter_vars):
                return None
            loops = sch.get_loops(out) or [sch.add_unit_loop(out)]   # a scalar output
            fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
            threads = self.threads or max_threads_per_block(target)
            bx, tx = sch.split(fused, factors=[None, max(1, min(threads, n_out))])
            sch.bind(bx, "blockIdx.x")
            sch.bind(tx, "threadIdx.x")
            sch.compute_at(red, tx, preserve_unit_loops=True)
        except ScheduleError:
            return None
        _hoist_init(sch, red)
        return sch

    # ------------------------------------------------------------------ analysis

    def _small_reduction(self, sch: s_tir.Schedule, infos: list[SBlockInfo]):
        """The reduction block if the PrimFunc is ours, else None."""
        kinds = [b.dom_kind() for b in infos]
        if any(set(k) - {"S", "R"} for k in kinds):
            return None
        reductions = [b for b, k in zip(infos, kinds) if "R" in k]
        if len(reductions) != 1:
            return None
        block = sch.get(reductions[0].block_rv)
        if len(block.writes) != 1:
            return None
        extent = _block_extent(block, tirx.IterVar.CommReduce)
        if extent is None or extent > self.max_extent:
            return None
        if get_index_map(block) is not None:      # GEMM-shaped: Matmul's
            return None
        return reductions[0].block_rv

    @staticmethod
    def _inline_all_but(sch: s_tir.Schedule, infos: list[SBlockInfo], red):
        """Inline every spatial block; the one left over (it writes the output) is
        returned. If the reduction itself writes the output, a ``local`` accumulator is
        made with ``cache_write`` and the copy-out block is returned. None if more than
        one spatial block is left."""
        pending = [b.block_rv for b in infos if not sch.get(b.block_rv).same_as(sch.get(red))]
        progress = True
        while progress:
            progress = False
            for blk in list(pending):
                try:
                    sch.compute_inline(blk)
                except ScheduleError:
                    continue
                pending.remove(blk)
                progress = True
        if len(pending) > 1:
            return None
        if not pending:
            return sch.cache_write(red, 0, "local")
        out = pending[0]
        consumers = sch.get_consumers(red)
        if len(consumers) != 1 or not sch.get(consumers[0]).same_as(sch.get(out)):
            return None                            # the leftover is a producer, not the epilogue
        sch.set_scope(red, 0, "local")
        return out


def _hoist_init(sch: s_tir.Schedule, red) -> None:
    """Put the accumulator's initialization before the window loops (``decompose_reduction``)
    rather than an ``if (first iteration)`` inside them. TVM refuses when the thread's
    output coordinates simplify to a non-quasi-affine binding (e.g. a fused extent that is a
    multiple of the block size: 32*112*112 = 392*1024); the reduction is then kept with its
    init, which TIR lowering turns into that ``if`` - correct, only a compare per step."""
    inner = sch.get_loops(red)[2:]                       # below blockIdx.x, threadIdx.x
    if not inner:
        return
    try:
        sch.decompose_reduction(red, inner[0])
    except ScheduleError:
        pass


def cuda_schedule_rules() -> list:
    """The DLight rules of ``paella compile``: :class:`SmallReduction` first, then TVM's
    default CUDA rules, in TVM's order (``tvm/relax/backend/cuda/pipeline.py``)."""
    return [
        SmallReduction(),
        dl.gpu.Matmul(),
        dl.gpu.GEMV(),
        dl.gpu.Reduction(),
        dl.gpu.GeneralReduction(),
        dl.gpu.Fallback(),
    ]


def rule_of(func: tirx.PrimFunc, target: Target) -> str | None:
    """Name of the first rule of :func:`cuda_schedule_rules` that schedules ``func``
    (for tests and diagnostics); call it under ``with target``."""
    for rule in cuda_schedule_rules():
        if rule.apply(func, target, False) is not None:
            return type(rule).__name__
    return None


__all__ = ["SmallReduction", "cuda_schedule_rules", "rule_of", "MAX_REDUCTION_EXTENT"]
