"""The CUDA runtime-like calls a job adaptor makes inside ``run(io)`` (§4.2's wrapped CUDA
API; named after CUDA's runtime library, ``cudart``, whose calls these mirror: the device
backend that really talks to a GPU is :mod:`paella.dispatcher.devices.cuda`).

Each function acts on the job whose greenlet is running (:func:`job.current`), like
Paella's wrappers keyed by the calling coroutine. Asynchronous calls return at once;
``*_synchronize`` yield to the dispatcher until the awaited work has completed. Outside
a job every call raises :class:`~paella.dispatcher.job.NotInJobError`.

    from paella.dispatcher import cudart
    s = cudart.stream_create()
    cudart.memcpy_htod(buf, io[:n], s)
    cudart.launch(fn, grid=64, block=256, stream=s)
    cudart.memcpy_dtoh(io[n:], out, s)
    cudart.stream_synchronize(s)
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from paella.dispatcher.devices.base import Function

from .job import current
from .ops import Op
from .waitlist import Event, VStream


def stream_create(non_blocking: bool = False) -> VStream:
    """A virtual stream; ``non_blocking`` streams do not synchronize with stream 0."""
    return current().stream_create(non_blocking)


def stream_destroy(stream: VStream) -> None:
    current().stream_destroy(stream)


def launch(func: Function, grid: int | Sequence[int], block: int | Sequence[int],
           stream: VStream | None = None, *, dyn_smem: int = 0, args: Sequence[Any] = ()) -> Op:
    """Launch ``func``; raises OccupancyError at once if a block can never fit."""
    return current().launch(func, grid, block, stream, dyn_smem=dyn_smem, args=args)


def memcpy_htod(dst: int, src: np.ndarray, stream: VStream | None = None) -> Op:
    return current().memcpy_htod(dst, src, stream)


def memcpy_dtoh(dst: np.ndarray, src: int, stream: VStream | None = None) -> Op:
    return current().memcpy_dtoh(dst, src, stream)


def event_create() -> Event:
    return current().event_create()


def event_record(event: Event, stream: VStream | None = None) -> None:
    current().event_record(event, stream)


def event_query(event: Event) -> bool:
    return current().event_query(event)


def event_synchronize(event: Event) -> None:
    current().event_synchronize(event)


def stream_wait_event(stream: VStream | None, event: Event) -> None:
    current().stream_wait_event(stream, event)


def stream_query(stream: VStream | None = None) -> bool:
    return current().stream_query(stream)


def stream_synchronize(stream: VStream | None = None) -> None:
    current().stream_synchronize(stream)


def device_synchronize() -> None:
    current().device_synchronize()


def malloc(nbytes: int) -> int:
    """Device memory owned by the current job, freed when it ends."""
    return current().malloc(nbytes)


def almost_finished() -> None:
    """Wake the client now: the job's outputs will be ready soon (§4.2)."""
    current().almost_finished()
