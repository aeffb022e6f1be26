"""BatchMaker's cell models on the step runtime, with real arithmetic: what the daemon's
``cellular`` plug-in serves (:mod:`.cellular_plugin`) and ``paella experiment cellular``
drives.

Three models (:data:`MODELS`), each a set of cell types run by Algorithm 1
(:class:`~.cell_scheduler.CellularScheduler`):

* ``lstm``: one ``lstm`` cell per element of the sequence (a chain);
* ``seq2seq``: an ``encoder`` chain over the source tokens, then a ``decoder`` chain
  (Figure 12's "feed previous": each decoder cell embeds the token the previous one
  chose, token 0 as the first); decoder cells have priority over encoder cells;
* ``treelstm``: a binary TreeLSTM over a tree given as a parent-index array: a ``leaf``
  cell per childless node, an ``internal`` cell per other node; internal cells have
  priority over leaves.

State lives in device memory (one allocation the scheduler context gives): every node of
every request has a row ``(h, c)``, taken when the request arrives and given back when
it ends. A batched cell is one job; as it is submitted, its inputs are gathered from the
rows of its nodes' predecessors (BatchMaker's gather) and its arithmetic (the numpy
references of :mod:`paella.models.rnn`, on the same seeded weights as the compiled
cells) starts in the daemon's effect workers (in this process in virtual time); the
cell's last kernel waits for it, and its effect scatters the new state into the nodes'
rows. The GPU time comes from the compiled cells' kernels (one bundle variant per batch
size, :func:`~.step_kernels.compile_steps`).

With ``compute=False`` (the experiment's timing runs) nothing is computed: the same
scheduling, jobs and kernels, no state.
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np

from paella import rings
from paella.dispatcher.batchers.base import SchedulerContext
from paella.dispatcher.devices.sim.effect_workers import submit_or_fail
from paella.models import rnn
from paella.models.base import DEFAULT_SEED

from .cell_scheduler import CellType, CellularScheduler
from .graph import StepGraph, unfold_chain, unfold_parents, unfold_seq2seq
from .runtime import StepRuntime
from .step_kernels import StepKernels


class CellError(ValueError):
    """A request the engine refuses (an empty sequence, one too long, a bad tree)."""


@dataclass(frozen=True)
class CellModel:
    """A cell-structured model: its cell types (priority: higher first) and how each
    cell is compiled (``makers[kind](batch, cfg, seed)``: a ModelDef)."""
    name: str
    kinds: tuple[str, ...]
    priorities: tuple[int, ...]
    makers: tuple[Callable, ...]
    seeds: tuple[int, ...]

    def maker(self, kind: str, cfg: rnn.RNNConfig, seed: int) -> Callable[[int], Any]:
        k = self.kinds.index(kind)
        make, offset = self.makers[k], self.seeds[k]
        return lambda b: make(b, cfg, seed + offset)

    def cell_types(self, bsizes: dict[str, tuple[int, ...]]) -> list[CellType]:
        """The scheduler's cell types, each with its compiled batch sizes."""
        return [CellType(k, bsizes[k], p) for k, p in zip(self.kinds, self.priorities)]


MODELS = {
    "lstm": CellModel("lstm", ("lstm",), (0,), (rnn.lstm_cell,), (0,)),
    "seq2seq": CellModel("seq2seq", ("encoder", "decoder"), (0, 1),
                         (rnn.encoder_cell, rnn.decoder_cell), (0, 1)),
    "treelstm": CellModel("treelstm", ("leaf", "internal"), (0, 1),
                          (rnn.tree_leaf_cell, rnn.tree_internal_cell), (2, 3)),
}
CONFIGS = {"tiny": rnn.RNNConfig.tiny, "paper": rnn.RNNConfig}

#: A process's cell weights, by (model, config, seed): made once (workers too).
_WEIGHTS: dict = {}


def cell_weights(model: str, cfg: rnn.RNNConfig, seed: int = DEFAULT_SEED) -> dict[str, list[np.ndarray]]:
    """Each cell type's weights (the compiled cells' own seeded parameters)."""
    key = (model, cfg, seed)
    w = _WEIGHTS.get(key)
    if w is None:
        m = MODELS[model]
        w = _WEIGHTS[key] = {k: list(m.maker(k, cfg, seed)(1).params) for k in m.kinds}
    return w


