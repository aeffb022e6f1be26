"""Orca's iteration as a compiled bundle: :func:`paella.models.gpt.gpt_iteration` built by
``paella compile`` for a grid of (tokens, slots) buckets, with the model's own weights.

Why a grid. The compiled iteration has static shapes: ``T`` new tokens (the batch's
flattened tokens) and ``S`` KV slots. Each iteration *gathers* the slots of the requests
in it (every request's own slots, positions 0 to its last new token) into ``S`` columns,
runs the variant for ``(bucket(T), bucket(S))`` (powers of two, as an engine captures one
CUDA graph per bucket), and scatters the updated keys and values back to the cache. So
the attention a variant computes covers the batch's own contexts, not the whole cache,
as Orca's selective batching does; its ``write`` and ``mask`` matrices
(``models/gpt.py``) keep each request's tokens on its own columns.

What each part gives:

* **GPU time**: the variant's compiled kernels (:func:`.step_kernels.from_bundle`:
  TVM's kernels, their grids, FLOPs and bytes, in the Relax VM's launch order), timed by
  the simulated GPU's cost model like every bundle's;
* **tokens**: the variant's CPU (llvm) build, with the same weights, run as the
  iteration's functional effect (:func:`compiled_step`): in the daemon's effect workers
  on the KV cache in shared memory, never on the dispatcher's loop;
* **the CUDA source** is built by nvcc as every bundle's is (``kernels.cubin``).

The variants grid: ``T`` from 1 to ``bucket(max_tokens)``, ``S`` from ``T`` to
``bucket(max_slots)`` (an iteration never has more new tokens than context). For a
tiny model (d 32, 2 layers) a variant takes about 3-4 s to build on this machine,
cached (``PAELLA_CACHE_DIR``) by the model's content, weights included.
"""
from __future__ import annotations

import math
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from paella.models.gpt import NEG, GPTConfig

from .step_kernels import StepKernels, bucket, from_bundle


def grid(max_tokens: int, max_slots: int) -> list[tuple[int, int]]:
    """The (T, S) buckets compiled: T <= S, both powers of two, S >= 2 (TVM's DLight
    cannot schedule a reduction over one slot)."""
    top_s = max(2, bucket(max_slots))
    top_t = min(bucket(max_tokens), top_s)
    ts = [1 << i for i in range(int(math.log2(top_t)) + 1)]
    return [(t, s) for t in ts for s in (1 << i for i in range(int(math.log2(top_s)) + 1)) if s >= max(t, 2)]


class NotBuilt(RuntimeError):
    """The compiled iteration is not in the compile cache and building was not asked for."""


class CompiledIteration:
    """The compiled iteration of one model (``cfg``, ``weights`` by parameter name):
    :meth:`kernels` for the GPU's timing, :meth:`submit` for the tokens.

    ``out``: where the bundle goes (None: ``<cache>/../orca/<its cache key>``, shared by
    every daemon serving the same model). ``build=False``: raise :class:`NotBuilt` unless
    the compile cache already holds it (a daemon's plug-in, whose calls must be short:
    ``python -m paella.stepsched.compiled_iteration FOLDER`` builds it). ``timing_only``:
    no CPU build (its tokens cannot be computed)."""

    def __init__(self, cfg: GPTConfig, weights: dict[str, np.ndarray] | None, *,
                 max_tokens: int, max_slots: int, out: str | Path | None = None,
                 cache_dir: str | Path | None = None, timing_only: bool = False,
                 build: bool = True, progress: Callable[[str], None] = lambda _m: None):
        from paella.bundle import load_bundle
        from paella.compiler_pass.build import compile_bundle
        from paella.models.gpt import gpt_iteration
        self.cfg = cfg
        self.grid = grid(max_tokens, max_slots)
        models = []
        for t, s in self.grid:
            m = _export(cfg, t, s, weights) if weights is not None else gpt_iteration(cfg, t, s)
            m.batch, m.seq_len = t, s
            models.append(m)
        key, cache = _cache_entry(models, cache_dir, timing_only)
        if not build and not (cache / "manifest.json").is_file():
            raise NotBuilt(f"its compiled iteration ({len(models)} variants) is not built yet")
        if out is None:
            out = cache.parent.parent / "orca" / key
        path = compile_bundle(models, Path(out) / f"gpt_d{cfg.d}_l{cfg.n_layer}_v{cfg.vocab}",
                              cache_dir=cache_dir, timing_only=timing_only, progress=progress)
        self.bundle = load_bundle(path)
        self.timing_only = timing_only
        self.index = {(v.rows, v.seq_len): k for k, v in enumerate(self.bundle.variants)}
        self._kernels: dict[int, StepKernels] = {}
        st = os.stat(path / "manifest.json")
        self.ref = (str(path), (st.st_mtime_ns, st.st_size, st.st_ino))

    @property
    def max_tokens(self) -> int:
        return max(t for t, _ in self.grid)

    def variant(self, tokens: int, slots: int) -> int:
        """The variant index for an iteration of ``tokens`` new tokens over ``slots``
        gathered slots."""
        key = (bucket(tokens), bucket(max(slots, tokens, 2)))
        k = self.index.get(key)
        if k is None:
            raise ValueError(f"an iteration of {tokens} tokens over {slots} KV slots has no "
                             f"compiled variant (the grid goes to {self.grid[-1]})")
        return k

    def kernels(self, variant: int) -> StepKernels:
        sk = self._kernels.get(variant)
        if sk is None:
            sk = self._kernels[variant] = from_bundle(self.bundle, variant)
        return sk

    def close(self) -> None:
        """(Nothing to free: the bundle stays where it is, for the next load.)"""


