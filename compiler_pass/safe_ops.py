"""What a client's values reach cannot crash the process or leave a tensor.

Why: a model computes on its inputs, which any client may fill with any bytes, and some
Relax ops are not defined for every value. Their builds then fault: the CPU build, which
the daemon runs as the simulator's functional effect, takes the daemon down, and on a
real GPU a faulting kernel takes the CUDA context (every client's work) with it. Two
kinds, made total here for the GPU kernels and the CPU build alike, so that the answer
stays defined and the same on both:

* **Indexing.** A model whose input is an index (an embedding's token ids, an ONNX
  ``Gather``, ``GatherElements``, ``GatherND``, ``ScatterElements``, ``ScatterND``,
  PyTorch's advanced indexing) lowers to an op that does no bounds check; an index of
  10**8 reads or writes far outside the tensor (SIGSEGV). Every ``take`` is rewritten to
  ``clip`` mode (an out-of-range index reads the nearest row); the index operand of
  ``gather_elements``, ``gather_nd``, ``scatter_elements``, ``scatter_nd``,
  ``index_tensor`` and ``index_put`` is clamped first: a negative index counts from the
  end (ONNX's rule), then every index is clipped into ``[0, dim - 1]`` of the axis it
  indexes. An index in range is unchanged. Cost: a few elementwise ops per index.
* **Integer division.** ``divide``, ``floor_divide``, ``mod`` and ``floor_mod`` on
  integers trap on a divisor of 0, and on the most negative value divided by -1
  (SIGFPE on x86). Unless the divisor is a constant free of both, it is guarded: by 0,
  a quotient is the dividend and a remainder 0 (as by 1); by -1, the quotient is the
  dividend negated (wrapping) and the remainder 0, which is what -1 gives everywhere
  else. Any other divisor is unchanged. Cost: three elementwise ops per division.
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
#: Integer divisions: quotients, and remainders.
_QUOTIENTS = ("relax.divide", "relax.floor_divide")
_REMAINDERS = ("relax.mod", "relax.floor_mod")


class UnboundedIndexError(ValueError):
    """An indexing op whose bounds cannot be known at compile time (``paella compile``
    reports it as the command's error)."""


def _static_shape(expr: relax.Expr, op: str) -> list[int]:
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr) \
            or not all(isinstance(d, tvm.tirx.IntImm) for d in ty.shape.values):
        raise UnboundedIndexError(
            f"{op} indexes a tensor of unknown shape ({ty}), so its indices cannot be "
            f"bounds-checked; give every input a fixed shape")
    return [int(d.value) for d in ty.shape.values]


def _safe_divisor(y: relax.Expr, dtype: str) -> bool:
    """A constant divisor with no 0 (and, signed, no -1) in it needs no guard."""
    if not isinstance(y, tvm.ir.expr.Constant):
        return False
    values = np.asarray(y.value.numpy())
    return not (values == 0).any() and (dtype.startswith("uint") or not (values == -1).any())


@relax.expr_functor.mutator
class _SafeOps(relax.PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not isinstance(call.op, tvm.ir.Op):
            return call
        name = call.op.name
        if name == "relax.take" and call.attrs.mode == "fast":
            return relax.op.take(call.args[0], call.args[1], call.attrs.axis, mode="clip")
        if name in _QUOTIENTS or name in _REMAINDERS:
            dtype = str(call.ty.dtype)
            if dtype.startswith(("int", "uint")) and not _safe_divisor(call.args[1], dtype):
                return self._guarded_division(call, dtype, name in _QUOTIENTS)
            return call
        try:
            return self._clamped(call, name)
        except UnboundedIndexError as e:     # (raised through TVM's FFI it would arrive as a
            self.refusals.append(str(e))     # RuntimeError: make_safe raises it after)
            return call

    def _clamped(self, call: relax.Call, name: str) -> relax.Expr:
        """An indexing ``call`` with its index operand clamped (module docstring)."""
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
            return self._with_index(call, 1, clamped)   # (a literal tuple, as legalization wants)
        return call

    def _guarded_division(self, call: relax.Call, dtype: str, quotient: bool) -> relax.Expr:
        """``call`` (x / y or x % y on integers) defined for every y (module docstring)."""
        x, y = call.args
        emit = self.builder_.emit
        zero, one = relax.const(0, dtype), relax.const(1, dtype)
        bad = emit(relax.op.equal(y, zero))
        signed = not dtype.startswith("uint")
        if signed:
            by_minus_one = emit(relax.op.equal(y, relax.const(-1, dtype)))
            bad = emit(relax.op.logical_or(bad, by_minus_one))
        safe = emit(relax.op.where(bad, one, y))
        result = emit(relax.Call(call.op, [x, safe], call.attrs, call.ty_args))
        if not signed:
            return result
        negated = emit(relax.op.subtract(zero, x)) if quotient else zero
        return relax.op.where(by_minus_one, negated, result)

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


def make_safe(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with every indexing op unable to leave its tensor and every integer
    division defined, whatever the values of its inputs."""
    m = _SafeOps(mod)
    m.refusals = []
    for gv, f in mod.functions.items():
        if isinstance(f, relax.Function):
            m.builder_.update_func(gv, m.visit_expr(f))
    if m.refusals:
        raise UnboundedIndexError(m.refusals[0])
    return m.builder_.get()
