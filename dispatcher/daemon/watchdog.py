"""The loop's watchdog: a plug-in call that never returns is interrupted, not waited on.

The dispatcher loop is one thread, and it calls third-party code (policies, batchers and
schedulers installed as plug-ins) once per kernel or request. A hook that loops forever
would hang the daemon for every client, and SIGTERM too (its handler only sets a flag the
loop reads between iterations). So a thread samples every thread's stack each fraction
of ``timeout``; when the same call into plug-in code (the same outermost plug-in frame)
has run for ``timeout`` seconds, it is interrupted with :class:`PluginTimeout`, an
``Exception``, which reaches the call site's usual error path: a policy falls back to
the default one, a batcher to the identity batcher, a plug-in's ``__init__`` fails
start-up (or, in a SIGHUP reload's thread, that model's load) with the message.

**The loop thread** is interrupted by a signal: its handler runs between two bytecodes
and raises there, but only when the code it stopped is the plug-in's own (the innermost
frame is plug-in code) and the call it was sent for is still on the stack. Anywhere
else (the plug-in calling ``logging``, or back into the daemon) an exception could leave
a lock held or a record half-updated, so the handler traces the innermost plug-in frame
instead and raises at its next line. A call stuck in C is interrupted when it returns to Python. The
interruptions counted are those delivered, not the signals sent.

A plug-in that swallows the exception and goes on is interrupted again after another
``timeout``; after :data:`STRIKES` of them it gets :class:`PluginHung`, a
``BaseException`` its ``except Exception`` cannot keep, and the daemon stops (every
accepted request is answered, exit status 4, and the service manager restarts it).
**Last resort:** a call still running :data:`STRIKES` + 2 timeouts after it began (it
catches ``BaseException`` too, or is stuck in C) ends the process from the watchdog's
thread (``last_resort``: the socket and lock files removed, exit status 4); its
clients see the daemon gone.

**Other threads** (a SIGHUP reload's, which builds batchers): no signal reaches them, so
they get the exception asynchronously (``PyThreadState_SetAsyncExc``), again only while
their innermost frame is plug-in code, once per ``timeout``; their errors fail that
model's load only, so there is no escalation.

What counts as plug-in code: modules of the packages that entry points loaded classes
from (:data:`paella.plugins.PLUGIN_PACKAGES`). The daemon's own slow work (a first CPU
reference run, a model load) is never interrupted. Cost: one wake-up of this thread per
sampling period (at most 1 s) to walk the stacks under the GIL; nothing on the hot path.
"""
from __future__ import annotations

import ctypes
import logging
import signal
import sys
import threading
import time
from dataclasses import dataclass
from types import FrameType
from typing import Callable

from paella.plugins import PLUGIN_PACKAGES

log = logging.getLogger(__name__)

#: The signal the watchdog sends the loop thread (unused by the daemon otherwise).
SIGNAL = signal.SIGUSR2
#: Interruptions a plug-in call may swallow before it gets :class:`PluginHung`.
STRIKES = 2


class PluginTimeout(Exception):
    """Raised inside a plug-in call that ran longer than ``plugin_timeout_seconds``."""


class PluginHung(BaseException):
    """A plug-in call swallowed :data:`STRIKES` timeouts and still runs: the daemon stops.
    (A ``BaseException``, so that the plug-in's ``except Exception`` cannot hold it.)"""


def in_plugin(module: str) -> bool:
    """Is ``module`` (a frame's ``__name__``) code of an installed plug-in?"""
    for pkg in PLUGIN_PACKAGES:
        if module == pkg or module.startswith(pkg + "."):
            return True
    return False


def _is_plugin(frame: FrameType | None) -> bool:
    return frame is not None and in_plugin(frame.f_globals.get("__name__", ""))


def plugin_entry(frame: FrameType | None) -> FrameType | None:
    """The outermost frame of plug-in code on the stack ending at ``frame``: the call the
    daemon made into the plug-in (None if there is none)."""
    entry = None
    while frame is not None:
        if _is_plugin(frame):
            entry = frame
        frame = frame.f_back
    return entry


def describe(entry: FrameType) -> str:
    code = entry.f_code
    return (f"the plug-in call {entry.f_globals.get('__name__', '?')}.{code.co_qualname} "
            f"({code.co_filename}:{entry.f_lineno})")


@dataclass(eq=False)
class _Call:
    """One thread's current call into plug-in code, as the sampler follows it."""
    entry: FrameType                         # (held: a live reference, so never reused)
    began: float
    since: float                             # began, or the last interruption delivered
    strikes: int = 0                         # interruptions delivered


