"""Replaying a variant's launch plan on the CPU, buffer by buffer.

This machine has no GPU, and a bundle's CPU build (``cpu.so``) is the whole Relax
model, which says nothing about a *plan*: which bytes of which statically planned
storage each kernel reads and writes. A sliced plan (a DVABatch stage,
:mod:`.stage_variants`) is right only if its copies in and out carry every byte the
later kernels need, storage reuse included. So this replays the plan itself: one
numpy array per device buffer (params loaded, the rest zero), the H2D and D2H copies
as written, and each fused PrimFunc *call* (``Variant.calls``) run by the llvm build of
the same fused, unscheduled PrimFunc (the ``fused_cpu`` file) on the views the call
names. The CUDA kernels are the GPU lowering of those PrimFuncs (DLight only schedules
them), so what is checked is the plan's dataflow, not the CUDA code generation.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from paella.bundle import Bundle, BundleError, ViewSpec

_BUILT: dict[str, Any] = {}          # fused_cpu path -> loaded module


def _library(bundle: Bundle, variant: int):
    import tvm
    path = str(bundle.file("fused_cpu", variant))
    if path not in _BUILT:
        _BUILT[path] = tvm.runtime.load_module(path)
    return _BUILT[path]


def _view(mem: list[np.ndarray], v: ViewSpec) -> np.ndarray:
    return mem[v.buffer][v.offset:v.offset + v.nbytes]


def replay_cpu(bundle: Bundle, inputs: dict[str, np.ndarray], variant: int = 0) -> dict[str, np.ndarray]:
    """``variant``'s outputs computed by replaying its plan on the CPU (see the module
    docstring). ``inputs``: its io tensors (a stage's boundary-in tensors)."""
    import tvm
    v = bundle.variants[variant]
    if not v.calls:
        raise BundleError(f"variant {v.name!r} records no PrimFunc calls (a bundle from before "
                          f"they were recorded): recompile it with `paella compile`")
    lib = _library(bundle, variant)
    params = bundle.params(variant)
    mem = [np.frombuffer(params[b.name].tobytes(), np.uint8).copy() if b.kind == "param"
           else np.zeros(b.nbytes, np.uint8) for b in v.buffers]
    io = bundle.pack_inputs(inputs, variant)
    dev = tvm.cpu()
    calls, done, launched = v.calls, 0, 0

    def run_calls(upto: int) -> None:
        nonlocal done
        while done < len(calls) and calls[done].launches[0] <= upto:
            c = calls[done]
            if any(a is None for a in c.args):
                raise BundleError(f"call {done} of {c.primfunc} has a non-tensor argument; "
                                  f"the CPU replay handles tensor arguments only")
            before = [_view(mem, a).copy() for a in c.args]
            args = [tvm.runtime.tensor(b.view(a.dtype).reshape(a.shape), dev) for a, b in zip(c.args, before)]
            lib[c.primfunc](*args)
            for a, b, t in zip(c.args, before, args):
                after = np.ascontiguousarray(t.numpy()).view(np.uint8).reshape(-1)
                if not np.array_equal(after, b):       # only what the call wrote goes back
                    _view(mem, a)[:] = after
            done += 1

    for op in v.plan:
        if op.op == "h2d":
            mem[op.buffer][op.buffer_offset:op.buffer_offset + op.nbytes] = io[op.io_offset:op.io_offset + op.nbytes]
        elif op.op == "launch":
            run_calls(launched)
            launched += 1
        elif op.op == "d2h":
            run_calls(launched)
            io[op.io_offset:op.io_offset + op.nbytes] = mem[op.buffer][op.buffer_offset:op.buffer_offset + op.nbytes]
    return bundle.unpack_outputs(io, variant)


__all__ = ["replay_cpu"]
