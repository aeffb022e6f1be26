"""Orca on the step runtime: a GPT served iteration by iteration, its KV cache in device
memory, tokens streamed as each iteration completes.

:class:`GenerationEngine` owns the physical KV slots: one device allocation of
``n_slots`` slots (:meth:`GPTConfig.kv_bytes_per_slot` bytes each). The iteration
scheduler reserves ``max_tokens`` slots logically on a request's first iteration; the
engine hands it that many physical slots then (the reservation guarantees they are
free), and takes them back when the request finishes, is preempted or its client goes
away.

Each iteration is one job (:class:`~.runtime.StepRuntime`) whose kernels are the
selectively batched transformer iteration (:func:`~.step_kernels.transformer_iteration`); with
weights given, its last kernel's functional effect runs the iteration
(:func:`paella.models.gpt.selective_iteration`) on the KV cache in simulated device
memory and the next tokens come out of it.

Preemption (when enabled) picks, per victim, the cheaper way to give its slots up:
*swap* (copy its cached keys and values to host memory and back: ``2 x bytes / pcie_bw``)
or *recompute* (drop them; one prefill over its prompt and its tokens so far:
``2 x parameters x tokens / peak_flops``). A swap's copies are the iteration job's first
operations (device to host for the victims, host to device for a request swapping back
in), timed by the simulated copy engines; the bytes themselves move at the iteration's
submission (the functional state).

``max_tokens`` in :meth:`submit` and :meth:`generate` counts *generated* tokens (as in
vLLM's and OpenAI's APIs); the scheduler's Orca-style reservation is the prompt plus that.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np

from paella.dispatcher.batchers.base import SchedulerContext
from paella.dispatcher.devices.sim.effect_workers import submit_or_fail
from paella.models.gpt import GPTConfig, selective_iteration

from .iteration_scheduler import GenRequest, Iteration, IterationScheduler
from .step_kernels import StepKernels, transformer_iteration
from .runtime import StepRuntime

if TYPE_CHECKING:
    from .compiled_iteration import CompiledIteration, IterationKernels


class GenerationError(ValueError):
    """A request the engine refuses (bad token ids, too long, too big for the cache)."""


@dataclass(eq=False)
class Stream:
    """A request's tokens as they come, with the device time of each."""
    req: GenRequest
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    t_submit: float = 0.0
    done: bool = False
    cancelled: bool = False
    on_token: Callable[[int], None] | None = None
    #: Called once when it ends: 0 when its last token is in, else the failed
    #: iteration's status (the engine drops it and frees its slots).
    on_end: Callable[[int], None] | None = None
    status: int = 0


