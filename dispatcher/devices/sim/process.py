"""The real-time simulator in a process of its own (``SimProcessDevice``).

The stepped variant (``SimDevice(realtime=True)``) does the simulation work inside the
dispatcher's loop. This one moves it to a child process that *sleeps* until its next
event or the next command, so it never busy-polls a core that clients need:

* the notifQ lives in POSIX shared memory: the child's simulated kernels write it and
  the dispatcher polls it exactly as it would poll a real GPU's pinned ring;
* commands (launch, copy, event) go to the child over a pipe; the child answers with
  the tokens of completed operations, which the parent collects in :meth:`poll`;
* both processes read the same monotonic clock, so device time agrees;
* device memory and the functional callbacks stay in the parent: the child only keeps
  time, so bytes never cross the pipe. A kernel whose answer is still being computed
  when the child reports it done is held in the parent with what reads its output,
  never waited for (:meth:`SimProcessDevice._arrived`).

The child exits when the parent closes the pipe, so a dead dispatcher leaves no
simulator behind.
"""
from __future__ import annotations

import logging
import mmap
import os
import socket
import subprocess
import sys
import time
from bisect import bisect_left, insort
from collections import deque
from functools import partial
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import posix_ipc

from paella import protocol
from paella.dispatcher.devices.base import (Callback, Device, DeviceError, Dim3,
                                            Function, KernelInfo, ModuleImage)
from paella.gpus import GpuSpec, preset
from paella.occupancy import Footprint
from paella.segments import segment_name

from .cost import CostModel
from .device import record_fault
from .hardware import D2H, H2D
from .memory import SimMemory

log = logging.getLogger(__name__)

_LOAD, _LAUNCH, _COPY, _MARK, _STOP = range(5)


def _nothing() -> None:
    """No loop to wake (a device used outside the daemon)."""


class _Pending:
    """A parent-side record of an op the child runs: what to do when it completes.
    ``spans``: the device bytes its completion reads or writes, ``(start, end)`` pairs
    (a copy's, a kernel's effect's operands); ``ask``: a kernel's effect's ``pending``
    hook, bound to the launch's arguments (None: no effect, or one with no hook)."""
    __slots__ = ("stream", "action", "on_complete", "done", "spans", "ask", "token")

    def __init__(self, stream: int, action, on_complete, spans: tuple = (), ask=None,
                 token: int = 0):
        self.stream, self.action, self.on_complete, self.done = stream, action, on_complete, False
        self.spans, self.ask, self.token = spans, ask, token


class _Held:
    """A kernel whose completion waits for its answer (``head``), and the completions
    that touch the bytes its effect writes, waiting behind it in arrival order."""
    __slots__ = ("spans", "queue")

    def __init__(self, head: _Pending):
        self.spans = head.spans
        self.queue: deque[_Pending] = deque([head])


def _overlaps(a: tuple, b: tuple) -> bool:
    return any(s < f and t < e for s, e in a for t, f in b)


def _effect_action(effect, device: "SimProcessDevice", args: tuple, launch_id: int):
    """A kernel's functional effect, applied when the child reports the kernel done. A
    failure (the answer's worker crashed or hung, the answer was evicted from a full
    queue, the computation raised) is that kernel's job's alone, as in the stepped
    simulator; but the dispatcher may have read the kernel's notifications already, so
    it goes in ``late_faults``, which the dispatcher takes before anything else this
    device reports (nothing reading the kernel's output lands before: it completes in a
    later report, or later in this one), and fails that job with the reason. (It was a
    sticky error once, as a faulting kernel is on a GPU: the daemon then answered every
    request in flight and exited, so one tenant's bad input restarted everyone's.)"""
    view = device.memory.view

    def action() -> None:
        try:
            effect(view, args)
        except Exception as e:  # noqa: BLE001 - any failure of the stand-in computation
            record_fault(device, launch_id, e, into=device.late_faults)
    return action


