"""Index operands a client supplies are clamped into range before they index anything.

Why: a model whose input is an index (an embedding's token ids, an ONNX ``Gather``,
``GatherElements``, ``GatherND``, ``ScatterElements``, ``ScatterND``, PyTorch's advanced
indexing) lowers to a Relax op that does no bounds check. A hostile client's index of
10**8 then reads or writes far outside the tensor: the CPU build, which the daemon runs
as the simulator's functional effect, segfaults the daemon, and on a real GPU the kernel
faults and takes the CUDA context (every client's work) with it. So:

* every ``take`` is rewritten to ``clip`` mode (an out-of-range index reads the nearest
  row);
* the index operand of ``gather_elements``, ``gather_nd``, ``scatter_elements``,
  ``scatter_nd``, ``index_tensor`` and ``index_put`` goes through a clamp first: a
  negative index counts from the end (ONNX's rule), then every index is clipped into
  ``[0, dim - 1]`` of the axis it indexes. An index in range is unchanged.

This holds for the GPU kernels and the CPU build alike, so the answer stays defined and
the same on both. The cost is a few elementwise operations per index.
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

#: Ops whose operand 1 indexes operand 0 elementwise along ``attrs.axis``.
_ELEMENTWISE = ("relax.gather_elements", "relax.scatter_elements")
#: Ops whose operand 1's last axis holds indices into operand 0's leading axes (after
#: ``attrs.batch_dims`` for gather_nd).
_ND = ("relax.gather_nd", "relax.scatter_nd")
#: Ops whose operand 1 is a tuple of index tensors, the i-th indexing operand 0's axis i.
_PER_AXIS = ("relax.index_tensor", "relax.index_put")


class UnboundedIndexError(ValueError):
    """An indexing op whose bounds cannot be known at compile time."""


def _static_shape(expr: relax.Expr, op: str) -> list[int]:
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr) \
            or not all(isinstance(d, tvm.tirx.IntImm) for d in ty.shape.values):
        raise UnboundedIndexError(
            f"{op} indexes a tensor of unknown shape ({ty}), so its indices cannot be "
            f"bounds-checked; give every input a fixed shape")
    return [int(d.value) for d in ty.shape.values]


@relax.expr_functor.mutator
class _ClampIndices(relax.PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not isinstance(call.op, tvm.ir.Op):
            return call
        name = call.op.name
        if name == "relax.take" and call.attrs.mode == "fast":
            return relax.op.take(call.args[0], call.args[1], call.attrs.axis, mode="clip")
        if name in _ELEMENTWISE:
            shape = _static_shape(call.args[0], name)
            dim = shape[int(call.attrs.axis) % len(shape)]
            return self._with_index(call, 1, self._clamp(call.args[1], dim))
        if name in _ND:
            shape = _static_shape(call.args[0], name)
            k = _static_shape(call.args[1], name)[-1]
            first = int(getattr(call.attrs, "batch_dims", 0) or 0)
            return self._with_index(call, 1, self._clamp(call.args[1], shape[first:first + k]))
        if name in _PER_AXIS:
            shape = _static_shape(call.args[0], name)
            fields = call.args[1].fields if isinstance(call.args[1], relax.Tuple) else None
            if fields is None:
                raise UnboundedIndexError(f"{name}'s indices are not a literal tuple; they "
                                          f"cannot be bounds-checked")
            clamped = relax.Tuple([self._clamp(ix, shape[i]) for i, ix in enumerate(fields)])
            return self._with_index(call, 1, self.builder_.emit(clamped))
        return call

    def _clamp(self, index: relax.Expr, dims: "int | list[int]") -> relax.Expr:
        """``index`` with negatives counted from the end, then clipped into range
        (``dims``: one bound, or one per component of the last axis)."""
        dtype = str(index.ty.dtype)
        bound = np.asarray(dims, dtype=dtype)
        emit = self.builder_.emit
        zero = relax.const(0, dtype)
        wrapped = emit(relax.op.where(relax.op.less(index, zero),
                                      relax.op.add(index, relax.const(bound, dtype)), index))
        low = emit(relax.op.maximum(wrapped, zero))
        return emit(relax.op.minimum(low, relax.const(bound - 1, dtype)))

    @staticmethod
    def _with_index(call: relax.Call, i: int, index: relax.Expr) -> relax.Call:
        args = list(call.args)
        args[i] = index
        return relax.Call(call.op, args, call.attrs, call.ty_args)


def bounded_indexing(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with every indexing op unable to leave its tensor, whatever the indices."""
    m = _ClampIndices(mod)
    for gv, f in mod.functions.items():
        if isinstance(f, relax.Function):
            m.builder_.update_func(gv, m.visit_expr(f))
    return m.builder_.get()
