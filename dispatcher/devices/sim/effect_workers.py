"""Where the simulated GPU's answers are computed: worker processes, off the loop.

The simulator's kernels compute nothing; a served model's outputs come from a reference
computation on the CPU (a bundle's CPU build, a GPT iteration in numpy), 100 ms to
seconds for an input never seen before. Run in the dispatcher's single-threaded loop,
that stalls every other client for as long. :class:`EffectWorkers` runs it in worker
processes instead, so one client's never-seen input cannot stall the others: the loop
only submits a task and is told when its answer is in.

Guarantees of :class:`EffectWorkers`:

* every submitted future completes exactly once: with the task's result, with
  :class:`EffectFailed` (the task raised; its worker died or ran past the deadline; its
  task or result could not be sent), or with :class:`EffectFailed` at :meth:`close`. The
  only exception is a future its caller cancelled before a worker took it: it is skipped;
* a failure is the failing task's alone: a crashed or hung worker is replaced and the
  tasks queued behind it run on;
* memory is bounded: :meth:`~EffectWorkers.submit` refuses (:class:`EffectQueueFull`)
  beyond ``max_queue`` waiting tasks;
* the queue is shared fairly by the tasks' owners (:class:`~.fair_queue.FairQueue`): a
  full queue refuses, or evicts the newest task of, the owner holding the most, and
  workers take the owners' tasks in turn, so one tenant's flood of new inputs neither
  refuses nor delays another's beyond a task;
* no worker outlives the pool: :meth:`~EffectWorkers.close` ends them, and a worker also
  ends when its parent dies (``PR_SET_PDEATHSIG``, as :mod:`paella.parent_death`) or
  closes its pipe.

:class:`InlineEffects` has the same interface and computes in the calling thread: virtual
time (experiments), tests, and anywhere a process per answer is not wanted.
"""
from __future__ import annotations

import atexit
import ctypes
import logging
import math
import multiprocessing
import multiprocessing.util  # before the atexit.register below: see _close_all_at_exit
import os
import pickle
import signal
import threading
import time
import weakref
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Hashable, Mapping

from paella.log_throttle import LogThrottle

from .fair_queue import FairQueue

log = logging.getLogger("paella.effects")

#: How long an error message from a worker may be (a task's exception can quote a whole
#: input).
MAX_MESSAGE = 2000
#: Workers that exit before they are ready, in a row, beyond which the queued tasks fail
#: rather than wait for a pool that cannot start (a broken install, a full disk).
MAX_STARTUP_FAILURES = 3
#: The longest pause between attempts to start a worker that keeps exiting at start.
MAX_BACKOFF = 30.0

_PR_SET_PDEATHSIG = 1            # <linux/prctl.h>; as paella.parent_death
#: The workers' niceness: an answer is batch work, while the round trips of every
#: client depend on the processes it competes with for a core (the clients, the
#: simulator's own process under ``--sim-mode process``). At 10, CFS gives a worker
#: about a tenth of a core it shares with a busy process of niceness 0, and the
#: worker runs at full speed on a core nobody else wants.
WORKER_NICE = 10


#: The pools started and not closed yet, closed at interpreter exit (see below).
_LIVE: "weakref.WeakSet[EffectWorkers]" = weakref.WeakSet()


def _close_all_at_exit() -> None:
    """Close every pool still open when the interpreter exits.

    Why: multiprocessing's own exit hook SIGTERMs its daemonic children and then joins
    them, and the workers ignore SIGTERM (a service manager may signal the whole group
    while the daemon drains), so a pool its owner forgot to close would hang the exit
    forever. atexit runs hooks last-registered first, and multiprocessing.util
    registered its hook when imported above, so this one runs before it."""
    for pool in list(_LIVE):
        try:
            pool.close(timeout=1.0)
        except Exception:                               # noqa: BLE001 - exiting anyway
            log.exception("closing effect workers at exit")


atexit.register(_close_all_at_exit)


class EffectFailed(RuntimeError):
    """A task did not produce its result: it raised, its worker died or ran past the
    deadline, or the pool was closed. The message says which."""


class EffectQueueFull(RuntimeError):
    """:meth:`EffectWorkers.submit` refused a task: ``max_queue`` tasks are waiting."""


class Evicted(EffectQueueFull):
    """A waiting task taken out of a full queue to make room for another owner's (its
    owner held the most waiting tasks): a refusal, told the client as an overload."""

    refusal = True


