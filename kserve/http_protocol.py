"""uvicorn's httptools protocol with the limits a hostile client calls for.

uvicorn with httptools bounds none of these (found by tests/service/test_frontend_hostile.py):

* **The size of a request's head.** httptools builds a long header by repeated
  concatenation, and uvicorn the URL, so a 100 MB header costs quadratic time on the
  event loop and hundreds of MB. Here, while a head is being read, the parser is fed
  :data:`HEAD_SLICE` bytes at a time and the head's bytes are counted: past
  :data:`MAX_HEAD` the answer is 431 and the connection closes.
* **The time to send a head.** uvicorn arms its keep-alive timer only after a response,
  so a connection that never completes a request (silent, or trickling its headers) is
  held for good. Here a connection has ``timeout_keep_alive`` (``--idle-timeout``)
  seconds to complete each request's head, counted from when it opened or its last
  response ended; then 408 and the connection closes.
* **Pipelined requests not read back.** uvicorn queues every request of each read and
  resumes reading whenever a request starts or a response ends, even with requests
  queued, so a client that pipelines and never reads its answers makes the front end
  read (and keep) all it sends. Here reading stays paused while any request is queued.
"""
from __future__ import annotations

import asyncio

from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

#: The most bytes a request line and headers may take (nginx's default large buffers
#: are 4 x 8 KiB; Triton's and KServe's requests need far less).
MAX_HEAD = 64 << 10
#: Bytes fed to the parser at a time while a head is being read.
HEAD_SLICE = 16 << 10


class _QueuedFlow(FlowControl):
    """Reading resumes only when no pipelined request is waiting its turn."""

    def __init__(self, transport: asyncio.Transport, protocol: "GuardedHttpToolsProtocol"):
        super().__init__(transport)
        self._protocol = protocol

    def resume_reading(self) -> None:
        if not self._protocol.pipeline:
            super().resume_reading()


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """``uvicorn.Config(http=GuardedHttpToolsProtocol)``."""

    _in_head = True
    _head_bytes = 0
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.flow = _QueuedFlow(transport, self)
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._in_head:
            return super().data_received(data)
        for pos in range(0, len(data), HEAD_SLICE):
            if not self._in_head:              # the head ended: the rest at once
                return super().data_received(data[pos:])
            part = data[pos:pos + HEAD_SLICE]
            self._head_bytes += len(part)
            super().data_received(part)
            if self.transport.is_closing():
                return
            if self._in_head and self._head_bytes > MAX_HEAD:
                return self._refuse(431, "Request Header Fields Too Large",
                                    f"the request line and headers exceed {MAX_HEAD} bytes")

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._stop_head_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._await_head()                      # the next request's head, if any

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.pipeline:                       # requests still queued: stop reading
            self.flow.pause_reading()

    # -- the head's deadline -----------------------------------------------------------
    def _await_head(self) -> None:
        """Between requests (or before the first): the next head's bytes are counted,
        and it has ``timeout_keep_alive`` seconds to arrive."""
        self._in_head = True
        self._head_bytes = 0
        self._stop_head_timer()
        self._arm_head_timer()

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.timeout_keep_alive, self._head_late)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if not self._in_head or self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self._arm_head_timer()              # still answering: counted from its end
            return
        if self._head_bytes == 0:
            self.transport.close()              # an idle connection: nothing to answer
        else:
            self._refuse(408, "Request Timeout", f"the request's head did not arrive "
                                                 f"within {self.timeout_keep_alive} s")

    def _refuse(self, status: int, phrase: str, message: str) -> None:
        body = message.encode()
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\n"
                             b"content-length: %d\r\nconnection: close\r\n\r\n%s"
                             % (status, phrase.encode(), len(body), body))
        self.transport.close()
        self._stop_head_timer()