def compute_cells(model: str, cfg: rnn.RNNConfig, seed: int, kind: str, a: dict) -> dict:
    """One batched cell's arithmetic (an effect worker runs it): ``a`` holds the gathered
    inputs (``x`` or ``tok``, and ``h``, ``c``, or both children's for ``internal``)."""
    w = cell_weights(model, cfg, seed)[kind]
    if kind == "lstm":
        h, c = rnn.lstm_reference(a["x"], a["h"], a["c"], *w)
    elif kind == "encoder":
        emb, ww, b = w
        h, c = rnn.lstm_reference(emb[a["tok"]], a["h"], a["c"], ww, b)
    elif kind == "decoder":
        tok, h, c = rnn.decoder_reference(a["tok"], a["h"], a["c"], w)
        return {"h": h, "c": c, "tok": tok}
    elif kind == "leaf":
        h, c = rnn.tree_leaf_reference(a["x"], *w)
    else:
        h, c = rnn.tree_internal_reference(a["hl"], a["cl"], a["hr"], a["cr"], *w)
    return {"h": h, "c": c}


def run_alone(model: str, cfg: rnn.RNNConfig, seed: int = DEFAULT_SEED, *, xs: Any = None,
              src: Any = None, tgt_len: int = 0, parents: Any = None) -> dict[str, Any]:
    """One request computed by itself, cell by cell at batch 1 (the reference the served
    answers are checked against): ``h`` (the last cell's; a tree's root's), ``steps``
    (every step's h: lstm per element, seq2seq per decoder step, treelstm per node) and,
    for seq2seq, ``tokens``."""
    w = cell_weights(model, cfg, seed)
    H = cfg.hidden
    if model == "treelstm":
        steps = rnn.treelstm_reference(np.asarray(xs, np.float32), [int(p) for p in parents],
                                       w["leaf"], w["internal"])
        return {"h": steps[[int(p) for p in parents].index(-1)], "steps": steps}
    h = c = np.zeros((1, H), np.float32)
    steps, tokens = [], []
    if model == "lstm":
        for x in np.asarray(xs, np.float32):
            h, c = rnn.lstm_reference(x[None], h, c, *w["lstm"])
            steps.append(h[0])
    else:
        emb, ww, b = w["encoder"]
        for t in src:
            h, c = rnn.lstm_reference(emb[[int(t)]], h, c, ww, b)
        tok = np.array([0], np.int32)
        for _ in range(tgt_len):
            tok, h, c = rnn.decoder_reference(tok, h, c, w["decoder"])
            tokens.append(int(tok[0]))
            steps.append(h[0])
    out = {"h": steps[-1], "steps": np.array(steps)}
    if model == "seq2seq":
        out["tokens"] = tokens
    return out


@dataclass(eq=False)
class CellRequest:
    """One request in the engine: its graph, its state rows (one per step), its inputs
    and, as its cells complete, its outputs."""
    key: Any
    graph: StepGraph
    inputs: np.ndarray                 # per step: x vectors [n, H], or tokens [n]
    user: int = 0
    nodes: list[int] | None = None     # treelstm: step -> tree node
    rows: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)     # seq2seq: the decoder's
    on_step: Callable[[int, np.ndarray], None] | None = None
    on_end: Callable[[int], None] | None = None
    cancelled: bool = False
    done: bool = False
    status: int = 0
    final: np.ndarray | None = None    # the last cell's h (the root's, for a tree)


