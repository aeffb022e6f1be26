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
6. **Own buffers** (:func:`own_boundary_buffers`): every boundary tensor is moved to a
   buffer of its own, exactly its bytes, so a runtime can bind it to rows of device
   memory it owns (the daemon's DVABatch pairs: no host copy between stages). Where a
   call straddles a boundary tensor's bytes, the variant keeps TVM's shared storage and
   the runtime copies that model's boundaries through the host.
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


class _Redirect:
    """Which call arguments of a stage variant move to a boundary tensor's own buffer:
    ``moves[(call, arg)] = (tensor index, byte offset in it)``."""

    def __init__(self) -> None:
        self.moves: dict[tuple[int, int], tuple[int, int]] = {}

    def add(self, key: tuple[int, int], to: tuple[int, int]) -> None:
        if self.moves.setdefault(key, to) != to:
            raise StageError(f"call {key[0]} argument {key[1]} is both a boundary-in and a "
                             f"boundary-out tensor's bytes")


def _in_moves(sv: Variant, acc: list[list[str]], i: int, t: TensorSpec, red: _Redirect) -> None:
    """Boundary-in ``t``: the reads of its bytes before any write in the stage overlaps them."""
    lo, hi = t.buffer_offset, t.buffer_offset + t.nbytes
    written: list[tuple[int, int]] = []    # bytes of its range rewritten in the stage
    dirty = False                          # written over once
    for c, call in enumerate(sv.calls):
        mine = [(j, a) for j, a in enumerate(call.args)
                if a.buffer == t.buffer and a.offset < hi and lo < a.offset + a.nbytes]
        for j, a in mine:
            if "r" not in acc[c][j]:
                continue
            if dirty:                      # after a write into it: must read only new bytes
                if not _inside(a.offset, a.offset + a.nbytes, written):
                    raise StageError(f"{call.primfunc} reads {t.name!r}'s bytes after part "
                                     f"of them was overwritten")
                continue
            if not (lo <= a.offset and a.offset + a.nbytes <= hi):
                raise StageError(f"{call.primfunc} reads across {t.name!r}'s bytes")
            red.add((c, j), (i, a.offset - lo))
        # A call reading and maybe writing it (in place) updates it in its own buffer, and
        # later reads follow it there; once a call only writes over its bytes, later
        # reads must read those new bytes, in the old buffer.
        dirty = dirty or any("w" in acc[c][j] and "r" not in acc[c][j] for j, _ in mine)
        written += [(a.offset, a.offset + a.nbytes) for j, a in mine
                    if "w" in acc[c][j] and "r" not in acc[c][j]]


def _inside(a: int, b: int, spans: list[tuple[int, int]]) -> bool:
    """[a, b) lies within the union of ``spans``."""
    pos = a
    for s0, s1 in sorted(spans):
        if s0 > pos:
            break
        pos = max(pos, s1)
    return pos >= b


def _out_moves(sv: Variant, acc: list[list[str]], k: int, t: TensorSpec, red: _Redirect) -> bool:
    """Boundary-out ``t``: the writes that make its bytes and the reads of them after, back
    from the stage's end to the write completing its bytes. False: nothing in the stage
    writes them (it passes through)."""
    lo, hi = t.buffer_offset, t.buffer_offset + t.nbytes
    covered: list[tuple[int, int]] = []
    moves: dict[tuple[int, int], tuple[int, int]] = {}   # (kept only if a write makes it)
    for c in range(len(sv.calls) - 1, -1, -1):
        call = sv.calls[c]
        for j, a in enumerate(call.args):
            if a.buffer != t.buffer or not (a.offset < hi and lo < a.offset + a.nbytes):
                continue
            if not (lo <= a.offset and a.offset + a.nbytes <= hi):
                raise StageError(f"{call.primfunc} touches part of {t.name!r}'s bytes")
            moves[(c, j)] = (k, a.offset - lo)
            if "w" in acc[c][j]:
                covered.append((a.offset, a.offset + a.nbytes))
        if _inside(lo, hi, covered):
            if any("r" in acc[c][j] and "w" in acc[c][j] for (cc, j) in moves if cc == c):
                raise StageError(f"{t.name!r} is completed by an in-place update")
            for key, to in moves.items():
                red.add(key, to)
            return True
    if covered:
        raise StageError(f"{t.name!r} is only partly written in its stage")
    return False


def own_boundary_buffers(sv: Variant) -> Variant:
    """``sv`` with every boundary tensor (each in and out) in a buffer of its own,
    exactly its bytes, so that a runtime may bind that buffer to rows of device memory it
    owns (DVABatch's pairs, docs/dvabatch.md). TVM's static memory plan puts a boundary
    tensor beside, or under, intermediates of the stage; here the calls' arguments that
    read an in's bytes (before anything overwrites them) and those that write an out's
    bytes (from the write completing them on) and read them after, move to the tensor's
    buffer; everything else stays. An out nothing in the stage writes (it passes through)
    shares its in's buffer. Raises :class:`StageError` where a call straddles a boundary
    tensor's bytes or updates one in place; the caller then keeps the copies."""
    acc = _call_access(sv)
    launches = sv.launches()
    if any(not (c.launches[0] <= i < c.launches[1] for c in sv.calls) for i in range(len(launches))):
        raise StageError("a launch outside every call")
    tensors = [*sv.inputs, *sv.outputs]
    n_in = len(sv.inputs)
    red = _Redirect()
    for i, t in enumerate(sv.inputs):
        _in_moves(sv, acc, i, t, red)
    home: dict[int, int] = {}              # tensor -> the tensor whose buffer it takes
    for k, t in enumerate(sv.outputs, n_in):
        if not _out_moves(sv, acc, k, t, red):
            src = next((i for i, u in enumerate(sv.inputs) if (u.buffer, u.buffer_offset, u.nbytes)
                        == (t.buffer, t.buffer_offset, t.nbytes)), None)
            if src is None:
                raise StageError(f"{t.name!r} is written by no call of its stage and is no input")
            home[k] = src
    base = 1 + max(b.id for b in sv.buffers)
    own: dict[int, int] = {}
    buffers = list(sv.buffers)
    for i, t in enumerate(tensors):
        if i not in home:
            own[i] = base + len(own)
            buffers.append(BufferSpec(own[i], f"boundary:{t.name}", t.nbytes, "intermediate"))
    for k, src in home.items():
        own[k] = own[src]
    calls, lmoves = [], {}
    for c, call in enumerate(sv.calls):
        args = list(call.args)
        for j, a in enumerate(args):
            to = red.moves.get((c, j))
            if to is not None:
                args[j] = ViewSpec(own[to[0]], to[1], list(a.shape), a.dtype)
                key = (c, a.buffer, a.offset)
                if lmoves.setdefault(key, (own[to[0]], to[1])) != (own[to[0]], to[1]):
                    raise StageError(f"{call.primfunc}: one pointer, two tensors")
        for j, a in enumerate(call.args):     # a pointer kept for one argument, moved for another
            if (c, j) not in red.moves and (c, a.buffer, a.offset) in lmoves:
                raise StageError(f"{call.primfunc}: one pointer, two tensors")
        calls.append(replace(call, args=args))
    call_of = {i: c for c, call in enumerate(sv.calls) for i in range(*call.launches)}
    plan, li = [], 0
    copies = {("h2d", t.offset): own[i] for i, t in enumerate(sv.inputs)}
    copies.update({("d2h", t.offset): own[k] for k, t in enumerate(sv.outputs, n_in)})
    for op in sv.plan:
        if op.op == "launch":
            c = call_of[li]
            li += 1
            op = replace(op, args=[KernelArg(*lmoves[(c, a.buffer, a.offset)])
                                   if a.buffer is not None and (c, a.buffer, a.offset) in lmoves else a
                                   for a in op.args])
        elif (op.op, op.io_offset) in copies:
            op = replace(op, buffer=copies[(op.op, op.io_offset)], buffer_offset=0)
        plan.append(op)
    tin = [replace(t, buffer=own[i], buffer_offset=0) for i, t in enumerate(sv.inputs)]
    tout = [replace(t, buffer=own[k], buffer_offset=0) for k, t in enumerate(sv.outputs, n_in)]
    used = {a.buffer for op in plan if op.op == "launch" for a in op.args if a.buffer is not None}
    used |= {op.buffer for op in plan if op.op in ("h2d", "d2h")}
    new = {b: i for i, b in enumerate(sorted(used))}        # ids 0..n-1 again
    plan = [replace(op, args=[replace(a, buffer=new[a.buffer]) if a.buffer is not None else a
                              for a in op.args]) if op.op == "launch" else
            replace(op, buffer=new[op.buffer]) if op.op in ("h2d", "d2h") else op for op in plan]
    calls = [replace(c, args=[replace(a, buffer=new[a.buffer]) if a.buffer in new else a
                              for a in c.args]) for c in calls]
    return replace(sv, inputs=[replace(t, buffer=new[t.buffer]) for t in tin],
                   outputs=[replace(t, buffer=new[t.buffer]) for t in tout], plan=plan,
                   calls=calls, buffers=[replace(b, id=new[b.id]) for b in buffers if b.id in used])


def call_times(bundle, variant: int, gpu: str) -> list[float]:
    """Each call's time at ``variant`` on the simulated ``gpu``: its launches, each
    profiled alone on an idle GPU, summed (seconds)."""
    from paella.dispatcher.devices.sim.bundle_profile import launch_profile
    v = bundle.variants[variant]
    t = [launch_profile(bundle, gpu, variant, i, op)["isolated_us"] * 1e-6
         for i, op in enumerate(v.launches())]
    return [sum(t[c.launches[0]:c.launches[1]]) for c in v.calls]


def slice_bundle(path: str | Path, n: int, gpu: str, progress: Progress = lambda _m: None) -> dict:
    """Rewrite the bundle at ``path`` (whole-model variants, one per batch size and length
    bucket) into its stage variants (see the module docstring); returns the slicing
    record (cuts, per stage and batch size the profiled seconds; with several length
    buckets, that record per bucket under ``buckets``).

    Each length bucket is cut on its own (its own profile, its own cuts: a longer
    sequence shifts where the preferred batch size changes), into the same ``n`` stages,
    so one served model holds every bucket's stages and a runtime keeps one boundary
    buffer per (cut, bucket)."""
    path = Path(path)
    bundle = load_bundle(path)
    variants = sorted(bundle.variants, key=lambda v: (v.seq_len, v.rows))
    if any(v.stage >= 0 for v in variants):
        raise StageError(f"bundle {path} is already cut into stages; compile the model again")
    if any(not v.calls for v in variants):
        raise StageError(f"bundle {path} records no PrimFunc calls; recompile it with this paella")
    if n < 1:
        raise StageError(f"--stages {n}: a model is cut into at least one stage")
    buckets = sorted({v.seq_len for v in variants})
    sizes = [sorted(v.rows for v in variants if v.seq_len == ln) for ln in buckets]
    if any(s != sizes[0] for s in sizes):
        raise StageError(f"the length buckets {buckets} are compiled for different batch sizes "
                         f"{sizes}; compile every bucket for the same --batch-sizes")
    index = {id(v): i for i, v in enumerate(bundle.variants)}
    out, records = [], {}
    for ln in buckets:
        mine = [v for v in variants if v.seq_len == ln]
        made, records[ln] = _slice_bucket(bundle, mine, index, n, gpu, progress)
        out += made
    mpath = path / MANIFEST
    manifest = manifest_from_dict(json.loads(mpath.read_text()))
    manifest.variants = out
    mpath.write_text(json.dumps(manifest.to_dict(), indent=1))
    if len(buckets) == 1:
        return records[buckets[0]]
    return {"stages": n, "gpu": gpu, "buckets": {str(ln): r for ln, r in records.items()}}


def _slice_bucket(bundle, variants: list[Variant], index: dict[int, int], n: int, gpu: str,
                  progress: Progress) -> tuple[list[Variant], dict]:
    """The stage variants of one length bucket's whole-model ``variants`` (one per batch
    size), and its slicing record."""
    ok, at = allowed_cuts(variants)
    units = sorted(set([0] + [c for c in range(1, len(ok) - 1) if ok[c]] + [len(ok) - 1]))
    where = f" at length {variants[0].seq_len}" if variants[0].seq_len else ""
    if n > len(units) - 1:
        raise StageError(f"--stages {n}: {bundle.model}{where} can be cut into at most {len(units) - 1} "
                         f"stages (it is cut between its {len(variants[0].calls)} fused operators, only "
                         f"where every live tensor is batch-major); use --stages {len(units) - 1} or fewer")
    progress(f"profiling {sum(len(v.launches()) for v in variants)} launches{where} on the simulated {gpu}")
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
            try:
                sv = own_boundary_buffers(sv)
            except StageError as e:           # (the runtime copies this model's boundaries)
                progress(f"stage {s} batch {v.rows}{where}: boundary tensors keep shared buffers ({e})")
            check_variant(sv)
            out.append(sv)
            record["seconds"].setdefault(str(s), {})[str(v.rows)] = secs
        progress(f"stage {s}{where}: calls {a}..{b - 1}, "
                 + ", ".join(f"b{bs} {1e6 * t:.0f} us" for bs, t in record["seconds"][str(s)].items()))
    return out, record


__all__ = ["StageError", "allowed_cuts", "boundaries", "call_times", "own_boundary_buffers",
           "slice_bundle", "stage_variant"]
