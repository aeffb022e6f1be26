"""Orca served by the daemon: the generation engine (:mod:`.generation`) as a scheduler
plug-in of the batching stage (:class:`~paella.dispatcher.batchers.base.SchedulerBatcher`).

It registers under the entry-point group ``paella.batchers`` as ``orca`` (pyproject.toml),
as every scheduler does, so the daemon loads it by name and the dispatcher never imports
it; it reaches the dispatcher only through the scheduler context it is started with. A
model repository folder with only a ``config.toml`` serves it (docs/step-scheduler.md,
"Serving generation from the daemon")::

    # models/gpt-tiny/config.toml
    [batching]
    batcher = "orca"
    config = "tiny"          # or "gpt2-small"
    max_bs = 8
    n_slots = 512            # KV slots in device memory (0: max_bs x the context)

Every iteration's tokens are computed in the daemon's effect workers (worker processes,
on the KV cache in shared memory), never on the dispatcher's loop; the iteration's last
kernel waits for them. Every iteration is one job of the kernel scheduler (its parts carry the clients of the
requests in it, so Paella's policy and its per-client fairness see them); the KV cache is
device memory the context allocates; each iteration's tokens go into the requests' io
regions and are announced with a progress entry (``ctx.progress``), the completion
follows the last one. Users, for the fairness deficit counters, are the clients' ids.

The io a client sees (one variant): inputs ``prompt`` (int32 x context) and ``lengths``
(int32 [prompt length, max_tokens]); outputs ``tokens`` (int32 x context) and
``n_tokens`` (int32 [1]: how many are valid). ``paella.generate`` fills and reads it.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from paella import rings, wire
from paella.dispatcher.batchers.base import (ModelVariants, RequestRefused, SchedulerBatcher,
                                             SchedulerContext)
from paella.dispatcher.devices.base import OutOfMemory
from paella.models.base import DEFAULT_SEED
from paella.models.gpt import GPTConfig, gpt_weights
from paella.shapes import align

from .generation import GenerationEngine, GenerationError, Stream

CONFIGS = {"tiny": GPTConfig.tiny, "gpt2-small": GPTConfig.gpt2_small}


def orca_priority(level: int) -> int:
    """The wire's priority (``paella.wire``: 1 the highest, 255 the lowest, 0 none) as
    the iteration scheduler's (larger goes first); none ranks as the middle level, as a
    Triton request without a priority takes the default level."""
    return wire.MAX_PRIORITY + 1 - (level or wire.DEFAULT_PRIORITY)


def generation_io(cfg: GPTConfig) -> wire.VariantInfo:
    """The io region of one generation request (each tensor 64-byte aligned)."""
    n = cfg.n_ctx
    prompt = wire.TensorInfo("prompt", (n,), "int32", 0)
    lengths = wire.TensorInfo("lengths", (2,), "int32", align(4 * n))
    tokens = wire.TensorInfo("tokens", (n,), "int32", lengths.offset + align(8))
    count = wire.TensorInfo("n_tokens", (1,), "int32", tokens.offset + align(4 * n))
    return wire.VariantInfo(count.offset + align(4), (prompt, lengths), (tokens, count))


class OrcaScheduler(SchedulerBatcher):
    """Options: ``checkpoint`` (a GPT-2-family safetensors file, relative to the model's
    folder: served on the compiled iteration), ``n_head`` (its heads; 0: d / 64);
    without a checkpoint, ``config`` ("tiny" | "gpt2-small") and ``seed`` of built-in
    seeded weights (kernels from the shapes, tokens in numpy); ``max_bs``, ``n_slots``
    (KV slots; 0: ``max_bs`` x the context), ``priorities``, ``fairness_threshold``
    (0: off), ``preempt``. ``folder`` is the model's folder (the daemon sets it)."""

    name = "orca"
    standalone = True
    #: The repository passes the model's folder as ``folder`` (a checkpoint's base).
    wants_folder = True

    def __init__(self, model: ModelVariants, *, config: str = "tiny", seed: int = DEFAULT_SEED,
                 checkpoint: str = "", n_head: int = 0, folder: str = "",
                 max_bs: int = 8, n_slots: int = 0, priorities: bool = False,
                 fairness_threshold: float = 0.0, preempt: bool = False):
        super().__init__(model)
        if config not in CONFIGS:
            raise ValueError(f"config must be one of {', '.join(CONFIGS)}, got {config!r}")
        if max_bs < 1 or n_slots < 0 or not fairness_threshold >= 0 or n_head < 0:   # (nan too)
            raise ValueError(f"max_bs must be >= 1, n_slots >= 0, fairness_threshold >= 0 and "
                             f"n_head >= 0; got {max_bs}, {n_slots}, {fairness_threshold}, {n_head}")
        if not 0 <= seed < 2 ** 32:
            raise ValueError(f"seed must be 0 .. 2**32 - 1 (the built-in weights' seed), got {seed}")
        self.compiled = None
        # The weights (and the compiled iteration) here, not in start(): a reload builds
        # the scheduler off the loop.
        if checkpoint:
            from paella.models.gpt_checkpoint import load_checkpoint
            path = os.path.join(folder, os.path.expanduser(checkpoint))
            self.cfg, weights = load_checkpoint(path, n_head)
        else:
            self.cfg = CONFIGS[config]()
        self.max_bs = max_bs
        self.n_slots = n_slots or max_bs * self.cfg.n_ctx
        self.options = dict(priorities=priorities, preempt=preempt,
                            fairness_threshold=fairness_threshold or None)
        if checkpoint:
            from .compiled_iteration import CompiledIteration, NotBuilt
            try:
                # Not built here: a plug-in call must end within the daemon's
                # plugin_timeout_seconds, and TVM's compiler cannot be interrupted.
                self.compiled = CompiledIteration(self.cfg, weights, build=False,
                                                  max_tokens=max_bs * self.cfg.n_ctx,
                                                  max_slots=self.n_slots)
            except NotBuilt as e:
                raise ValueError(f"checkpoint {path}: {e}: build it with `python -m "
                                 f"paella.stepsched.compiled_iteration {folder or '.'}` (about 4 s "
                                 f"a variant for a small model), then reload the models "
                                 f"(SIGHUP)") from None
            self.weights, self.seed = None, None
        else:
            self.weights = gpt_weights(self.cfg, seed)
            self.seed = seed
        self.io = generation_io(self.cfg)
        self.engine: GenerationEngine | None = None
        self._streams: dict[int, Stream] = {}       # id(req) -> its generation

    def client_variants(self) -> list[wire.VariantInfo]:
        return [self.io]

    def start(self, ctx: SchedulerContext) -> None:
        super().start(ctx)
        try:
            self.engine = GenerationEngine(ctx, self.cfg, max_bs=self.max_bs,
                                           n_slots=self.n_slots, weights=self.weights,
                                           name="iteration", seed=self.seed,
                                           compiled=self.compiled, **self.options)
        except (OSError, MemoryError, OutOfMemory) as e:   # the KV cache does not fit
            per_slot = self.cfg.kv_bytes_per_slot()
            need = self.n_slots * per_slot
            raise RuntimeError(f"the KV cache of n_slots = {self.n_slots} ({need / 2**30:.3g} GiB"
                               f", {per_slot} bytes per slot) cannot be "
                               f"allocated ({type(e).__name__}: {e}); lower n_slots in "
                               f"config.toml") from None
        except RuntimeError as e:        # (a device without a host view of its memory)
            fix = ("" if "--sim-mode" in str(e) else
                   "; serve it with --backend sim, or name a checkpoint (checkpoint = ...) to "
                   "serve it on its compiled kernels")
            raise RuntimeError(f"orca without a checkpoint computes its tokens in numpy, as "
                               f"the simulated GPU's functional effects{fix} ({e})") from None
        self.engine.keep_streams = False

    # -- requests ---------------------------------------------------------------------------
    def add(self, req: Any, now: float) -> None:
        prompt_t, lengths_t = self.io.inputs
        io = req.io
        # Read the client's bytes once, into private copies: it may change them any time.
        plen, max_tokens = (int(x) for x in io[lengths_t.offset:lengths_t.offset + 8]
                            .view(np.int32))
        cap = self.cfg.n_ctx
        if not 1 <= plen <= cap:
            raise RequestRefused(f"the prompt length must be 1..{cap} tokens, got {plen}")
        if max_tokens < 1:
            raise RequestRefused(f"max_tokens must be >= 1, got {max_tokens}")
        prompt = io[prompt_t.offset:prompt_t.offset + 4 * plen].view(np.int32).tolist()
        try:
            s = self.engine.submit(prompt, max_tokens, user=req.client_id,    # type: ignore[union-attr]
                                   priority=orca_priority(req.priority),
                                   on_token=lambda tok: self._token(req, tok),
                                   on_end=lambda status: self._end(req, status))
        except GenerationError as e:
            raise RequestRefused(str(e)) from None
        self._streams[id(req)] = s

    def _token(self, req: Any, tok: int) -> None:
        """One more token: into the request's io, then the progress entry (TSO: the
        client sees the token when it sees the count)."""
        s = self._streams.get(id(req))
        io = req.io
        if s is None or io is None:
            return
        k = len(s.tokens)
        tokens_t, count_t = self.io.outputs
        io[tokens_t.offset + 4 * (k - 1):tokens_t.offset + 4 * k] = \
            np.array([tok], np.int32).view(np.uint8)
        io[count_t.offset:count_t.offset + 4] = np.array([k], np.int32).view(np.uint8)
        self.ctx.progress(req, k)

    def _end(self, req: Any, status: int) -> None:
        self._streams.pop(id(req), None)
        if status == rings.OK:
            self.ctx.complete(req)
        else:
            self.ctx.complete(req, status, f"the iteration running this generation failed "
                                           f"(status {rings.STATUS_NAMES.get(status, status)})")

    def remove_client(self, client_id: int) -> list:
        """Its generations leave the line; their KV slots come back (at once, or when the
        iteration running them returns)."""
        for key, s in list(self._streams.items()):
            if s.req.user == client_id:
                del self._streams[key]
                self.engine.cancel(s)   # type: ignore[union-attr]
        return []

    def close(self) -> None:
        for s in self._streams.values():
            self.engine.cancel(s)       # type: ignore[union-attr]
        self._streams.clear()
        if self.engine is not None:
            self.engine.close()
        if self.compiled is not None:
            self.compiled.close()

    @property
    def pending(self) -> int:
        return len(self._streams)
