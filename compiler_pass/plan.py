"""The launch plan: replay the lowered Relax entry function as buffers and device ops.

Input is the Relax function exactly as TVM's VM would execute it (after the CUDA
Relax pipeline: fusion, DLight schedules, ``CallTIRRewrite``, static memory planning,
``VMShapeLower``). Walking its bindings in order gives the plan:

* ``R.vm.alloc_storage``      -> an intermediate buffer (statically planned, reused)
* ``R.vm.alloc_tensor``       -> a tensor view (buffer, byte offset) of a storage
* ``vm.builtin.reshape``      -> a view of the same bytes, no device work
* a call of a PrimFunc        -> that PrimFunc's kernel launches, in the order its
                                 host code makes them (see :mod:`.kernels`)
* shape checks, kills, nulls  -> nothing

The entry's first ``num_input`` params become H2D copies from the io buffer, the
remaining params and any folded constants become param buffers, and the returned
tensors become D2H copies. Anything else is refused with :class:`PlanError`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax
from tvm.ir.expr import Constant, StringImm

from paella.bundle import IO_ALIGN, BufferSpec, CallSpec, KernelArg, Op, TensorSpec, ViewSpec

from .kernels import HostPlan, PlanError

_IGNORED_PACKED = {"vm.builtin.check_tensor_info", "vm.builtin.match_shape", "vm.builtin.check_shape_info",
                   "vm.builtin.check_tuple_info", "vm.builtin.make_shape", "vm.builtin.null_value"}
_IGNORED_OPS = {"relax.vm.kill_object", "relax.null_value", "relax.memory.kill_storage",
                "relax.memory.kill_tensor"}
_VIEW_PACKED = {"vm.builtin.reshape"}


#: A tensor as the plan sees it: bytes at ``offset`` in device buffer ``buffer``.
View = ViewSpec


@dataclass
class Launch:
    """One planned launch, before kernels are merged into the manifest's kernel list."""

    primfunc: str
    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    dyn_smem: int
    args: list[KernelArg]
    views: list[View | None]


@dataclass
class PlanResult:
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    buffers: list[BufferSpec]
    params: dict[str, np.ndarray]      # buffer name -> contents (params and constants)
    launches: list[Launch]
    plan: list[Op]
    io_bytes: int
    calls: list[CallSpec]


