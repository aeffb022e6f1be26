"""Bundles on the dispatcher: the client-facing description of a bundle, and the adaptor
that serves it on a device (on the simulator, with the CPU build as the plan's functional
effect, through the cache of reference outputs)."""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from typing import Any, Callable

import numpy as np

from paella import wire
from paella.dispatcher import native
from paella.dispatcher.adaptor import PlanAdaptor
from paella.log_throttle import LogThrottle

log = logging.getLogger("paella.daemon")
_offload = native.load("devices.sim._offload")


def model_info_from_bundle(model_id: int, bundle, name: str | None = None) -> wire.ModelInfo:
    """The client-facing description of a loaded bundle (every variant), under ``name``
    (the model's folder name in the repository; default the bundle's own). A bundle of
    stage variants (``paella compile --stages``) is described as the whole model it was
    cut from: per (batch size, length) one variant of stage 0's inputs and the last
    stage's outputs, laid out as a shaped request of that size (``paella.shapes``)."""
    def tensors(ts) -> tuple[wire.TensorInfo, ...]:
        return tuple(wire.TensorInfo(t.name, tuple(t.shape), t.dtype, t.offset) for t in ts)
    if getattr(bundle, "n_stages", 0):
        return _staged_model_info(model_id, bundle, name)
    batched = all(v.batch for v in bundle.variants)
    return wire.ModelInfo(model_id, name or bundle.model, tuple(
        wire.VariantInfo(v.io_bytes, tensors(v.inputs), tensors(v.outputs),
                         v.batch if batched else 0, v.seq_len if batched else 0)
        for v in bundle.variants))


def _staged_model_info(model_id: int, bundle, name: str | None) -> wire.ModelInfo:
    """Per stage-0 variant the whole model, then per stage ``k`` but the last the same
    sizes again as *exit variants*: stage 0's inputs, stage ``k``'s outputs (a request
    selecting one leaves after stage ``k``: dvabatch's ``early_exits``)."""
    from paella.shapes import layout
    last = bundle.n_stages - 1
    out = []
    firsts = [v for v in bundle.variants if v.stage == 0]
    for after, first in [(last, f) for f in firsts] + [(k, f) for k in range(last) for f in firsts]:
        end = next(v for v in bundle.variants if v.stage == after and v.rows == first.rows
                   and v.seq_len == first.seq_len)
        ts = [(t.name, tuple(t.shape), t.dtype) for t in (*first.inputs, *end.outputs)]
        slots, io_bytes = layout(ts, first.rows, first.seq_len, first.rows, first.seq_len)
        info = [wire.TensorInfo(s.name, s.shape, s.dtype, s.offset) for s in slots]
        n_in = len(first.inputs)
        out.append(wire.VariantInfo(io_bytes, tuple(info[:n_in]), tuple(info[n_in:]),
                                    first.rows, first.seq_len))
    return wire.ModelInfo(model_id, name or bundle.model, tuple(out))


#: Bytes of an input the cache's key samples (a strided sample; see FunctionalCache).
KEY_SAMPLE_BYTES = 4096
#: Distinct inputs kept under one key (see FunctionalCache): a lookup compares at most
#: this many whole inputs.
MAX_PER_KEY = 4
#: Buffer sets a model remembers the owner of (functional_adaptor's answer_owner): more
#: than a pool keeps at once; beyond it the oldest entry goes.
MAX_OWNED_SETS = 4096
#: The lookup ahead's coarse key (FunctionalCache.ahead): two runs of this many bytes
#: of each input, at its start and at its middle (see coarse_spans).
AHEAD_SPAN = 128


def coarse_spans(nbytes: int) -> list[tuple[int, int]]:
    """Where :meth:`FunctionalCache.ahead`'s coarse key reads an input of ``nbytes``:
    ``[start, end)`` byte ranges (all of a small one)."""
    if nbytes <= 2 * AHEAD_SPAN:
        return [(0, nbytes)]
    mid = nbytes // 2
    return [(0, AHEAD_SPAN), (mid, mid + AHEAD_SPAN)]


def coarse_digest(pieces: list) -> bytes:
    """The coarse key's digest of ``pieces`` (uint8 arrays: every byte of each)."""
    return _offload.digest(pieces, 1 << 30)


