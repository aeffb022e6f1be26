"""``SimDevice``: the device interface on the simulated GPU.

Virtual time (the default) is a deterministic discrete-event clock that the caller
steps (:meth:`SimDevice.run_until`, :meth:`SimDevice.step`, :meth:`SimDevice.run`);
tests and experiments use it. Real time (``realtime=True``) follows the wall clock and
advances whenever the dispatcher calls :meth:`poll`, or on any submission, so the
daemon can run against it with no thread or process of its own.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any, Callable, Sequence

import numpy as np

from paella import protocol
from paella.dispatcher.devices.base import (Callback, Device, DeviceError, DeviceLost, Dim3,
                                            Function, ModuleImage)
from paella.gpus import GpuSpec, preset
from paella.log_throttle import LogThrottle
from paella.occupancy import Footprint, wave_blocks

from .clock import EventLoop, RealTimeLoop
from .cost import CostModel, slice_cost
from .effect_workers import EffectFailed, EffectQueueFull, Evicted, InlineEffects, overloaded_reason
from .hardware import D2H, H2D, Shapes, SMView, build_engine
from .memory import SimMemory

log = logging.getLogger(__name__)


class Marker:
    """An event recorded on a stream: ``done`` once every earlier op of the stream has."""
    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = False

    def complete(self) -> None:
        self.done = True


def _nothing() -> None:
    pass


class SimDevice(Device):
    backend = "sim"

    def __init__(self, props: GpuSpec | str = "t4", *, n_streams: int | None = None,
                 notifq_slots: int = protocol.DEFAULT_NOTIFQ_SLOTS, seed: int = 0,
                 cost: CostModel | None = None, jitter: float = 0.0, realtime: bool = False,
                 speed: float = 1.0, lose_after: int | None = None):
        spec = preset(props) if isinstance(props, str) else props
        super().__init__(spec, n_streams or spec.hw_queues, notifq_slots)
        self.realtime = realtime
        self.cost = cost or CostModel()
        #: The C engine (``_engine.Gpu``): queues, SMs, timing, notifQ, statistics.
        self.gpu = build_engine(spec, self.cost, len(self.streams), self.notifq, seed, jitter)
        self._shapes = Shapes(self.gpu)
        self.loop: EventLoop = RealTimeLoop(self.gpu, speed) if realtime else EventLoop(self.gpu)
        self.memory = SimMemory(self.props.mem_bytes, self.props.name)
        # Fault injection: after this many launches the device is "lost", as a GPU is after
        # a sticky error, so the daemon's handling of that case can be tested.
        self.lose_after = lose_after
        self._launches = 0
        #: Ops submitted and not completed that touch device memory at their completion
        #: (copies landing then, kernels with a functional effect): see _memcpy_htod.
        self._pending_access = 0
        #: Launch records (the dispatcher's KernelLaunch) -> what the engine needs of them.
        self._prepared: dict[Any, tuple] = {}
        #: Where functional effects are computed (``submit(fn, *args) -> Future``): in the
        #: calling thread here; the daemon gives its worker processes
        #: (:mod:`.effect_workers`), so no client's answer is computed on its loop.
        self.effects: Any = InlineEffects()
        #: Gates (engine handles) whose answer is in, to open on the loop's thread; the
        #: workers' thread appends, then calls :attr:`effect_ready` (the daemon wakes its
        #: loop with it).
        self._answered: deque[int] = deque()
        self.effect_ready: Callable[[], None] = _nothing
        #: Gates (engine handles) ahead of a kernel launched behind unfinished work of its
        #: stream, whose answer is asked when they reach the stream's head (then its input
        #: has landed): handle -> (pending, args, launch id, step hold). See _prepare_effect.
        self._deferred: dict[int, tuple[Callable, tuple, int, bool]] = {}
        #: Gates that hold a kernel whose answer is being computed (not those ahead of a
        #: kernel that has not reached its stream's head: released ahead, an eager
        #: policy puts one in front of every kernel with an answer to ask, and those
        #: counted against the bound made the step plug-ins' holds, orca's iterations,
        #: fail as overloaded under fifo/ms-jbj: the fuzzer, session 29).
        self._holding = 0

    @property
    def resources(self) -> SMView:
        """Ground truth: the free resources of every SM (``paella.occupancy.SMResources``'s
        interface over the engine)."""
        return SMView(self.props, self.gpu, self._shapes)

    # -- clock ----------------------------------------------------------------------
    def now(self) -> float:
        return self.loop.wall() if self.realtime else self.loop.now

    def poll(self) -> None:
        if self.realtime:
            self.gpu.poll_wall(self.loop._t0, self.loop.speed)
            if self._deferred:
                self._ask_reached()

    def next_event_time(self) -> float:
        if self._answered:
            self.open_answered()
        return self.loop.peek()

    # -- answers computed elsewhere ---------------------------------------------------
    def _hold(self, stream: int, answer: Any) -> None:
        """Hold the kernel about to be launched on ``stream`` until ``answer`` (a future)
        is done: a gate in its stream ahead of it (``Gpu.gate``). Real time only: the
        kernel would otherwise complete, and its effect run, before its answer exists.
        The job waits alone: other streams run on; the dispatcher sees a released kernel
        that starts late, as if the GPU had been slow to issue it."""
        handle = self.gpu.gate(stream)
        answered = self._answered
        self._holding += 1

        def done(_f: Any) -> None:           # (in the workers' thread, or here if done)
            answered.append(handle)
            self.effect_ready()
        answer.add_done_callback(done)

    def open_answered(self) -> int:
        """Open the gates whose answers are in (the loop's thread); returns how many.
        The engine is brought to the wall clock first: the held kernel starts now."""
        answered = self._answered
        if not answered:
            return 0
        self.loop.sync()
        n = 0
        while answered:
            self.gpu.open(answered.popleft())
            self._holding -= 1
            n += 1
        return n

    def _wait_answers(self) -> None:
        """Block until a held kernel's answer is in (a synchronize: start-up, tools)."""
        import time
        while not self._answered:
            if self._deferred:
                self._ask_reached()
                if self.loop.peek() < float("inf"):
                    return                    # (a gate opened at once: its work runs)
            time.sleep(0.0005)
        self.open_answered()

    def close(self) -> None:
        """Stop the effect workers: an answer still being computed fails (its held kernel
        is let go, and its effect reports the failure); no worker outlives this."""
        self.effects.close()
        self.open_answered()
        for handle in list(self._deferred):  # (never asked: let their kernels go)
            self.gpu.open(handle)
        self._deferred.clear()

    def set_stream_priority(self, stream: int, priority: int) -> None:
        """Give ``stream`` a priority, as ``cudaStreamCreateWithPriority`` does (lower is
        more urgent; 0 the default): the block scheduler places the blocks of a more
        urgent stream's kernels first as resources free up, and never preempts running
        blocks (hardware.py). The mechanism Triton users are pointed to for priorities;
        ``paella experiment priority`` compares it with this project's."""
        self._check_stream(stream)
        self.gpu.set_priority(stream, priority)

    @property
    def gates(self) -> int:
        """Kernels held back for an answer still being computed (not the gates ahead of
        a kernel that has not reached its stream's head yet)."""
        return self._holding

    def run_until(self, t: float) -> bool:
        """Virtual time: fire the events due by ``t``; True if a host could observe any
        (a notification written, an op completed)."""
        return self.loop.run_until(t)

    def step(self) -> None:
        self.loop.step()

    def run_until_observed(self, t: float) -> bool:
        """Virtual time: fire events up to ``t`` but stop after the first one a host could
        observe (a notifQ entry, an op's completion); False, with the clock at ``t``
        (unless ``t`` is inf), if none happened by then. A driver that can only react to
        such things skips the events it could not see in one call."""
        return self.gpu.run_until_observed(t)

    def run(self) -> None:
        """Run until the device is idle (virtual time jumps; real time sleeps)."""
        if self.realtime:
            import time
            while self.loop.peek() != float("inf"):
                time.sleep(self.loop.seconds_until_next())
                self.loop.poll()
        else:
            self.loop.run()

    # -- kernels --------------------------------------------------------------------
    def _load_module(self, image: ModuleImage) -> dict[str, Function]:
        # A kernel's functional effect (ModuleImage.effects) is its handle here.
        return {k.name: Function(k, image.effects.get(k.name)) for k in image.kernels}

    def _unload_module(self, funcs: dict[str, Function]) -> None:
        # The launch records prepared for these kernels hold their effects (and through
        # them a model's CPU build): forgotten with the module.
        gone = {id(f) for f in funcs.values()}
        for k in [k for k in self._prepared if id(k.func) in gone]:
            del self._prepared[k]

    def _launch(self, func: Function, grid: Dim3, block: Dim3, fp: Footprint, dyn_smem: int,
                args: tuple, stream: int, launch_id: int, instrumented: bool, group: int,
                on_complete: Callback) -> None:
        info = func.info
        self._submit_kernel((self._shapes[fp], grid[0] * grid[1] * grid[2], info.flops,
                             info.bytes, info.duration, func.handle), args, stream, launch_id,
                            instrumented, group, on_complete)

    def launch_checked(self, k: Any, stream: int, launch_id: int, args: Sequence[Any] = (),
                       group: int = protocol.DEFAULT_GROUP, on_complete: Callback = None) -> None:
        # Speed (a trick, labelled): what the engine needs of a launch record (its shape id,
        # block count, work and functional effect) is looked up once per record, by
        # identity (KernelLaunch compares by identity), instead of hashing its Footprint
        # (a dataclass, hashed in Python) and multiplying its grid at every launch.
        p = self._prepared.get(k)
        if p is None:
            info = k.func.info
            flops, nbytes, duration = info.flops, info.bytes, info.duration
            if k.whole:                      # a slice: its share of the kernel
                flops, nbytes, duration = slice_cost(flops, nbytes, duration, k.blocks, k.whole,
                                                     wave_blocks(self.props, k.fp))
            p = self._prepared[k] = (self._shapes[k.fp], k.blocks, flops, nbytes, duration,
                                     k.func.handle)
        self._submit_kernel(p, args, stream, launch_id, True, group, on_complete)

    def _submit_kernel(self, p: tuple, args: Sequence[Any], stream: int, launch_id: int,
                       instrumented: bool, group: int, on_complete: Callback) -> None:
        shape, blocks, flops, nbytes, duration, effect = p
        self._launches += 1
        if self.lose_after is not None and self._launches > self.lose_after:
            raise DeviceLost(f"simulated sticky error after {self.lose_after} launches (fault "
                             f"injection, PAELLA_SIM_LOSE_DEVICE_AFTER)")
        self.loop.sync()
        if self.faults:                      # a stale entry of a reused id (Device.faults)
            self.faults.pop(launch_id, None)
        if effect is not None:               # its functional effect, when it completes
            args = tuple(args)
            pending = getattr(effect, "pending", None)
            if pending is not None:
                # (the functional model's work, into the self-log while logging)
                t0 = time.perf_counter() if self.gpu.logging else None
                self._prepare_effect(pending, args, stream, launch_id,
                                     getattr(effect, "step_hold", False))
                if t0 is not None:
                    self.gpu.log_work(t0)
            on_complete = _with_effect(effect, self.memory.view, args, on_complete, self,
                                       launch_id)
        self.gpu.launch(shape, blocks, flops, nbytes, duration, stream, launch_id, instrumented,
                        group, on_complete)
        if effect is not None:
            self._pending_access += 1        # (once submitted: its completion undoes it)

    def _prepare_effect(self, pending: Callable, args: tuple, stream: int, launch_id: int,
                        step: bool = False) -> None:
        """Ask the effect for its answer before its kernel goes in (functional.py): one
        still being computed holds the kernel in real time; in virtual time the effect
        waits for it at the kernel's completion, the simulated clock standing still. A
        failure is the kernel's fault (its job fails with the reason), as in
        :func:`_with_effect`.

        The inputs the answer reads must have landed: true when nothing earlier is left on
        the kernel's stream (its input copies are among that). A dispatcher that releases
        ahead (lookahead > 1, an eager policy) launches the kernel behind such work: then
        a gate goes in ahead of it, asking the engine to say when it reaches the stream's
        head, and the answer is asked then (:meth:`_ask_reached`), still off the loop."""
        if self.realtime and not self.gpu.stream_idle(stream):
            self._deferred[self.gpu.gate(stream, True)] = (pending, args, launch_id, step)
            return
        answer = self._ask(pending, args, launch_id)
        if answer is not None and self.realtime and not self._refuse_hold(launch_id, step):
            self._hold(stream, answer)

    def _refuse_hold(self, launch_id: int, step: bool = False) -> bool:
        """Too many kernels are held already (half the streams): this one is not held but
        fails its job as overloaded (its kernel runs; its effect is skipped). Why: a
        held kernel keeps its stream, and a client able to make inputs miss at their
        kernels (equal to a cached one where the lookup ahead reads, or rewritten after
        submitting) could otherwise hold every stream, and so everyone. The answer still
        goes on being computed, and is cached. True if refused.

        ``step``: the kernel is a scheduler plug-in's step (``step_hold`` on its effect:
        orca's iteration, a batch of cells), one batch of many clients' requests that
        the plug-in runs a few at a time: never refused, or a tenant's uncovered inputs
        filling the bound would fail every client the plug-in batches (the fuzzer,
        session 29)."""
        limit = max(1, len(self.streams) // 2)
        if step or self._holding < limit:
            return False
        self.faults[launch_id] = (f"overloaded: {self._holding} kernels on the simulated GPU "
                                  f"already wait for their answers (half its {len(self.streams)} "
                                  f"streams); retry later")
        return True

    def _ask(self, pending: Callable, args: tuple, launch_id: int) -> Any:
        """The effect's answer (a future still running, or None: ready), None after
        recording a failure as the kernel's fault."""
        try:
            return pending(self.memory.view, args)
        except Exception as e:  # noqa: BLE001 - any failure of the stand-in computation
            record_fault(self, launch_id, e)
            return None

    def _ask_reached(self) -> None:
        """The deferred answers whose gate reached its stream's head: ask them now (their
        inputs have landed); open the gate at once when the answer is ready, else when it
        comes in (as :meth:`_hold`)."""
        for handle in self.gpu.reached():
            entry = self._deferred.pop(handle, None)
            if entry is None:
                continue
            answer = self._ask(*entry[:3])
            if answer is None or self._refuse_hold(entry[2], entry[3]):
                self.gpu.open(handle)
                continue
            answered = self._answered
            self._holding += 1

            def done(_f: Any, handle: int = handle) -> None:   # (the workers' thread)
                answered.append(handle)
                self.effect_ready()
            answer.add_done_callback(done)

    # -- memory ---------------------------------------------------------------------
    def _alloc(self, nbytes: int) -> int:
        return self.memory.alloc(nbytes)

    def _free(self, ptr: int) -> None:
        self.memory.free(ptr)

    def _memcpy_htod(self, dst: int, src: np.ndarray, stream: int, on_complete: Callback) -> None:
        target = self.memory.view(dst, src.size)      # checks the range now, not at completion
        self.loop.sync()
        if self.realtime and not self._pending_access:
            # Speed (a trick, labelled): the bytes move just after the submission, while
            # the simulated copy keeps time. The host has nothing else to do while a
            # request's input crosses the simulated PCIe bus (its kernels wait for it), so
            # the memcpy (602 KB for an ImageNet image: 15 us warm, 60-100 us with cold
            # caches) overlaps the copy's own GPU time instead of preceding or following
            # it. Nobody can see the copy complete before this returns: the engine moves
            # only when this thread polls it. A DMA reads its source at some time during
            # the copy. Only while nothing in flight reads or writes device memory at its
            # completion (a D2H, a functional effect, an H2D landing late): in stream
            # order they all come before this copy, so none of them may see its bytes
            # early or overwrite them later. Otherwise, and in virtual time, they land at
            # the end.
            self.gpu.copy(H2D, stream, src.size, None, on_complete)
            target[:] = src
            return

        def land() -> None:
            self._pending_access -= 1
            target[:] = src
        self.gpu.copy(H2D, stream, src.size, land, on_complete)
        self._pending_access += 1

    def _memcpy_dtoh(self, dst: np.ndarray, src: int, stream: int, on_complete: Callback) -> None:
        source = self.memory.view(src, dst.size)
        self.loop.sync()

        def land() -> None:
            self._pending_access -= 1
            dst[:] = source
        self.gpu.copy(D2H, stream, dst.size, land, on_complete)
        self._pending_access += 1

    # -- ordering -------------------------------------------------------------------
    def _record_event(self, stream: int) -> Marker:
        self.loop.sync()
        m = Marker()
        self.gpu.marker(stream, m.complete)
        return m

    def _event_query(self, event: Any) -> bool:
        if not isinstance(event, Marker):
            raise TypeError(f"not an event of this device: {event!r}")
        return event.done

    def _stream_query(self, stream: int) -> bool:
        return self.gpu.stream_idle(stream)

    def _synchronize(self) -> None:
        """Wait for all submitted work: virtual time runs the loop until the streams
        drain; real time sleeps until they do."""
        loop = self.loop
        while self.gpu.busy():
            if loop.peek() == float("inf") and self.gpu.gates:
                self._wait_answers()          # (a kernel held for its answer)
                continue
            if loop.peek() == float("inf"):
                raise DeviceError("synchronize: work is pending but no event can complete it "
                                  "(simulator bug; please report)")
            if self.realtime:
                import time
                time.sleep(loop.seconds_until_next())
                loop.poll()
            else:
                loop.step()

    # -- statistics -----------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        g = self.gpu
        return {"now": g.now, "resident_blocks": g.resident, "placements": g.placements,
                "events": g.events, "notifications": g.tail, "mean_resident": g.mean_resident()}


#: At most this many functional-effect failures are logged with their traceback per
#: minute (a client sending inputs that make the reference computation fail, in a loop,
#: must not fill the log); the others are counted in the next logged line.
_FAULT_LOG = LogThrottle(60.0, burst=3)


def _with_effect(effect, view, args: tuple, then: Callback, device: SimDevice,
                 launch_id: int) -> Callable[[], None]:
    """The completion of a kernel with a functional effect: the effect on device memory,
    then the caller's callback. An effect that raises (the reference computation failed:
    a hostile input, the host out of memory or descriptors) is that kernel's fault, not
    the simulated device's: recorded in ``device.faults`` for the dispatcher, which fails
    the kernel's job with the reason. It must not unwind the engine's poll, which is the
    daemon's loop."""
    def done() -> None:
        device._pending_access -= 1
        if launch_id not in device.faults:   # (not already failed as it was launched)
            try:
                effect(view, args)
            except Exception as e:  # noqa: BLE001 - any failure of the stand-in computation
                record_fault(device, launch_id, e)
        if then is not None:
            then()
    return done


def record_fault(device: Device, launch_id: int, e: BaseException,
                 into: dict[int, str] | None = None) -> None:
    """Record why kernel ``launch_id``'s effect failed, in ``device.faults`` (or
    ``into``: the process simulator's ``late_faults``), logging it rate-limited."""
    # (A client sees the first 120 bytes: the workers' failures say it all themselves.)
    worker = isinstance(e, (EffectFailed, EffectQueueFull))
    effects = getattr(device, "effects", None)
    if isinstance(e, EffectQueueFull):       # a refusal: told as the overload it is, as
        reason = (str(e) if isinstance(e, Evicted) else overloaded_reason(effects)
                  if hasattr(effects, "queued") else f"overloaded: {e}")
    else:                                    # the lookup ahead's refusals are
        reason = (f"answer not computed: {str(e)[:300]}" if worker else
                  f"the simulated GPU could not compute this request's outputs "
                  f"({type(e).__name__}: {str(e)[:300]})")
    (device.faults if into is None else into)[launch_id] = reason
    held = _FAULT_LOG.admit()
    if held is not None:
        log.warning("kernel launch %d: %s%s", launch_id, reason,
                    f"; {held} more such failures since the last line" if held else "",
                    exc_info=not worker)