class CellEngine:
    """Cell-structured requests served through ``ctx`` (a scheduler context: the
    daemon's, or one built on a dispatcher in virtual time)."""

    def __init__(self, ctx: SchedulerContext, model: str, kernels: dict[str, dict[int, StepKernels]],
                 *, cfg: rnn.RNNConfig | None = None, seed: int = DEFAULT_SEED,
                 state_rows: int = 4096, max_tasks_to_submit: int = 5, n_workers: int = 1,
                 compute: bool = True, cpu_scale: float = 0.0, name: str = "cells",
                 priorities: tuple[int, ...] | None = None):
        if model not in MODELS:
            raise ValueError(f"model must be one of {', '.join(MODELS)}, got {model!r}")
        self.ctx, self.model, self.m = ctx, model, MODELS[model]
        self.cfg = cfg or rnn.RNNConfig.tiny()
        self.seed, self.compute = seed, compute
        self.kernels = kernels
        missing = set(self.m.kinds) - set(kernels)
        if missing:
            raise ValueError(f"no kernels for the {model} cells {sorted(missing)}")
        # Each cell type's batch sizes are its compiled ones (BatchMaker-512,256: the
        # encoder's may go higher than the decoder's).
        # ``priorities``: the cell types' own, by default (later cells first); another
        # order for an ablation.
        m = self.m if priorities is None else replace(self.m, priorities=tuple(priorities))
        self.sched = CellularScheduler(m.cell_types({k: tuple(kernels[k]) for k in self.m.kinds}),
                                       max_tasks_to_submit)
        self.runtime = StepRuntime(ctx, self.sched, self._kernels, name=name, n_workers=n_workers,
                                   client_of=lambda r: r.user,
                                   effect=self._effect if compute else None,
                                   pending=self._pending if compute else None,
                                   on_task_done=self._after, cpu_scale=cpu_scale)
        self.H = self.cfg.hidden
        self.rows = state_rows if compute else 0
        self.state_ptr = ctx.alloc(self.rows * 2 * self.H * 4) if compute else None
        self.free_rows: list[int] = list(range(self.rows - 1, -1, -1))
        if compute:
            from paella.dispatcher.devices.sim.effect_workers import InlineEffects
            self.effects = ctx.effects if ctx.effects is not None else InlineEffects()
            self._state()                    # (a device without host views fails here)
            cell_weights(model, self.cfg, seed)
        self.live: dict[Any, CellRequest] = {}
        #: False (a server): the runtime forgets a request's finishing time once it ended.
        self.keep_finished = True

    # ---- requests -----------------------------------------------------------------------
    def submit(self, key: Any, *, xs: Any = None, src: Any = None, tgt_len: int = 0,
               parents: Any = None, user: int = 0, on_step=None, on_end=None,
               kick: bool = True) -> CellRequest:
        """Queue one request: ``xs`` [n, hidden] (lstm: one vector per step; treelstm:
        one per node, read at the leaves) with ``parents`` [n] (treelstm), or ``src``
        token ids and ``tgt_len`` (seq2seq). ``on_step(step, h)`` as each cell's state
        is in; ``on_end(status)`` once, when the last is (0) or the request failed.
        Timing only (``compute=False``): ``xs`` and ``src`` may be lengths."""
        now = self.ctx.now()
        nodes = None
        if not self.compute:                 # timing only: lengths may stand for the data
            xs = np.empty((xs, 0), np.float32) if isinstance(xs, (int, np.integer)) else xs
            src = np.zeros(src, np.int32) if isinstance(src, (int, np.integer)) else src
        try:
            if self.model == "seq2seq":
                inputs = self._tokens(src)
                if type(tgt_len) is not int or tgt_len < 1:
                    raise CellError(f"the target length must be >= 1, got {tgt_len!r}")
                graph = unfold_seq2seq(key, len(inputs), tgt_len, arrival=now)
            else:
                inputs = self._vectors(xs)
                if self.model == "lstm":
                    graph = unfold_chain(key, len(inputs), arrival=now)
                else:
                    parents = [int(p) for p in np.asarray(parents).ravel()]
                    if len(parents) != len(inputs):
                        raise CellError(f"{len(parents)} parents for {len(inputs)} nodes")
                    graph, nodes = unfold_parents(key, parents, arrival=now)
        except CellError:
            raise
        except ValueError as e:              # (TreeError and the unfolding's own)
            raise CellError(str(e)) from None
        need = len(graph.steps) if self.compute else 0
        if need > len(self.free_rows):
            raise CellError(f"the request needs {need} state rows and {len(self.free_rows)} of "
                            f"{self.rows} are free; retry later, or raise state_rows")
        r = CellRequest(key, graph, inputs, user, nodes, on_step=on_step, on_end=on_end)
        r.rows = [self.free_rows.pop() for _ in range(need)]
        self.live[key] = r
        graph.request = r
        self.runtime.add(graph, kick=kick)
        return r

    def _vectors(self, xs: Any) -> np.ndarray:
        if xs is None:
            raise CellError("no input vectors")
        xs = np.asarray(xs, np.float32)
        if xs.ndim != 2 or (xs.shape[1] != self.H and self.compute):
            raise CellError(f"inputs must be [length, {self.H}], got {list(xs.shape)}")
        if len(xs) < 1:
            raise CellError("the sequence is empty; send at least one step")
        if not np.isfinite(xs).all():
            raise CellError("the inputs hold NaN or infinite values")
        return xs

    def _tokens(self, src: Any) -> np.ndarray:
        src = np.asarray(src if src is not None else [], np.int64).ravel()
        if len(src) < 1:
            raise CellError("the source sequence is empty; send at least one token")
        bad = src[(src < 0) | (src >= self.cfg.vocab)]
        if len(bad):
            raise CellError(f"token id {int(bad[0])} is outside the vocabulary [0, {self.cfg.vocab})")
        return src.astype(np.int32)

    def cancel(self, r: CellRequest) -> None:
        """Its client went away: its cells not yet batched are withdrawn; its rows come
        back once no batched cell of it is queued or running."""
        if r.done or r.cancelled:
            return
        r.cancelled = True
        self.sched.remove(r.graph)
        self._release_if_idle(r)
        self.runtime.kick()

    def cancel_user(self, user: int) -> int:
        mine = [r for r in self.live.values() if r.user == user]
        for r in mine:
            self.cancel(r)
        return len(mine)

    def _release_if_idle(self, r: CellRequest) -> None:
        if any(s.state == "submitted" for s in r.graph.steps):
            return                           # a batched cell of it is queued or running
        self.free_rows.extend(r.rows)
        r.rows = []
        self.live.pop(r.key, None)

    # ---- the runtime's hooks ------------------------------------------------------------
    def _state(self, view=None) -> np.ndarray:
        nbytes = self.rows * 2 * self.H * 4
        raw = (view or self.ctx.view)(self.state_ptr, nbytes)
        return raw.view(np.float32).reshape(self.rows, 2, self.H)

    def _kernels(self, task: Any) -> StepKernels:
        """Called as the task is submitted: every predecessor's state is in, so gather
        and start the arithmetic."""
        if self.compute:
            task.answer = self._start(task)
        return self.kernels[task.kind][task.batch_size]

    def _start(self, task: Any) -> Future:
        st, H, kind = self._state(), self.H, task.kind
        n = len(task.nodes)
        zero = np.zeros((n, H), np.float32)
        a: dict[str, np.ndarray] = {}

        def prev(j: int, which: int) -> tuple[np.ndarray, np.ndarray]:
            h, c = zero[0].copy(), zero[0].copy()
            g, s = task.nodes[j]
            if len(s.deps) > which:
                row = g.request.rows[s.deps[which]]
                h, c = st[row, 0], st[row, 1]
            return h, c

        if kind == "internal":
            for which, (hn, cn) in enumerate((("hl", "cl"), ("hr", "cr"))):
                pairs = [prev(j, which) for j in range(n)]
                a[hn] = np.stack([p[0] for p in pairs])
                a[cn] = np.stack([p[1] for p in pairs])
        else:
            pairs = [prev(j, 0) for j in range(n)]
            a["h"] = np.stack([p[0] for p in pairs])
            a["c"] = np.stack([p[1] for p in pairs])
            if kind in ("lstm", "leaf"):
                a["x"] = np.stack([g.request.inputs[g.request.nodes[s.index] if g.request.nodes else s.index]
                                   for g, s in task.nodes])
            elif kind == "encoder":
                a["tok"] = np.array([g.request.inputs[s.depth] for g, s in task.nodes], np.int32)
            else:
                a["tok"] = np.array([g.request.tokens[s.depth - 1] if s.depth else 0
                                     for g, s in task.nodes], np.int32)
        return submit_or_fail(self.effects, compute_cells, self.model, self.cfg, self.seed,
                              kind, a)

    def _pending(self, task: Any) -> Any:
        f = getattr(task, "answer", None)
        return f if f is not None and not f.done() else None

    def _effect(self, task: Any, view) -> None:
        out = task.answer.result()           # (done already when the device held the kernel)
        st = self._state(view)
        rows = [g.request.rows[s.index] for g, s in task.nodes]
        st[rows, 0], st[rows, 1] = out["h"], out["c"]
        task.result = out

    def _after(self, task: Any, finished: list) -> None:
        out = getattr(task, "result", None)
        failed = self.compute and (task.status != 0 or out is None)
        for j, (g, s) in enumerate(task.nodes):
            r: CellRequest = g.request
            if r.cancelled or r.done:
                if r.rows:
                    self._release_if_idle(r)
                continue
            if failed:                       # the cell did not run: the request ends
                self._end(r, task.status or rings.E_INTERNAL)
                continue
            if out is not None:
                if "tok" in out:
                    r.tokens.append(int(out["tok"][j]))
                if r.on_step is not None:
                    r.on_step(s.index, out["h"][j])
        for r in finished:
            if r.cancelled or r.done:
                continue
            if self.compute:
                r.final = self._state()[r.rows[-1], 0].copy()
            self._end(r, 0)

    def _end(self, r: CellRequest, status: int) -> None:
        r.done, r.status = True, status
        if not self.keep_finished:
            self.runtime.finished.pop(r, None)
        if status:
            self.sched.remove(r.graph)
        self._release_if_idle(r)
        if r.on_end is not None:
            r.on_end(status)