class GenerationEngine:
    """Generations served through ``ctx``, a scheduler context (the daemon's, or one
    built on a dispatcher in virtual time: ``stage.scheduler_context``).

    ``plans``: each iteration a job of its kernels' launch plan, replayed by the
    dispatcher (:mod:`.runtime`'s replayed steps: the same times, far less Python per
    kernel); timing only, without preemption (the experiments in virtual time)."""

    def __init__(self, ctx: SchedulerContext, cfg: GPTConfig, *, max_bs: int, n_slots: int,
                 weights: dict[str, np.ndarray] | None = None, name: str = "gpt",
                 priorities: bool = False, fairness_threshold: float | None = None,
                 preempt: bool = False, n_workers: int = 1, cpu_scale: float = 0.0,
                 seed: int | None = None, compiled: "CompiledIteration | None" = None,
                 iteration_kernels: "IterationKernels | None" = None, plans: bool = False):
        self.ctx, self.cfg = ctx, cfg
        self.weights = weights
        #: The compiled iteration (:mod:`.compiled_iteration`): its kernels time every
        #: iteration and its CPU build computes the tokens (None: kernels from the
        #: shapes, tokens from the numpy iteration with ``weights``).
        self.compiled = compiled
        #: Timing only: the compiled iteration's kernels, compiled per bucket as met.
        self.iteration_kernels = iteration_kernels
        functional = weights is not None or compiled is not None
        if plans and (functional or preempt):
            raise ValueError("replayed iterations (plans=True) are timing only, without "
                             "preemption: no weights, no compiled iteration, preempt=False")
        # Where the iterations' tokens are computed: the device's effect workers when the
        # weights can be made there (their seed) and the device has workers (the
        # daemon); else in this process, at the iteration's submission (virtual time: the
        # simulated clock does not see it).
        from paella.dispatcher.devices.sim.effect_workers import InlineEffects
        runner = ctx.effects
        self.effects = (runner if runner is not None and (seed is not None or compiled is not None)
                        else InlineEffects())
        self.seed = seed
        self.kv_shared = None
        self.n_slots = n_slots
        self.sched = IterationScheduler(max_bs, n_slots, n_workers=n_workers, priorities=priorities,
                                        fairness_threshold=fairness_threshold, preempt=preempt,
                                        preempt_cost=self.preempt_cost)
        self.runtime = StepRuntime(ctx, self.sched, self._kernels, name=name, n_workers=n_workers,
                                   client_of=lambda r: r.user,
                                   effect=self._effect if functional else None,
                                   pending=self._pending if functional else None,
                                   on_task_done=self._after, cpu_scale=cpu_scale, plans=plans)
        self.kv_ptr = None
        self.functional = functional
        #: A real GPU runs the compiled iteration (:meth:`_job`): the KV cache is host
        #: memory, each iteration's slots copied in and out with its inputs and outputs.
        self.kv_host: np.ndarray | None = None
        self._jobs: dict[str, int] = {}
        if functional:
            nbytes = n_slots * cfg.kv_bytes_per_slot()
            self.kv_ptr = self.ctx.alloc(nbytes)
            if isinstance(self.effects, InlineEffects):
                try:
                    self.ctx.view(self.kv_ptr, nbytes)[:] = 0
                except RuntimeError:         # no host view of device memory: a real GPU
                    if compiled is None:
                        raise
                    self.ctx.free(self.kv_ptr)
                    self.kv_ptr = None
                    self.kv_host = np.zeros(nbytes, np.uint8)
                    self.runtime.job_for = self._job
            else:
                # Worker processes compute in place on the cache: its functional bytes
                # live in shared memory (the device allocation still counts its size).
                from paella.dispatcher.devices.sim.shared_array import SharedArray
                self.kv_shared = SharedArray(nbytes, "kv")
        self.free_slots: deque[int] = deque(range(n_slots))
        self.slots: dict[GenRequest, list[int]] = {}
        self.swapped: dict[GenRequest, np.ndarray] = {}
        self.streams: dict[GenRequest, Stream] = {}
        self.swaps = self.recomputes = 0
        #: False (a server): a generation's Stream is forgotten once it ended.
        self.keep_streams = True

    # ---- client side ---------------------------------------------------------------------
    def submit(self, prompt: list[int], max_tokens: int, *, out_len: int | None = None, user: int = 0,
               priority: int = 0, on_token: Callable[[int], None] | None = None,
               on_end: Callable[[int], None] | None = None, kick: bool = True) -> Stream:
        """Queue a generation of up to ``max_tokens`` tokens (``out_len``: where the
        workload's EOS falls, for timing-only runs without weights)."""
        prompt = list(prompt)
        if not prompt:
            raise GenerationError("the prompt is empty; send at least one token id")
        if type(max_tokens) is not int or max_tokens < 1:
            raise GenerationError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        if self.functional:
            bad = [t for t in prompt if type(t) is not int or not 0 <= t < self.cfg.vocab]
            if bad:
                raise GenerationError(f"token id {bad[0]!r} is outside the vocabulary [0, {self.cfg.vocab})")
        total = len(prompt) + max_tokens
        if total > self.cfg.n_ctx:
            raise GenerationError(f"prompt ({len(prompt)}) + max_tokens ({max_tokens}) = {total} exceeds "
                                  f"the model's context of {self.cfg.n_ctx} tokens")
        if total > self.n_slots:
            raise GenerationError(f"prompt + max_tokens = {total} exceeds the KV cache's {self.n_slots} slots")
        now = self.ctx.now()
        req = GenRequest(object(), len(prompt), total, out_len, now, user, priority)
        s = Stream(req, prompt, t_submit=now, on_token=on_token, on_end=on_end)
        self.streams[req] = s
        self.runtime.add(req, kick=kick)
        return s

    def generate(self, prompt_ids: list[int], max_tokens: int, **options) -> Iterator[int]:
        """Yield the tokens of one generation as the iterations that make them complete
        (virtual time: this drives the dispatcher until the next token)."""
        s = self.submit(prompt_ids, max_tokens, **options)
        given = 0
        while True:
            if given < len(s.tokens):
                yield s.tokens[given]
                given += 1
                continue
            if s.done or s.cancelled:
                return
            self.runtime.drive([], until=lambda: len(s.tokens) > given or s.done or s.cancelled)

    def cancel(self, s: Stream) -> None:
        """The client went away: its slots come back (now, or when its running iteration
        returns) and the rest of the line moves up."""
        if s.done or s.cancelled:
            return
        s.cancelled = True
        running = s.req.state == "running"
        self.sched.cancel(s.req)
        self.swapped.pop(s.req, None)        # a swapped-out cache goes with it
        if not running:
            self._free(s.req)
            self._forget(s.req)
        self.runtime.kick()

    def cancel_user(self, user: int) -> int:
        """Cancel every live generation of ``user`` (its connection dropped)."""
        live = [s for s in self.streams.values() if s.req.user == user and not (s.done or s.cancelled)]
        for s in live:
            self.cancel(s)
        return len(live)

    # ---- preemption cost ------------------------------------------------------------------
    def preempt_cost(self, r: GenRequest) -> str:
        p = self.ctx.device_props
        cfg = self.cfg
        swap = 2 * r.context * cfg.kv_bytes_per_slot() / p.pcie_bw
        n_params = cfg.n_layer * 12 * cfg.d * cfg.d + cfg.vocab * cfg.d
        recompute = 2.0 * n_params * r.context / p.peak_flops
        return "swap" if swap < recompute else "recompute"

    # ---- step runtime hooks -----------------------------------------------------------------
    def _kv(self) -> np.ndarray:
        cfg = self.cfg
        nbytes = self.n_slots * cfg.kv_bytes_per_slot()
        raw = (self.kv_shared.array if self.kv_shared is not None else self.kv_host
               if self.kv_host is not None else self.ctx.view(self.kv_ptr, nbytes))
        return raw.view(np.float32).reshape(2 * cfg.n_layer, self.n_slots, cfg.d)

    def close(self) -> None:
        """Give the shared KV segment back (its device allocation goes with the
        scheduler's context)."""
        if self.kv_shared is not None:
            self.kv_shared.close()

    def _kernels(self, it: Iteration) -> StepKernels:
        """Called as the iteration is submitted: victims give their slots up first, then
        requests starting (or resuming) take theirs."""
        slot = self.cfg.kv_bytes_per_slot()
        copies = []
        for v in it.preempted:
            if v.evicted == "swap":
                self.swaps += 1
                copies.append(("d2h", (v.context - 1) * slot))
                if self.functional:
                    self.swapped[v] = self._kv()[:, self.slots[v][:v.context - 1]].copy()
            else:
                self.recomputes += 1
            self._free(v)
        for r, phase in zip(it.requests, it.phases):
            if phase in ("prefill", "swap-in", "recompute"):
                self.slots[r] = [self.free_slots.popleft() for _ in range(r.max_tokens)]
            if phase == "swap-in":
                copies.append(("h2d", (r.context - 1) * slot))
                if r in self.swapped:
                    saved = self.swapped.pop(r)
                    self._kv()[:, self.slots[r][:saved.shape[1]]] = saved
        contexts = [self._first(r, ph) + n for r, ph, n in zip(it.requests, it.phases, it.n_tokens)]
        if self.compiled is not None:
            it.variant = self.compiled.variant(sum(it.n_tokens), sum(contexts))
            sk = self.compiled.kernels(it.variant)
        elif self.iteration_kernels is not None:
            sk = self.iteration_kernels.for_iteration(sum(it.n_tokens), sum(contexts))
        else:
            sk = transformer_iteration(self.cfg, it.n_tokens, contexts)
        if self.functional and self.kv_host is None:
            it.answer = self._compute(it)
        return replace(sk, copies=tuple(copies))

    def _batch(self, it: Iteration) -> list:
        """Per request of ``it``: its new tokens, the position of the first, its slots."""
        batch = []
        for r, phase in zip(it.requests, it.phases):
            s = self.streams[r]
            if phase == "prefill":
                new = s.prompt
            elif phase == "recompute":
                new = s.prompt + s.tokens
            else:
                new = [s.tokens[-1]]
            batch.append((new, self._first(r, phase), list(self.slots[r])))
        return batch

    def _job(self, it: Iteration) -> tuple[int, np.ndarray]:
        """A real GPU: the iteration is one job of its variant's plan (the compiled
        kernels, the bundle's params uploaded once per variant), its io the inputs with
        the requests' KV slots gathered; :meth:`_after` scatters them back."""
        from paella.dispatcher.adaptor import PlanAdaptor

        from .compiled_iteration import iteration_inputs
        c = self.compiled
        k = it.variant
        v = c.bundle.variants[k]
        mid = self._jobs.get(v.name)
        if mid is None:
            mid = self._jobs[v.name] = self.ctx.register_model(
                f"{self.runtime.adaptor.name}/{v.name}", PlanAdaptor.from_bundle(c.bundle, k),
                profile_runs=0)
        inputs, it.gathered, it.ends = iteration_inputs(self.cfg, self._kv(), self._batch(it),
                                                        v.rows, v.seq_len)
        it.io = c.bundle.pack_inputs(inputs, k)
        return mid, it.io

    def _unpack(self, it: Iteration) -> list[int]:
        nxt, kv = self.compiled.bundle.unpack_outputs(it.io, it.variant).values()
        self._kv()[:, it.gathered] = kv[:, :len(it.gathered)]
        return [int(nxt[e]) for e in it.ends]

    def _first(self, r: GenRequest, phase: str) -> int:
        """Position of the first token this iteration processes for ``r``."""
        return 0 if phase in ("prefill", "recompute") else r.prompt_len + r.generated - 1

    def _compute(self, it: Iteration) -> Any:
        """Start the iteration's tokens as it is submitted (the KV cache holds every
        earlier iteration's keys and values, and its swaps are done): in a worker process
        on the shared cache, or here. Returns the future; a failure to start is the
        iteration's (its effect raises it)."""
        batch = self._batch(it)
        if self.compiled is not None:
            from .compiled_iteration import compiled_step, run_iteration
            if self.kv_shared is not None:
                return submit_or_fail(self.effects, compiled_step, self.compiled.ref, it.variant,
                                      self.cfg, self.kv_shared.ref, self.n_slots, batch)
            return submit_or_fail(self.effects, run_iteration, self.compiled.bundle, it.variant,
                                  self.cfg, self._kv(), batch)
        if self.kv_shared is not None:
            return submit_or_fail(self.effects, worker_iteration, self.cfg, self.seed,
                                  self.kv_shared.ref, self.n_slots, batch)
        return submit_or_fail(self.effects, selective_iteration, self.cfg, self.weights,
                              self._kv(), batch)

    def _pending(self, it: Iteration) -> Any:
        f = getattr(it, "answer", None)
        return f if f is not None and not f.done() else None

    def _effect(self, it: Iteration, view) -> None:
        it.result = it.answer.result()       # (done already when the device held the kernel)

    def _after(self, it: Iteration, finished: list) -> None:
        now = self.ctx.now()
        if self.kv_host is not None and it.status == 0:
            it.result = self._unpack(it)
        result = getattr(it, "result", None)
        failed = it.status != 0 and self.functional and result is None
        for i, r in enumerate(it.requests):
            s = self.streams[r]
            if s.cancelled:
                self._free(r)
                self._forget(r)
                continue
            if failed:       # the iteration did not run: no token; the request ends
                self._end(s, it.status)
                continue
            tok = result[i] if result is not None else -1
            s.tokens.append(tok)
            s.times.append(now)
            if s.on_token is not None:
                s.on_token(tok)
        for r in finished:
            s = self.streams.get(r)
            if s is not None and not s.done:
                s.done = True
                self._free(r)
                self._forget(r)
                if s.on_end is not None:
                    s.on_end(0)

    def _end(self, s: Stream, status: int) -> None:
        """A generation ends with an error: out of the scheduler, its slots back."""
        s.status, s.done = status, True
        self.sched.cancel(s.req)             # (its iteration has returned: slots back now)
        self.swapped.pop(s.req, None)
        self._free(s.req)
        self._forget(s.req)
        if s.on_end is not None:
            s.on_end(status)

    def _forget(self, r: GenRequest) -> None:
        if not self.keep_streams:
            self.streams.pop(r, None)

    def _free(self, r: GenRequest) -> None:
        self.free_slots.extend(self.slots.pop(r, ()))


#: A worker's GPT weights, by (configuration, seed): made once per process.
_WEIGHTS: dict = {}


def worker_iteration(cfg: GPTConfig, seed: int, kv_ref: tuple[str, int], n_slots: int,
                     batch: list) -> list[int]:
    """One iteration's tokens in an effect worker: the seeded weights (made once per
    process: the same as the daemon's), the KV cache mapped from shared memory and
    updated in place (:func:`paella.models.gpt.selective_iteration`)."""
    from paella.dispatcher.devices.sim.shared_array import attach
    from paella.models.gpt import gpt_weights
    w = _WEIGHTS.get((cfg, seed))
    if w is None:
        w = _WEIGHTS[(cfg, seed)] = gpt_weights(cfg, seed)
    kv = attach(kv_ref).view(np.float32).reshape(2 * cfg.n_layer, n_slots, cfg.d)
    return selective_iteration(cfg, w, kv, batch)
