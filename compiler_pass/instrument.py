"""The Paella instrumentation pass: every CUDA kernel reports its blocks to the notifQ.

It runs in TVM's device-finalize stage, where each device kernel is a PrimFunc with
``calling_conv=2`` and its launch dimensions as ``thread_extent`` attributes. For each
kernel the pass

* appends two parameters, ``paella_notifq`` (pointer to the notifQ region) and
  ``paella_launch_id`` (uint32), after the original ones;
* wraps the body found inside the leading ``thread_extent`` attributes as
  ``paella_block_start(q, id); body; paella_block_end(q, id);`` so every thread runs
  the prologue and the epilogue exactly once (the helpers live in
  ``include/paella_notif.cuh``, prepended to the source by :func:`postproc_hook`).

Early exits: TVM kernels normally guard with ``if``; should a kernel contain a TIR
``Return``, the pass rewrites each one into a jump to the epilogue (``PAELLA_EXIT``)
and puts the body in its own C scope, so no exit path can skip the barrier and the
COMPLETION post. ``Break``/``Continue`` only leave loops and need nothing.

Slicing (every instrumented kernel; ``instrument_kernel(sliceable=False)`` for tests): the pass also inserts a
``paella_block_offset`` (uint32) parameter after the original ones, before the two
notifQ parameters, so that the dispatcher can launch a kernel's grid in slices. The
kernel no longer reads its block index from the hardware: it computes its linear block
number ``paella_block = paella_block_offset + blockIdx.x + gridDim.x * (blockIdx.y +
gridDim.y * blockIdx.z)`` over the grid it was *launched* with, and every use of
``blockIdx.x/y/z`` in the body becomes that number decoded over the grid it was
*compiled* for (``paella_block % X``, ``paella_block / X % Y``, ``paella_block / (X *
Y)``). An unsliced launch (the compiled grid, offset 0) therefore computes exactly what
it did before, and a slice launched as a 1-D grid of ``n`` blocks at offset ``o`` runs
blocks ``o .. o+n-1`` of the compiled grid. The notifQ counts each launch's own blocks
(``gridDim``), so a slice with its own launch id completes on its own. The launch plan
passes the offset as the kernel's last own argument (0 unless sliced;
``paella.dispatcher.slicing``).

Because TVM's own host code still launches with the original argument count, an
instrumented module must be launched by Paella's runtime from the bundle's launch
plan, never by TVM's CUDA runtime.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from importlib import resources
from typing import Callable, Iterator

import tvm
import tvm_ffi
from tvm import tirx

from paella.protocol import DEFAULT_GROUP, MAX_GROUP

#: Parameter names the pass appends, in order. The launch plan binds them last.
NOTIFQ_PARAM = "paella_notifq"
LAUNCH_ID_PARAM = "paella_launch_id"
#: The slicing parameter, the kernel's last own parameter (before the two above).
OFFSET_PARAM = "paella_block_offset"
#: The kernel's linear block number (the variable the body's block indices decode from).
BLOCK_VAR = "paella_block"
BLOCK_TAGS = ("blockIdx.x", "blockIdx.y", "blockIdx.z")
#: Device helpers the pass calls (defined in the header).
START_FN = "paella_block_start"
END_FN = "paella_block_end"
EXIT_MACRO = "PAELLA_EXIT"
EPILOGUE_MACRO = "PAELLA_EPILOGUE"
#: Function attribute marking a kernel as instrumented (read back by the extractor).
INSTRUMENTED_ATTR = "paella.instrumented"
#: Function attribute marking a kernel as launchable in slices (it has OFFSET_PARAM).
SLICEABLE_ATTR = "paella.sliceable"

HEADER_NAME = "paella_notif.cuh"
DEVICE_KERNEL_LAUNCH = 2  # tvm::CallingConv::kDeviceKernelLaunch


class InstrumentError(Exception):
    """A kernel the pass cannot instrument safely."""


@dataclass(frozen=True)
class InstrumentOptions:
    """Compile options of the pass. ``group`` is the blocks per notification."""

    enabled: bool = True
    group: int = DEFAULT_GROUP

    def __post_init__(self) -> None:
        if not 1 <= self.group <= MAX_GROUP:
            raise ValueError(f"group must be in 1..{MAX_GROUP} (blocks per notification), got {self.group}; "
                             f"use 16 (default, the paper's aggregation) or 1 (one entry per block)")


def header_text() -> str:
    """The device header shipped with the package."""
    return resources.files("paella.compiler_pass").joinpath("include", HEADER_NAME).read_text()


def source_prelude(group: int) -> str:
    """What the post-processing hook prepends: the group size, then the header."""
    return (f"// ---- Paella instrumentation (group={group}) ----\n"
            f"#define PAELLA_GROUP {group}\n"
            f"#define {EXIT_MACRO}() goto paella_epilogue\n"
            f"#define {EPILOGUE_MACRO}() paella_epilogue: ;\n"
            f"{header_text()}\n// ---- end of Paella instrumentation prelude ----\n")


def is_device_kernel(func: tirx.PrimFunc) -> bool:
    attrs = func.attrs
    return attrs is not None and int(attrs.get("calling_conv", 0)) == DEVICE_KERNEL_LAUNCH


def _is_thread_extent(stmt: tirx.Stmt) -> bool:
    return isinstance(stmt, tirx.AttrStmt) and stmt.attr_key == "thread_extent"


def _extern(name: str, *args: tvm.ir.PrimExpr) -> tirx.Stmt:
    return tirx.Evaluate(tirx.call_extern("int32", name, *args))


def _has_return(stmt: tirx.Stmt) -> bool:
    found = []
    tvm_ffi.structural_walk(stmt, (tirx.Return, lambda n: found.append(n)))
    return bool(found)


def _guarded_exits(body: tirx.Stmt) -> tirx.Stmt:
    """Turn every ``Return`` into a jump to the epilogue label; scope the body.

    The ``if (1)`` gives the body its own braces, so the forward ``goto`` never
    jumps over a variable initialisation in the label's scope (a C++ error).
    """
    body = tvm_ffi.structural_map(body, (tirx.Return, lambda _n: _extern(EXIT_MACRO)))
    scoped = tirx.IfThenElse(tirx.const(1, "bool") == tirx.const(1, "bool"), body, None)
    return tirx.SeqStmt([scoped, _extern(EPILOGUE_MACRO)])


def _wrap(stmt: tirx.Stmt, q: tirx.Var, lid: tirx.Var, off: tirx.Var | None,
          grid: dict[str, tuple[tirx.Var, tvm.ir.PrimExpr]]) -> tirx.Stmt:
    """Descend through the leading launch attributes and wrap what they enclose,
    collecting the block-index variables (``grid``: tag -> (var, extent)) on the way."""
    if _is_thread_extent(stmt):
        tag = stmt.node.thread_tag
        if tag in BLOCK_TAGS:
            grid = {**grid, tag: (stmt.node.var, stmt.value)}
        return tirx.AttrStmt(stmt.node, stmt.attr_key, stmt.value, _wrap(stmt.body, q, lid, off, grid))
    if isinstance(stmt, tirx.SeqStmt) and _is_thread_extent(stmt.seq[-1]) and all(
            isinstance(s, (tirx.AllocBuffer, tirx.DeclBuffer, tirx.Bind)) for s in stmt.seq[:-1]):
        return tirx.SeqStmt(list(stmt.seq[:-1]) + [_wrap(stmt.seq[-1], q, lid, off, grid)])
    body = _guarded_exits(stmt) if _has_return(stmt) else stmt
    head = [_extern(START_FN, q, lid)]
    if off is not None and grid:
        block, body = _sliced(body, off, grid)
        head.append(block)
    return tirx.SeqStmt(head + [body, _extern(END_FN, q, lid)])


def _sliced(body: tirx.Stmt, off: tirx.Var,
            grid: dict[str, tuple[tirx.Var, tvm.ir.PrimExpr]]) -> tuple[tirx.Stmt, tirx.Stmt]:
    """(the binding of the linear block number, the body reading its block indices from
    it): see the module docstring.

    The launched grid's linear index is ``blockIdx.x + X * blockIdx.y + X * Y *
    blockIdx.z`` with the *compiled* extents as strides: an unsliced launch has exactly
    those dims, and a slice is a 1-D launch whose y and z indices are 0, so no
    ``gridDim`` read is needed. A block index the kernel never binds counts as 0."""
    # The block indices' own integer type (int32 in TVM's kernels, int64 if it chose so).
    dt = str(grid[min(grid)][0].ty.dtype)
    block = tirx.Var(BLOCK_VAR, dt)
    raw: tvm.ir.PrimExpr = tirx.Cast(dt, off)
    decode = {}
    stride: tvm.ir.PrimExpr = tirx.const(1, dt)
    for tag in BLOCK_TAGS:
        if tag in grid:
            var, extent = grid[tag]
            e = extent.astype(dt)
            v = var.astype(dt)
            first = not decode
            raw = raw + (v if first else v * stride)
            decode[var] = tirx.Mod(block if first else tirx.Div(block, stride), e).astype(str(var.ty.dtype))
            stride = e if first else stride * e
    mapped = tvm_ffi.structural_map(body, (tirx.Var, lambda v: decode.get(v, v)))
    return tirx.Bind(block, raw), mapped


def instrument_kernel(func: tirx.PrimFunc, sliceable: bool = True) -> tirx.PrimFunc:
    """The instrumented version of one device kernel (appended params, wrapped body)."""
    if func.attrs.get(INSTRUMENTED_ATTR, False):
        return func
    names = {p.name for p in func.params}
    if {NOTIFQ_PARAM, LAUNCH_ID_PARAM, OFFSET_PARAM, BLOCK_VAR} & names:
        raise InstrumentError(f"kernel already has a parameter named {NOTIFQ_PARAM!r}/{LAUNCH_ID_PARAM!r}/"
                              f"{OFFSET_PARAM!r}/{BLOCK_VAR!r}; rename it before instrumenting")
    q = tirx.Var(NOTIFQ_PARAM, tvm.ir.PointerType(tvm.ir.PrimType("uint8")))
    lid = tirx.Var(LAUNCH_ID_PARAM, "uint32")
    off = tirx.Var(OFFSET_PARAM, "uint32") if sliceable else None
    params = list(func.params) + ([off] if sliceable else []) + [q, lid]
    new = tirx.PrimFunc(params, _wrap(func.body, q, lid, off, {}), ret_type=func.ret_type,
                        attrs=func.attrs)
    return new.with_attr(INSTRUMENTED_ATTR, True).with_attr(SLICEABLE_ATTR, sliceable)


@tirx.transform.prim_func_pass(opt_level=0, name="paella.InstrumentKernels")
def InstrumentKernels(func: tirx.PrimFunc, _mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tirx.PrimFunc:  # noqa: N802
    """Device-finalize pass: instrument every device kernel, leave other functions."""
    return instrument_kernel(func) if is_device_kernel(func) else func


def finalize_device_with(instrument: bool):
    """Device-finalize factory: TVM's own passes, then (optionally) ours last."""
    from tvm.s_tir.pipeline import finalize_device_passes

    def factory() -> tvm.transform.Pass:
        passes = [finalize_device_passes()]
        if instrument:
            passes.append(InstrumentKernels)
        return tvm.transform.Sequential(passes, name="paella.finalize_device")
    return factory