class FunctionalCache:
    """Reference outputs by (model, input), least recently used first out, and the
    computation of the ones it does not hold.

    The CPU build is slow (about 1 s for MobileNetV2, 4 s for ResNet-18 on these
    machines, ~100 ms for SqueezeNet), so it never runs on the dispatcher's loop: a
    first-seen input is computed by ``effects`` (the device's runner: worker processes in
    the daemon, :mod:`~paella.dispatcher.devices.sim.effect_workers`), while the loop
    keeps serving everyone else, and an input the daemon has already answered is
    answered again from here. Bounded by ``max_bytes`` of cached inputs and outputs.

    One request's answer goes through three calls (:class:`Answer` carries it):
    :meth:`begin` when its input is in device memory (the first kernel after the input
    copies), :meth:`prepare` when its last kernel is launched (the device holds that
    kernel back while the answer is not ready), :meth:`finish` when that kernel completes.

    Speed (a trick, labelled): a lookup runs at a simulated kernel's completion, on the
    request's critical path, so it must cost far less than the GPU time it stands in
    for. A cryptographic digest of the whole input did not (blake2b over ResNet-18's
    602 KB: 0.70 ms, 60% of the 1.17 ms the model takes on the simulated T4). The key
    is a digest of a strided sample of ``KEY_SAMPLE_BYTES`` bytes (7 us) and the hit is
    confirmed by comparing the whole input with the one cached (memcmp speed, 20 us), so
    an answer is never another input's: inputs that share a sample are separate
    entries under one key, at most ``MAX_PER_KEY`` of them (the oldest goes first). A
    client that knows the sample could otherwise send inputs that differ only between
    sampled bytes and make every lookup under that key compare hundreds of inputs.
    """

    def __init__(self, max_bytes: int = 256 << 20, effects=None):
        from paella.dispatcher.devices.sim.effect_workers import InlineEffects
        self.max_bytes = max_bytes
        #: Where first-seen inputs are computed (``submit(fn, *args) -> Future``): in
        #: this thread unless the daemon gives its worker processes.
        self.effects = effects if effects is not None else InlineEffects()
        self.off_loop = not isinstance(self.effects, InlineEffects)
        # key -> [(inputs, outputs), ...] (one entry per distinct input sharing the key)
        self._entries: OrderedDict[tuple, list] = OrderedDict()
        # key -> [(inputs, future), ...]: new inputs computed ahead of their jobs (ahead)
        self._ahead: dict[tuple, list] = {}
        # coarse key (AHEAD_SAMPLE_BYTES) -> how many cached inputs have it (ahead)
        self._coarse: dict[tuple, int] = {}
        self._bytes = 0
        self.hits = self.misses = 0
        self._log = LogThrottle(10.0, burst=5)
        # The loop, the workers' completions and a background model load (the profiling
        # input's outputs) share the cache. The lock covers the dictionary only, never a
        # CPU run.
        self._lock = threading.Lock()

    @staticmethod
    def _key(name: str, inputs: dict[str, np.ndarray]) -> tuple:
        names = sorted(inputs)
        digest = _offload.digest([np.ascontiguousarray(inputs[k]) for k in names],
                                 KEY_SAMPLE_BYTES)
        return name, digest, tuple((k, inputs[k].dtype.str, inputs[k].shape) for k in names)

    @staticmethod
    def _coarse_key(name: str, inputs: dict[str, np.ndarray]) -> tuple:
        """:meth:`ahead`'s key of ``inputs`` (those cached): the name and the
        :func:`coarse_digest` of each input's :func:`coarse_spans`, by input name."""
        pieces = []
        for k in sorted(inputs):
            b = np.ascontiguousarray(inputs[k]).reshape(-1).view(np.uint8)
            pieces.extend(b[a:e] for a, e in coarse_spans(b.size))
        return name, coarse_digest(pieces)

    def _count(self, name: str, inputs: dict[str, np.ndarray], n: int) -> None:
        """The cached inputs per coarse key (:meth:`ahead`'s), under the lock."""
        ck = self._coarse_key(name, inputs)
        left = self._coarse.get(ck, 0) + n
        if left > 0:
            self._coarse[ck] = left
        else:
            self._coarse.pop(ck, None)

    @staticmethod
    def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
        return all(np.array_equal(_words(a[k]), _words(b[k])) for k in a)

    def begin(self, name: str, bundle, inputs: dict[str, np.ndarray], variant: int = 0,
              owner=None) -> "Answer":
        """Start on ``inputs`` (views of device memory that nothing changes until the
        request's outputs are copied back): an input under a key nothing is cached under
        is sent to be computed at once; otherwise its comparison with the cached inputs
        under its key starts on the comparison thread
        (:mod:`paella.dispatcher.devices.sim._offload`).

        Speed (a trick, labelled): the simulated device starts this when a request's
        input is in device memory and collects it when the model's last kernel is
        launched (:func:`~paella.dispatcher.devices.sim.functional.model_effects`), so
        the compare (100-150 us of memory traffic with cold caches) and any computation
        run elsewhere while the kernels run, off the dispatcher loop. ``owner``: whose
        share of the workers' queue a computation takes (as :meth:`ahead`'s)."""
        key = self._key(name, inputs)
        with self._lock:
            candidates = list(self._entries.get(key, ()))
        answer = Answer(key, candidates, None)
        if not candidates:
            self._compute(answer, bundle, variant, inputs, owner=owner)
            return answer
        names = sorted(inputs)
        try:
            answer.pending = _offload.compare([inputs[k] for k in names],
                                              [[c[k] for k in names] for c, _ in candidates])
        except (BufferError, ValueError, RuntimeError):
            pass                             # (not contiguous, or no thread: prepare() compares)
        return answer

    def prepare(self, name: str, bundle, inputs: dict[str, np.ndarray], variant: int = 0,
                answer: "Answer | None" = None, bound: bool = True,
                owner=None) -> "tuple[Answer, object | None]":
        """``inputs``' answer as far as it can be known now (the request's last kernel is
        being launched): a hit, or a computation under way. Returns the answer and the
        computation's future while it is not done (the device holds the kernel back
        until it is), else None. ``answer``: what :meth:`begin` started (None: it did
        not run; everything happens here). ``bound=False``: a computation goes past a
        full queue (:meth:`outputs`). ``owner``: as :meth:`ahead`'s."""
        if answer is None:
            answer = Answer(self._key(name, inputs), [], None)
        if answer.outputs is None and answer.future is None:
            outs = self._hit(answer, inputs)
            if outs is not None:
                answer.outputs = outs
            else:
                self._compute(answer, bundle, variant, inputs, bound, owner=owner)
        f = answer.future
        return answer, (f if f is not None and not f.done() else None)

    def finish(self, name: str, bundle, inputs: dict[str, np.ndarray], variant: int = 0,
               answer: "Answer | None" = None, bound: bool = True) -> dict[str, np.ndarray]:
        """The outputs, once the request's last kernel completed: the hit, or the
        computation's result (waited for if it is not in yet: in virtual time, where
        the device holds nothing back; the simulated clock does not move meanwhile),
        cached. Raises the computation's failure (the request's job fails with it)."""
        answer, _ = self.prepare(name, bundle, inputs, variant, answer, bound)
        if answer.outputs is not None:
            return answer.outputs
        outs = answer.future.result()        # (done already when the device held the kernel)
        self._log_compute(name, answer)
        self._insert(answer.key, answer.inputs, outs)
        answer.outputs = outs
        return outs

    def ahead(self, name: str, bundle, coarse: tuple,
              inputs: Callable[[], dict[str, np.ndarray]], variant: int = 0, owner=None):
        """Before a job takes any device resource (a buffer set, a stream, a kernel
        slot: ``Dispatcher._await_answer``): start computing ``inputs``' answer when
        nothing is cached under their key. ``coarse``: their coarse key, ``(name,
        coarse_digest(...))`` (:meth:`_coarse_key`); ``inputs()``: the inputs, made only
        when the coarse key is not cached. Returns the computation's future (the
        dispatcher keeps the job back until it is done; its outputs are cached by then,
        so the job's own lookup at its kernels hits), else None: a likely hit, or answers
        computed in this thread (virtual time), both left to the device's path. A job
        with the same new input as one being computed shares its future. ``owner``: whose
        share of the workers' queue the computation takes (``Dispatcher.owner_of``).

        ``inputs`` are the job's host inputs (views of its io), which its input copies
        will carry to the device. A client that rewrites them meanwhile only makes its
        own job's lookup miss at its kernels: that job is then held on the device as
        before (``SimDevice._hold``), and nobody else waits for it.

        Speed (a trick, labelled): this runs on the loop before every job of a compiled
        model, cached inputs included, where the kernels' own lookup follows anyway. So
        the likely hit is decided on a coarse key (``coarse``, which the caller reads
        straight from the job's io: two runs of ``AHEAD_SPAN`` bytes per input, see
        :func:`coarse_spans`; the cached inputs are counted per coarse key), and the full
        key is computed only for a new input. Measured in the daemon, the full key of a
        602 KB input cost about 20 us here (the client's pages, cold), and building the
        inputs' views, its property and call overheads a few more each (docs/service.md).
        An input made to share its coarse key with a cached one (equal on those bytes)
        passes as a likely hit: its job is then held on the device until its answer is
        in, as before this lookup existed."""
        if not self.off_loop or coarse in self._coarse:   # (a dict lookup: atomic under the GIL)
            return None
        inputs = inputs()
        key = self._key(name, inputs)
        with self._lock:
            if key in self._entries:
                return None
            for seen, future in self._ahead.get(key, ()):
                if self._same(inputs, seen):
                    return future
        answer = Answer(key, [], None)
        self._compute(answer, bundle, variant, inputs, owner=owner)
        future = answer.future
        if future.done() and future.exception() is not None:
            from concurrent.futures import Future

            from paella.dispatcher.devices.sim.effect_workers import (EffectQueueFull, Overloaded,
                                                                       overloaded_reason)
            if isinstance(future.exception(), EffectQueueFull):
                refused: Future = Future()   # (the client is told it as an overload)
                refused.set_exception(Overloaded(overloaded_reason(self.effects)))
                return refused
        with self._lock:
            self._ahead.setdefault(key, []).append((answer.inputs, future))

        def cache(f) -> None:                # (the workers' thread, or here if done)
            with self._lock:
                same = self._ahead.get(key, [])
                same[:] = [e for e in same if e[1] is not f]
                if not same:
                    self._ahead.pop(key, None)
            if not f.cancelled() and f.exception() is None:
                self._log_compute(name, answer)
                self._insert(key, answer.inputs, f.result())
        future.add_done_callback(cache)
        return future

    def use_effects(self, effects) -> None:
        """Compute new inputs with ``effects`` from now on (the daemon's workers)."""
        from paella.dispatcher.devices.sim.effect_workers import InlineEffects
        self.effects = effects
        #: Whether new inputs are computed elsewhere (worker processes), not in the
        #: calling thread (then :meth:`ahead` looks them up ahead of their jobs).
        self.off_loop = not isinstance(effects, InlineEffects)

    def outputs(self, name: str, bundle, inputs: dict[str, np.ndarray],
                variant: int = 0) -> dict[str, np.ndarray]:
        """``inputs``' outputs now (a lookup, else a computation waited for): for a
        model's warm-up off the loop, and tests. Never refused for a full queue: a
        reload must not fail because the clients keep the workers busy."""
        return self.finish(name, bundle, inputs, variant, bound=False)

    # -- the parts -------------------------------------------------------------------
    def _hit(self, answer: "Answer", inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
        # The inputs are views of device memory that only copies write: a hit compares
        # them with a cached input and answers that input's outputs (no copy: 600 KB
        # allocated per request cost 100-250 us in page faults). The comparison begin()
        # started decides if it ran (a candidate evicted since still holds an equal
        # input's outputs); without one, or without a match, the inputs cached under
        # the key since are compared here.
        if answer.pending is not None:
            i = answer.pending.result()
            answer.pending = None
            if i >= 0:
                with self._lock:
                    self.hits += 1
                    if answer.key in self._entries:
                        self._entries.move_to_end(answer.key)
                return answer.candidates[i][1]
        with self._lock:
            for cached, outs in self._entries.get(answer.key, ()):
                if self._same(inputs, cached):
                    self.hits += 1
                    self._entries.move_to_end(answer.key)
                    return outs
        return None

    def _compute(self, answer: "Answer", bundle, variant: int, inputs: dict[str, np.ndarray],
                 bound: bool = True, owner=None) -> None:
        # A private copy: what is computed and cached is exactly these bytes. (Views of
        # a client's arena could be rewritten at any moment; device memory cannot, but
        # the copy is what travels to the worker anyway.)
        with self._lock:
            self.misses += 1
        answer.inputs = {k: np.array(v) for k, v in inputs.items()}
        answer.t0 = time.perf_counter()
        from paella.dispatcher.devices.sim.effect_workers import InlineEffects, submit_or_fail
        target = bundle if isinstance(self.effects, InlineEffects) else BundleRef.of(bundle)
        answer.future = submit_or_fail(self.effects, bundle_outputs, target, variant,
                                       answer.inputs, bound=bound, owner=owner)

    def _log_compute(self, name: str, answer: "Answer") -> None:
        held = self._log.admit()             # (a client sending new inputs in a loop
        if held is not None:                 # wrote 3 MB of these in 10 s)
            log.info("model %s: computed reference outputs for a new input on the CPU in "
                     "%.0f ms, off the dispatcher loop (repeated inputs are answered from the "
                     "cache)%s", name, (time.perf_counter() - answer.t0) * 1e3,
                     f"; {held} more new inputs since the last line" if held else "")

    def _insert(self, key: tuple, inputs: dict[str, np.ndarray], outs: dict[str, np.ndarray]) -> None:
        size = _nbytes(inputs) + _nbytes(outs)
        with self._lock:
            same = self._entries.setdefault(key, [])
            if size <= self.max_bytes and not any(self._same(inputs, c) for c, _ in same):
                if len(same) >= MAX_PER_KEY:
                    i, o = same.pop(0)
                    self._bytes -= _nbytes(i) + _nbytes(o)
                    self._count(key[0], i, -1)
                same.append((inputs, outs))
                self._count(key[0], inputs, 1)
                self._bytes += size
                self._entries.move_to_end(key)
                while self._bytes > self.max_bytes:
                    gone, old = self._entries.popitem(last=False)
                    self._bytes -= sum(_nbytes(i) + _nbytes(o) for i, o in old)
                    for i, _ in old:
                        self._count(gone[0], i, -1)
            elif not same:
                del self._entries[key]


class Answer:
    """One request's answer under way: its key, the cached ``(inputs, outputs)`` its
    comparison runs against (``pending``: that comparison; None when nothing to compare
    or done), and once known the ``outputs`` (a hit) or the ``future`` computing them from
    ``inputs`` (a private copy). (A plain class: built once per request.)"""
    __slots__ = ("key", "candidates", "pending", "outputs", "future", "inputs", "t0")

    def __init__(self, key: tuple, candidates: list, pending: object | None):
        self.key, self.candidates, self.pending = key, candidates, pending
        self.outputs = self.future = self.inputs = None
        self.t0 = 0.0


class BundleRef:
    """A bundle as a worker process finds it: its folder and the manifest's stamp (a
    bundle replaced in place by a reload is a new one)."""
    __slots__ = ("path", "stamp")

    def __init__(self, path: str, stamp: tuple):
        self.path, self.stamp = path, stamp

    def __reduce__(self):
        return BundleRef, (self.path, self.stamp)

    @staticmethod
    def of(bundle) -> "BundleRef":
        path = str(bundle.path)
        try:
            st = os.stat(os.path.join(path, "manifest.json"))
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError:
            stamp = ()
        return BundleRef(path, stamp)


#: Bundles a worker process keeps loaded (their CPU builds), least recently used first out.
_LOADED: "OrderedDict[tuple, object]" = OrderedDict()
_MAX_LOADED = 8


def bundle_outputs(bundle, variant: int, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A bundle's outputs for ``inputs`` from its CPU build: the task the effect workers
    run (``bundle`` is a :class:`BundleRef` there, loaded once per worker; the bundle
    itself in process). ``PAELLA_SIM_EFFECT_FAULT`` injects a fault into worker
    processes only (tests), for inputs not all zeros (a model's warm-up stays healthy):
    ``delay:SECONDS``, ``crash`` (SIGSEGV) or ``hang``."""
    if isinstance(bundle, BundleRef):
        _inject_fault(inputs)
        key = (bundle.path, bundle.stamp)
        b = _LOADED.get(key)
        if b is None:
            from paella.bundle import load_bundle
            b = _LOADED[key] = load_bundle(bundle.path)
            while len(_LOADED) > _MAX_LOADED:
                _LOADED.popitem(last=False)
        _LOADED.move_to_end(key)
        bundle = b
    return {k: np.array(v) for k, v in _cpu_answer(bundle, variant)(inputs, variant).items()}


def _inject_fault(inputs: dict[str, np.ndarray]) -> None:
    fault = os.environ.get("PAELLA_SIM_EFFECT_FAULT", "")
    if not fault or not any(np.any(v) for v in inputs.values()):
        return
    import multiprocessing
    if multiprocessing.parent_process() is None:
        return                               # only ever in a worker process
    if fault.startswith("delay:"):
        time.sleep(float(fault[6:]))
    elif fault == "crash":
        import signal
        os.kill(os.getpid(), signal.SIGSEGV)
    elif fault == "hang":
        while True:
            time.sleep(3600)


def _cpu_answer(bundle, variant: int):
    """How the CPU computes ``variant``'s outputs: the CPU build of the model, or, for a
    stage of a sliced model (which has no CPU build of its own), its plan replayed on
    the CPU (``Bundle.run_stage_cpu``)."""
    variants = getattr(bundle, "variants", None)      # (None: a bundle-like test double)
    if variants is None or getattr(variants[variant], "stage", -1) < 0:
        return bundle.run_cpu
    return bundle.run_stage_cpu


def _words(a: np.ndarray) -> np.ndarray:
    """``a``'s bytes, as 8-byte words when they divide evenly (compared 1.7x faster)."""
    b = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    return b.view(np.uint64) if b.size % 8 == 0 else b


def _nbytes(arrays: dict[str, np.ndarray]) -> int:
    return sum(v.nbytes for v in arrays.values())


def functional_adaptor(bundle, name: str, cache: FunctionalCache | None = None,
                       variant: int = 0, early_lookup: bool = True,
                       answers_at_launch: bool = True):
    """Sim backend: the plan's timing on the simulated GPU, the CPU build's answers.

    The simulated kernels compute nothing, so the plan's last kernel carries the CPU
    build as its functional effect (:mod:`paella.dispatcher.devices.sim.functional`): when
    it completes, the simulated device reads the request's inputs from the device buffers
    the H2D copies filled, computes the outputs through ``cache`` and writes them into the
    output buffers, which the plan's D2H copies then bring back. The dispatcher replays
    the plan as on any backend (the path the benchmarks measure).
    """
    from paella.dispatcher.adaptor import BufferArg, plan_from_bundle
    from paella.dispatcher.devices.sim.functional import model_effects

    v = bundle.variants[variant]
    cache = cache or FunctionalCache()
    plan = plan_from_bundle(bundle, variant, name=f"{name}/{v.name}")
    launches = [op for op in plan.ops if op.kind == "launch"]
    if not launches:                         # (nothing to carry the reference outputs)
        raise ValueError(f"model {name!r}, variant {v.name!r}: its plan launches no kernel, "
                         f"so the simulator has none to compute its outputs; recompile it")
    key = f"{name}/{v.name}"
    # The cache's lookup starts at the first kernel after the input copies (a first-seen
    # input is sent to be computed then), the last kernel's launch waits for the answer
    # (the device holds it back meanwhile) and its effect writes it: see
    # FunctionalCache.begin.
    # Whose share of the workers' queue a computation started at a kernel takes, by the
    # request's input pointers (its buffer set's): told by the dispatcher as the job
    # takes the set (answer_owner below). One entry per buffer set, bounded.
    owners: dict[tuple, Any] = {}
    effect, start = model_effects(
        v.inputs, v.outputs, lambda x, who: cache.begin(key, bundle, x, variant, owner=who),
        lambda x, started: cache.finish(key, bundle, x, variant, started),
        len(launches[-1].args),
        prepare=(lambda x, started, who: cache.prepare(key, bundle, x, variant, started,
                                                       owner=who))
        if answers_at_launch else None, owner=owners.get)
    operands = [BufferArg(str(t.buffer), t.buffer_offset) for t in (*v.inputs, *v.outputs)]
    start_operands = operands[:len(v.inputs)]

    def answer_owner(bindings, owner) -> None:
        if not cache.off_loop or bindings is None:
            return                           # (virtual time: nothing queues for workers)
        ptrs = tuple(bindings.ptrs[a.buffer] + a.offset for a in start_operands)
        owners.pop(ptrs, None)
        if len(owners) >= MAX_OWNED_SETS:    # (sets freed and made again elsewhere)
            del owners[next(iter(owners))]
        owners[ptrs] = owner

    def host_inputs(io: np.ndarray) -> dict[str, np.ndarray]:
        return {t.name: io[t.offset:t.offset + t.nbytes].view(t.dtype).reshape(t.shape)
                for t in v.inputs}

    def warm() -> None:
        cache.outputs(key, bundle, host_inputs(np.zeros(plan.io_bytes, np.uint8)), variant)

    # The coarse key's byte ranges in the io, inputs by name (FunctionalCache._coarse_key).
    spans = [(t.offset + a, t.offset + e) for t in sorted(v.inputs, key=lambda t: t.name)
             for a, e in coarse_spans(t.nbytes)]

    def ahead(io: np.ndarray, owner=None):
        if not cache.off_loop or io.size < plan.io_bytes:
            return None                      # (virtual time, or another layout: the device's)
        return cache.ahead(key, bundle, (key, coarse_digest([io[a:e] for a, e in spans])),
                           lambda: host_inputs(io), variant, owner)

    return FunctionalBundleAdaptor(plan.with_effect(effect, operands, start if early_lookup else None,
                                                    start_operands), warm,
                                   ahead if answers_at_launch else None, answer_owner)


class FunctionalBundleAdaptor(PlanAdaptor):
    """The plan with the CPU build as its last kernel's effect (replayed like any plan).

    One class for every model, holding its model's parts in closures: a class made per
    model would be a reference cycle around the bundle (its weights, its CPU build),
    which only the cyclic collector frees, and the daemon freezes its heap after a
    reload (system.freeze_new_objects), so a retired version would never go."""

    def __init__(self, plan, warm: Callable[[], None], ahead: Callable[[np.ndarray], Any] | None = None,
                 owner: Callable[[Any, Any], None] | None = None):
        super().__init__(plan)
        self._warm = warm
        #: ``answer_ahead(io, owner) -> Future | None``: the dispatcher asks it before a job
        #: takes any device resource (``FunctionalCache.ahead``); None: never asked.
        self.answer_ahead = ahead
        #: ``answer_owner(bindings, owner)``: the dispatcher tells it whose job takes the
        #: buffer set ``bindings``, so that an answer computed at that job's kernels (what
        #: the lookup ahead did not cover: an input rewritten after its submission, or
        #: made equal to a cached one where the lookup reads) takes that owner's share of
        #: the workers' queue, as the lookup ahead's computations do.
        self.answer_owner = owner

    def warm(self) -> None:
        """Off the loop, before registration: load the CPU build and answer the
        profiling runs' input (zeros), so that registering costs the loop no CPU run."""
        self._warm()


def bundle_adaptor(bundle, name: str, device, cache: FunctionalCache | None = None,
                   variant: int = 0, early_lookup: bool = True, answers_at_launch: bool = True):
    """The adaptor serving ``bundle``'s ``variant`` on ``device``.

    Every backend gets the same plan with real device memory (params uploaded once,
    per-request buffer sets, bound kernel arguments: see ``paella.dispatcher.adaptor``),
    replayed by the dispatcher. On the simulator, whose kernels compute nothing, the
    plan's last kernel carries the CPU build's outputs as its effect
    (:func:`functional_adaptor`); on a real GPU the kernels compute them.
    ``early_lookup=False``: the cache's lookup all at the last kernel's launch, on the
    loop (the benchmark's before, ``bench_realtime --late-lookup``).
    ``answers_at_launch=False``: the answer is looked up, and a first-seen input computed
    (waited for, on the loop), at the last kernel's completion (the tests' comparison;
    the daemon asks at the launch whatever its release rule: the simulated device waits
    for the input to land, SimDevice._prepare_effect).
    """
    if device.backend == "sim":
        return functional_adaptor(bundle, name, cache, variant, early_lookup, answers_at_launch)
    from paella.dispatcher.adaptor import PlanAdaptor
    return PlanAdaptor.from_bundle(bundle, variant, name=f"{name}/{bundle.variants[variant].name}")