def _cache_entry(models: list, cache_dir: str | Path | None, timing_only: bool) -> tuple[str, Path]:
    """The compile cache's key and folder for ``models`` (as ``compile_bundle`` names
    them, on its default architecture and options)."""
    import hashlib

    from paella.compiler_pass.build import cache_key, default_cache_dir, variant_name
    from paella.compiler_pass.instrument import InstrumentOptions
    opts = InstrumentOptions()
    key = hashlib.sha256("".join(cache_key(m, "sm_75", opts) + variant_name(m)
                                 for m in models).encode()).hexdigest()[:24]
    key += "-timing" if timing_only else ""
    return key, Path(cache_dir or default_cache_dir()) / key


def _export(cfg: GPTConfig, t: int, s: int, weights: dict[str, np.ndarray]):
    from paella.models.base import export
    from paella.models.gpt import GPTIteration
    f = "float32"
    return export(f"gpt_d{cfg.d}_l{cfg.n_layer}_t{t}_s{s}", GPTIteration(cfg),
                  {"tok": ((t,), "int32"), "pos": ((t,), "int32"), "write": ((t, s), f),
                   "mask": ((t, s), f), "kv": ((2 * cfg.n_layer, s, cfg.d), f)},
                  description=f"GPT iteration: d {cfg.d}, {cfg.n_layer} layers, {t} tokens, {s} KV slots",
                  weights=weights)


def iteration_inputs(cfg: GPTConfig, kv: np.ndarray, batch: list, T: int, S: int
                     ) -> tuple[dict[str, np.ndarray], np.ndarray, list[int]]:
    """The compiled iteration's inputs for ``batch`` (per request: its new tokens, the
    position of the first, its slots), padded to ``T`` tokens and ``S`` slots: the
    requests' slots gathered from ``kv`` [2L, n_slots, d] side by side. Returns the
    inputs, the gathered slot ids (to scatter back) and each request's last token row."""
    tok = np.zeros(T, np.int32)
    pos = np.zeros(T, np.int32)
    write = np.zeros((T, S), np.float32)
    mask = np.full((T, S), NEG, np.float32)
    gathered: list[int] = []
    ends = []
    row = 0
    for new, first, slots in batch:
        col = len(gathered)
        mine = list(slots[:first + len(new)])
        for j, t in enumerate(new):
            p = first + j
            tok[row], pos[row] = t, p
            write[row, col + p] = 1.0
            mask[row, col:col + p + 1] = 0.0
            row += 1
        ends.append(row - 1)
        gathered += mine
    cache = np.zeros((2 * cfg.n_layer, S, cfg.d), np.float32)
    cache[:, :len(gathered)] = kv[:, gathered]
    return {"tok": tok, "pos": pos, "write": write, "mask": mask, "kv": cache}, np.asarray(gathered), ends


def run_iteration(bundle: Any, variant: int, cfg: GPTConfig, kv: np.ndarray, batch: list) -> list[int]:
    """One iteration's next tokens from ``variant``'s CPU build; ``kv`` updated in place."""
    v = bundle.variants[variant]
    inputs, gathered, ends = iteration_inputs(cfg, kv, batch, v.rows, v.seq_len)
    nxt, new_kv = bundle.run_cpu(inputs, variant).values()
    kv[:, gathered] = new_kv[:, :len(gathered)]
    return [int(nxt[e]) for e in ends]


#: A worker's loaded bundles, by (path, stamp): their CPU builds, loaded once per process.
_LOADED: dict = {}


def compiled_step(ref: tuple[str, tuple], variant: int, cfg: GPTConfig, kv_ref: tuple[str, int],
                  n_slots: int, batch: list) -> list[int]:
    """The effect workers' task: :func:`run_iteration` on the KV cache mapped from shared
    memory (the bundle loaded once per worker process)."""
    from paella.bundle import load_bundle
    from paella.dispatcher.devices.sim.shared_array import attach
    b = _LOADED.get(ref)
    if b is None:
        if len(_LOADED) >= 4:
            _LOADED.pop(next(iter(_LOADED)))
        b = _LOADED[ref] = load_bundle(ref[0])
    kv = attach(kv_ref).view(np.float32).reshape(2 * cfg.n_layer, n_slots, cfg.d)
    return run_iteration(b, variant, cfg, kv, batch)


