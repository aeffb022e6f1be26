"""DVABatch as a daemon batcher: ``[batching] batcher = "dvabatch"`` in a model's
``config.toml``, for a bundle compiled with ``paella compile --stages N``.

A scheduler plug-in (:class:`~paella.dispatcher.batchers.base.SchedulerBatcher`),
registered under the entry-point group ``paella.batchers`` (pyproject.toml) like every
scheduler: it drives its own jobs through the scheduler context, its only way to the
dispatcher. Per model it keeps one
:class:`~.pipeline.DvaPipeline` (batch table, buffer pairs, the three policies) and
moves real data through it (:mod:`.stage_io`):

* a request joins a batch (*new* or *stretch*): its inputs are copied into row ``k`` of
  its pair's boundary 0 (``on_join``);
* a stage run of ``n`` rows at row ``k`` is one job per piece of ``n``'s cover by the
  compiled batch sizes, each on the variant of its size, its ins copied from boundary
  ``s`` and its outs back to boundary ``s + 1`` at the piece's rows; with ``own_streams``
  every stage's jobs go to that stage's own stream;
* a request leaves with its rows (multi-exit): its outputs are copied from the last
  boundary into its io region and it is answered then, whatever its batch-mates do.

Hostile cases: a client that goes away leaves its rows in their batch (the batch's
shape does not change under the others), its answer is dropped (the stage answers it
cancelled at once); a waiting request of it is withdrawn. A stage job that fails fails
the requests whose rows it ran, with the job's reason, at once; the rows go on so the
batch's other rows are not held up. On a drain every request is run to its exit.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from paella import rings
from paella.bundle import split_rows
from paella.shapes import layout as request_layout
from paella.wire import DEFAULT_PRIORITY

from paella.dispatcher.batchers.base import (MAX_DELAY_US, BatcherError, ModelVariants,
                                             RequestRefused, SchedulerBatcher, SchedulerContext)
from .handoff import HandoffAdaptor, HandoffUnavailable, handoff_plan, make_handoff
from .pipeline import DvaConfig, DvaPipeline
from .stage_io import PairData, StageModel, StageVariant, gather_request, scatter_request

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Group:
    """One request: its rows' queries report here; it is answered once, when its last
    row left (or at its first failure, or when its client left)."""
    req: Any
    slots: tuple
    stages: int                   # the stages its rows run (n_stages: the whole model)
    left: int                     # its rows not out yet
    answered: bool = False        # failed, or its client left: nothing more to send


@dataclass(eq=False)
class _Query:
    """One row of a request in the pipeline (the pipeline's query: it reads
    ``seq_len``; ``stages``: the policy's ``stages_of``)."""
    group: _Group
    part: int                     # its row in the request
    seq_len: int
    pair: int = -1
    row: int = -1
    bucket: int = 0               # the length its batch is padded to

    @property
    def req(self) -> Any:
        return self.group.req

    @property
    def stages(self) -> int:
        return self.group.stages


@dataclass
class DvaStats:
    """What the batcher did (``paella status``'s ``batcher`` entry of the model)."""
    requests: int = 0
    rows: int = 0                 # rows of those requests (a request may have several)
    exited: int = 0
    early_exits: int = 0          # requests that left after an earlier stage than the last
    failed: int = 0
    dropped: int = 0              # rows run for a client that had left
    jobs: int = 0
    gathered_bytes: int = 0
    #: Bytes of stage boundaries (between two stages, not a request's inputs or
    #: answers) copied through host memory: 0 with the device hand-off.
    boundary_host_bytes: int = 0
    #: Where stage boundaries live: "device" (the pairs' device memory, bound per job)
    #: or "host" (copied through host memory around every stage job).
    handoff: str = ""


class DvaBatcher(SchedulerBatcher):
    """Options (``[batching]`` keys):

    * ``pairs``            buffer pairs (1: stages serial; 2+: pipelined), default 2;
    * ``bs_max``           most queries in a batch (0: the largest compiled batch size;
                           "preferred": the model's preferred batch size, the smallest
                           compiled size within 3% of the best profiled throughput);
    * ``window_us``        batching window before a *new* batch, default 0;
    * ``stretch``          policy III on/off; ``t_comp_wait_us`` its bound (0: none);
    * ``stretch_idle_only`` stretch only when the first stage can start the catch-up now;
    * ``split``            policy II on/off; ``split_factor`` its test
                           ``T_remain(bs) >= split_factor x T_remain(bs/2)`` (the paper: 2);
    * ``own_streams``      each stage executor on a real stream of its own (the paper's);
    * ``early_exits``      the stages after which a request may leave (a client selects
                           an *exit variant*: stage 0's inputs, stage k's outputs; default:
                           every stage but the last);
    * ``handoff``          where stage boundaries live: "device" (the pairs' device
                           memory, each stage job bound to its rows: no host copy between
                           stages), "host" (copied through host memory), "auto" (the
                           default: device when every stage variant can be bound);
    * ``length_buckets``   the compiled length buckets served (default: every one the
                           bundle has); a request runs in the smallest that takes it;
    * ``group_lengths``    policy I: a batch holds one length bucket (default); off, a
                           batch takes every waiting query, padded to its longest one's
                           bucket (the ZeroBatch / DelayBatch baselines of the experiment).
    """

    name = "dvabatch"
    # Built at load time, so a bad option fails before the bundle is warmed; the stage
    # variants' profiled times (policy II) are read in start(), after registration.
    needs_costs = False

    def __init__(self, model: ModelVariants, pairs: int = 2, bs_max: int | str = 0,
                 window_us: float = 0.0, stretch: bool = True, t_comp_wait_us: float = 0.0,
                 stretch_idle_only: bool = False, split: bool = True, split_factor: float = 2.0,
                 own_streams: bool = True, early_exits: list | None = None,
                 handoff: str = "auto", length_buckets: list | None = None,
                 group_lengths: bool = True):
        super().__init__(model)
        if not any(v.stage >= 0 for v in model.variants):
            raise BatcherError(f"batcher 'dvabatch' needs a model cut into stages; "
                               f"{model.name} has whole-model variants only: compile it with "
                               f"`paella compile MODEL --stages N --batch-sizes 1,2,4,...`")
        if type(pairs) is not int or not 1 <= pairs <= 8:
            raise BatcherError(f"pairs must be an integer 1..8 (buffer pairs: 1 runs the "
                               f"stages serially, 2 pipelines them), got {pairs!r}")
        if bs_max != "preferred" and (type(bs_max) is not int or not 0 <= bs_max <= 1024):
            raise BatcherError(f"bs_max must be an integer 0..1024 (0: the largest compiled "
                               f"batch size) or \"preferred\" (the smallest compiled size "
                               f"within 3% of the best throughput), got {bs_max!r:.40}")
        for key, val in (("window_us", window_us), ("t_comp_wait_us", t_comp_wait_us)):
            if isinstance(val, bool) or not isinstance(val, (int, float)) or \
                    not 0 <= val <= MAX_DELAY_US:     # (a wait past a day is none: nan, inf too)
                raise BatcherError(f"{key} must be a number of microseconds 0..{MAX_DELAY_US:.0f} "
                                   f"(a day), got {val!r}")
        if isinstance(split_factor, bool) or not isinstance(split_factor, (int, float)) or \
                not 0 <= split_factor < math.inf:
            raise BatcherError(f"split_factor must be a number >= 0 (the paper's 2: split when "
                               f"the remaining stages at batch b take at least twice their "
                               f"time at b/2), got {split_factor!r}")
        n_stages = 1 + max(v.stage for v in model.variants)
        if early_exits is None:
            early_exits = list(range(n_stages - 1))
        if not isinstance(early_exits, (list, tuple)) or any(
                type(k) is not int or not 0 <= k < n_stages - 1 for k in early_exits):
            raise BatcherError(f"early_exits must be a list of the stages after which a request "
                               f"may leave, each one of {list(range(n_stages - 1))} ({model.name} "
                               f"has {n_stages} stages, 0..{n_stages - 1}; leaving after the "
                               f"last is the whole model), got {early_exits!r:.80}")
        self.early_exits = frozenset(early_exits)
        if handoff not in HANDOFFS:
            raise BatcherError(f"handoff must be one of {list(HANDOFFS)} (where stage boundaries "
                               f"live), got {handoff!r:.40}")
        self.handoff = handoff
        self.length_buckets = _check_buckets(model, length_buckets)
        self.group_lengths = bool(group_lengths)
        self.pairs, self.bs_max = pairs, bs_max
        self.window = window_us * 1e-6
        self.t_comp_wait = t_comp_wait_us * 1e-6 if t_comp_wait_us else math.inf
        self.stretch, self.stretch_idle_only = bool(stretch), bool(stretch_idle_only)
        self.split, self.split_factor = bool(split), float(split_factor)
        self.own_streams = bool(own_streams)
        self.stats = DvaStats()
        self.closed = False
        self._at: dict[tuple[int, int], _Query] = {}     # (pair, row) -> its query

    # -- hooks -------------------------------------------------------------------------------
    def start(self, ctx: SchedulerContext) -> None:
        super().start(ctx)
        served = set(self.length_buckets)
        variants = [StageVariant(k, sv.spec.stage, sv.spec.rows, sv.spec.seq_len,
                                 sv.layout.inputs, sv.layout.outputs, sv.layout.io_bytes,
                                 sv.spec.cost_s)
                    for k, sv in ctx.variants.items()
                    if sv.spec.stage >= 0 and (not served or sv.spec.seq_len in served)]
        self.stages = sm = StageModel(ctx.name, variants)
        self.model_ids = {k: sv.model_id for k, sv in ctx.variants.items()}
        bs_max = self._bs_max(sm)
        self.data = PairData(sm, self.pairs, bs_max)
        self._open_handoff(ctx, sm, bs_max)
        split = self.split
        if split and not any(v.cost_s > 0 for v in variants):
            log.warning("dvabatch %s: the stage variants are not profiled ([policy] "
                        "profile_runs = 0): policy II (split) is off", ctx.name)
            split = False
        cfg = DvaConfig(sm.n_stages, sm.stage_time, pairs=self.pairs, bs_max=bs_max,
                        window=self.window, stretch=self.stretch, t_comp_wait=self.t_comp_wait,
                        stretch_idle_only=self.stretch_idle_only, split=split,
                        split_factor=self.split_factor,
                        length_buckets=sm.buckets if sm.buckets != (0,) else (),
                        group_lengths=self.group_lengths,
                        class_of=_class_of, stages_of=_stages_of)
        self.pipe = DvaPipeline(cfg, self, self._exit, ctx.now, on_error=self._failed,
                                on_join=self._join)
        self._free: dict[int, list[np.ndarray]] = {}
        self._client_layouts: dict[tuple[int, int, int], tuple] = {}
        # The client-visible variants (model_info_from_bundle's order): per stage-0
        # variant the whole model, then per early exit k the same sizes, exiting after k.
        firsts = [(sv.spec.rows, sv.spec.seq_len) for _, sv in sorted(ctx.variants.items())
                  if sv.spec.stage == 0]
        self.client_variants = [(sm.n_stages - 1, r, ln) for r, ln in firsts] + \
            [(k, r, ln) for k in range(sm.n_stages - 1) for r, ln in firsts]
        self.bucket_rows = {ln: 0 for ln in sm.buckets if ln}
        log.info("dvabatch %s: %d stages, batch sizes %s%s, %d pair(s) of %d rows (%.1f KB of "
                 "boundary buffers)", ctx.name, sm.n_stages, list(sm.sizes),
                 f", length buckets {list(sm.buckets)}" if self.bucket_rows else "",
                 self.pairs, bs_max, sum(nb for (_, ln), ts in sm.boundaries.items()
                                         for _, nb in ts) * bs_max * self.pairs / 1024)

    def _bs_max(self, sm: StageModel) -> int:
        """The batch bound: ``bs_max``, the largest compiled size (0), or the model's
        preferred size ("preferred"; the largest compiled size when unprofiled)."""
        if self.bs_max != "preferred":
            return self.bs_max or sm.max_rows
        rows = sm.preferred_rows()
        if not rows:
            log.warning("dvabatch %s: bs_max = \"preferred\" needs the stage variants "
                        "profiled ([policy] profile_runs >= 1); using %d", sm.name, sm.max_rows)
        return rows or sm.max_rows

    def _open_handoff(self, ctx: Any, sm: StageModel, bs_max: int) -> None:
        """The device hand-off (``handoff`` "device" or "auto"): the pairs' device memory
        and, per stage variant, hand-off models without boundary copies (a fetching one
        too, keeping the D2H of its outputs, for runs with rows leaving after it)."""
        self.stats.handoff = "host"
        self.handoff_ids: dict[tuple[int, bool], int] = {}
        self.pools: dict[tuple[int, bool], Any] = {}
        if self.handoff == "host":
            return
        try:
            adaptors = {v.index: ctx.adaptor(ctx.variants[v.index].model_id)
                        for v in sm.by_key.values()}
            self.dev, found = make_handoff(sm, adaptors, self.pairs, bs_max, ctx.alloc)
        except (HandoffUnavailable, AttributeError) as e:
            if self.handoff == "device":
                raise BatcherError(f"handoff = \"device\": {ctx.name} cannot be bound to device "
                                   f"memory: {e}") from None
            log.warning("dvabatch %s: stage boundaries go through host memory: %s", ctx.name, e)
            return
        last = sm.n_stages - 1
        for v in sm.by_key.values():
            pb = found[v.index]

            def ptrs(pair: int, row: int, v: StageVariant = v, pb: Any = pb) -> dict:
                out = {b: self.dev.ptr(pair, v.stage, v.seq_len, n, row) for n, b in pb.ins}
                out.update({b: self.dev.ptr(pair, v.stage + 1, v.seq_len, n, row)
                            for n, b in pb.outs})
                return out
            for fetch in ((True,) if v.stage == last else (False, True)):
                ad = HandoffAdaptor(handoff_plan(adaptors[v.index].plan, v.stage, fetch),
                                    adaptors[v.index], pb.buffers, ptrs)
                self.handoff_ids[(v.index, fetch)] = ctx.register_model(
                    f"s{v.stage}_b{v.rows}_l{v.seq_len}{'_fetch' if fetch else ''}", ad,
                    profile_runs=None)   # (the dispatcher's own setting, as for every model)
                self.pools[(v.index, fetch)] = ad.buffer_pool
        self.stats.handoff = "device"
        log.info("dvabatch %s: stage boundaries in device memory (%.1f KB)", ctx.name,
                 self.dev.nbytes / 1024)

    def add(self, req: Any, now: float) -> None:
        sm = self.stages
        last = sm.n_stages - 1
        if req.layout is not None:           # a shaped request: the whole model
            try:                             # (its bucket: the smallest taking its length)
                bucket = sm.bucket(req.seq_len) if sm.buckets != (0,) else 0
            except BatcherError as e:
                raise RequestRefused(str(e)) from None
            slots, after, seq = tuple(req.layout), last, req.seq_len
        else:                                # a variant: maybe an exit variant
            k = req.options or 0
            if not 0 <= k < len(self.client_variants):
                raise RequestRefused(f"no variant {k} (it has {len(self.client_variants)})")
            after, rows, bucket = self.client_variants[k]
            if bucket not in sm.buckets:
                raise RequestRefused(f"variant {k} is of length {bucket}, not a bucket served "
                                     f"(length_buckets = {list(sm.buckets)})")
            if after != last and after not in self.early_exits:
                raise RequestRefused(f"an early exit after stage {after} is not enabled "
                                     f"(early_exits = {sorted(self.early_exits)})")
            slots, seq = self._whole_layout(bucket, rows, after), bucket
        if req.rows < 1:
            raise RequestRefused(f"a request needs at least one row, got {req.rows}")
        self.stats.requests += 1
        self.stats.rows += req.rows
        group = _Group(req, slots, after + 1, req.rows)
        for part in range(req.rows):
            self.pipe.add(_Query(group, part, seq if bucket else 0), now)
        self.pipe.poll(now)

    def poll(self, now: float) -> None:
        self.pipe.poll(now)

    def deadline(self) -> float | None:
        return self.pipe.deadline()

    def remove_client(self, client_id: int) -> None:
        self.pipe.withdraw(lambda q: q.req.client_id != client_id)
        for q in self._at.values():
            if q.req.client_id == client_id and not q.group.answered:
                q.group.answered = True    # its rows go on; the stage answers it cancelled
                self.stats.dropped += 1

    def close(self) -> None:
        self.closed = True

    @property
    def pending(self) -> int:
        return len(self.pipe.waiting) if hasattr(self, "pipe") else 0

    def stats_dict(self) -> dict:
        """Counters for ``paella status`` (the pipeline's meta-operations included)."""
        p = self.pipe.stats if hasattr(self, "pipe") else None
        out = dict(vars(self.stats))
        out.update({f"rows_l{ln}": n for ln, n in getattr(self, "bucket_rows", {}).items()})
        if p is not None:
            out.update(new=p.new, stretch=p.stretch, split=p.split, stage_runs=p.stage_runs,
                       rows_run=p.rows_run, failed_runs=p.failed_runs)
        return out

    # -- the pipeline's callbacks ------------------------------------------------------------
    def _join(self, q: _Query, pair: int, row: int, seq_len: int) -> None:
        q.pair, q.row, q.bucket = pair, row, seq_len
        self._at[(pair, row)] = q
        if seq_len:
            self.bucket_rows[seq_len] += 1
        self.stats.gathered_bytes += gather_request(self.data, self.stages,
                                                    _Req(q.req.io, q.group.slots), pair, row,
                                                    seq_len, part=q.part)

    def _exit(self, q: _Query, now: float) -> None:
        self._at.pop((q.pair, q.row), None)
        g = q.group
        g.left -= 1
        if g.answered:
            return
        scatter_request(self.data, self.stages, _Req(g.req.io, g.slots), q.pair, q.row,
                        q.bucket, part=q.part, boundary=g.stages)
        if g.left == 0:
            g.answered = True
            self.stats.exited += 1
            if g.stages < self.stages.n_stages:
                self.stats.early_exits += 1
            self.ctx.complete(g.req)

    def _failed(self, q: _Query, why: str) -> None:
        g = q.group
        if g.answered:
            return
        g.answered = True
        self.stats.failed += 1
        self.ctx.complete(g.req, rings.E_FAILED, why)

    # -- the runner (the pipeline's StageRunner) --------------------------------------------
    def run(self, stage: int, rows: int, seq_len: int, done: Callable[..., None]) -> None:
        raise RuntimeError("dvabatch runs stages with run_at (it moves real rows)")

    def run_at(self, stage: int, pair: int, row: int, rows: int, seq_len: int,
               done: Callable[..., None]) -> None:
        """Rows ``row .. row+rows`` of ``pair`` through stage ``stage``: one job per piece
        of the cover of ``rows`` by the compiled sizes; ``done`` once all pieces ended."""
        if self.closed:
            return                       # the daemon abandons us: nothing runs any more
        sm = self.stages
        pieces = split_rows(row, rows, sm.sizes)
        left = [len(pieces), None]       # pieces in flight, first error
        queries = [q for k in range(row, row + rows) if (q := self._at.get((pair, k))) is not None]
        clients = sorted({q.req.client_id for q in queries}) or [0]
        level = min(map(_class_of, queries), default=0)   # a batch is of one class
        device = self.stats.handoff == "device"
        last = sm.n_stages - 1
        for at, size in pieces:
            v = sm.variant(stage, size, seq_len)
            io = self._staging(v)
            bindings = None
            if not device:
                sm.load(self.data, v, pair, at, io)
                fetch = True
                if stage:
                    self.stats.boundary_host_bytes += v.in_bytes
                if stage < last:
                    self.stats.boundary_host_bytes += v.out_bytes
                model_id = self.model_ids[v.index]
            else:
                if stage == 0:                   # the requests' inputs, from the host
                    sm.load(self.data, v, pair, at, io)
                fetch = stage == last or self._leaving(pair, at, v.rows, stage)
                model_id = self.handoff_ids[(v.index, fetch)]
                bindings = self.pools[(v.index, fetch)].bind(pair, at)

            def piece_done(status: int, err: str | None, v: StageVariant = v,
                           io: np.ndarray = io, at: int = at, fetch: bool = fetch) -> None:
                if status == rings.OK:
                    if fetch:
                        sm.store(self.data, v, pair, at, io)
                elif status != rings.E_CANCELLED and left[1] is None:
                    left[1] = (f"{self.ctx.name}: stage {stage} of {sm.n_stages} failed on rows "
                               f"{at}..{at + v.rows - 1} of its batch (variant {v.index}): {err}")
                self._free.setdefault(v.index, []).append(io)
                left[0] -= 1
                if left[0] == 0:
                    done(left[1])
            self.stats.jobs += 1
            self.ctx.submit(model_id, io, clients, piece_done,
                            stream=f"s{stage}" if self.own_streams else None, priority=level,
                            bindings=bindings)

    def _leaving(self, pair: int, row: int, rows: int, stage: int) -> bool:
        """Some of rows ``row .. row+rows`` of ``pair`` leave after ``stage`` (an early
        exit): the run brings its outputs to the host."""
        for k in range(row, row + rows):
            q = self._at.get((pair, k))
            if q is not None and q.stages == stage + 1:
                return True
        return False

    def _staging(self, v: StageVariant) -> np.ndarray:
        free = self._free.get(v.index)
        return free.pop() if free else np.zeros(v.io_bytes, np.uint8)

    def _whole_layout(self, bucket: int, rows: int = 1, after: int | None = None) -> tuple:
        """The io slots of a variant request (no shape given): the client-visible
        variant's of ``rows`` rows (stage 0's inputs, then the outputs of stage
        ``after``: the last stage's by default, an earlier one for an exit variant), as
        ``model_info_from_bundle`` lays them out."""
        sm = self.stages
        after = sm.n_stages - 1 if after is None else after
        key = (bucket, rows, after)
        lay = self._client_layouts.get(key)
        if lay is None:
            first, last = sm.variant(0, rows, bucket), sm.variant(after, rows, bucket)
            tensors = [(t.name, t.shape, t.dtype) for t in (*first.inputs, *last.outputs)]
            lay = self._client_layouts[key] = tuple(request_layout(tensors, rows, bucket, rows,
                                                                   bucket)[0])
        return lay


#: The ``handoff`` option's values.
HANDOFFS = ("auto", "device", "host")


def _check_buckets(model: ModelVariants, buckets: list | None) -> tuple[int, ...]:
    """The ``length_buckets`` option: a non-empty list of the bundle's compiled length
    buckets (``paella compile --stages N --seq-lens ...``); () when not given: every
    one. Raises :class:`BatcherError` naming the valid buckets otherwise."""
    compiled = sorted({v.seq_len for v in model.variants if v.stage >= 0 and v.seq_len})
    if buckets is None:
        return ()
    if not compiled:
        raise BatcherError(f"length_buckets: {model.name} has no length axis (its stage "
                           f"variants are compiled without --seq-lens); leave the option out")
    if not isinstance(buckets, (list, tuple)) or not buckets or any(
            type(b) is not int or b not in compiled for b in buckets) or \
            len(set(buckets)) != len(buckets):
        raise BatcherError(f"length_buckets must be a list of distinct compiled length buckets, "
                           f"each one of {compiled} ({model.name}'s; compile others with "
                           f"`paella compile --stages N --seq-lens ...`), got {buckets!r:.80}")
    return tuple(sorted(buckets))


def _stages_of(q: "_Query") -> int:
    """The stages a query runs (policy I's early exits: fewer than all for an exit
    variant's rows)."""
    return q.group.stages


def _class_of(q: "_Query") -> int:
    """A query's priority class (its request's; none named: the default, 128)."""
    return q.req.priority or DEFAULT_PRIORITY


@dataclass
class _Req:
    """What gather/scatter read of a request: its io and its slots."""
    io: np.ndarray
    layout: tuple


__all__ = ["DvaBatcher", "DvaStats"]
