"""Request shapes: how many rows a request carries (and its sequence length), how a
ring entry says so, and where each tensor of such a request lies in its io region.

Shared by the client library and the daemon (neither imports the other), so both lay
a shaped request out the same way.

A model's compiled variants each have a batch size (``rows``) and, for models with a
length dimension, a length bucket (``seq_len``; 0 when the model has none). A request
of ``r`` rows and length ``l`` uses every tensor of the model at that shape: axis 0 is
``r`` instead of the variant's rows, and axis 1, on tensors whose axis 1 is the
variant's length bucket, is ``l``. Its io region holds the inputs then the outputs,
each C-contiguous at an ``IO_ALIGN``-aligned offset, in the variant's tensor order.

The ring entry's ``options`` word says the shape: bit 31 (``SHAPED``) set, the rows in
bits 0..15 and the length in bits 16..30. Without ``SHAPED``, a request is one whole
variant (the low 16 bits select it), as before batching.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: Byte alignment of each tensor in a request's io region (as in a bundle's io buffer).
IO_ALIGN = 64
SHAPED = 1 << 31
ROWS_MASK = 0xFFFF
SEQ_SHIFT = 16
SEQ_MASK = 0x7FFF
MAX_ROWS = ROWS_MASK
MAX_SEQ_LEN = SEQ_MASK


class ShapeError(ValueError):
    """A request shape the model does not take (the text names the limit)."""


@dataclass(frozen=True)
class RequestShape:
    """Rows (the batch axis) and sequence length (0: the model has no length axis)."""
    rows: int = 1
    seq_len: int = 0

    def options(self) -> int:
        """The ring entry's options word for this shape."""
        if not 1 <= self.rows <= MAX_ROWS:
            raise ShapeError(f"rows must be 1..{MAX_ROWS}, got {self.rows}")
        if not 0 <= self.seq_len <= MAX_SEQ_LEN:
            raise ShapeError(f"seq_len must be 0..{MAX_SEQ_LEN}, got {self.seq_len}")
        return SHAPED | self.rows | (self.seq_len << SEQ_SHIFT)

    @staticmethod
    def from_options(options: int) -> "RequestShape | None":
        """The shape an options word carries (None: not a shaped request)."""
        if not options & SHAPED:
            return None
        return RequestShape(options & ROWS_MASK, (options >> SEQ_SHIFT) & SEQ_MASK)


@dataclass(frozen=True)
class Slot:
    """One tensor of a shaped request: its name, shape, dtype and byte offset."""
    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int

    @property
    def nbytes(self) -> int:
        n = np.dtype(self.dtype).itemsize      # (Python ints: no int64 overflow)
        for d in self.shape:
            n *= d
        return n


def align(n: int, to: int = IO_ALIGN) -> int:
    return -(-n // to) * to


def reshape(shape: tuple[int, ...], variant_rows: int, variant_seq: int,
            rows: int, seq_len: int) -> tuple[int, ...]:
    """A variant tensor's shape at ``rows`` x ``seq_len`` (see the module doc)."""
    out = list(shape)
    if out and out[0] == variant_rows:
        out[0] = rows
    if variant_seq and len(out) > 1 and out[1] == variant_seq:
        out[1] = seq_len
    return tuple(out)


def layout(tensors: "list[tuple[str, tuple[int, ...], str]]", variant_rows: int,
           variant_seq: int, rows: int, seq_len: int) -> tuple[list[Slot], int]:
    """The slots of a request of ``rows`` x ``seq_len`` whose tensors (inputs then
    outputs, as ``(name, shape, dtype)``) are the variant's, and its io size in bytes."""
    slots, off = [], 0
    for name, shape, dtype in tensors:
        s = Slot(name, reshape(tuple(shape), variant_rows, variant_seq, rows, seq_len), dtype, off)
        slots.append(s)
        off = align(off + s.nbytes)
    return slots, off


def batchable(variants) -> bool:
    """Whether a model's variants (``wire.VariantInfo``) take shaped requests."""
    return bool(variants) and all(v.batch > 0 for v in variants)


def request_layout(variants, rows: int, seq_len: int) -> tuple[list[Slot], int]:
    """The slots and io size of a shaped request to a model with ``variants``
    (``wire.VariantInfo``); :class:`ShapeError` names what the model takes instead."""
    if not batchable(variants):
        raise ShapeError("the model takes whole-variant requests only (it was compiled "
                         "without --batch-sizes): select a variant instead of giving a shape")
    max_rows = max(v.batch for v in variants)
    max_seq = max(v.seq_len for v in variants)
    if not 1 <= rows <= max_rows:
        raise ShapeError(f"{rows} rows: a request has 1..{max_rows} rows, the largest compiled "
                         f"variant taking {max_rows} (compiled batch sizes: "
                         f"{', '.join(str(b) for b in sorted({v.batch for v in variants}))})")
    if max_seq and not 1 <= seq_len <= max_seq:
        raise ShapeError(f"sequence length {seq_len}: the model takes 1..{max_seq} "
                         f"(length buckets: "
                         f"{', '.join(str(s) for s in sorted({v.seq_len for v in variants}))})")
    if not max_seq and seq_len:
        raise ShapeError(f"sequence length {seq_len}: the model has no length axis (give 0)")
    v = min((v for v in variants if v.batch >= rows and v.seq_len >= seq_len),
            key=lambda v: (v.seq_len, v.batch))
    tensors = [(t.name, tuple(t.shape), t.dtype) for t in (*v.inputs, *v.outputs)]
    return layout(tensors, v.batch, v.seq_len, rows, seq_len)
