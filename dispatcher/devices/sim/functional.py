"""Functional outputs on the simulated GPU: a model's arithmetic as a kernel's effect.

The simulator's kernels compute nothing, so a served model's outputs come from a
reference computation (a bundle's CPU build), applied by the *simulated device* where a
real GPU's kernels would have written them: in device memory, when the kernel that ends
the computation completes. The plan then copies them back to the host with its own D2H
copies, exactly as on a GPU, and the dispatcher path is the one the benchmarks measure.

The kernel carrying the effect gets, after its own arguments, the device pointers of
the model's inputs and then of its outputs (bound per request like every argument). A
launch of the same kernel without them (its own arguments only) has no effect. Such a
plan is for the simulator only: a real GPU would see extra kernel parameters.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from paella.dispatcher.devices.base import KernelEffect


def model_effect(inputs: Sequence[Any], outputs: Sequence[Any], compute: Callable[..., dict[str, np.ndarray]],
                 own_args: int, *, pass_pointers: bool = False) -> KernelEffect:
    """The effect of a whole model: read ``inputs`` (tensors with ``name``, ``shape``,
    ``dtype``, ``nbytes``) from device memory at the launch's extra arguments, run
    ``compute`` on them, write ``outputs`` likewise. ``own_args``: the kernel's own
    arguments, before the extra ones. ``pass_pointers``: call ``compute(values,
    input_pointers)`` instead (see :func:`model_effects`)."""
    n_in = len(inputs)
    want = own_args + n_in + len(outputs)

    def effect(view: Callable[[int, int], np.ndarray], args: tuple) -> None:
        if len(args) != want:
            return                           # a launch of this kernel without the operands
        ptrs = args[own_args:]
        values = {t.name: view(p, t.nbytes).view(t.dtype).reshape(t.shape)
                  for t, p in zip(inputs, ptrs[:n_in])}
        result = compute(values, tuple(ptrs[:n_in])) if pass_pointers else compute(values)
        for t, p in zip(outputs, ptrs[n_in:]):
            view(p, t.nbytes)[:] = np.ascontiguousarray(result[t.name], dtype=t.dtype) \
                .view(np.uint8).reshape(-1)
    return effect


#: Lookups started and not yet collected, per effect pair, beyond which the oldest is
#: dropped (a request cancelled between its two kernels never collects its own).
MAX_STARTED = 256


def model_effects(inputs: Sequence[Any], outputs: Sequence[Any],
                  begin: Callable[[dict[str, np.ndarray]], Any],
                  compute: Callable[[dict[str, np.ndarray], Any], dict[str, np.ndarray]],
                  own_args: int) -> tuple[KernelEffect, Callable[[int], KernelEffect]]:
    """A model's effect in two parts. ``end`` (for the last kernel, as
    :func:`model_effect`) passes ``compute(inputs, started)`` what ``begin(inputs)``
    returned (a lookup running elsewhere) when the ``start`` effect ran, on a kernel that
    runs after the input copies and before the last kernel; ``None`` when no ``start``
    ran for the same input buffers. Returns ``end`` and ``make_start(n)``, the ``start``
    effect for a kernel with ``n`` arguments of its own, before the input pointers.

    ``start`` and ``end`` meet by the input buffers' device pointers: a request owns its
    buffers from its input copies to its output copies, and in the simulator nothing but
    copies and effects writes device memory, so the inputs ``begin`` saw are those
    ``end`` reads."""
    n_in = len(inputs)
    started: dict[tuple, Any] = {}

    def make_start(start_own_args: int) -> KernelEffect:
        def start(view: Callable[[int, int], np.ndarray], args: tuple) -> None:
            if len(args) != start_own_args + n_in:
                return                       # a launch of this kernel without the operands
            ptrs = tuple(args[start_own_args:])
            started.pop(ptrs, None)
            if len(started) >= MAX_STARTED:
                del started[next(iter(started))]
            started[ptrs] = begin({t.name: view(p, t.nbytes).view(t.dtype).reshape(t.shape)
                                   for t, p in zip(inputs, ptrs)})
        return start

    def compute_started(values: dict[str, np.ndarray], ptrs: tuple) -> dict[str, np.ndarray]:
        return compute(values, started.pop(ptrs, None))

    return model_effect(inputs, outputs, compute_started, own_args, pass_pointers=True), make_start