class Overloaded(RuntimeError):
    """A request refused because the answer workers' queue is full; its text is what
    the client is told (:func:`overloaded_reason`), and ``refusal`` says so to the
    dispatcher, which fails the job with it as is."""

    refusal = True


def overloaded_reason(effects: Any) -> str:
    """What a client refused for a full queue is told. (Short: a client sees the first
    120 bytes of a reason.)"""
    return (f"overloaded: {effects.queued} answers wait for the CPU workers; retry later "
            f"(or raise [daemon] effect_queue)")


def default_workers() -> int:
    """How many worker processes a daemon starts when not told: one core fewer than the
    machine has, because the dispatcher's loop owns one (pinned, under SCHED_FIFO, it
    would otherwise compete with a worker for it), and at most 4: each worker holds its
    own copy of the models' CPU builds, and a burst of new inputs beyond 4 at once is
    better queued than paid for in memory. At least 1."""
    return max(1, min(4, (os.cpu_count() or 2) - 1))


def submit_or_fail(effects: Any, fn: Callable[..., Any], *args: Any, bound: bool = True,
                   owner: Hashable = None) -> Future:
    """``effects.submit(fn, *args)``, or a future already failed with the pool's reason
    when it refuses (its queue is full, or it stopped): the request that wanted the
    answer fails with that reason through the same path as any other failure.
    ``bound=False``: past a full queue (a model's warm-up). ``owner``: whose share of
    the queue it takes (:class:`~.fair_queue.FairQueue`)."""
    try:
        return effects.submit(fn, *args, bound=bound, owner=owner)
    except RuntimeError as e:
        f: Future = Future()
        # Without its traceback: it would keep this call's frames alive, and through
        # them (f_back) the caller's, whose locals are views of the client's memory;
        # as a reference cycle, only the cyclic collector frees them, which an idle
        # daemon may not run for minutes: a refused client's segment stayed mapped
        # after it left (the fuzzer's leak check, session 29).
        f.set_exception(_bare(e))
        return f


def _bare(e: BaseException) -> BaseException:
    """``e`` and the exceptions chained to it, without their tracebacks (what a stored
    failure keeps alive: see :func:`submit_or_fail`)."""
    seen = set()
    x: BaseException | None = e
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        x.__traceback__ = None
        if x.__cause__ is not None:
            _bare(x.__cause__)
        x = x.__context__
    return e


