"""The little HTTP the front end's ASGI applications share: a request read with its
limits, and answers (JSON, bytes, server-sent events).

Why not a web framework: every route here is a handful of fixed paths, and the front
end's budget is tens of microseconds of CPU per request, which a framework's routing
and request objects would spend on their own. The server underneath (uvicorn with
httptools, :mod:`.command`) parses HTTP; this module enforces what this project
promises about bodies: a declared length is ASCII digits within the limit (else 411 or
413, and the connection closes without reading the body), a chunked body is counted as
it arrives and cut off at the limit, and a body shorter than declared is a 400.
"""
from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterable
from urllib.parse import unquote

from .tensors import InferError

Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]

#: A length header: ASCII digits (str.isdigit also takes "²"), at most 18 of them.
LENGTH = re.compile(r"[0-9]{1,18}")
_JSON = [(b"content-type", b"application/json")]
_CLOSE = (b"connection", b"close")


class ClientGone(Exception):
    """The peer closed its connection before the body was read or while answering."""


@dataclass
class Request:
    """One HTTP request as the ASGI scope describes it, its body not read yet."""
    method: str
    path: str                   # UTF-8, percent-encoding kept (decoded per segment)
    headers: dict[str, str]     # lower-case names; a repeated header: its last value
    receive: Receive
    max_body: int
    #: Set when the answer must close the connection (a body left unread).
    close: bool = False
    #: The body was read (or given up on): nothing of it is left to discard.
    consumed: bool = False

    @classmethod
    def of(cls, scope: dict, receive: Receive, max_body: int) -> "Request":
        raw = scope.get("raw_path") or scope["path"].encode("utf-8", "surrogateescape")
        path = raw.split(b"?", 1)[0].decode("utf-8", "replace")
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        return cls(scope["method"], path, headers, receive, max_body)

    async def body(self, limit: int | None = None, what: str = "") -> bytes:
        """The whole body, within ``max_body`` and ``limit`` (what the route can need at
        most, ``what`` says why: a 61 MB JSON array for a 256-element input is refused
        before it is read, not parsed on the loop); InferError 411/413/400 otherwise."""
        most = self.max_body if limit is None else min(limit, self.max_body)
        why = f" ({what})" if what and most < self.max_body else ""
        text = self.headers.get("content-length")
        if text is not None:
            if not LENGTH.fullmatch(text):
                self.close = True
                raise InferError(411, "a request body needs a Content-Length of ASCII digits")
            n = int(text)
            if n > most:
                self.close = True                 # its body is not read
                raise InferError(413, f"request body of {n} bytes exceeds the limit of "
                                      f"{most}{why}")
        chunks, got = [], 0
        while True:
            msg = await self.receive()
            if msg["type"] == "http.disconnect":
                self.consumed = True
                raise ClientGone()
            part = msg.get("body", b"")
            got += len(part)
            if got > most:
                self.close = True
                raise InferError(413, f"request body exceeds the limit of {most} bytes{why}")
            if part:
                chunks.append(part)
            if not msg.get("more_body", False):
                break
        self.consumed = True
        if text is not None and got != int(text):
            self.close = True
            raise InferError(400, f"the body ended after {got} of {text} bytes")
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def discard_body(self) -> None:
        """Read and drop a small body (so the connection can carry the next request);
        a large or unknown one closes the connection instead."""
        if self.consumed:
            return
        text = self.headers.get("content-length", "0")
        if not (LENGTH.fullmatch(text) and int(text) <= self.max_body):
            self.close = True
            return
        try:
            await self.body()
        except (InferError, ClientGone):
            self.close = True


def segments(path: str, prefix: str) -> list[str] | None:
    """The percent-decoded segments after ``prefix`` (None if the path is not under it);
    a trailing slash is ignored."""
    if not path.startswith(prefix):
        return None
    rest = path[len(prefix):].strip("/")
    return [unquote(s) for s in rest.split("/")] if rest else []


#: Seconds a refused body is drained after its answer, before the connection closes.
LINGER_SECONDS = 1.0


async def respond(send: Send, status: int, body: bytes = b"",
                  headers: Iterable[tuple[bytes, bytes]] = _JSON, close: bool = False,
                  linger: Request | None = None) -> None:
    """One whole answer. ``linger``: a request whose body is left unread; the answer is
    sent whole, then what the client still sends is drained (not kept) for at most
    ``LINGER_SECONDS`` before the connection closes. Why: closing a socket with unread
    bytes makes the kernel reset the connection, and a reset can discard the answer
    before the client reads it (a 413 would arrive as "connection reset")."""
    hdrs = [(b"content-length", str(len(body)).encode()), *headers]
    if close:
        hdrs.append(_CLOSE)
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    if linger is None or not close or linger.consumed:
        await send({"type": "http.response.body", "body": body})
        return
    await send({"type": "http.response.body", "body": body, "more_body": True})
    try:
        await asyncio.wait_for(_drain(linger.receive), LINGER_SECONDS)
    except asyncio.TimeoutError:
        pass
    await send({"type": "http.response.body", "body": b""})


async def _drain(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def respond_json(send: Send, status: int, obj: Any, close: bool = False,
                       extra: Iterable[tuple[bytes, bytes]] = (),
                       linger: Request | None = None) -> None:
    await respond(send, status, json.dumps(obj).encode(), [*_JSON, *extra], close, linger)


async def start_events(send: Send) -> None:
    """The head of a server-sent-event stream (kept open until :func:`end_events`)."""
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream"),
                            (b"cache-control", b"no-cache")]})


async def event(send: Send, data: bytes) -> None:
    """One ``data:`` event (``data`` is the JSON, or ``[DONE]``)."""
    await send({"type": "http.response.body", "body": b"data: " + data + b"\n\n",
                "more_body": True})


async def end_events(send: Send) -> None:
    await send({"type": "http.response.body", "body": b""})
