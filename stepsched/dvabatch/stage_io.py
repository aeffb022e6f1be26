"""Real data through DVABatch's buffer pairs: a served model's stage variants, the
pairs' boundary buffers, and the copies between them, the variants' io and the
requests' io regions.

A model cut into ``N`` stages (``paella compile --stages N``, docs/dvabatch.md) has one
compiled variant per (stage, batch size[, length bucket]). Stage ``s``'s io holds its
boundary-in tensors, then its boundary-out tensors; stage ``s``'s outs are stage
``s + 1``'s ins, by name (stage 0's ins are the model's inputs, the last stage's outs its
outputs), and every boundary tensor is *batch-major*: rows ``k .. k+n`` of a batch are
bytes ``k * row .. (k+n) * row`` of it. So a pair's boundary buffer ``b`` is, per
tensor of boundary ``b``, ``bs_max`` rows of that tensor's row bytes (:class:`PairData`),
and a run of ``n`` rows at row ``k``:

* copies rows ``k .. k+n`` of boundary ``s`` into the ``n``-row variant's io
  (:meth:`StageModel.load`), runs it as a job, and copies its outs back to rows
  ``k .. k+n`` of boundary ``s + 1`` (:meth:`StageModel.store`);
* when ``n`` is not a compiled batch size, runs the pieces of ``n``'s cover by the
  compiled sizes (:func:`paella.bundle.split_rows`: greedy, largest first; with the
  powers of two, ``n``'s binary decomposition), each at its own row offset -- no
  padding row is ever run.

Why copies, not jobs on the pair's bytes in place: a job's io is one contiguous region
in its variant's layout (ins then outs), while a run's ins and outs are rows of two
different boundary buffers; binding a variant's device buffers at row offsets of
pair-owned device memory is not done (docs/dvabatch.md, "What is not done"). The
copies are host memcpys of the rows run (``bench``: see the docs).

A request's inputs are copied into boundary 0 at the row its query was given (new or
stretch: the pipeline's ``on_join``), zero-padded to the batch's length bucket; its
outputs are copied out of boundary ``N`` into its own io region when it leaves.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from paella.bundle import split_rows
from paella.shapes import Slot

from paella.dispatcher.batchers.base import BatcherError


@dataclass(frozen=True)
class StageVariant:
    """One compiled (stage, batch size, length bucket) variant of a staged model."""
    index: int                      # the variant's index in the bundle
    stage: int
    rows: int
    seq_len: int
    inputs: tuple[Slot, ...]        # its boundary-in tensors in its io
    outputs: tuple[Slot, ...]       # its boundary-out tensors
    io_bytes: int
    cost_s: float = 0.0             # profiled time (0: not profiled)

    @property
    def in_bytes(self) -> int:
        return sum(t.nbytes for t in self.inputs)

    @property
    def out_bytes(self) -> int:
        return sum(t.nbytes for t in self.outputs)


def _row_bytes(t: Slot, rows: int) -> int:
    if not t.shape or t.shape[0] % rows:
        raise BatcherError(f"tensor {t.name!r} {tuple(t.shape)} is not batch-major for "
                           f"{rows} rows (axis 0 must be a multiple of the batch size)")
    return t.nbytes // rows


class StageModel:
    """The stage variants of one model, checked: every stage has the same batch sizes
    and length buckets, batch size 1 among them, and stage ``s``'s ins are stage
    ``s - 1``'s outs (names, row bytes). Raises :class:`BatcherError` naming what is
    wrong otherwise."""

    def __init__(self, name: str, variants: list[StageVariant]):
        self.name = name
        if not variants:
            raise BatcherError(f"model {name!r} has no stage variants: dvabatch serves a model "
                               f"compiled with `paella compile --stages N`")
        self.n_stages = max(v.stage for v in variants) + 1
        self.by_key: dict[tuple[int, int, int], StageVariant] = {}
        for v in variants:
            self.by_key[(v.stage, v.rows, v.seq_len)] = v
        per_stage = [sorted((v.rows, v.seq_len) for v in variants if v.stage == s)
                     for s in range(self.n_stages)]
        for s, keys in enumerate(per_stage):
            if keys != per_stage[0]:
                raise BatcherError(f"model {name!r}: stage {s} is compiled for (batch, length) "
                                   f"{keys}, stage 0 for {per_stage[0]}; compile every stage "
                                   f"for the same sizes")
        self.sizes = tuple(sorted({r for r, _ in per_stage[0]}))
        self.buckets = tuple(sorted({ln for _, ln in per_stage[0]}))
        if 1 not in self.sizes:
            raise BatcherError(f"model {name!r} has no batch-size-1 stage variants (sizes "
                               f"{list(self.sizes)}): a run of any count of rows needs them; "
                               f"compile with --batch-sizes starting at 1")
        # boundary b, bucket -> [(name, row bytes)]: stage b's ins (b = N: the last outs)
        self.boundaries: dict[tuple[int, int], tuple[tuple[str, int], ...]] = {}
        for ln in self.buckets:
            for s in range(self.n_stages):
                v = self.by_key[(s, 1, ln)]
                ins = tuple((t.name, _row_bytes(t, 1)) for t in v.inputs)
                outs = tuple((t.name, _row_bytes(t, 1)) for t in v.outputs)
                if s and ins != self.boundaries[(s, ln)]:
                    raise BatcherError(
                        f"model {name!r}: stage {s}'s inputs {list(ins)} are not stage "
                        f"{s - 1}'s outputs {list(self.boundaries[(s, ln)])} (name, bytes "
                        f"per row); the stages must chain")
                self.boundaries.setdefault((s, ln), ins)
                self.boundaries[(s + 1, ln)] = outs
        self.max_rows = max(self.sizes)

    @property
    def max_seq_len(self) -> int:
        return max(self.buckets)

    def variant(self, stage: int, rows: int, seq_len: int) -> StageVariant:
        return self.by_key[(stage, rows, seq_len)]

    def bucket(self, seq_len: int) -> int:
        """The smallest length bucket taking ``seq_len`` (0 without a length axis)."""
        for b in self.buckets:
            if seq_len <= b:
                return b
        raise BatcherError(f"length {seq_len} exceeds {self.name}'s longest bucket "
                           f"{self.max_seq_len}")

    def stage_time(self, stage: int, rows: int, seq_len: int) -> float:
        """Profiled time of a run of ``rows`` rows (its pieces' times added)."""
        ln = self.bucket(seq_len) if self.buckets != (0,) else 0
        return sum(self.by_key[(stage, b, ln)].cost_s for _, b in split_rows(0, rows, self.sizes))

    def preferred_rows(self, within: float = 0.03) -> int:
        """The model's preferred batch size (the paper's "smallest batch size that fully
        uses the GPU", taken for the whole model): the smallest compiled size whose
        profiled throughput through every stage, at the longest bucket, is within
        ``within`` of the best compiled size's. A larger batch only delays its own first
        rows. 0 when the variants are not profiled."""
        ln = self.max_seq_len
        total = {b: sum(self.by_key[(s, b, ln)].cost_s for s in range(self.n_stages))
                 for b in self.sizes}
        if not all(t > 0 for t in total.values()):
            return 0
        best = max(b / t for b, t in total.items())
        return min(b for b, t in total.items() if b / t >= (1 - within) * best)

    # -- copies ---------------------------------------------------------------------------
    def load(self, data: "PairData", v: StageVariant, pair: int, row: int,
             io: np.ndarray) -> None:
        """Rows ``row .. row + v.rows`` of boundary ``v.stage`` into ``io``'s ins."""
        bufs = data.buffers(pair, v.stage, v.seq_len)
        for t in v.inputs:
            src = bufs[t.name][row:row + v.rows]
            io[t.offset:t.offset + t.nbytes] = src.reshape(-1)

    def store(self, data: "PairData", v: StageVariant, pair: int, row: int,
              io: np.ndarray) -> None:
        """``io``'s outs into rows ``row .. row + v.rows`` of boundary ``v.stage + 1``."""
        bufs = data.buffers(pair, v.stage + 1, v.seq_len)
        for t in v.outputs:
            bufs[t.name][row:row + v.rows] = io[t.offset:t.offset + t.nbytes].reshape(v.rows, -1)


@dataclass
class PairData:
    """The boundary buffers of ``pairs`` pairs, ``rows`` rows each, allocated per length
    bucket on first use: ``[pair][(boundary, bucket)][tensor name]`` -> uint8 array of
    ``rows`` x the tensor's bytes per row."""
    model: StageModel
    pairs: int
    rows: int
    _bufs: list[dict[tuple[int, int], dict[str, np.ndarray]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._bufs = [{} for _ in range(self.pairs)]

    def buffers(self, pair: int, boundary: int, seq_len: int) -> dict[str, np.ndarray]:
        key = (boundary, seq_len)
        b = self._bufs[pair].get(key)
        if b is None:
            b = self._bufs[pair][key] = {
                name: np.zeros((self.rows, nb), np.uint8)
                for name, nb in self.model.boundaries[(boundary, seq_len)]}
        return b

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for p in self._bufs for d in p.values() for a in d.values())


def _view(buf: np.ndarray, s: Slot) -> np.ndarray:
    return buf[s.offset:s.offset + s.nbytes].view(np.dtype(s.dtype)).reshape(s.shape)


def gather_request(data: PairData, model: StageModel, req: Any, pair: int, row: int,
                   seq_len: int, part: int = 0) -> int:
    """Row ``part`` of the request's inputs into row ``row`` of boundary 0 (bucket
    ``seq_len``); a shorter sequence is zero-padded (axis 1). ``req.layout``: its slots,
    inputs then outputs (the client's request layout). Returns the bytes copied."""
    v = model.variant(0, 1, seq_len)
    bufs = data.buffers(pair, 0, seq_len)
    copied = 0
    for t, mine in zip(v.inputs, req.layout[:len(v.inputs)]):
        dst = bufs[t.name][row].view(np.dtype(t.dtype)).reshape(t.shape[1:])
        src = _view(req.io, mine)[part]
        if src.shape == dst.shape:
            dst[...] = src
        else:
            dst[...] = 0
            dst[tuple(slice(0, n) for n in src.shape)] = src
        copied += src.nbytes
    return copied


def scatter_request(data: PairData, model: StageModel, req: Any, pair: int, row: int,
                    seq_len: int, part: int = 0, boundary: int | None = None) -> None:
    """Row ``row`` of boundary ``boundary`` (default the last: the model's outputs; ``k``
    for a request leaving after stage ``k - 1``) into row ``part`` of the request's
    outputs (cut to its length)."""
    boundary = model.n_stages if boundary is None else boundary
    last = model.variant(boundary - 1, 1, seq_len)
    bufs = data.buffers(pair, boundary, seq_len)
    n_in = len(req.layout) - len(last.outputs)
    for t, mine in zip(last.outputs, req.layout[n_in:]):
        src = bufs[t.name][row].view(np.dtype(t.dtype)).reshape(t.shape[1:])
        dst = _view(req.io, mine)[part]
        dst[...] = src[tuple(slice(0, n) for n in dst.shape)]


__all__ = ["PairData", "StageModel", "StageVariant", "gather_request", "scatter_request"]