class SimProcessDevice(Device):
    backend = "sim"
    late_effects = True                      # applied as the child's completions arrive

    def __init__(self, props: GpuSpec | str = "t4", *, n_streams: int | None = None,
                 notifq_slots: int = protocol.DEFAULT_NOTIFQ_SLOTS, seed: int = 0,
                 cost: CostModel | None = None, jitter: float = 0.0, speed: float = 1.0):
        spec = preset(props) if isinstance(props, str) else props
        # Named after this process (paella.segments): a daemon restarted after a
        # SIGKILL recognises and removes the notifQ its predecessor left behind.
        self._shm_name = segment_name("notifq")
        self._shm = posix_ipc.SharedMemory(self._shm_name, posix_ipc.O_CREX, mode=0o600,
                                           size=8 * notifq_slots)
        self._map = mmap.mmap(self._shm.fd, self._shm.size)
        self._shm.close_fd()
        super().__init__(spec, n_streams or spec.hw_queues, notifq_slots)
        self.speed = speed
        self.cost = cost or CostModel()
        self.memory = SimMemory(self.props.mem_bytes, self.props.name)
        self._t0 = time.perf_counter()
        self._pending: dict[int, _Pending] = {}
        self._per_stream = [0] * len(self.streams)
        #: Per stream, kernels launched with an answer to ask and not applied yet: each
        #: may be held for its answer when the child reports it done. The kernel cores
        #: read it as the stepped simulator's gates (an int32 array, read in place), so
        #: that where jobs share streams (fifo, ms-jbj) a new job goes to a stream with
        #: none, or waits for one, and never completes behind another client's answer.
        self.stream_gates = np.zeros(len(self.streams), np.int32)
        #: The bytes those kernels' effects will write: ``(start, end, token)``, sorted
        #: (:meth:`writes_pending`).
        self._writes: list[tuple[int, int, int]] = []
        #: The kernels whose answer is still being computed, each with the completions
        #: held behind it; and those whose answer came in (the workers' thread appends).
        self._held: list[_Held] = []
        self._answered: deque[_Held] = deque()
        #: Per stream with completions held (behind a held kernel), the held kernel its
        #: latest waits behind: what comes next on that stream waits there too.
        self._behind: dict[int, _Held] = {}
        #: Called (from the workers' thread) when a held kernel's answer is in: the
        #: daemon wakes its loop, whose housekeeping calls :meth:`open_answered`.
        self.effect_ready = _nothing
        self._token = 0
        # A fresh interpreter (not fork): the child inherits none of the daemon's sockets.
        mine, theirs = socket.socketpair()
        self._proc = subprocess.Popen(
            [sys.executable, "-c", f"import sys; from {__name__} import child_main; "
             f"child_main(int(sys.argv[1]))", str(theirs.fileno())], pass_fds=[theirs.fileno()])
        theirs.close()
        self._conn = Connection(mine.detach())
        self._conn.send((self._shm_name, spec, len(self.streams), notifq_slots, seed, self.cost,
                         jitter, speed, self._t0))

    def _alloc_notifq(self, slots: int) -> np.ndarray:
        return np.frombuffer(self._map, dtype=np.uint64, count=slots)

    def keep_off_core(self, core: int) -> None:
        """Keep the child off ``core`` (the daemon's loop runs there, pinned and under
        SCHED_FIFO) when there is another core for it. Why: a process of normal
        priority that finds its core taken by a real-time task waits for the load
        balancer to move it, milliseconds to tens of them, and every client waits for
        the child's completions meanwhile (echo p99 of 5-56 ms beside fresh inputs on 2
        cores, session 28)."""
        pid = self._proc.pid
        try:
            others = os.sched_getaffinity(pid) - {core}
            if others:
                os.sched_setaffinity(pid, others)
        except OSError as e:                 # (gone, or not permitted: it runs anywhere)
            log.info("the simulator process stays on every core: %s", e)

    # -- clock ----------------------------------------------------------------------
    def now(self) -> float:
        return (time.perf_counter() - self._t0) * self.speed

    def poll(self) -> None:
        """Collect completions the child has reported (non-blocking)."""
        if self._answered:
            self.open_answered()
        conn = self._conn
        try:
            while conn.poll():
                for token in conn.recv():
                    self._arrived(self._pending.pop(token))
        except (EOFError, ConnectionResetError):
            raise DeviceError(f"the simulator process exited (code {self._proc.poll()}); "
                              f"see its error above, then restart the daemon") from None

    def _arrived(self, p: _Pending) -> None:
        """A completion the child reported: applied now; or held behind a kernel whose
        answer is still being computed, when it touches the bytes that kernel's effect
        writes (the job's output copy, on whatever stream the core gave it); or held
        itself when it is such a kernel (what the lookup ahead did not cover: an input
        rewritten after its submission, or equal to a cached one where the lookup
        reads). Why: applying it means writing the answer, and waiting for it here
        stopped the loop, and every other client with it, for the whole computation.
        Held, the job waits alone: its output copy cannot land, so it cannot finish,
        while every other completion is applied and the child keeps time. What
        follows a held copy on its stream waits behind it too (stream order: the event
        the core records after the copy says it landed), so that stream stays busy in
        the core's eyes and is not given to another job meanwhile. (The dispatcher has
        seen the kernel done in the notifQ already: on a GPU too a kernel's completion
        says nothing to the host until a copy reads its output.)"""
        if self._held:
            h = self._behind.get(p.stream)
            if h is None and p.spans:        # (few held: kernels waiting for answers)
                h = next((x for x in self._held if _overlaps(p.spans, x.spans)), None)
            if h is not None:
                h.queue.append(p)
                self._behind[p.stream] = h
                return
        if p.ask is not None and self._hold_for_answer(p):
            return
        self._finish(p)

    def _hold_for_answer(self, p: _Pending) -> bool:
        """Ask ``p``'s effect for its answer (its inputs have landed: what the kernel
        waited for completed before it in the child, which reports completions in
        order, and their copies are applied here first); True if it is still being
        computed: ``p`` is then held until it is in. A failure to ask is left to the
        effect itself (``late_faults``). (The held kernels are not bounded here
        as the stepped simulator bounds its gates: each holds only its own job's
        completions, no stream.)"""
        try:
            future = p.ask()
        except Exception:  # noqa: BLE001 - applying the effect reports it (_effect_action)
            return False
        if future is None or future.done():
            return False
        h = _Held(p)
        self._held.append(h)
        answered = self._answered

        def done(_f: Any) -> None:           # (the workers' thread)
            answered.append(h)
            self.effect_ready()
        future.add_done_callback(done)
        return True

    def open_answered(self) -> int:
        """Apply the held kernels whose answer came in (the loop's thread), then what
        waited behind each, in arrival order (some may wait on another held kernel);
        returns how many kernels were let go."""
        n = 0
        while self._answered:
            h = self._answered.popleft()
            self._held.remove(h)
            n += 1
            queue = h.queue
            head = queue.popleft()
            for stream in {q.stream for q in queue}:     # (re-held below if they must)
                if self._behind.get(stream) is h:
                    other = next((x for x in self._held
                                  if any(q.stream == stream for q in list(x.queue)[1:])), None)
                    if other is None:
                        del self._behind[stream]
                    else:
                        self._behind[stream] = other
            self._finish(head)               # (its answer is in: the effect writes it)
            while queue:
                self._arrived(queue.popleft())
        return n

    def writes_pending(self, pointers) -> bool:
        """Whether a kernel's effect not applied yet (in the child still, or held for its
        answer) will write into any of the allocations at ``pointers`` (a finished
        job's buffers; a pointer that is no allocation's start counts as one byte). The
        dispatcher sees a kernel done in the notifQ before its completion is applied
        here, so a job cancelled meanwhile (its output copy never released) finishes
        before its answer is written; the dispatcher keeps its buffer set from the next
        job until this is False. (The spans of those effects, sorted by start: a lookup
        per allocation. An effect may write at an offset inside a buffer.)"""
        w = self._writes
        if not w:
            return False
        sizes = self._sizes
        for p in pointers:
            end = p + sizes.get(p, 1)
            i = bisect_left(w, (end,))       # the spans starting before the allocation ends
            if i and w[i - 1][1] > p:
                return True
        return False

    @property
    def quiet(self) -> bool:
        """Nothing can complete until the loop sends something or an answer comes in:
        no op is in the child (the daemon's loop may then sleep; the answer workers and
        clients wake it)."""
        return not self._pending

    @property
    def gates(self) -> int:
        """Kernels whose completion is held until their answer is in (``paella status``'s
        held kernels, as the stepped simulator's gates)."""
        return len(self._held)

    def stream_gated(self, stream: int) -> bool:
        """A kernel that may be held for its answer is in ``stream`` (``stream_gates``)."""
        return bool(self.stream_gates[stream])

    def _finish(self, p: _Pending) -> None:
        p.done = True
        self._per_stream[p.stream] -= 1
        if p.ask is not None:
            self.stream_gates[p.stream] -= 1
            w = self._writes
            for a, e in p.spans:
                del w[bisect_left(w, (a, e, p.token))]
        if p.action is not None:
            p.action()
        if p.on_complete is not None:
            p.on_complete()

    def _send(self, msg: tuple, stream: int, action=None, on_complete: Callback = None,
              spans: tuple = (), ask=None) -> _Pending:
        if self._proc.poll() is not None:
            raise DeviceError(f"the simulator process exited (code {self._proc.returncode}); "
                              f"see its error above, then restart the daemon")
        self._token += 1
        p = self._pending[self._token] = _Pending(stream, action, on_complete, spans, ask,
                                                  self._token)
        self._per_stream[stream] += 1
        self._conn.send(msg + (self._token,))
        return p

    # -- kernels --------------------------------------------------------------------
    def _load_module(self, image: ModuleImage) -> dict[str, Function]:
        self._conn.send((_LOAD, list(image.kernels)))
        # A kernel's functional effect (ModuleImage.effects) is its handle, applied here
        # in the parent, where device memory lives.
        return {k.name: Function(k, image.effects.get(k.name)) for k in image.kernels}

    def _launch(self, func: Function, grid: Dim3, block: Dim3, fp: Footprint, dyn_smem: int,
                args: tuple, stream: int, launch_id: int, instrumented: bool, group: int,
                on_complete: Callback) -> None:
        effect = func.handle
        action = None if effect is None else _effect_action(effect, self, args, launch_id)
        hook, writes = getattr(effect, "pending", None), getattr(effect, "writes", None)
        ask = None if hook is None else partial(hook, self.memory.view, tuple(args))
        spans = () if writes is None else tuple((p, p + n) for p, n in writes(tuple(args)))
        p = self._send((_LAUNCH, func.name, grid, block, stream, launch_id, dyn_smem, instrumented,
                        group), stream, action, on_complete, spans, ask)
        if ask is not None:
            self.stream_gates[stream] += 1
            for a, e in p.spans:
                insort(self._writes, (a, e, p.token))

    # -- memory (kept here: the child only keeps time) -------------------------------------
    def _alloc(self, nbytes: int) -> int:
        return self.memory.alloc(nbytes)

    def _free(self, ptr: int) -> None:
        self.memory.free(ptr)

    def _memcpy_htod(self, dst: int, src: np.ndarray, stream: int, on_complete: Callback) -> None:
        target = self.memory.view(dst, src.size)
        self._send((_COPY, H2D, stream, src.size), stream,
                   lambda: target.__setitem__(slice(None), src), on_complete,
                   ((dst, dst + src.size),))

    def _memcpy_dtoh(self, dst: np.ndarray, src: int, stream: int, on_complete: Callback) -> None:
        source = self.memory.view(src, dst.size)
        self._send((_COPY, D2H, stream, dst.size), stream,
                   lambda: dst.__setitem__(slice(None), source), on_complete,
                   ((src, src + dst.size),))

    # -- ordering -------------------------------------------------------------------
    def _record_event(self, stream: int) -> _Pending:
        return self._send((_MARK, stream), stream)

    def _event_query(self, event: Any) -> bool:
        if not isinstance(event, _Pending):
            raise TypeError(f"not an event of this device: {event!r}")
        return event.done

    def _stream_query(self, stream: int) -> bool:
        return self._per_stream[stream] == 0

    def _synchronize(self) -> None:
        while self._pending or self._held:
            if not self._pending:            # (only answers to wait for)
                time.sleep(0.0005)
                self.poll()
                continue
            if not self._conn.poll(5.0):
                raise DeviceError("synchronize: the simulator process answered nothing for 5 s")
            self.poll()

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self._conn.send((_STOP,))
                self._proc.wait(timeout=5)
            except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
                self._proc.kill()         # unresponsive or already gone: make sure it ends
                self._proc.wait()
        self._conn.close()
        try:
            posix_ipc.unlink_shared_memory(self._shm_name)
        except posix_ipc.ExistentialError:
            pass                          # already unlinked by an earlier close()
        # The mapping itself goes when the last numpy view of the notifQ does.

    def __del__(self) -> None:
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.poll() is None:
            self.close()


