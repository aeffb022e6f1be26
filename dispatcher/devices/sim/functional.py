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


def model_effect(inputs: Sequence[Any], outputs: Sequence[Any],
                 compute: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]],
                 own_args: int) -> KernelEffect:
    """The effect of a whole model: read ``inputs`` (tensors with ``name``, ``shape``,
    ``dtype``, ``nbytes``) from device memory at the launch's extra arguments, run
    ``compute`` on them, write ``outputs`` likewise. ``own_args``: the kernel's own
    arguments, before the extra ones."""
    n_in = len(inputs)
    want = own_args + n_in + len(outputs)

    def effect(view: Callable[[int, int], np.ndarray], args: tuple) -> None:
        if len(args) != want:
            return                           # a launch of this kernel without the operands
        ptrs = args[own_args:]
        values = {t.name: view(p, t.nbytes).view(t.dtype).reshape(t.shape)
                  for t, p in zip(inputs, ptrs[:n_in])}
        result = compute(values)
        for t, p in zip(outputs, ptrs[n_in:]):
            view(p, t.nbytes)[:] = np.ascontiguousarray(result[t.name], dtype=t.dtype) \
                .view(np.uint8).reshape(-1)
    return effect