def paella_tir_pipeline(instrument: bool = True):
    """A TIR pipeline factory: TVM's s_tir lowering plus the instrumentation pass."""
    from tvm.s_tir.pipeline import default_s_tir_pipeline, finalize_host_passes
    lower, _host, _device = default_s_tir_pipeline()
    return lower, finalize_host_passes, finalize_device_with(instrument)


@contextlib.contextmanager
def override_global_func(name: str, make: Callable[[Callable | None], Callable]) -> Iterator[None]:
    """Install a TVM global function for the duration of one codegen, then restore.

    TVM's codegen callbacks are process-global; ``make(previous)`` builds the
    replacement (which may chain to the previous one), and the previous one (or
    nothing) is put back afterwards.
    """
    previous = tvm_ffi.get_global_func(name, allow_missing=True)
    tvm_ffi.register_global_func(name, make(previous), override=True)
    try:
        yield
    finally:
        if previous is not None:
            tvm_ffi.register_global_func(name, previous, override=True)
        else:
            tvm_ffi.remove_global_func(name)


def postproc_hook(options: InstrumentOptions) -> contextlib.AbstractContextManager:
    """``tvm_callback_cuda_postproc`` that prepends the prelude (when instrumenting)."""
    def make(previous):
        def hook(code: str, target=None) -> str:
            if previous is not None:
                code = previous(code, target)
            return source_prelude(options.group) + code if options.enabled else code
        return hook
    return override_global_func("tvm_callback_cuda_postproc", make)
