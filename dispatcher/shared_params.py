"""One device copy of a model's weights, whichever of its variants are served.

A compiled model is served as several variants (batch sizes, length buckets, Orca's
(tokens, slots) grid), each a plan of its own with its own param buffers. Their weights
are the same arrays: ``paella compile`` keeps one ``params.npz`` for the variants that
share them, and :meth:`paella.bundle.Bundle.param_bytes` hands every such variant the
same ``bytes`` objects. Uploading them once per variant cost a GPT-2 small (500 MB of
float32) with 66 variants 33 GB of device memory; here a param buffer is allocated and
uploaded once per distinct contents object and device, and freed when the last plan
using it closes.

Keyed by the contents object's identity (not a hash of 500 MB), which the store keeps
alive while any plan holds it, so an id is never reused under it. Param buffers are
read-only (``Plan`` refuses a plan that writes one), so sharing them is safe.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class _Held:
    data: Any            # the contents object (kept alive: its id is the key)
    ptr: int
    refs: int


class SharedParams:
    """The param buffers of one device, shared by identity of their contents."""

    def __init__(self) -> None:
        self._held: dict[tuple[int, int], _Held] = {}
        self._keys: dict[int, tuple[int, int]] = {}          # pointer -> key

    def acquire(self, device: Any, data: Any, nbytes: int) -> tuple[int, bool]:
        """A device buffer of ``nbytes`` holding ``data``: ``(pointer, new)``; ``new``: the
        caller must upload ``data`` into it (the first plan to ask), then synchronize
        before serving. Released with :meth:`release`."""
        key = (id(data), nbytes)
        h = self._held.get(key)
        if h is not None and h.data is data:
            h.refs += 1
            return h.ptr, False
        ptr = device.alloc(nbytes)
        self._held[key] = _Held(data, ptr, 1)
        self._keys[ptr] = key
        return ptr, True

    def release(self, device: Any, ptr: int) -> None:
        """One plan no longer uses ``ptr`` (from :meth:`acquire`); the last one frees it."""
        key = self._keys[ptr]
        h = self._held[key]
        h.refs -= 1
        if h.refs == 0:
            del self._held[key], self._keys[ptr]
            device.free(ptr)

    def __len__(self) -> int:
        return len(self._held)

    def nbytes(self) -> int:
        """Device bytes the shared params take."""
        return sum(len(h.data) for h in self._held.values())


#: Per device (a device object is the GPU context its pointers belong to).
_STORES: "weakref.WeakKeyDictionary[Any, SharedParams]" = weakref.WeakKeyDictionary()


def shared_params(device: Any) -> SharedParams:
    """``device``'s store of shared param buffers (made at first use)."""
    store = _STORES.get(device)
    if store is None:
        store = _STORES[device] = SharedParams()
    return store


def upload(device: Any, ptr: int, data: Any) -> None:
    """Queue ``data``'s copy into ``ptr`` on stream 0 (the caller synchronizes)."""
    device.memcpy_htod(ptr, np.frombuffer(data, dtype=np.uint8), 0)