class IterationKernels:
    """The compiled iteration's kernels alone (timing only: no CPU build, no weights),
    one variant compiled the first time an iteration of its (tokens, slots) bucket
    runs, and cached by ``paella compile``'s cache: for experiments in virtual time,
    whose iterations span buckets no precompiled grid could hold (GPT-2 small, 32
    requests of up to 640 tokens: tokens to 16384, slots to 32768). A variant of GPT-2
    small takes about 5 s to build here, once per machine.

    Every kernel's name carries its bucket (``t{T}_s{S}/``): TVM names kernels after
    their operators, so two buckets' kernels would otherwise share names."""

    def __init__(self, cfg: GPTConfig, out: str | Path, *, cache_dir: str | Path | None = None,
                 progress: Callable[[str], None] = lambda _m: None):
        self.cfg = cfg
        self.out = Path(out)
        self.cache_dir = cache_dir
        self.progress = progress
        self._kernels: dict[tuple[int, int], StepKernels] = {}
        self.compiled = 0

    def for_iteration(self, tokens: int, slots: int) -> StepKernels:
        """The kernels of an iteration of ``tokens`` new tokens over ``slots`` gathered
        KV slots (their buckets' variant)."""
        key = (bucket(tokens), bucket(max(slots, tokens, 2)))
        sk = self._kernels.get(key)
        if sk is None:
            from paella.bundle import load_bundle
            from paella.compiler_pass.build import compile_bundle
            from paella.models.gpt import gpt_iteration
            t, s = key
            m = gpt_iteration(self.cfg, t, s)
            m.batch, m.seq_len = t, s
            self.progress(f"the GPT iteration for {t} tokens over {s} slots (built, or from the cache)")
            name = f"gpt_d{self.cfg.d}_t{t}_s{s}"
            # Processes sharing ``out`` (the experiment's workers) build and install each
            # variant one at a time: the second finds the first's bundle up to date.
            with _locked(self.out / f".{name}.lock"):
                path = compile_bundle([m], self.out / name, timing_only=True, cache_dir=self.cache_dir)
                bundle = load_bundle(path)
            sk = self._kernels[key] = tagged(from_bundle(bundle, 0), f"t{t}_s{s}")
            self.compiled += 1
        return sk


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (made if missing) between processes, held inside."""
    import fcntl
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def tagged(sk: StepKernels, tag: str) -> StepKernels:
    """``sk`` with every kernel's name prefixed by ``tag/``."""
    from dataclasses import replace
    return StepKernels(f"{tag}/{sk.name}", [replace(k, name=f"{tag}/{k.name}") for k in sk.kernels],
                       [replace(ln, kernel=f"{tag}/{ln.kernel}") for ln in sk.launches], sk.copies)


def request_level_compiled(kernels: IterationKernels, prompts: list[int], outputs: list[int]) -> StepKernels:
    """:func:`.step_kernels.request_level_generation` on the compiled iteration: one
    prefill of every prompt padded to the longest, then ``max(outputs)`` decode
    iterations of the whole batch, each over the batch's contexts."""
    b, p = len(prompts), max(prompts)
    parts = [kernels.for_iteration(b * p, b * p)]
    for i in range(1, max(outputs)):
        parts.append(kernels.for_iteration(b, b * (p + i)))
    uniq = {k.name: k for sk in parts for k in sk.kernels}
    return StepKernels(f"gen_b{b}_p{p}_o{max(outputs)}", list(uniq.values()),
                       [ln for sk in parts for ln in sk.launches])


def build_folder(folder: str | Path, progress: Callable[[str], None] = print) -> Path:
    """Build the compiled iteration a model folder's ``config.toml`` asks for (its
    ``checkpoint``, ``n_head``, ``max_bs``, ``n_slots``) into the compile cache, where
    the daemon's ``orca`` plug-in finds it."""
    import tomllib

    from paella.models.gpt_checkpoint import load_checkpoint
    folder = Path(folder)
    with open(folder / "config.toml", "rb") as f:
        opts = tomllib.load(f).get("batching", {})
    if not opts.get("checkpoint"):
        raise ValueError(f"{folder / 'config.toml'} names no checkpoint ([batching] checkpoint = ...)")
    cfg, w = load_checkpoint(folder / os.path.expanduser(opts["checkpoint"]), int(opts.get("n_head", 0)))
    max_bs = int(opts.get("max_bs", 8))
    n_slots = int(opts.get("n_slots", 0)) or max_bs * cfg.n_ctx
    c = CompiledIteration(cfg, w, max_tokens=max_bs * cfg.n_ctx, max_slots=n_slots, progress=progress)
    return c.bundle.path


if __name__ == "__main__":       # python -m paella.stepsched.compiled_iteration FOLDER...
    for arg in sys.argv[1:] or ["."]:
        print(f"built {build_folder(arg)}")
