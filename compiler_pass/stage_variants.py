"""Cutting a compiled (fused) model into DVABatch stages: ``paella compile --stages N``.

Input: a bundle of whole-model variants, one per batch size, each compiled as usual
(fusion, schedules, static memory plan). Output: the same bundle with one variant per
(stage, batch size) instead, whose launch plans are the whole plans cut at the same
places. Steps:

1. **Units.** The plan is cut between fused PrimFunc *calls* (``Variant.calls``), never
   inside one: a call's launches share workspaces. Every variant must make the same
   calls in the same order (it does when the batch size is only a shape).
2. **Boundary tensors.** Across a cut before call ``c``, a tensor is live when a step at
   or after ``c`` reads bytes a step before ``c`` wrote and no step in between rewrote
   them all (:func:`boundaries`). The analysis is on byte ranges of buffers, so TVM's
   storage reuse (one storage holding several tensors over time, at several offsets)
   is handled: what counts is the tensor the later step reads, where it reads it.
3. **Allowed cuts.** A cut is allowed only where every live tensor is *batch-major* in
   every variant (axis 0 is ``batch`` x the same constant, the other axes the same),
   so that rows ``k..k+n`` of a batch are one contiguous byte range of each boundary
   tensor; a weight transposed at run time, say, is live with no batch axis and its
   neighbourhood is not cut. The calls between two allowed cuts form one slicing unit.
4. **Profile and slice.** Each launch is profiled alone on the simulated GPU
   (:func:`paella.dispatcher.devices.sim.bundle_profile.launch_profile`) for every batch
   size; a unit's time is its launches' sum; :func:`.stages.slice_stages` cuts the
   units (where the preferred batch size changes, then balanced in time).
5. **Stage variants** (:func:`stage_variant`): the stage's launches, its buffers
   renumbered, its io = boundary-in tensors then boundary-out tensors (stage 0's ins
   are the model's inputs, the last stage's outs its outputs), an H2D copy per in and a
   D2H copy per out. Boundary tensors are named ``cut<k>.<j>``: the ``j``-th tensor
   live across cut ``k`` (cut ``k`` is between stage ``k-1`` and stage ``k``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

from paella.bundle import (IO_ALIGN, MANIFEST, BufferSpec, CallSpec, KernelArg, Op, TensorSpec,
                           Variant, ViewSpec, check_variant, load_bundle, manifest_from_dict)

from .stages import OpProfile, slice_stages

Progress = Callable[[str], None]


class StageError(ValueError):
    """The model cannot be cut as asked; the message says why and what to do."""


@dataclass(frozen=True)
class _Read:
    """A tensor a plan event reads, with the cuts across which it is live: every cut
    event ``e`` with ``lo < e <= event``."""
    view: ViewSpec
    event: int
    lo: int


def _call_access(v: Variant) -> list[list[str]]:
    """Per call, per argument: "r", "w" or "rw", from its launches' kernel parameters
    (an argument no launch uses counts as read: conservative)."""
    launches = v.launches()
    out = []
    for c in v.calls:
        acc: dict[tuple[int, int], str] = {}
        for op in launches[c.launches[0]:c.launches[1]]:
            for a, p in zip(op.args, v.kernel(op.kernel).params):
                if p["kind"] == "buffer" and a.buffer is not None:
                    key = (a.buffer, a.offset)
                    acc[key] = "".join(sorted(set(acc.get(key, "") + (p.get("access") or "rw"))))
        out.append([acc.get((a.buffer, a.offset), "r") if a is not None else "" for a in c.args])
    return out


def _events(v: Variant) -> list[tuple[list[ViewSpec], list[ViewSpec]]]:
    """(reads, writes) per event: one per model input (its H2D), one per call, one per
    model output (its D2H). Event ``len(inputs) + c`` is call ``c``."""
    ev: list[tuple[list[ViewSpec], list[ViewSpec]]] = []
    for t in v.inputs:
        ev.append(([], [ViewSpec(t.buffer, t.buffer_offset, list(t.shape), t.dtype)]))
    for c, acc in zip(v.calls, _call_access(v)):
        if any(a is None for a in c.args):
            raise StageError(f"call of {c.primfunc} has a non-tensor argument; stages need "
                             f"tensor arguments only")
        ev.append(([a for a, x in zip(c.args, acc) if "r" in x], [a for a, x in zip(c.args, acc) if "w" in x]))
    for t in v.outputs:
        ev.append(([ViewSpec(t.buffer, t.buffer_offset, list(t.shape), t.dtype)], []))
    return ev


def _reads(v: Variant) -> list[_Read]:
    """Every read, with ``lo``: the later of its latest fully covering write and its
    earliest overlapping write (see the module docstring, step 2)."""
    ev = _events(v)
    writes: dict[int, list[tuple[int, int, int]]] = {}      # buffer -> [(event, start, stop)]
    out = []
    for e, (reads, wrs) in enumerate(ev):
        for r in reads:
            a, b = r.offset, r.offset + r.nbytes
            ws = [(we, s, t) for we, s, t in writes.get(r.buffer, ()) if s < b and a < t]
            if not ws:
                continue                                # nothing wrote it: a param, or never live
            first = min(we for we, _, _ in ws)
            cover = max((we for we, s, t in ws if s <= a and b <= t), default=-1)
            out.append(_Read(r, e, max(first, cover)))
        for w in wrs:
            writes.setdefault(w.buffer, []).append((e, w.offset, w.offset + w.nbytes))
    return out


def boundaries(v: Variant, cut: int, reads: Sequence[_Read] | None = None) -> list[ViewSpec]:
    """The tensors live across a cut before call ``cut`` of ``v``, in the order they are
    first read after it (one per byte range)."""
    e = len(v.inputs) + cut
    seen, out = set(), []
    for r in reads if reads is not None else _reads(v):
        if r.lo < e <= r.event:
            key = (r.view.buffer, r.view.offset, r.view.nbytes)
            if key not in seen:
                seen.add(key)
                out.append(r.view)
    return out


def _row_shape(view: ViewSpec, batch: int) -> tuple | None:
    """The shape of one row of a batch-major tensor, or None if axis 0 is not a
    multiple of the batch."""
    if not view.shape or view.shape[0] % batch:
        return None
    return (view.shape[0] // batch, *view.shape[1:], view.dtype)


def allowed_cuts(variants: Sequence[Variant]) -> tuple[list[bool], dict[int, list[list[ViewSpec]]]]:
    """Per call index ``c`` (0..n), whether the plans may be cut before call ``c``
    (every variant's live tensors correspond and are batch-major), and each variant's
    boundary tensors there."""
    n = len(variants[0].calls)
    for v in variants:
        if len(v.calls) != n or [len(c.args) for c in v.calls] != [len(c.args) for c in variants[0].calls]:
            raise StageError(f"variant {v.name!r} makes other PrimFunc calls than {variants[0].name!r} "
                             f"(fusion differs between batch sizes); slice with fewer batch sizes")
    reads = [_reads(v) for v in variants]
    ok, at = [True] * (n + 1), {}
    for c in range(1, n):
        lists = [boundaries(v, c, r) for v, r in zip(variants, reads)]
        rows = [[_row_shape(t, v.rows) for t in ts] for v, ts in zip(variants, lists)]
        ok[c] = all(len(r) == len(rows[0]) for r in rows) and \
            all(x is not None for r in rows for x in r) and all(r == rows[0] for r in rows)
        at[c] = lists
    return ok, at


def _align(n: int) -> int:
    return -(-n // IO_ALIGN) * IO_ALIGN


def stage_variant(v: Variant, stage: int, calls: range, ins: list[tuple[str, ViewSpec]] | None,
                  outs: list[tuple[str, ViewSpec]] | None, cuts: list[int], seconds: float) -> Variant:
    """Stage ``stage`` of ``v``: its ``calls``' launches, boundary-in tensors ``ins`` and
    boundary-out tensors ``outs`` (``(name, view)``; ``None``: the model's own inputs /
    outputs)."""
    launches = v.launches()
    first, stop = v.calls[calls.start].launches[0], v.calls[calls.stop - 1].launches[1]
    if calls.stop == len(v.calls):
        stop = len(launches)
    mine = launches[first:stop]
    ins = ins if ins is not None else [(t.name, ViewSpec(t.buffer, t.buffer_offset, list(t.shape), t.dtype))
                                       for t in v.inputs]
    outs = outs if outs is not None else [(t.name, ViewSpec(t.buffer, t.buffer_offset, list(t.shape), t.dtype))
                                          for t in v.outputs]
    used = {a.buffer for op in mine for a in op.args if a.buffer is not None}
    used |= {t.buffer for _, t in ins + outs}
    new = {b: i for i, b in enumerate(sorted(used))}
    buffers = [BufferSpec(new[b.id], b.name, b.nbytes, b.kind) for b in v.buffers if b.id in new]
    io, tin, tout, plan = 0, [], [], []
    for name, t in ins:
        tin.append(TensorSpec(name, list(t.shape), t.dtype, io, t.nbytes, new[t.buffer], t.offset))
        plan.append(Op("h2d", buffer=new[t.buffer], buffer_offset=t.offset, io_offset=io, nbytes=t.nbytes))
        io = _align(io + t.nbytes)
    plan += [replace(op, args=[KernelArg(new[a.buffer], a.offset) if a.buffer is not None else a
                               for a in op.args]) for op in mine]
    for name, t in outs:
        tout.append(TensorSpec(name, list(t.shape), t.dtype, io, t.nbytes, new[t.buffer], t.offset))
        plan.append(Op("d2h", buffer=new[t.buffer], buffer_offset=t.offset, io_offset=io, nbytes=t.nbytes))
        io = _align(io + t.nbytes)
    names = {op.kernel for op in mine}
    my_calls = [CallSpec(c.primfunc, [c.launches[0] - first, c.launches[1] - first],
                         [replace(a, buffer=new[a.buffer]) for a in c.args])
                for c in v.calls[calls.start:calls.stop]]
    last = (tin + tout)[-1]
    return Variant(f"s{stage}_b{v.rows}" + (f"_l{v.seq_len}" if v.seq_len else ""), tin, tout, buffers,
                   [k for k in v.kernels if k.name in names], plan, last.offset + last.nbytes,
                   batch=v.rows, seq_len=v.seq_len, files=dict(v.files), calls=my_calls, stage=stage,
                   cuts=list(cuts), stage_seconds=seconds)


def call_times(bundle, variant: int, gpu: str) -> list[float]:
    """Each call's time at ``variant`` on the simulated ``gpu``: its launches, each
    profiled alone on an idle GPU, summed (seconds)."""
    from paella.dispatcher.devices.sim.bundle_profile import launch_profile
    v = bundle.variants[variant]
    t = [launch_profile(bundle, gpu, variant, i, op)["isolated_us"] * 1e-6
         for i, op in enumerate(v.launches())]
    return [sum(t[c.launches[0]:c.launches[1]]) for c in v.calls]


def slice_bundle(path: str | Path, n: int, gpu: str, progress: Progress = lambda _m: None) -> dict:
    """Rewrite the bundle at ``path`` (whole-model variants, one per batch size) into its
    stage variants (see the module docstring); returns the slicing record (cuts, per
    stage and batch size the profiled seconds)."""
    path = Path(path)
    bundle = load_bundle(path)
    variants = sorted(bundle.variants, key=lambda v: (v.seq_len, v.rows))
    if any(v.stage >= 0 for v in variants):
        raise StageError(f"bundle {path} is already cut into stages; compile the model again")
    if any(not v.calls for v in variants):
        raise StageError(f"bundle {path} records no PrimFunc calls; recompile it with this paella")
    if len({v.seq_len for v in variants}) > 1:
        raise StageError("--stages takes one length bucket: give --seq-lens a single length")
    if n < 1:
        raise StageError(f"--stages {n}: a model is cut into at least one stage")
    ok, at = allowed_cuts(variants)
    units = sorted(set([0] + [c for c in range(1, len(ok) - 1) if ok[c]] + [len(ok) - 1]))
    if n > len(units) - 1:
        raise StageError(f"--stages {n}: {bundle.model} can be cut into at most {len(units) - 1} "
                         f"stages (it is cut between its {len(variants[0].calls)} fused operators, only "
                         f"where every live tensor is batch-major); use --stages {len(units) - 1} or fewer")
    index = {id(v): i for i, v in enumerate(bundle.variants)}
    progress(f"profiling {sum(len(v.launches()) for v in variants)} launches on the simulated {gpu}")
    times = {v.rows: call_times(bundle, index[id(v)], gpu) for v in variants}
    segs = [OpProfile(f"calls {a}..{b - 1}", tuple((bs, sum(times[bs][a:b])) for bs in sorted(times)))
            for a, b in zip(units, units[1:])]
    stages = slice_stages(segs, n)
    cuts = [units[s.start] for s in stages[1:]]
    bounds = [0, *cuts, len(variants[0].calls)]
    out, record = [], {"stages": n, "gpu": gpu, "cuts": cuts, "seconds": {}}
    for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
        for k, v in enumerate(variants):
            ins = None if a == 0 else [(f"cut{s}.{j}", t) for j, t in enumerate(at[a][k])]
            outs = None if b == bounds[-1] else [(f"cut{s + 1}.{j}", t) for j, t in enumerate(at[b][k])]
            secs = sum(times[v.rows][a:b])
            sv = stage_variant(v, s, range(a, b), ins, outs, cuts, secs)
            check_variant(sv)
            out.append(sv)
            record["seconds"].setdefault(str(s), {})[str(v.rows)] = secs
        progress(f"stage {s}: calls {a}..{b - 1}, "
                 + ", ".join(f"b{bs} {1e6 * t:.0f} us" for bs, t in record["seconds"][str(s)].items()))
    mpath = path / MANIFEST
    manifest = manifest_from_dict(json.loads(mpath.read_text()))
    manifest.variants = out
    mpath.write_text(json.dumps(manifest.to_dict(), indent=1))
    return record


__all__ = ["StageError", "allowed_cuts", "boundaries", "call_times", "slice_bundle", "stage_variant"]
