"""What each kernel is and how its PrimFunc launches it, read from the lowered TIR.

Two views of a lowered module are needed:

* the **host** functions right after ``SplitHostDevice`` (before ``MakePackedAPI``
  hides the buffers behind packed arguments): each holds, in order, the
  ``call_ffi_kernel`` calls TVM's runtime would make, with their argument bindings
  and launch dimensions;
* the **device** kernels after finalization: their parameters, and which pointer
  parameters they store through (access mode for the plan checks and the simulator).

Only static launches are accepted: a launch under host-side control flow, or one
whose dimensions are not constants, is refused with :class:`PlanError`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import tvm
import tvm_ffi
from tvm import tirx

FFI_KERNEL_OP = "tirx.call_ffi_kernel"
BUFFER_DATA_OP = "tirx.buffer_data"
DYN_SMEM_TAG = "tirx.use_dyn_shared_memory"
_AXES = {"x": 0, "y": 1, "z": 2}


class PlanError(Exception):
    """The lowered model cannot be turned into a static launch plan."""


@dataclass
class HostArg:
    """One kernel argument as the host passes it: a pointer variable or a constant."""

    var: tirx.Var | None = None
    value: int | float | None = None
    dtype: str = ""


@dataclass
class HostLaunch:
    kernel: str
    args: list[HostArg]
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    dyn_smem: int


@dataclass
class HostPlan:
    """Launch sequence of one PrimFunc, plus the global workspaces it allocates."""

    params: list[tirx.Var]                        # data var of each buffer param, in order
    launches: list[HostLaunch]
    workspaces: list[tuple[tirx.Var, int]] = field(default_factory=list)  # (data var, bytes)


@dataclass
class KernelParam:
    name: str
    kind: str             # "buffer" or "scalar"
    dtype: str
    access: str = ""      # buffers: "r", "w" or "rw"


class Aliases:
    """Resolves buffer views (``DeclBuffer``) to the variable that owns the memory.

    In 0.27 TIR a buffer is a variable; ``T.decl_buffer(..., data=X.data)`` makes a
    view of ``X``, and kernel operands are ``buffer_data(view)`` calls. The root is
    a function parameter (host: buffer param; device: pointer param) or an
    allocation.
    """

    def __init__(self, body: tirx.Stmt) -> None:
        self._decl: list[tuple[tvm.ir.expr.Var, tvm.ir.expr.Expr]] = []
        tvm_ffi.structural_walk(body, (tirx.DeclBuffer, lambda d: self._decl.append((d.buffer, d.data))))

    def root(self, expr):
        """The owning variable of a pointer-valued expression, or None for scalars."""
        for _ in range(64):
            if isinstance(expr, tvm.ir.Call) and getattr(expr.op, "name", "") == BUFFER_DATA_OP:
                expr = expr.args[0]
                continue
            if isinstance(expr, tvm.ir.expr.Var):
                src = next((data for buf, data in self._decl if buf.same_as(expr)), None)
                if src is None:
                    is_ptr = isinstance(expr.ty, tvm.ir.PointerType) or not isinstance(expr.ty, tvm.ir.PrimType)
                    return expr if is_ptr else None
                expr = src
                continue
            return None
        raise PlanError(f"buffer alias chain too deep at {expr}")


def _const(expr, what: str) -> int | float:
    if isinstance(expr, (int, float)):
        return expr
    if isinstance(expr, (tirx.IntImm, tirx.FloatImm)):
        return expr.value
    raise PlanError(f"{what} is not a compile-time constant ({expr}); only static shapes "
                    "are supported: give every input a fixed shape")


def _launch(call, func_name: str, aliases: "Aliases") -> HostLaunch:
    args = list(call.args)
    kernel = args[0].value
    tags = list(call.attrs.launch_params)
    n_values = sum(1 for t in tags if t != DYN_SMEM_TAG)
    dyn = DYN_SMEM_TAG in tags
    n_tail = n_values + (1 if dyn else 0)
    operands, values = args[1:len(args) - n_tail], args[len(args) - n_tail:]
    grid, block = [1, 1, 1], [1, 1, 1]
    it = iter(values)
    for tag in tags:
        if tag == DYN_SMEM_TAG:
            continue
        v = int(_const(next(it), f"launch dimension {tag} of {kernel}"))
        scope, axis = tag.rsplit(".", 1)
        (grid if scope == "blockIdx" else block)[_AXES[axis]] = v
    dyn_smem = int(_const(next(it), f"dynamic shared memory of {kernel}")) if dyn else 0
    host_args = []
    for a in operands:
        root = aliases.root(a)
        if root is not None:
            host_args.append(HostArg(var=root))
        else:
            host_args.append(HostArg(value=_const(a, f"scalar argument {a} of {kernel} in {func_name}"),
                                     dtype=str(a.dtype)))
    return HostLaunch(kernel, host_args, tuple(grid), tuple(block), dyn_smem)


def _buffer_bytes(buf) -> int:
    n = 1
    for s in buf.shape:
        n *= int(_const(s, f"size of workspace {buf.name}"))
    return n * tvm.runtime.DataType(str(buf.dtype)).bits // 8


def host_plan(func: tirx.PrimFunc, name: str) -> HostPlan:
    """The static launch sequence of one host PrimFunc (captured after SplitHostDevice)."""
    params = list(func.params)
    aliases = Aliases(func.body)
    launches: list[HostLaunch] = []
    workspaces: list[tuple[tirx.Var, int]] = []

    def visit(stmt, guarded: bool) -> None:
        if isinstance(stmt, tirx.SeqStmt):
            for s in stmt.seq:
                visit(s, guarded)
        elif isinstance(stmt, tirx.AttrStmt):
            visit(stmt.body, guarded)
        elif isinstance(stmt, tirx.Evaluate):
            call = stmt.value
            if isinstance(call, tvm.ir.Call) and getattr(call.op, "name", "") == FFI_KERNEL_OP:
                if guarded:
                    raise PlanError(f"{name}: kernel {call.args[0].value} is launched under host-side "
                                    "control flow; the launch plan must be static")
                launches.append(_launch(call, name, aliases))
            elif not isinstance(call, (tirx.IntImm,)):
                raise PlanError(f"{name}: host code calls {call}, which is not a kernel launch; "
                                "library calls (cuBLAS, thrust, ...) are not supported in bundles")
        elif isinstance(stmt, tirx.AllocBuffer):
            if str(stmt.buffer.scope()) not in ("global", ""):
                raise PlanError(f"{name}: host allocation in scope {stmt.buffer.scope()}")
            workspaces.append((stmt.buffer, _buffer_bytes(stmt.buffer)))
        elif isinstance(stmt, (tirx.DeclBuffer, tirx.AssertStmt, tirx.Bind)):
            pass
        elif isinstance(stmt, (tirx.For, tirx.While, tirx.IfThenElse)):
            found = []
            tvm_ffi.structural_walk(stmt, (tvm.ir.Call, lambda c: found.append(c)
                                           if getattr(c.op, "name", "") == FFI_KERNEL_OP else None))
            if found:
                raise PlanError(f"{name}: kernel launches under host-side control flow "
                                f"({type(stmt).__name__}); the launch plan must be static")
        else:
            raise PlanError(f"{name}: unexpected host statement {type(stmt).__name__}")

    visit(func.body, False)
    return HostPlan(params, launches, workspaces)


def kernel_params(func: tirx.PrimFunc) -> list[KernelParam]:
    """Parameters of a device kernel, with the access mode of each pointer."""
    aliases = Aliases(func.body)
    stored, loaded = set(), set()

    def note(into: set, buf) -> None:
        root = aliases.root(buf)
        if root is not None:
            into.add(root.name)
    tvm_ffi.structural_walk(func.body, [
        (tirx.BufferStore, lambda s: note(stored, s.buffer)),
        (tvm.ir.TensorLoad, lambda s: note(loaded, s.source)),
    ])
    out = []
    for p in func.params:
        if isinstance(p.ty, tvm.ir.PointerType):
            access = ("r" if p.name in loaded else "") + ("w" if p.name in stored else "")
            out.append(KernelParam(p.name, "buffer", str(p.ty.element_type.dtype), access or "r"))
        else:
            out.append(KernelParam(p.name, "scalar", str(p.ty.dtype)))
    return out

