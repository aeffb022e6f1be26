"""BatchMaker served by the daemon: the cell engine (:mod:`.cell_engine`) as the scheduler
plug-in ``cellular`` of the batching stage.

Declared in the entry-point group ``paella.batchers`` (pyproject.toml) like every
scheduler; it reaches the dispatcher only through its scheduler context. A model
repository folder with only a ``config.toml`` serves one cell model
(docs/step-scheduler.md, "Serving cell models from the daemon")::

    # repo/lstm/config.toml
    [batching]
    batcher = "cellular"
    model = "lstm"           # "lstm", "seq2seq" or "treelstm"
    config = "tiny"          # hidden 16, vocabulary 32; "paper": hidden 1024, vocabulary 30000
    bsizes = [1, 2, 4, 8]    # the batch sizes each cell is compiled at
    max_len = 64             # the longest sequence (tree: the most nodes) a request may carry

Each cell type is compiled at every batch size in ``bsizes`` as one bundle of variants
(``compile_steps``: TVM's kernels, timed by the simulated GPU like any bundle's), when
the model is loaded (off the daemon's loop; the compile cache makes a reload free).
Requests join a running batch at its next step and leave it when their own steps end
(Algorithm 1, :mod:`.cell_scheduler`); each batched cell is one job whose parts carry
the clients of its requests.

The io a client sees (one variant; ``L`` = ``max_len``, ``H`` = the hidden size):

* inputs: ``lstm``: ``xs`` (float32 [L, H]: one vector per step); ``seq2seq``: ``src``
  (int32 [L]: source token ids); ``treelstm``: ``xs`` (float32 [L, H]: one vector per
  node, read at the leaves) and ``parents`` (int32 [L]: each node's parent, -1 at the
  root); all: ``lengths`` (int32 [3]: the sequence's length or the tree's nodes, the
  target length (seq2seq, else 0), and 1 to have the per-step outputs, else 0);
* outputs: ``h`` (float32 [H]: the last cell's hidden state; a tree's root's),
  ``steps`` (float32 [L, H]: where asked, each step's hidden state: lstm per element,
  seq2seq per decoder step, treelstm per node), ``n_steps`` (int32 [1]: the steps
  written), and for seq2seq ``tokens`` (int32 [L]: the decoder's tokens).

:func:`cell_request` fills the inputs from unpadded arrays. With the per-step outputs
asked for, each step's row is announced with a progress entry (streaming clients see
them as the cells complete).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from paella import rings, wire
from paella.dispatcher.batchers.base import (ModelVariants, RequestRefused, SchedulerBatcher,
                                             SchedulerContext)
from paella.dispatcher.devices.base import OutOfMemory
from paella.models.base import DEFAULT_SEED
from paella.shapes import align

from .cell_engine import CONFIGS, MODELS, CellEngine, CellError, CellRequest
from .step_kernels import NotBuilt


def cellular_io(model: str, hidden: int, max_len: int) -> wire.VariantInfo:
    """The io region of one request of ``model`` (each tensor 64-byte aligned)."""
    ins = {"lstm": [("xs", (max_len, hidden), "float32")],
           "seq2seq": [("src", (max_len,), "int32")],
           "treelstm": [("xs", (max_len, hidden), "float32"), ("parents", (max_len,), "int32")]}[model]
    ins.append(("lengths", (3,), "int32"))
    outs = [("h", (hidden,), "float32"), ("steps", (max_len, hidden), "float32"),
            ("n_steps", (1,), "int32")]
    if model == "seq2seq":
        outs.append(("tokens", (max_len,), "int32"))
    off, tensors = 0, []
    for name, shape, dtype in ins + outs:
        tensors.append(wire.TensorInfo(name, shape, dtype, off))
        off += align(int(np.prod(shape)) * np.dtype(dtype).itemsize)
    return wire.VariantInfo(off, tuple(tensors[:len(ins)]), tuple(tensors[len(ins):]))


def cell_request(variant: wire.VariantInfo, *, xs: Any = None, src: Any = None, tgt_len: int = 0,
                 parents: Any = None, per_step: bool = False) -> dict[str, np.ndarray]:
    """The inputs of one request for ``Client.infer`` (``variant``: the model's, as
    ``client.model(name).variants[0]``), padded to the io's shapes: ``xs`` and
    ``parents`` (treelstm), ``xs`` (lstm), or ``src`` and ``tgt_len`` (seq2seq)."""
    out: dict[str, np.ndarray] = {}
    n = 0
    for t in variant.inputs:
        if t.name == "lengths":
            continue
        given = {"xs": xs, "src": src, "parents": parents}[t.name]
        a = np.zeros(t.shape, t.dtype)
        if given is not None:
            g = np.asarray(given, t.dtype)
            if len(g) > t.shape[0]:
                raise ValueError(f"{t.name}: {len(g)} steps, the model takes at most {t.shape[0]}")
            a[:len(g)] = g
            n = len(g)
        out[t.name] = a
    out["lengths"] = np.array([n, tgt_len, int(per_step)], np.int32)
    return out


class CellularPlugin(SchedulerBatcher):
    """Options: ``model`` ("lstm" | "seq2seq" | "treelstm"), ``config`` ("tiny" |
    "paper"), ``seed`` of the weights, ``bsizes`` (compiled batch sizes), ``max_len``,
    ``state_rows`` (rows of device state; 0: 64 requests of ``max_len`` steps),
    ``max_tasks_to_submit``, ``n_workers`` (BatchMaker's workers), ``bundle_dir`` (where
    the cells' bundles are written; "": the zoo's ``steps`` folder)."""

    name = "cellular"
    standalone = True

    def __init__(self, variants: ModelVariants, /, *, model: str = "lstm", config: str = "tiny",
                 seed: int = DEFAULT_SEED, bsizes: list | tuple = (1, 2, 4, 8), max_len: int = 64,
                 state_rows: int = 0, max_tasks_to_submit: int = 5, n_workers: int = 1,
                 bundle_dir: str = ""):
        # (``variants``: the stage's placeholder; the option ``model`` names the cell model)
        super().__init__(variants)
        kind = model
        if kind not in MODELS:
            raise ValueError(f"model must be one of {', '.join(MODELS)}, got {kind!r}")
        if config not in CONFIGS:
            raise ValueError(f"config must be one of {', '.join(CONFIGS)}, got {config!r}")
        bs = tuple(bsizes)
        if not bs or any(type(b) is not int or b < 1 for b in bs):
            raise ValueError(f"bsizes must be a list of positive ints, got {bsizes!r}")
        for opt, v in (("max_len", max_len), ("max_tasks_to_submit", max_tasks_to_submit),
                       ("n_workers", n_workers)):
            if type(v) is not int or v < 1:
                raise ValueError(f"{opt} must be an int >= 1, got {v!r}")
        if type(state_rows) is not int or state_rows < 0:
            raise ValueError(f"state_rows must be an int >= 0, got {state_rows!r}")
        self.kind, self.cfg, self.seed = kind, CONFIGS[config](), seed
        self.max_len = max_len
        self.state_rows = state_rows or 64 * max_len
        self.options = dict(max_tasks_to_submit=max_tasks_to_submit, n_workers=n_workers)
        self.io = cellular_io(kind, self.cfg.hidden, max_len)
        # The daemon never compiles: a plug-in call must end within plugin_timeout_seconds
        # and TVM cannot be interrupted. The cells come from the compile cache, here (a
        # (re)load builds the scheduler off the loop); ``python -m
        # paella.stepsched.cellular_plugin FOLDER`` builds them there.
        try:
            self.kernels = compile_cells(kind, self.cfg, tuple(sorted(set(bs))), seed, bundle_dir,
                                         build=False)
        except NotBuilt as e:
            raise ValueError(f"the {kind} cells are not compiled yet ({e}); build them with: "
                             f"python -m paella.stepsched.cellular_plugin MODEL_FOLDER") from None
        self.engine: CellEngine | None = None
        self._reqs: dict[int, tuple[Any, CellRequest]] = {}     # id(req) -> (req, its cells)

    def client_variants(self) -> list[wire.VariantInfo]:
        return [self.io]

    def start(self, ctx: SchedulerContext) -> None:
        super().start(ctx)
        try:
            self.engine = CellEngine(ctx, self.kind, self.kernels, cfg=self.cfg, seed=self.seed,
                                     state_rows=self.state_rows, name=f"cells-{self.kind}",
                                     **self.options)
        except (OSError, MemoryError, OutOfMemory) as e:
            raise RuntimeError(f"the cells' state of state_rows = {self.state_rows} rows cannot "
                               f"be allocated ({type(e).__name__}: {e}); lower state_rows") from None
        except RuntimeError as e:        # (a device without a host view of its memory)
            fix = "" if "--sim-mode" in str(e) else "; serve it with --backend sim"
            raise RuntimeError(f"cellular computes its cells as the simulated GPU's functional "
                               f"effects{fix} ({e})") from None
        self.engine.keep_finished = False

    # -- requests ---------------------------------------------------------------------------
    def _input(self, io: np.ndarray, name: str) -> np.ndarray:
        t = next(t for t in self.io.inputs if t.name == name)
        n = int(np.prod(t.shape)) * np.dtype(t.dtype).itemsize
        return io[t.offset:t.offset + n].view(t.dtype).reshape(t.shape)

    def add(self, req: Any, now: float) -> None:
        io = req.io
        # Read the client's bytes once, into private copies: it may change them any time.
        n, tgt_len, per_step = (int(x) for x in self._input(io, "lengths"))
        L = self.max_len
        what = "the tree's nodes" if self.kind == "treelstm" else "the sequence's length"
        if n < 1:
            raise RequestRefused(f"{what} must be at least 1 (an empty request), got {n}")
        if n > L:
            raise RequestRefused(f"{what} is {n}, over the configured maximum max_len = {L}")
        if self.kind == "seq2seq" and not 1 <= tgt_len <= L:
            raise RequestRefused(f"the target length must be 1..{L} (max_len), got {tgt_len}")
        args: dict[str, Any] = {}
        if self.kind == "seq2seq":
            args = dict(src=self._input(io, "src")[:n].copy(), tgt_len=tgt_len)
        else:
            args = dict(xs=self._input(io, "xs")[:n].copy())
            if self.kind == "treelstm":
                args["parents"] = self._input(io, "parents")[:n].copy()
        self._output(io, "n_steps")[:] = 0
        try:
            r = self.engine.submit(id(req), user=req.client_id,   # type: ignore[union-attr]
                                   on_step=(lambda step, h: self._step(req, step, h))
                                   if per_step or self.kind == "seq2seq" else None,
                                   on_end=lambda status: self._end(req, status), **args)
        except CellError as e:
            raise RequestRefused(str(e)) from None
        self._reqs[id(req)] = (req, r)
        r.per_step = bool(per_step)          # type: ignore[attr-defined]
        r.written = 0                        # type: ignore[attr-defined]

    def _output(self, io: np.ndarray, name: str) -> np.ndarray:
        t = next(t for t in self.io.outputs if t.name == name)
        n = int(np.prod(t.shape)) * np.dtype(t.dtype).itemsize
        return io[t.offset:t.offset + n].view(t.dtype).reshape(t.shape)

    def _step(self, req: Any, step: int, h: np.ndarray) -> None:
        """One cell of ``req`` is in: its row of ``steps`` (and, seq2seq, its token), then
        the progress entry (TSO: the client sees the row when it sees the count)."""
        item = self._reqs.get(id(req))
        io = req.io
        if item is None or io is None:
            return
        r = item[1]
        if self.kind == "seq2seq":
            src_len = len(r.inputs)
            if step < src_len:               # an encoder cell: no output of its own
                return
            row = step - src_len
            self._output(io, "tokens")[row] = r.tokens[row]
        else:
            row = r.nodes[step] if r.nodes is not None else step
        if not r.per_step:                   # type: ignore[attr-defined]
            return
        self._output(io, "steps")[row] = h
        r.written += 1                       # type: ignore[attr-defined]
        self._output(io, "n_steps")[0] = r.written      # type: ignore[attr-defined]
        self.ctx.progress(req, r.written)    # type: ignore[attr-defined]

    def _end(self, req: Any, status: int) -> None:
        item = self._reqs.pop(id(req), None)
        if status != rings.OK:
            self.ctx.complete(req, status, f"a batched cell of this request failed "
                                           f"(status {rings.STATUS_NAMES.get(status, status)})")
            return
        r = item[1] if item is not None else None
        if r is not None and req.io is not None:
            self._output(req.io, "h")[:] = r.final
            if not r.per_step:               # type: ignore[attr-defined]
                self._output(req.io, "n_steps")[0] = 0
        self.ctx.complete(req)

    def remove_client(self, client_id: int) -> list:
        """Its requests' cells not yet batched are withdrawn; their state rows come back
        (at once, or when the batched cells running them return)."""
        for key, (req, r) in list(self._reqs.items()):
            if r.user == client_id:
                del self._reqs[key]
                self.engine.cancel(r)        # type: ignore[union-attr]
        return []

    def close(self) -> None:
        for _, r in self._reqs.values():
            self.engine.cancel(r)            # type: ignore[union-attr]
        self._reqs.clear()

    @property
    def pending(self) -> int:
        return len(self._reqs)


def compile_cells(model: str, cfg: Any, bsizes: tuple[int, ...] | dict, seed: int = DEFAULT_SEED,
                  bundle_dir: str | Path = "", build: bool = True) -> dict:
    """Each cell type of ``model`` compiled at every batch size (one bundle of variants
    per cell type; ``bsizes`` the same for all, or by cell type):
    ``{kind: {batch size: StepKernels}}``. ``build=False``: raise
    :class:`~.step_kernels.NotBuilt` unless the compile cache holds them."""
    from paella.bundle import DEFAULT_ZOO_DIR

    from .step_kernels import compile_steps
    out = Path(bundle_dir) if bundle_dir else DEFAULT_ZOO_DIR / "steps"
    m = MODELS[model]
    per = bsizes if isinstance(bsizes, dict) else {k: bsizes for k in m.kinds}
    out_k = {k: compile_steps(m.maker(k, cfg, seed), per[k], out, build=build) for k in m.kinds}
    for by in out_k.values():
        for b, sk in by.items():
            by[b] = gathers_read_their_rows(sk, b, cfg.hidden)
    return out_k


def gathers_read_their_rows(sk: Any, batch: int, hidden: int) -> Any:
    """The cell's embedding lookup as the rows it reads. The compiler counts every
    buffer a kernel touches once, so TVM's ``take`` kernel is charged the whole table
    (123 MB at vocabulary 30,000: 11 ms for its one block at batch 1 on the simulated
    V100); a gather reads ``batch`` rows of ``hidden`` floats and writes as many (plus
    the indices)."""
    from dataclasses import replace
    nbytes = batch * (2 * hidden * 4 + 4)
    kernels = [replace(k, bytes=min(k.bytes, nbytes)) if k.name.startswith("take") else k
               for k in sk.kernels]
    return replace(sk, kernels=kernels)


def build_folder(folder: str | Path, progress: Any = print) -> dict:
    """Compile the cells a model folder's ``config.toml`` asks for (its ``model``,
    ``config``, ``seed``, ``bsizes``, ``bundle_dir``) into the compile cache, where the
    daemon's ``cellular`` plug-in finds them."""
    import tomllib
    folder = Path(folder)
    with open(folder / "config.toml", "rb") as f:
        opts = tomllib.load(f).get("batching", {})
    kind, config = opts.get("model", "lstm"), opts.get("config", "tiny")
    if kind not in MODELS or config not in CONFIGS:
        raise ValueError(f"{folder / 'config.toml'}: model must be one of {', '.join(MODELS)} and "
                         f"config one of {', '.join(CONFIGS)}; got {kind!r}, {config!r}")
    bs = tuple(sorted(set(opts.get("bsizes", (1, 2, 4, 8)))))
    progress(f"compiling the {kind} cells ({config}) at batch sizes {list(bs)}")
    return compile_cells(kind, CONFIGS[config](), bs, int(opts.get("seed", DEFAULT_SEED)),
                         opts.get("bundle_dir", ""))


if __name__ == "__main__":       # python -m paella.stepsched.cellular_plugin FOLDER...
    import sys
    for arg in sys.argv[1:] or ["."]:
        built = build_folder(arg)
        print(f"built {arg}: " + ", ".join(f"{k} at {sorted(v)}" for k, v in built.items()))
