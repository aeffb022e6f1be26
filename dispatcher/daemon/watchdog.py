"""The loop's watchdog: a plug-in hook that never returns is interrupted, not waited on.

The dispatcher loop is one thread, and it calls third-party code (policies, batchers and
schedulers installed as plug-ins) once per kernel or request. A hook that loops forever
would hang the daemon for every client, and SIGTERM too (its handler only sets a flag the
loop reads between iterations). So a thread samples the loop thread's stack every
fraction of ``timeout``; when the same call into plug-in code (the same outermost
plug-in frame) has been running for ``timeout`` seconds, it signals the loop thread, and
the handler, running in the loop thread between two bytecodes of that call, raises
:class:`PluginTimeout` there. That is an ``Exception``, so it reaches the call site's
usual error path: a policy falls back to the default one, a batcher to the identity
batcher, a plug-in's ``__init__`` fails start-up with the message. The handler checks
that the call it was sent for is still on the stack, so a hook that returned meanwhile
is never hit by a late signal.

A plug-in that swallows the exception and goes on looping is interrupted again after
another ``timeout``; at the third time it gets :class:`PluginHung`, a ``BaseException``
its ``except Exception`` cannot keep, and the daemon stops (every accepted request is
answered, and the service manager restarts it).

What counts as plug-in code: modules of the packages that entry points loaded classes
from (:data:`paella.plugins.PLUGIN_PACKAGES`), and whatever they call. The daemon's own
slow work (a first CPU reference run, loading a model) is never interrupted. Not caught:
a hook stuck in C code that holds the GIL (nothing in Python can run then) or that
ignores signals.

Cost: one wake-up of this thread per sampling period (at most 1 s), which takes the GIL
for the few microseconds a stack walk needs; nothing on the loop's hot path.
"""
from __future__ import annotations

import logging
import signal
import sys
import threading
import time
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


def plugin_entry(frame: FrameType | None) -> FrameType | None:
    """The outermost frame of plug-in code on the stack ending at ``frame``: the call the
    daemon made into the plug-in (None if there is none)."""
    entry = None
    while frame is not None:
        if in_plugin(frame.f_globals.get("__name__", "")):
            entry = frame
        frame = frame.f_back
    return entry


def describe(entry: FrameType) -> str:
    code = entry.f_code
    return (f"the plug-in call {entry.f_globals.get('__name__', '?')}.{code.co_qualname} "
            f"({code.co_filename}:{entry.f_lineno})")


class Watchdog:
    """Watches the thread that creates it (the loop: signal handlers run in the main
    thread, so it must be the main thread). ``start`` installs the handler and starts
    the sampling thread; ``stop`` ends both. ``timeout`` 0 disables it."""

    def __init__(self, timeout: float, clock: Callable[[], float] = time.monotonic):
        self.timeout = timeout
        self.clock = clock
        self.interrupted = 0                 # PluginTimeouts raised (status, tests)
        self._loop = threading.get_ident()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # (entry frame, description, hung?) the next signal is for; set by the sampling
        # thread, consumed by the handler (one reference swap each: atomic under the GIL)
        self._pending: tuple[FrameType, str, bool] | None = None
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
        signal.signal(SIGNAL, self._old_handler or signal.SIG_DFL)

    # -- the sampling thread ---------------------------------------------------------
    def _watch(self) -> None:
        period = min(1.0, self.timeout / 4)
        seen: FrameType | None = None        # (held: a live reference, so never reused)
        since = 0.0
        strikes = 0
        while not self._stop.wait(period):
            frame = sys._current_frames().get(self._loop)
            entry = plugin_entry(frame)
            del frame
            now = self.clock()
            if entry is None or entry is not seen:
                seen, since, strikes = entry, now, 0
                continue
            if now - since < self.timeout * (strikes + 1):
                continue
            hung = strikes >= STRIKES
            strikes += 1
            what = describe(entry)
            log.error("%s has run for %.1f s without returning (an endless loop?): %s", what,
                      now - since, "stopping the daemon, it kept running after being "
                      "interrupted" if hung else "interrupting it")
            self._pending = (entry, what, hung)
            signal.pthread_kill(self._loop, SIGNAL)

    # -- the loop thread -------------------------------------------------------------
    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        entry, what, hung = pending
        f = frame
        while f is not None and f is not entry:
            f = f.f_back
        if f is None:
            return                           # the call returned meanwhile: nothing to stop
        if hung:
            raise PluginHung(f"{what} kept running after {STRIKES} interruptions")
        self.interrupted += 1
        raise PluginTimeout(f"{what} ran for more than {self.timeout:g} s without returning "
                            f"(plugin_timeout_seconds); interrupted")