# -- the worker process ---------------------------------------------------------------------
def _end_with_parent(parent_pid: int) -> None:
    """Die (SIGKILL) when the thread that started this process exits: a crashed daemon
    leaves no worker behind. The technique of :func:`paella.parent_death.end_with_parent`,
    applied here from the worker's own main (a spawned process has no ``preexec_fn``).
    Linux only; elsewhere the pipe's EOF still ends the worker."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:   # the parent died before the prctl: too late for it
        os._exit(1)


def _describe(e: BaseException) -> str:
    msg = str(e)
    text = f"{type(e).__name__}: {msg}" if msg else type(e).__name__
    return text if len(text) <= MAX_MESSAGE else text[:MAX_MESSAGE] + "..."


def _worker_main(conn: Connection, env: dict[str, str], parent_pid: int) -> None:
    """A worker: receive ``(fn, args)``, answer ``("ok", fn(*args))`` or ``("err",
    "TypeName: message")``, one task at a time, until the pipe closes. The first message
    is ``("ready", pid)``: the manager gives tasks only to a worker that has started."""
    os.environ.update(env)
    # The parent handles the signals. SIGTERM too: a service manager stops the daemon by
    # signalling its whole cgroup, and the daemon's drain still needs the answers under
    # way (the pool ends its workers itself: pipe closed, and SIGKILL on its thread's exit).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _end_with_parent(parent_pid)
    try:
        os.nice(WORKER_NICE)
    except OSError:                                  # (not permitted: run as is)
        pass
    conn.send(("ready", os.getpid()))
    while True:
        try:
            reply = _run(conn.recv_bytes())
        except (EOFError, OSError):
            return                                   # the parent closed the pipe, or died
        try:
            conn.send(reply)
        except (EOFError, OSError):
            return
        except Exception as e:  # noqa: BLE001 - the result could not be pickled
            conn.send(("err", f"the result could not be sent back ({_describe(e)})"))
        del reply                                    # (not held while idle)


def _run(data: bytes) -> tuple[str, Any]:
    try:
        fn, args = pickle.loads(data)
        return "ok", fn(*args)
    except BaseException as e:  # noqa: BLE001 - the task's failure, whatever it is (SystemExit too)
        return "err", _describe(e)


# -- the parent's side ----------------------------------------------------------------------
@dataclass(eq=False)
class _Task:
    fn: Callable[..., Any]
    args: tuple
    future: Future
    owner: Hashable = None


@dataclass(eq=False)
class _Worker:
    proc: BaseProcess
    conn: Connection
    pid: int
    ready: bool = False
    task: _Task | None = None
    since: float = 0.0                  # monotonic: when it took its task


@dataclass
class _Counters:
    completed: int = 0
    failed: int = 0
    crashed: int = 0
    timed_out: int = 0
    restarts: int = 0
    evicted: int = 0


def _settle(future: Future, *, value: Any = None, error: BaseException | None = None) -> None:
    """Complete ``future`` (running: a worker took it) unless it already is (a race with
    :meth:`EffectWorkers.close`): exactly once, whoever comes first."""
    try:
        if error is None:
            future.set_result(value)
        else:
            future.set_exception(error)
    except InvalidStateError:
        pass


def _fail_unstarted(future: Future, error: BaseException) -> None:
    """Fail a future no worker finished, unless its caller cancelled it while it waited
    (then it is skipped: its callbacks ran at the cancel) or it is complete already."""
    try:
        if future.running() or future.set_running_or_notify_cancel():
            future.set_exception(error)
    except (RuntimeError, InvalidStateError):
        pass


def _death(code: int | None) -> str:
    """How a worker ended (its exit code), in words."""
    if code is None:
        return "ended"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = str(-code)
        hint = " (the OOM killer?)" if -code == signal.SIGKILL else ""
        return f"died of signal {name}{hint}"
    return f"exited with status {code}"


class EffectWorkers:
    """A pool of ``n`` worker processes computing picklable tasks, one at a time each.

    ``submit(fn, *args)`` returns a :class:`concurrent.futures.Future`; ``fn`` must be a
    module-level function (pickled by reference, imported in the worker) and ``args``
    picklable. Tasks wait in a queue of at most ``max_queue`` and go to idle workers in
    order. A task running longer than ``deadline`` seconds is killed with its worker.

    **Threads.** A manager thread (daemon) dispatches the tasks and collects the
    answers; the futures' done-callbacks run in that thread, so a callback must be quick
    and thread-safe (the daemon's wakes its loop). The workers are started by that
    thread too: ``PR_SET_PDEATHSIG`` fires when the *thread* that started a process
    exits, and this one lives until :meth:`close`.

    **Processes.** Started by the manager thread (which :meth:`start` starts) once the
    first task is submitted, not before: a daemon that never computes an answer (echo,
    host models) never pays for a Python process importing its models' code. They use the
    "spawn" context: the daemon has threads, and forking a threaded process is unsafe.
    A worker imports this package and the task's module, sets ``env`` in its
    ``os.environ`` first thing in its main (so a library read later sees it: TVM's
    thread pool, OpenMP loaded by a task's import; numpy is imported before and does not
    see it), ignores SIGINT, and ends with its parent.
    """

    def __init__(self, n: int, *, deadline: float = 120.0, max_queue: int = 64,
                 name: str = "paella-effects", env: Mapping[str, str] | None = None):
        if type(n) is not int or n < 1:
            raise ValueError(f"EffectWorkers needs n >= 1 worker processes (an int), got {n!r}")
        if (isinstance(deadline, bool) or not isinstance(deadline, (int, float))
                or not math.isfinite(deadline) or deadline <= 0):
            raise ValueError(f"EffectWorkers' deadline must be a finite number of seconds > 0, "
                             f"got {deadline!r}")
        if type(max_queue) is not int or max_queue < 1:
            raise ValueError(f"EffectWorkers' max_queue must be an int >= 1, got {max_queue!r}")
        if not isinstance(name, str) or not name:
            raise ValueError(f"EffectWorkers' name must be a non-empty str, got {name!r}")
        env = dict(env or {})
        bad = [k for k, v in env.items() if not isinstance(k, str) or not isinstance(v, str)
               or not k or "=" in k or "\0" in k or "\0" in v]
        if bad:
            raise ValueError(f"EffectWorkers' env must map variable names to str values; "
                             f"not usable: {bad!r}")
        self.n, self.deadline, self.max_queue, self.name, self.env = n, float(deadline), max_queue, name, env
        self._ctx = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()
        self._queue: FairQueue[_Task] = FairQueue(max_queue)
        self._workers: list[_Worker] = []        # the manager thread's; read under the lock
        self._count = _Counters()
        self._spawned = 0
        self._wanted = False                     # a task was submitted: keep n workers
        self._startup_failures = 0
        self._next_spawn = 0.0                   # monotonic: no start attempt before
        self._closed = False
        self._broken: str | None = None          # why the manager thread ended early
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._deaths = LogThrottle(10.0, burst=5)

    # -- the interface ------------------------------------------------------------------
    def start(self) -> None:
        """Start the manager thread, which starts the workers (without waiting for
        them). Idempotent; :meth:`submit` calls it."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the effect workers are closed")
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._manage, name=f"{self.name}-manager",
                                            daemon=True)
            self._thread.start()
            _LIVE.add(self)

    def warm(self) -> None:
        """Start the workers now rather than at the first task (a daemon that will
        compute answers: its first client does not wait for a worker's start)."""
        self.start()
        with self._lock:
            self._wanted = True
            self._wake()

    def submit(self, fn: Callable[..., Any], *args: Any, bound: bool = True,
               owner: Hashable = None) -> Future:
        """Queue ``fn(*args)`` for a worker, as ``owner``'s (the tenant whose share of the
        queue it takes: :class:`~.fair_queue.FairQueue`); the future completes with its
        value or with :class:`EffectFailed`. When ``max_queue`` tasks are waiting, the
        newest task of an owner holding more (see :meth:`FairQueue.victim`) is evicted
        (its future fails with :class:`Evicted`), else this raises
        :class:`EffectQueueFull`; ``bound=False`` goes past a full queue (a model's
        warm-up at a reload, which the clients' new inputs must not make fail).
        RuntimeError after :meth:`close`."""
        if self._thread is None:
            self.start()
        future: Future = Future()
        evicted = None
        with self._lock:
            if self._closed:
                raise RuntimeError("the effect workers are closed (the daemon is stopping)")
            if self._broken is not None:
                raise RuntimeError(self._broken)
            queue = self._queue
            if bound and queue.full():
                self._drop_cancelled()
            if bound and queue.full():
                victim = queue.victim(owner)
                if victim is None:
                    raise EffectQueueFull(
                        f"{len(queue)} tasks are already waiting for the {self.n} effect "
                        f"worker(s), the most allowed (max_queue; the daemon's [daemon] "
                        f"effect_queue setting raises it, effect_workers adds workers)")
                evicted = queue.evict_newest(victim)
                self._count.evicted += 1
            queue.push(owner, _Task(fn, args, future, owner))
            self._wanted = True
            self._wake()
        if evicted is not None:
            _fail_unstarted(evicted.future, Evicted(overloaded_reason(self)))
        return future

    def refuses(self, owner: Hashable = None) -> bool:
        """A bounded :meth:`submit` of ``owner``'s would raise :class:`EffectQueueFull`
        now (the queue is full and ``owner`` holds the largest share)."""
        with self._lock:
            return self._queue.refuses(owner)

    @property
    def queued(self) -> int:
        """Tasks waiting for a worker (a cancelled one until it is skipped)."""
        return len(self._queue)

    @property
    def running(self) -> int:
        """Tasks a worker holds."""
        return self._queue.busy

    def stats(self) -> dict[str, int]:
        """The counters, consistent with each other; callable from any thread.
        ``failed`` counts every failure but those at :meth:`close` (raised, crashed,
        timed out, not sendable); ``crashed`` and ``timed_out`` are among them;
        ``restarts`` counts the workers started beyond the first ``n``; ``evicted`` the
        waiting tasks taken out for another owner's (not among ``failed``)."""
        with self._lock:
            c = self._count
            return {"workers": self.n, "alive": len(self._workers), "queued": len(self._queue),
                    "running": self._queue.busy, "completed": c.completed, "failed": c.failed,
                    "crashed": c.crashed, "timed_out": c.timed_out, "restarts": c.restarts,
                    "evicted": c.evicted}

    def close(self, timeout: float = 5.0) -> None:
        """Fail every waiting and running task (:class:`EffectFailed`, "the daemon is
        stopping"), stop the manager thread, end the workers (SIGTERM, SIGKILL after
        ``timeout`` seconds) and reap them. Idempotent; no worker outlives it."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._wake()
        _LIVE.discard(self)
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():         # blocked on a worker's pipe: ending them frees it
                for w in list(self._workers):
                    w.proc.kill()
                thread.join(timeout)
        with self._lock:
            tasks = [w.task for w in self._workers if w.task is not None] + self._queue.clear()
            workers, self._workers = self._workers, []
        stopping = "the effect workers were closed before computing this: the daemon is stopping"
        for t in tasks:
            _fail_unstarted(t.future, EffectFailed(stopping))
        self._end(workers, timeout)
        if thread is None or not thread.is_alive():  # (else it may still select on them)
            with self._lock:
                os.close(self._wake_r)
                os.close(self._wake_w)
                self._wake_r = self._wake_w = -1

    def __enter__(self) -> "EffectWorkers":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the manager thread -------------------------------------------------------------
    def _manage(self) -> None:
        """The manager thread. A done-callback may close the pool (it runs here): every
        step checks."""
        try:
            while not self._closed and self._broken is None:
                self._spawn_missing()
                self._dispatch()
                ready = wait(self._waitables(), self._timeout())
                if self._closed:
                    break
                self._serve(ready)
                if self._closed:
                    break
                self._enforce_deadlines()
        except BaseException as e:  # noqa: BLE001 - a bug here must not hang the futures
            if not self._closed:
                log.exception("the effect workers' manager thread failed; the pool is closed")
                self._fail_all(f"the effect workers' manager failed ({_describe(e)})")

    def _waitables(self) -> list:
        objs: list = [self._wake_r]
        for w in self._workers:
            objs += (w.conn, w.proc.sentinel)
        return objs

    def _timeout(self) -> float | None:
        now = time.monotonic()
        ends = [w.since + self.deadline for w in self._workers if w.task is not None]
        if len(self._workers) < self.n:
            ends.append(self._next_spawn)
        return max(0.0, min(ends) - now) if ends else None

    def _serve(self, ready: list) -> None:
        ready_set = set(ready)
        if self._wake_r in ready_set:
            self._drain_wake()
        for w in list(self._workers):
            if self._closed:
                return
            dead = w.proc.sentinel in ready_set
            if w.conn in ready_set or dead:
                dead = not self._receive(w) or dead
            if dead and not self._closed:
                self._reap(w)

    def _receive(self, w: _Worker) -> bool:
        """Read what ``w`` sent (all of it, if it died after sending). False: the pipe is
        closed, the worker is gone."""
        try:
            while not self._closed and w.conn.poll(0):
                data = w.conn.recv_bytes()
                try:
                    msg = pickle.loads(data)
                except Exception as e:  # noqa: BLE001 - e.g. a class the parent cannot import
                    msg = ("err", f"the result could not be read back ({_describe(e)})")
                self._handle(w, msg)
        except (EOFError, OSError):
            return False
        return True

    def _handle(self, w: _Worker, msg: tuple) -> None:
        kind, payload = msg
        if kind == "ready":
            w.ready = True
            with self._lock:
                self._startup_failures = 0
            return
        task, w.task = w.task, None
        if task is None:
            return
        with self._lock:
            self._queue.ended(task.owner)
            if kind == "ok":
                self._count.completed += 1
            else:
                self._count.failed += 1
        if kind == "ok":
            _settle(task.future, value=payload)
        else:
            _settle(task.future, error=EffectFailed(payload))

    def _reap(self, w: _Worker) -> None:
        """``w`` is gone: fail its task with how it ended, and start another."""
        how = self._stop(w, kill=False)
        task = w.task
        with self._lock:
            self._workers.remove(w)
            if task is not None:
                self._queue.ended(task.owner)
                self._count.failed += 1
                self._count.crashed += 1
        if task is not None:
            self._log_death(f"effect worker (pid {w.pid}) {how} while computing "
                            f"{getattr(task.fn, '__qualname__', task.fn)}; starting another")
            _settle(task.future, error=EffectFailed(
                f"effect worker {w.pid} {how} while computing this"))
        elif not w.ready:
            self._startup_failed(how)
        else:
            self._log_death(f"idle effect worker (pid {w.pid}) {how}; starting another")

    def _startup_failed(self, how: str) -> None:
        """A worker ended before it was ready: wait longer before each new attempt and,
        after a few in a row, fail the waiting tasks rather than hold them indefinitely."""
        with self._lock:
            self._startup_failures += 1
            k = self._startup_failures
            self._next_spawn = time.monotonic() + min(MAX_BACKOFF, 0.25 * 2 ** (k - 1))
            serving = any(w.ready for w in self._workers)
            doomed = self._queue.clear() if k >= MAX_STARTUP_FAILURES and not serving else []
            self._count.failed += len(doomed)
        self._log_death(f"an effect worker {how} as it started ({k} in a row); trying again")
        err = EffectFailed(f"the effect workers cannot start: {k} in a row {how} before "
                           f"they were ready (see the daemon's log)")
        for t in doomed:
            _fail_unstarted(t.future, err)

    def _enforce_deadlines(self) -> None:
        now = time.monotonic()
        for w in list(self._workers):
            if self._closed:
                return
            if w.task is None or now - w.since < self.deadline:
                continue
            task, w.task = w.task, None
            self._stop(w, kill=True)
            with self._lock:
                self._workers.remove(w)
                self._queue.ended(task.owner)
                self._count.failed += 1
                self._count.timed_out += 1
            self._log_death(f"effect worker (pid {w.pid}) killed: "
                            f"{getattr(task.fn, '__qualname__', task.fn)} ran past the deadline "
                            f"of {self.deadline:g} s; starting another")
            # (Short: a client sees the first 120 bytes of a reason.)
            _settle(task.future, error=EffectFailed(
                f"ran past the deadline ({self.deadline:g} s, [daemon] "
                f"effect_deadline_seconds); effect worker {w.pid} killed"))

    def _dispatch(self) -> None:
        """Give waiting tasks to idle, ready workers."""
        for w in self._workers:
            if not w.ready or w.task is not None:
                continue
            task = self._next_task()
            if task is None:
                return
            try:
                data = ForkingPickler.dumps((task.fn, task.args))
            except Exception as e:  # noqa: BLE001 - whatever pickling raises
                self._unsendable(task, e)
                continue
            w.task, w.since = task, time.monotonic()
            try:
                w.conn.send_bytes(data)
            except OSError:
                pass                  # it died: its sentinel says so, and _reap fails the task

    def _next_task(self) -> _Task | None:
        """The oldest waiting task its caller has not cancelled (now marked running, so
        it can no longer be)."""
        while True:
            with self._lock:
                got = self._queue.pop()
                if got is None:
                    return None
                task = got[1]
            if task.future.set_running_or_notify_cancel():
                return task
            with self._lock:
                self._queue.ended(task.owner)

    def _unsendable(self, task: _Task, e: Exception) -> None:
        with self._lock:
            self._count.failed += 1
            self._queue.ended(task.owner)
        _settle(task.future, error=EffectFailed(
            f"the task could not be sent to an effect worker ({_describe(e)})"))

    def _spawn_missing(self) -> None:
        if (not self._wanted or len(self._workers) >= self.n
                or time.monotonic() < self._next_spawn):
            return
        while len(self._workers) < self.n and not self._closed:
            parent_end, child_end = self._ctx.Pipe(duplex=True)
            proc = self._ctx.Process(target=_worker_main, args=(child_end, self.env, os.getpid()),
                                     name=f"{self.name}-{self._spawned}", daemon=True)
            try:
                proc.start()
            except Exception as e:  # noqa: BLE001 - no process (EAGAIN, EMFILE, ENOMEM...)
                parent_end.close()
                self._startup_failed(f"could not be started ({_describe(e)})")
                return
            finally:
                child_end.close()
            with self._lock:
                self._workers.append(_Worker(proc, parent_end, proc.pid))
                if self._spawned >= self.n:
                    self._count.restarts += 1
                self._spawned += 1

    # -- helpers --------------------------------------------------------------------------
    def _stop(self, w: _Worker, *, kill: bool, timeout: float = 1.0) -> str:
        """End ``w`` (SIGKILL if ``kill``), reap it, release its pipe and process
        handles (a restart per crash must not leak descriptors); how it ended, in words."""
        if kill:
            w.proc.kill()
        w.proc.join(timeout)
        if w.proc.exitcode is None:
            w.proc.kill()
            w.proc.join()
        how = _death(w.proc.exitcode)
        w.conn.close()
        w.proc.close()
        return how

    def _end(self, workers: list[_Worker], timeout: float) -> None:
        for w in workers:
            if w.proc.exitcode is None:
                w.proc.terminate()
            w.conn.close()
        end = time.monotonic() + timeout
        for w in workers:
            w.proc.join(max(0.0, end - time.monotonic()))
            if w.proc.exitcode is None:
                w.proc.kill()
                w.proc.join()
            w.proc.close()

    def _fail_all(self, why: str) -> None:
        """The manager thread is ending on a bug: fail what it held and refuse more
        (:meth:`close` still ends the workers)."""
        with self._lock:
            self._broken = why
            tasks = [w.task for w in self._workers if w.task is not None] + self._queue.clear()
        for t in tasks:
            _fail_unstarted(t.future, EffectFailed(why))

    def _drop_cancelled(self) -> None:
        """(Under the lock.) Forget waiting tasks whose callers cancelled them."""
        self._queue.remove_if(lambda t: t.future.cancelled())

    def _wake(self) -> None:
        """(Under the lock, so that close cannot have closed the descriptor.)"""
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass                      # a wake-up is pending already, or closed

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _log_death(self, text: str) -> None:
        held = self._deaths.admit()
        if held is not None:
            log.warning("%s%s", text, f" ({held} more such events since the last line)" if held else "")


class OwnedEffects:
    """A pool's interface whose every task is ``owner``'s: what a step scheduler is
    given (``SchedulerContext.effects``). Its iterations serve all its clients at once,
    so the scheduler is one owner of the workers' queue, apart from the tenants' new
    inputs: a tenant's flood can neither evict nor refuse the iterations of everyone's
    generations beyond the scheduler's own share."""

    def __init__(self, effects: "EffectWorkers", owner: Hashable):
        self._effects, self.owner = effects, owner

    def submit(self, fn: Callable[..., Any], *args: Any, bound: bool = True,
               owner: Hashable = None) -> Future:
        """The pool's :meth:`EffectWorkers.submit`, as this view's owner."""
        return self._effects.submit(fn, *args, bound=bound, owner=self.owner)

    def refuses(self, owner: Hashable = None) -> bool:
        return self._effects.refuses(self.owner)

    def __getattr__(self, name: str) -> Any:          # queued, stats, max_queue, ...
        return getattr(self._effects, name)


