"""Index operands a client supplies are clamped into range before they index anything.

Why: a model whose input is an index (an embedding's token ids, an ONNX ``Gather``)
lowers to Relax ``take``, whose default mode (``fast``) does no bounds check. A hostile
client's token id of 10**8 then reads far outside the table: the CPU build, which the
daemon runs as the simulator's functional effect, segfaults the daemon, and on a real
GPU the kernel faults and takes the CUDA context (every client's work) with it. Every
``take`` is rewritten to ``clip`` mode (an out-of-range index reads the nearest row),
for the GPU kernels and the CPU build alike, so the answer stays defined and the same
on both. The cost is a min and a max per index.
"""
from __future__ import annotations

import tvm
from tvm import relax


@relax.expr_functor.mutator
class _ClampTake(relax.PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.take" \
                and call.attrs.mode == "fast":
            return relax.op.take(call.args[0], call.args[1], call.attrs.axis, mode="clip")
        return call


def bounded_indexing(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with every unchecked ``take`` clamping its indices."""
    m = _ClampTake(mod)
    for gv, f in mod.functions.items():
        if isinstance(f, relax.Function):
            m.builder_.update_func(gv, m.visit_expr(f))
    return m.builder_.get()
