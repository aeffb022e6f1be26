"""Traces of the running daemon (``paella trace``): recorded on the loop, written off it.

A client allowed to (the front end checks: the daemon's owner, root, or a user of
``[access] trace_users``) sends TRACE with a duration. :class:`TraceSessions` installs a
:class:`~paella.dispatcher.trace.TraceRecorder` on the dispatcher for that long (the loop
only appends a tuple per event), then takes it off and hands the records to a thread
that writes the Trace Event JSON into a memfd. Once written, the loop sends the client
the descriptor (TRACE_REPLY with SCM_RIGHTS): the daemon never opens a path a client
names, and the file is the client's to copy wherever it may write.

Bounds: at most :data:`MAX_SESSIONS` traces at once (another is refused "busy"); each
stops recording at ``trace_max_bytes`` worth of events, with a note in the file.
"""
from __future__ import annotations

import io
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from paella import wire
from paella.dispatcher.trace import BYTES_PER_EVENT, TraceRecorder, write_trace

log = logging.getLogger("paella.daemon")

#: Traces recorded at once.
MAX_SESSIONS = 2


@dataclass(eq=False)
class _Session:
    client: Any                           # the front end's ClientConn
    recorder: TraceRecorder
    deadline: float                       # monotonic
    timer: threading.Timer
    fd: int = -1                          # the written memfd, once written
    info: dict = field(default_factory=dict)
    error: str | None = None
    writing: bool = False


class TraceSessions:
    """The daemon's traces in progress. ``wake()`` wakes the loop (from any thread) so
    that it calls :meth:`service`; ``front`` sends the replies."""

    def __init__(self, front: Any, wake: Callable[[], None], max_bytes: int):
        self.front = front
        self.wake = wake
        self.max_events = max(16, max_bytes // BYTES_PER_EVENT)
        self.sessions: list[_Session] = []
        self._lock = threading.Lock()       # session.fd / error, set by writer threads

    def start(self, client: Any, seconds: float, dispatcher: Any) -> None:
        """TRACE from ``client`` (allowed): record ``dispatcher`` for ``seconds``."""
        if dispatcher is None:
            self.front.send(client, wire.error("unsupported", "this daemon runs no dispatcher "
                                                              "(no GPU model): nothing to trace"))
            return
        if len(self.sessions) >= MAX_SESSIONS:
            self.front.send(client, wire.error("busy", f"{MAX_SESSIONS} traces are being taken "
                                                       f"already; try again when they end"))
            return
        rec = TraceRecorder(dispatcher, self.max_events, self._model_name).start()
        timer = threading.Timer(seconds, self.wake)
        timer.daemon = True
        self.sessions.append(_Session(client, rec, time.monotonic() + seconds, timer))
        timer.start()
        log.info("client %d (uid %d) takes a trace of %.3g s", client.cid, client.uid, seconds)

    def _model_name(self, model_id: int) -> str | None:
        """A request's model (its id is the front end's, not the dispatcher's)."""
        m = self.front.models.by_id.get(model_id)
        return m.name if m is not None else None

    def service(self) -> None:
        """On the loop: stop the traces whose time is up and start writing them; send
        those written. Cheap when there is nothing to do."""
        now = time.monotonic()
        for s in list(self.sessions):
            if not s.writing and (now >= s.deadline or not s.client.alive):
                s.recorder.stop()
                s.writing = True
                if s.client.alive:
                    threading.Thread(target=self._write, args=(s,), daemon=True,
                                     name="paella-trace-writer").start()
                else:
                    self.sessions.remove(s)
                continue
            with self._lock:
                done = s.fd >= 0 or s.error is not None
            if not done:
                continue
            self.sessions.remove(s)
            if s.error is not None:
                self.front.send(s.client, wire.error("internal", s.error))
            else:
                self.front.send_trace(s.client, s.info, s.fd)
                os.close(s.fd)

    def close(self) -> None:
        """At exit: stop recording; traces not sent are dropped (their clients see the
        connection close)."""
        for s in self.sessions:
            s.timer.cancel()
            s.recorder.stop()
            with self._lock:
                if s.fd >= 0:
                    os.close(s.fd)
                    s.fd = -1
        self.sessions.clear()

    def _write(self, s: _Session) -> None:
        """The writer thread: the JSON into a memfd, then wake the loop to send it."""
        fd = -1
        try:
            fd = os.memfd_create("paella-trace", os.MFD_CLOEXEC)
            with io.open(os.dup(fd), "w", encoding="utf-8", closefd=True) as f:
                summary = write_trace(f, s.recorder, source="paella trace",
                                      daemon_pid=os.getpid())
            os.lseek(fd, 0, os.SEEK_SET)
            info = {"events": summary.events, "requests": summary.requests,
                    "kernels": summary.kernels, "truncated": summary.truncated,
                    "bytes": os.fstat(fd).st_size}
            with self._lock:
                s.info, s.fd = info, fd
            fd = -1
        except Exception as e:                       # noqa: BLE001 - told to the client
            log.exception("writing a trace failed")
            with self._lock:
                s.error = f"writing the trace failed ({type(e).__name__}: {e})"
        finally:
            if fd >= 0:
                os.close(fd)
            self.wake()


__all__ = ["TraceSessions", "MAX_SESSIONS"]