def child_main(fd: int) -> None:
    """The simulator process: sleep until the next event or command, then catch up."""
    from .device import SimDevice

    conn = Connection(fd)
    shm_name, spec, n_streams, slots, seed, cost, jitter, speed, t0 = conn.recv()

    shm = posix_ipc.SharedMemory(shm_name)
    buf = mmap.mmap(shm.fd, shm.size)
    shm.close_fd()

    class _SharedRingSim(SimDevice):
        def _alloc_notifq(self, n: int) -> np.ndarray:
            return np.frombuffer(buf, dtype=np.uint64, count=n)

    dev = _SharedRingSim(spec, n_streams=n_streams, notifq_slots=slots, seed=seed, cost=cost,
                         jitter=jitter, realtime=True, speed=speed)
    dev.loop._t0 = t0                    # the parent's clock origin: device time agrees
    funcs: dict[str, Function] = {}
    done: deque[int] = deque()
    loop = dev.loop
    try:
        while True:
            wait = loop.seconds_until_next()
            if conn.poll(None if wait == float("inf") else wait):
                msg = conn.recv()
                op = msg[0]
                if op == _STOP:
                    return
                if op == _LOAD:
                    funcs.update(dev.load_module(ModuleImage("m", msg[1])))
                    continue
                token = msg[-1]
                cb = (lambda t=token: done.append(t))
                if op == _LAUNCH:
                    _, name, grid, block, stream, lid, dyn, instr, group, _ = msg
                    dev.launch(funcs[name], grid, block, stream, lid, dyn_smem=dyn,
                               instrumented=instr, group=group, on_complete=cb)
                elif op == _COPY:
                    _, kind, stream, nbytes, _ = msg
                    loop.sync()
                    dev.gpu.copy(kind, stream, nbytes, None, cb)
                elif op == _MARK:
                    loop.sync()
                    dev.gpu.marker(msg[1], cb)
            loop.poll()
            if done:
                conn.send(list(done))
                done.clear()
    except (EOFError, BrokenPipeError):
        return                            # the parent is gone: so is its simulator


__all__ = ["SimProcessDevice", "KernelInfo"]