class InlineEffects:
    """:class:`EffectWorkers`' interface, computing ``fn(*args)`` in the calling thread at
    :meth:`submit`: the future it returns is already complete (its done-callbacks run at
    once, in the caller's thread). For virtual time, where the simulated clock does not
    see the CPU's time anyway, and for tests. It bounds nothing (``max_queue`` is None)."""

    max_queue: int | None = None

    def __init__(self) -> None:
        self._closed = False
        self._completed = self._failed = 0

    def start(self) -> None:
        """Nothing to start."""

    def submit(self, fn: Callable[..., Any], *args: Any, bound: bool = True,
               owner: Hashable = None) -> Future:
        if self._closed:
            raise RuntimeError("the effects are closed (the daemon is stopping)")
        future: Future = Future()
        future.set_running_or_notify_cancel()
        try:
            value = fn(*args)
        except Exception as e:  # noqa: BLE001 - the task's failure, whatever it is
            self._failed += 1
            err = EffectFailed(_describe(e))
            err.__cause__ = _bare(e)                    # (frames: see submit_or_fail)
            future.set_exception(err)
        else:
            self._completed += 1
            future.set_result(value)
        return future

    def refuses(self, owner: Hashable = None) -> bool:
        """Never: nothing waits."""
        return False

    @property
    def queued(self) -> int:
        return 0

    @property
    def running(self) -> int:
        return 0

    def stats(self) -> dict[str, int]:
        return {"workers": 0, "alive": 0, "queued": 0, "running": 0,
                "completed": self._completed, "failed": self._failed, "crashed": 0,
                "timed_out": 0, "restarts": 0, "evicted": 0}

    def close(self, timeout: float = 5.0) -> None:
        self._closed = True


__all__ = ["EffectWorkers", "InlineEffects", "OwnedEffects", "EffectFailed", "EffectQueueFull", "Evicted",
           "default_workers"]
