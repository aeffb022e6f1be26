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

Where the computation runs: an effect may carry a ``pending(args)`` attribute, asked
when its kernel is *launched*; it returns a future while the answer is still being
computed elsewhere (the worker processes of
:mod:`~paella.dispatcher.devices.sim.effect_workers`), and the simulated device then holds
that kernel back in its stream until the future is done (``SimDevice``, "gates"), so the
effect itself, at the kernel's completion, only writes what is ready. Nothing a client
sends is ever computed on the dispatcher's loop.
"""
from __future__ import annotations

from concurrent.futures import Future
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

    def writes(args: tuple) -> tuple[tuple[int, int], ...]:
        """The device bytes the effect writes for a launch with ``args``: its outputs'
        ``(pointer, nbytes)`` (none for a launch without the operands). A device that
        applies the effect late keeps what reads them waiting for it (SimProcessDevice)."""
        if len(args) != want:
            return ()
        return tuple((int(p), t.nbytes) for t, p in zip(outputs, args[own_args + n_in:]))
    effect.writes = writes                   # type: ignore[attr-defined]
    return effect


#: Lookups started and not yet collected, per effect pair, beyond which the oldest is
#: dropped (a request cancelled between its two kernels never collects its own; the next
#: request on the same buffer set replaces it, so they number at most the model's buffer
#: sets). Above any number of requests a model has in flight at once: a live request's
#: entry dropped makes its last kernel wait for a start that has run already (a
#: placeholder never completed: the request was never answered, and its client's
#: segment stayed mapped; the fuzzer found it with 256, a flood of a tiny model having
#: hundreds in flight, session 29).
MAX_STARTED = 1 << 16


def model_effects(inputs: Sequence[Any], outputs: Sequence[Any],
                  begin: Callable[[dict[str, np.ndarray]], Any],
                  compute: Callable[[dict[str, np.ndarray], Any], dict[str, np.ndarray]],
                  own_args: int, *,
                  prepare: Callable[[dict[str, np.ndarray], Any], tuple[Any, Any]] | None = None,
                  owner: Callable[[tuple], Any] | None = None,
                  ) -> tuple[KernelEffect, Callable[[int], KernelEffect]]:
    """A model's effect in two parts. ``end`` (for the last kernel, as
    :func:`model_effect`) passes ``compute(inputs, started)`` what ``begin(inputs)``
    returned (a lookup running elsewhere) when the ``start`` effect ran, on a kernel that
    runs after the input copies and before the last kernel; ``None`` when no ``start``
    ran for the same input buffers. Returns ``end`` and ``make_start(n)``, the ``start``
    effect for a kernel with ``n`` arguments of its own, before the input pointers.

    ``start`` and ``end`` meet by the input buffers' device pointers: a request owns its
    buffers from its input copies to its output copies, and in the simulator nothing but
    copies and effects writes device memory, so the inputs ``begin`` saw are those
    ``end`` reads.

    ``prepare(inputs, started)`` (optional) runs when the last kernel is launched and
    returns ``(started, future)``: what ``compute`` will receive (it may replace what
    ``begin`` returned, or stand in for a ``begin`` that never ran), and a future that is
    not done yet while the answer is being computed elsewhere (else None). It becomes
    ``end.pending``, the hook the simulated device asks before it launches the kernel.
    The inputs it reads must have landed by then: the simulated device asks only once
    nothing earlier is left on the kernel's stream (a dispatcher that releases ahead
    launches it sooner: the device then asks when a gate ahead of it reaches the
    stream's head; SimDevice._prepare_effect). When the start has not run yet at that
    point (a plan whose start kernel is on another stream), the kernel is held on a
    placeholder the start completes.

    ``owner(input_pointers)`` (optional): whose share of the answer workers' queue a
    computation started here takes (the request's tenant: the dispatcher tells the
    model when the job takes its buffers). Given, ``begin`` and ``prepare`` get it as
    one more argument: ``begin(inputs, owner)``, ``prepare(inputs, started, owner)``."""
    n_in = len(inputs)
    want_end = own_args + n_in + len(outputs)
    started: dict[tuple, Any] = {}
    #: Placeholders the last kernel's launch left for a start that had not run yet
    #: (its future is done once the start has run and the answer is in).
    waiting: dict[tuple, Future] = {}
    has_start = False                        # (set once make_start has made a start)

    def remember(ptrs: tuple, value: Any) -> None:
        started.pop(ptrs, None)
        if len(started) >= MAX_STARTED:
            del started[next(iter(started))]
        started[ptrs] = value

    def values(view: Callable[[int, int], np.ndarray], ptrs: tuple) -> dict[str, np.ndarray]:
        return {t.name: view(p, t.nbytes).view(t.dtype).reshape(t.shape)
                for t, p in zip(inputs, ptrs)}

    def begun(view: Callable[[int, int], np.ndarray], ptrs: tuple) -> Any:
        x = values(view, ptrs)
        return begin(x) if owner is None else begin(x, owner(ptrs))

    def prepared(view: Callable[[int, int], np.ndarray], ptrs: tuple) -> tuple[Any, Any]:
        x, st = values(view, ptrs), started.pop(ptrs, None)
        return prepare(x, st) if owner is None else prepare(x, st, owner(ptrs))

    def make_start(start_own_args: int) -> KernelEffect:
        nonlocal has_start
        has_start = True

        def start(view: Callable[[int, int], np.ndarray], args: tuple) -> None:
            if len(args) != start_own_args + n_in:
                return                       # a launch of this kernel without the operands
            ptrs = tuple(args[start_own_args:])
            remember(ptrs, begun(view, ptrs))
            placeholder = waiting.pop(ptrs, None)
            if placeholder is not None and prepare is not None:
                # The last kernel was launched before this start ran (released ahead):
                # its gate waits on the placeholder, done when the answer is.
                value, future = prepared(view, ptrs)
                remember(ptrs, value)
                if future is None:
                    placeholder.set_result(None)
                else:
                    future.add_done_callback(lambda _f: placeholder.set_result(None))
        return start

    def compute_started(values: dict[str, np.ndarray], ptrs: tuple) -> dict[str, np.ndarray]:
        return compute(values, started.pop(ptrs, None))

    end = model_effect(inputs, outputs, compute_started, own_args, pass_pointers=True)
    if prepare is not None:
        def pending(view: Callable[[int, int], np.ndarray], args: tuple) -> Any:
            if len(args) != want_end:
                return None                  # a launch of this kernel without the operands
            ptrs = tuple(args[own_args:own_args + n_in])
            if has_start and ptrs not in started:
                # The start has not run: the inputs may not have landed yet. Hold the
                # kernel on a placeholder the start completes.
                placeholder: Future = Future()
                old = waiting.pop(ptrs, None)
                if old is not None:
                    old.set_result(None)
                if len(waiting) >= MAX_STARTED:
                    waiting.pop(next(iter(waiting))).set_result(None)
                waiting[ptrs] = placeholder
                return placeholder
            value, future = prepared(view, ptrs)
            remember(ptrs, value)
            return future
        end.pending = pending                # type: ignore[attr-defined]
    return end, make_start