class Watchdog:
    """Watches every thread of the process; signals go to the thread that creates it
    (the loop: signal handlers run in the main thread, so it must be the main thread).
    ``start`` installs the handler and starts the sampling thread; ``stop`` ends both.
    ``timeout`` 0 disables it. ``last_resort(message)`` must end the process."""

    def __init__(self, timeout: float, last_resort: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.timeout = timeout
        self.clock = clock
        self.last_resort = last_resort
        self.interrupted = 0                 # PluginTimeouts delivered (status, tests)
        self._loop = threading.get_ident()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._calls: dict[int, _Call] = {}   # thread ident -> its call into a plug-in
        # The loop's call the next signal is for; set by the sampler, cleared by the
        # handler when it raises (one reference swap each: atomic under the GIL).
        self._pending: _Call | None = None
        self._armed: FrameType | None = None  # the plug-in frame traced for its next line
        self._prev_trace = None
        self._old_handler = None

    def start(self) -> None:
        if self.timeout <= 0 or self._thread is not None:
            return
        self._old_handler = signal.signal(SIGNAL, self._on_signal)
        self._thread = threading.Thread(target=self._watch, name="paella-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        self._pending = None
        self._disarm()
        self._calls.clear()
        signal.signal(SIGNAL, self._old_handler or signal.SIG_DFL)

    # -- the sampling thread ---------------------------------------------------------
    def _watch(self) -> None:
        period = min(1.0, self.timeout / 4)
        me = threading.get_ident()
        while not self._stop.wait(period):
            frames = sys._current_frames()
            now = self.clock()
            for ident in list(self._calls):
                if ident not in frames:
                    del self._calls[ident]   # the thread ended
            for ident, frame in frames.items():
                if ident != me:
                    self._sample(ident, frame, now)
            del frames

    def _sample(self, ident: int, frame: FrameType, now: float) -> None:
        entry = plugin_entry(frame)
        call = self._calls.get(ident)
        if entry is None:
            self._calls.pop(ident, None)
            return
        if call is None or call.entry is not entry:
            self._calls[ident] = _Call(entry, now, now)
            return
        if now - call.since < self.timeout:
            return
        if ident != self._loop:
            if _is_plugin(frame):            # (no escalation: see the module docstring)
                call.since = now
                log.error("%s has run for %.1f s without returning (an endless loop?) in "
                          "thread %s: interrupting it", describe(entry), now - call.began,
                          _thread_name(ident))
                _raise_in_thread(ident, PluginTimeout)
            return
        if now - call.began >= (STRIKES + 2) * self.timeout and self.last_resort is not None:
            self.last_resort(f"{describe(entry)} has run for {now - call.began:.1f} s and "
                             f"could not be interrupted")
            return
        self._pending = call                 # (again each period until the handler raises)
        signal.pthread_kill(self._loop, SIGNAL)

    # -- the loop thread -------------------------------------------------------------
    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        call = self._pending
        if call is None:
            return
        f = frame
        while f is not None and f is not call.entry:
            f = f.f_back
        if f is None:
            self._pending = None             # the call returned meanwhile: nothing to stop
            return
        if not _is_plugin(frame):            # not at a plug-in line: at its next one
            self._arm(frame)
            return
        self._deliver(call)

    def _arm(self, frame: FrameType | None) -> None:
        """The plug-in called out (into logging, into the daemon): trace the innermost
        plug-in frame (the way ``pdb.set_trace`` does) so that the timeout is raised at
        its next line, once the call it made has returned. Tracing costs the loop only
        until then: new frames are not traced."""
        if self._armed is not None:
            return
        while frame is not None and not _is_plugin(frame):
            frame = frame.f_back
        if frame is None:
            return
        self._armed = frame
        self._prev_trace = sys.gettrace()
        frame.f_trace_lines = True
        frame.f_trace = self._at_plugin_line
        sys.settrace(_no_new_frames)         # (tracing must be on for f_trace to fire)

    def _disarm(self) -> None:
        if self._armed is not None:
            self._armed.f_trace = None
            self._armed = None
            sys.settrace(self._prev_trace)

    def _at_plugin_line(self, frame: FrameType, event: str, arg: object):
        self._disarm()
        call = self._pending
        if event == "line" and call is not None:
            self._deliver(call)              # raises, at this line of the plug-in
        return None                          # ("return": left the frame; next signal)

    def _deliver(self, call: _Call) -> None:
        self._disarm()
        self._pending = None
        now = self.clock()
        ran = now - call.began
        call.strikes += 1
        call.since = now
        what = describe(call.entry)
        if call.strikes > STRIKES:
            raise PluginHung(f"{what} kept running after {STRIKES} interruptions")
        self.interrupted += 1
        log.error("%s has run for %.1f s without returning (an endless loop?): interrupting it",
                  what, ran)
        raise PluginTimeout(f"{what} ran for more than {self.timeout:g} s without returning "
                            f"(plugin_timeout_seconds); interrupted")


def _no_new_frames(frame: FrameType, event: str, arg: object) -> None:
    return None


def _thread_name(ident: int) -> str:
    for t in threading.enumerate():
        if t.ident == ident:
            return t.name
    return str(ident)


def _raise_in_thread(ident: int, exc: type[BaseException]) -> None:
    """``exc`` raised in thread ``ident`` at its next bytecode (the C API's
    ``PyThreadState_SetAsyncExc``: Python has no other way into another thread)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(exc))
