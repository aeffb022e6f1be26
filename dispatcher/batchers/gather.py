"""Gather and scatter: requests' rows into a variant's io buffer, and back.

A variant's io buffer holds each input and output tensor at the variant's full shape
(``rows`` on axis 0, the length bucket on axis 1 where the model has one). A batch's
requests fill it in order: request k's rows go to rows ``[r0, r0 + rows_k)``, and a
request shorter than the bucket fills ``[:seq_len_k]`` of axis 1. What no request
fills (padding rows, and the tail of each shorter sequence) is zeroed, so a padded
batch computes on defined values. Outputs are scattered back the same way.

Zero copy: a batch of one request whose layout *is* the variant's (same shapes and
offsets: an unbatched request on its own variant) runs on the request's io region
itself, with no staging buffer and no copy (:func:`in_place`). The cost of the copies
otherwise is measured by ``benchmarks/bench_gather.py`` (docs/batching.md).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from paella.shapes import Slot


@dataclass(frozen=True)
class IoLayout:
    """A variant's io buffer: its inputs and outputs (full shapes) and size."""
    inputs: tuple[Slot, ...]
    outputs: tuple[Slot, ...]
    io_bytes: int

    @property
    def slots(self) -> tuple[Slot, ...]:
        """Inputs then outputs: one tuple, made once (a request on the variant's own
        layout holds this very object, so :func:`in_place` is an identity test)."""
        s = self.__dict__.get("_slots")
        if s is None:
            s = self.inputs + self.outputs
            object.__setattr__(self, "_slots", s)
        return s


def _view(buf: np.ndarray, s: Slot) -> np.ndarray:
    return buf[s.offset:s.offset + s.nbytes].view(np.dtype(s.dtype)).reshape(s.shape)


def in_place(requests: list, layout: IoLayout) -> bool:
    """True when the batch can run on its one request's io region (no copy)."""
    if len(requests) != 1:
        return False
    own = requests[0].layout
    slots = layout.slots
    return own is None or own is slots or tuple(own) == slots


def _slots(req, layout: IoLayout) -> list[Slot]:
    return list(req.layout) if req.layout is not None else [*layout.inputs, *layout.outputs]


def gather(requests: list, layout: IoLayout, staging: np.ndarray) -> int:
    """Copy every request's inputs into ``staging`` (the variant's io buffer), zero the
    padding; returns the bytes copied."""
    copied = 0
    for i, t in enumerate(layout.inputs):
        dst = _view(staging, t)
        r0 = 0
        for req in requests:
            src = _view(req.io, _slots(req, layout)[i])
            r1 = r0 + src.shape[0]
            if src.shape[1:] == dst.shape[1:]:
                dst[r0:r1] = src
            else:                       # shorter sequence: fill the head, zero the tail
                ln = src.shape[1]
                dst[r0:r1, :ln] = src
                dst[r0:r1, ln:] = 0
            copied += src.nbytes
            r0 = r1
        if r0 < dst.shape[0]:
            dst[r0:] = 0                # padding rows
    return copied


def scatter_one(req, row0: int, layout: IoLayout, staging: np.ndarray) -> int:
    """Copy request ``req``'s rows (from ``row0``) of every output back into its io
    region; returns the bytes copied."""
    n_in = len(layout.inputs)
    slots = _slots(req, layout)
    copied = 0
    for j, t in enumerate(layout.outputs):
        s = slots[n_in + j]
        dst = _view(req.io, s)
        src = _view(staging, t)[row0:row0 + s.shape[0]]
        if src.shape[1:] != dst.shape[1:]:
            src = src[:, :dst.shape[1]]
        dst[...] = src
        copied += dst.nbytes
    return copied