def _align(n: int) -> int:
    return -(-n // IO_ALIGN) * IO_ALIGN


def _shape_of(ty) -> tuple[tuple[int, ...], str]:
    """Static shape and dtype of a Relax tensor type (``expr.ty``)."""
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        raise PlanError(f"value of type {ty} is not a tensor of known shape; only static shapes "
                        "are supported: give every input a fixed shape")
    dims = []
    for d in ty.shape.values:
        if not isinstance(d, tvm.tirx.IntImm):
            raise PlanError(f"dimension {d} is symbolic; only static shapes are supported: "
                            "give every input a fixed shape")
        dims.append(int(d.value))
    return tuple(dims), str(ty.dtype)


def _int_list(expr) -> list[int]:
    if isinstance(expr, relax.ShapeExpr):
        return [int(v) for v in expr.values]
    raise PlanError(f"expected a static shape, got {expr}")


def _callee(call: relax.Call) -> str:
    op = call.op
    if isinstance(op, tvm.ir.Op):
        return op.name
    if isinstance(op, relax.ExternFunc):
        return op.global_symbol
    if isinstance(op, tvm.ir.GlobalVar):
        return "@" + op.name_hint
    raise PlanError(f"unsupported callee {op}")


class _Planner:
    def __init__(self, host_plans: dict[str, HostPlan], param_names: list[str], params: list[np.ndarray]):
        self.host_plans = host_plans
        self.buffers: list[BufferSpec] = []
        self.env: dict = {}                     # relax Var -> View | ("storage", id) | None
        self.params: dict[str, np.ndarray] = {}
        self.launches: list[Launch] = []
        self.ops: list[Op] = []
        self.calls: list[CallSpec] = []
        self._param_names = param_names
        self._param_values = params
        self._consts = 0

    def buffer(self, name: str, nbytes: int, kind: str) -> int:
        self.buffers.append(BufferSpec(len(self.buffers), name, int(nbytes), kind))
        return len(self.buffers) - 1

    def value(self, expr):
        if isinstance(expr, relax.Var):
            if expr not in self.env:
                raise PlanError(f"variable {expr.name} used before it is defined")
            return self.env[expr]
        if isinstance(expr, Constant):
            arr = expr.value.numpy()
            name = f"const_{self._consts}"
            self._consts += 1
            bid = self.buffer(name, arr.nbytes, "param")
            self.params[name] = arr
            return View(bid, 0, tuple(arr.shape), str(arr.dtype))
        raise PlanError(f"unsupported argument {expr} ({type(expr).__name__})")

    def bind(self, var: relax.Var, value) -> None:
        if isinstance(value, (relax.Var, Constant)):
            self.env[var] = self.value(value)
        elif isinstance(value, relax.Tuple):
            self.env[var] = tuple(self.value(f) for f in value.fields)
        elif isinstance(value, relax.TupleGetItem):
            self.env[var] = self.value(value.tuple_value)[value.index]
        elif isinstance(value, relax.Call):
            self.env[var] = self.call(value)
        elif isinstance(value, (relax.ShapeExpr, StringImm)):
            self.env[var] = None
        else:
            raise PlanError(f"unsupported binding {var.name} = {type(value).__name__}")

    def call(self, call: relax.Call):
        name = _callee(call)
        if name in _IGNORED_PACKED or name in _IGNORED_OPS:
            return None
        if name == "relax.vm.alloc_storage":
            nbytes = int(np.prod(_int_list(call.args[0])))
            return ("storage", self.buffer(f"storage{len(self.buffers)}", nbytes, "intermediate"))
        if name == "relax.vm.alloc_tensor":
            tag, bid = self.value(call.args[0])
            offset = int(call.args[1].value)
            shape, dtype = _shape_of(call.ty)
            return View(bid, offset, shape, dtype)
        if name in _VIEW_PACKED:
            src = self.value(call.args[0])
            shape, dtype = _shape_of(call.ty)
            return View(src.buffer, src.offset, shape, dtype)
        if name.startswith("@"):
            self.primfunc(name[1:], call.args)
            return None
        raise PlanError(f"the model calls {name!r}, which has no static device plan (only TIR kernels, "
                        "static allocations and reshapes are supported)")

    def primfunc(self, fname: str, args) -> None:
        hp = self.host_plans.get(fname)
        if hp is None:
            raise PlanError(f"PrimFunc {fname} has no lowered host function")
        views = [self.value(a) for a in args]
        if len(views) != len(hp.params):
            raise PlanError(f"{fname} takes {len(hp.params)} args, the call passes {len(views)}")
        binding = {}
        for var, v in zip(hp.params, views):
            binding[var] = v
        for var, nbytes in hp.workspaces:
            bid = self.buffer(f"{fname}.{var.name}", nbytes, "workspace")
            binding[var] = View(bid, 0, (nbytes,), "uint8")
        first = len(self.launches)
        for hl in hp.launches:
            kargs, kviews = [], []
            for a in hl.args:
                if a.var is None:
                    kargs.append(KernelArg(scalar=a.value, dtype=a.dtype))
                    kviews.append(None)
                    continue
                v = next((bv for bvar, bv in binding.items() if bvar.same_as(a.var)), None)
                if not isinstance(v, View):
                    raise PlanError(f"{fname}: argument {a.var.name} of {hl.kernel} is not a buffer of the call")
                kargs.append(KernelArg(buffer=v.buffer, offset=v.offset))
                kviews.append(v)
            self.launches.append(Launch(fname, hl.kernel, hl.grid, hl.block, hl.dyn_smem, kargs, kviews))
            self.ops.append(Op("launch", kernel=hl.kernel, grid=list(hl.grid), block=list(hl.block),
                               dyn_smem=hl.dyn_smem, args=kargs))
        self.calls.append(CallSpec(fname, [first, len(self.launches)],
                                   [ViewSpec(v.buffer, v.offset, list(v.shape), v.dtype)
                                    if isinstance(v, View) else None for v in views]))


def build_plan(func: relax.Function, host_plans: dict[str, HostPlan], params: list[np.ndarray]) -> PlanResult:
    """Turn the lowered Relax entry ``func`` into buffers, io layout and the op list."""
    num_input = int(func.attrs["num_input"]) if func.attrs and "num_input" in func.attrs else len(func.params) - len(params)
    in_vars, param_vars = list(func.params[:num_input]), list(func.params[num_input:])
    if len(param_vars) != len(params):
        raise PlanError(f"entry function has {len(param_vars)} weight params but {len(params)} values were given")
    p = _Planner(host_plans, [v.name for v in param_vars], params)
    inputs, io = [], 0
    for var in in_vars:
        shape, dtype = _shape_of(var.ty)
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        bid = p.buffer(var.name, nbytes, "input")
        p.env[var] = View(bid, 0, shape, dtype)
        inputs.append(TensorSpec(var.name, list(shape), dtype, io, nbytes, bid))
        p.ops.append(Op("h2d", buffer=bid, io_offset=io, nbytes=nbytes))
        io = _align(io + nbytes)
    for var, arr in zip(param_vars, params):
        shape, dtype = _shape_of(var.ty)
        if tuple(arr.shape) != shape or str(arr.dtype) != dtype:
            raise PlanError(f"param {var.name}: value is {arr.shape} {arr.dtype}, model wants {shape} {dtype}")
        bid = p.buffer(var.name, arr.nbytes, "param")
        p.params[var.name] = arr
        p.env[var] = View(bid, 0, shape, dtype)

    body = func.body
    for block in body.blocks:
        for b in block.bindings:
            if isinstance(b, relax.MatchCast):
                p.env[b.var] = p.value(b.value)
            else:
                p.bind(b.var, b.value)
    result = p.value(body.body) if not isinstance(body.body, relax.Tuple) else \
        tuple(p.value(f) for f in body.body.fields)
    results = list(result) if isinstance(result, tuple) else [result]
    outputs = []
    for i, v in enumerate(results):
        if not isinstance(v, View):
            raise PlanError(f"output {i} is not a tensor")
        outputs.append(TensorSpec(f"output{i}", list(v.shape), v.dtype, io, v.nbytes, v.buffer, v.offset))
        p.ops.append(Op("d2h", buffer=v.buffer, buffer_offset=v.offset, io_offset=io, nbytes=v.nbytes))
        io = _align(io + v.nbytes)
    last = (inputs + outputs)[-1]
    return PlanResult(inputs, outputs, p.buffers, p.params, p.launches, p.ops, last.offset + last.nbytes,
                      p.calls)
