"""The load generator's own HTTP clients: HTTP/1.1 (KServe REST) and a minimal HTTP/2
(gRPC), on plain sockets with each request encoded once.

Why not http.client, grpcio or tritonclient: they cost the load generator 107-230 us
of its own CPU per request, which on a 2-core host is CPU taken from the front end it
measures. These do only what ``paella perf`` sends: one request at a time per
connection (HTTP/1.1), unary calls and one stream at a time per connection (HTTP/2),
with the server's flow-control windows respected.
"""
from __future__ import annotations

import json
import socket as sockets
import struct
import threading
import time
from typing import Iterator, Sequence

GRPC_SERVICE = "/inference.GRPCInferenceService/"


# --- KServe over HTTP/1.1 -----------------------------------------------------------------
def _connect(host: str, port: int, timeout: float) -> sockets.socket:
    """A TCP connection for one worker: no Nagle delay, and ``timeout`` as the kernel's
    (SO_RCVTIMEO, SO_SNDTIMEO) rather than Python's, which makes every blocking call a
    non-blocking try, a poll() and a second try: three system calls for one."""
    sock = sockets.create_connection((host, port), timeout)
    sock.settimeout(None)
    sock.setsockopt(sockets.IPPROTO_TCP, sockets.TCP_NODELAY, 1)
    tv = struct.pack("ll", int(timeout), int(timeout % 1 * 1e6))
    sock.setsockopt(sockets.SOL_SOCKET, sockets.SO_RCVTIMEO, tv)
    sock.setsockopt(sockets.SOL_SOCKET, sockets.SO_SNDTIMEO, tv)
    return sock


def _send_all(sock: sockets.socket, parts: Sequence[bytes]) -> None:
    """``parts`` in one system call where the kernel takes them all (no joined copy)."""
    sent = sock.sendmsg(parts)
    if sent < sum(map(len, parts)):
        sock.sendall(b"".join(parts)[sent:])


class Http1:
    """One keep-alive HTTP/1.1 connection on a plain socket, opened on first use and
    again after a failure or a ``Connection: close``. Answers are read with the least
    parsing: the status, then Content-Length bytes or chunks."""

    def __init__(self, host: str, port: int, timeout: float):
        self.addr, self.timeout = (host, port), timeout
        self.sock: sockets.socket | None = None
        self.buf = bytearray()

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def send(self, parts: Sequence[bytes]) -> None:
        if self.sock is None:
            self.sock = _connect(*self.addr, self.timeout)
            self.buf.clear()
        _send_all(self.sock, parts)

    def _fill(self) -> float:
        """More bytes into the buffer; the time they came."""
        n = _recv(self.sock, self.buf) if self.sock is not None else 0
        if not n:
            self.close()
            raise ConnectionError("the server closed the connection")
        return time.perf_counter()

    def head(self) -> tuple[int, bytes]:
        """The next answer's status and its header lines, lower-cased."""
        while (i := self.buf.find(b"\r\n\r\n")) < 0:
            self._fill()
        head = bytes(self.buf[:i]).lower()
        del self.buf[:i + 4]
        try:
            return int(head[9:12]), head
        except ValueError:
            self.close()
            raise ConnectionError(f"not an HTTP answer: {head[:60]!r}") from None

    def pieces(self, head: bytes) -> Iterator[tuple[bytes, float]]:
        """The body of the answer ``head`` began, as it arrives: (bytes, the time the last
        of them came), de-chunked."""
        t = time.perf_counter()
        length = _header(head, b"content-length")
        if length is not None:
            left = int(length)
            while left:
                if not self.buf:
                    t = self._fill()
                piece = bytes(self.buf[:left])
                del self.buf[:len(piece)]
                left -= len(piece)
                yield piece, t
        elif _header(head, b"transfer-encoding") == b"chunked":
            while True:
                while (i := self.buf.find(b"\r\n")) < 0:
                    t = self._fill()
                size = int(bytes(self.buf[:i]).split(b";")[0], 16)
                while len(self.buf) < i + size + 4:
                    t = self._fill()
                piece = bytes(self.buf[i + 2:i + 2 + size])
                del self.buf[:i + size + 4]               # (no trailers after the last)
                if not size:
                    break
                yield piece, t
        if b"\r\nconnection: close" in head:
            self.close()

    def body(self, head: bytes) -> bytes:
        return b"".join(p for p, _ in self.pieces(head))

    def answer(self) -> tuple[int, bytes]:
        """The next answer's status and body: :meth:`head` and :meth:`body`, with the
        common case (a Content-Length) inline, as it is every request's cost."""
        status, head = self.head()
        i = head.find(b"\r\ncontent-length:")
        if i < 0:
            return status, self.body(head)
        j = head.find(b"\r\n", i + 2)
        n = int(head[i + 17:j if j > 0 else None])
        buf = self.buf
        while len(buf) < n:
            self._fill()
        body = bytes(buf[:n])
        del buf[:n]
        if b"\r\nconnection: close" in head:
            self.close()
        return status, body


_RECV = threading.local()


def _recv(sock: sockets.socket, buf: bytearray) -> int:
    """Receive into ``buf``'s end; the bytes received (0: the peer closed). Through a
    scratch buffer of the thread's: ``recv(n)`` allocates n bytes per call, and n large
    enough for a big answer is an mmap and page faults per call."""
    scratch = getattr(_RECV, "view", None)
    if scratch is None:
        scratch = _RECV.view = memoryview(bytearray(1 << 18))
    try:
        n = sock.recv_into(scratch)
    except BlockingIOError:                      # (SO_RCVTIMEO ran out)
        raise TimeoutError("timed out waiting for the answer") from None
    buf += scratch[:n]
    return n


def _header(head: bytes, name: bytes) -> bytes | None:
    """A header's value in lower-cased header lines, or None."""
    i = head.find(b"\r\n" + name + b":")
    if i < 0:
        return None
    j = head.find(b"\r\n", i + 2)
    return head[i + len(name) + 3:j if j >= 0 else None].strip()


def http_error(status: int, body: bytes) -> RuntimeError:
    try:
        why = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        why = body[:200]
    return RuntimeError(f"HTTP {status}: {why}")


# --- KServe over gRPC: a minimal HTTP/2 client ----------------------------------------------
DATA, _HEADERS, RST, _SETTINGS, _PING, _GOAWAY, _WINDOW = 0, 1, 3, 4, 6, 7, 8
END_STREAM, _END_HEADERS, _PADDED, _ACK = 0x1, 0x4, 0x8, 0x1
_FRAME = struct.Struct(">HBBBI")          # length (24 bits as 16 + 8), type, flags, stream
_MAX_WINDOW = 2 ** 31 - 1


def _frame(kind: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return _FRAME.pack(n >> 8, n & 0xFF, kind, flags, sid) + payload


def _hpack_int(value: int, prefix: int, first: int = 0) -> bytes:
    top = (1 << prefix) - 1
    if value < top:
        return bytes((first | value,))
    out, value = [first | top], value - top
    while value >= 128:
        out.append(value & 127 | 128)
        value >>= 7
    return bytes(out + [value])


def _hpack_str(s: bytes) -> bytes:
    return _hpack_int(len(s), 7) + s


def grpc_headers(authority: str, method: str) -> bytes:
    """A gRPC call's request headers as an HPACK block: static-table entries and
    literals never added to a table, so the block is the same for every call."""
    return (b"\x83\x86"                                            # :method POST, :scheme http
            + _hpack_int(4, 4) + _hpack_str((GRPC_SERVICE + method).encode())     # :path
            + _hpack_int(1, 4) + _hpack_str(authority.encode())                  # :authority
            + _hpack_int(31, 4) + _hpack_str(b"application/grpc")             # content-type
            + b"\x00" + _hpack_str(b"te") + _hpack_str(b"trailers"))


class H2:
    """One HTTP/2 connection to a gRPC server over plain TCP (h2c with prior knowledge,
    as gRPC does without TLS), for the load generator's workers: a request is HEADERS
    (a block encoded once, :func:`grpc_headers`) and DATA frames; the answer's frames
    are read and their headers never decoded. A call succeeded if its answer carries a
    message: a failing gRPC call is answered by trailers alone (its status is in them;
    the caller asks grpcio why). Our receive windows are opened to the maximum and
    topped up; the server's are respected (a large request waits for WINDOW_UPDATE)."""

    PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

    def __init__(self, host: str, port: int, timeout: float):
        self.sock = _connect(host, port, timeout)
        # no header table (we decode no headers), no push, the largest windows and frames
        settings = struct.pack(">HIHIHIHI", 1, 0, 2, 0, 4, _MAX_WINDOW, 5, 2 ** 24 - 1)
        self.sock.sendall(self.PREFACE + _frame(_SETTINGS, 0, 0, settings)
                          + _frame(_WINDOW, 0, 0, struct.pack(">I", _MAX_WINDOW - 65535)))
        self.buf, self.pos = bytearray(), 0
        self.t_recv = 0.0                       # when the last bytes came
        self.next_sid = 1
        self.closed = False                     # GOAWAY: no new streams on this one
        self.send_conn, self.send_initial, self.max_frame = 65535, 65535, 16384
        self.send_window: dict[int, int] = {}   # open streams' windows toward the server
        self.received: dict[int, int] = {0: 0}  # bytes received not yet given back

    def close(self) -> None:
        self.closed = True
        self.sock.close()

    def open(self, block: bytes, data: bytes = b"", end: bool = False) -> int:
        """A new stream: HEADERS, then ``data`` as gRPC's message frame (``end``: the
        request's last). Its id."""
        if self.next_sid > _MAX_WINDOW or self.closed:
            raise ConnectionError("this HTTP/2 connection takes no more streams")
        sid, self.next_sid = self.next_sid, self.next_sid + 2
        self.send_window[sid] = self.send_initial
        self.received[sid] = 0
        flags = _END_HEADERS | (END_STREAM if end and not data else 0)
        headers = _frame(_HEADERS, flags, sid, block)
        if data:
            self.send(sid, data, end, headers)
        else:
            self.sock.sendall(headers)
        return sid

    def send(self, sid: int, data: bytes, end: bool, first: bytes = b"") -> None:
        """``data`` (a gRPC message with its 5-byte prefix) on stream ``sid``, as the
        server's windows allow; ``first``: frames to send before it."""
        view, n = memoryview(data), len(data)
        if n <= min(self.send_conn, self.send_window[sid], self.max_frame):
            self.send_conn -= n
            self.send_window[sid] -= n
            _send_all(self.sock, [first, _FRAME.pack(n >> 8, n & 0xFF, DATA,
                                                     END_STREAM if end else 0, sid), data])
            return
        if first:
            self.sock.sendall(first)
        while view:
            room = min(self.send_conn, self.send_window[sid], self.max_frame, len(view))
            if room <= 0:
                got = self.poll()                 # (a WINDOW_UPDATE, in the end)
                if got and got[2] == sid and (got[0] == RST or got[1] & END_STREAM):
                    raise RuntimeError("the server ended the call before its request")
                continue
            last = end and room == len(view)
            self.sock.sendall(_FRAME.pack(room >> 8, room & 0xFF, DATA,
                                          END_STREAM if last else 0, sid) + view[:room])
            self.send_conn -= room
            self.send_window[sid] -= room
            view = view[room:]

    def done(self, sid: int) -> None:
        """Stream ``sid`` ended: forget it."""
        self.send_window.pop(sid, None)
        self.received.pop(sid, None)

    def frame(self) -> tuple[int, int, int, bytes]:
        """The next frame of a stream (DATA, HEADERS, RST_STREAM): (type, flags, stream,
        payload; DATA without its padding). Connection frames are handled on the way."""
        while (got := self.poll()) is None:
            pass
        return got

    def poll(self) -> tuple[int, int, int, bytes] | None:
        """The next frame: a stream's as :meth:`frame` returns it, or None for a
        connection frame (handled)."""
        kind, flags, sid, payload = self._next()
        if kind == DATA:
            self._consumed(sid, len(payload))
            if flags & _PADDED:
                payload = payload[1:len(payload) - payload[0]]
            return kind, flags, sid, payload
        if kind in (_HEADERS, RST):
            return kind, flags, sid, payload
        self._control(kind, flags, sid, payload)
        return None

    def _next(self) -> tuple[int, int, int, bytes]:
        buf = self.buf
        while True:
            p = self.pos
            if len(buf) - p >= 9:
                hi, lo, kind, flags, sid = _FRAME.unpack_from(buf, p)
                n = hi << 8 | lo
                if len(buf) - p >= 9 + n:
                    self.pos = p + 9 + n
                    return kind, flags, sid & _MAX_WINDOW, bytes(buf[p + 9:p + 9 + n])
            if p:
                del buf[:p]
                self.pos = 0
            if not _recv(self.sock, buf):
                self.closed = True
                raise ConnectionError("the server closed the HTTP/2 connection")
            self.t_recv = time.perf_counter()

    def _consumed(self, sid: int, n: int) -> None:
        """Give the server back its window once a large part of it is used."""
        for s in (0, sid):
            if s in self.received:
                self.received[s] += n
                if self.received[s] >= 1 << 30:
                    self.sock.sendall(_frame(_WINDOW, 0, s, struct.pack(">I", self.received[s])))
                    self.received[s] = 0

    def _control(self, kind: int, flags: int, sid: int, payload: bytes) -> None:
        if kind == _SETTINGS and not flags & _ACK:
            for i in range(0, len(payload) - 5, 6):
                key, value = struct.unpack_from(">HI", payload, i)
                if key == 4:                                # INITIAL_WINDOW_SIZE
                    for s in self.send_window:
                        self.send_window[s] += value - self.send_initial
                    self.send_initial = value
                elif key == 5:                              # MAX_FRAME_SIZE
                    self.max_frame = value
            self.sock.sendall(_frame(_SETTINGS, _ACK, 0))
        elif kind == _PING and not flags & _ACK:
            self.sock.sendall(_frame(_PING, _ACK, 0, payload))
        elif kind == _WINDOW and len(payload) == 4:
            inc = struct.unpack(">I", payload)[0] & _MAX_WINDOW
            if sid == 0:
                self.send_conn += inc
            elif sid in self.send_window:
                self.send_window[sid] += inc
        elif kind == _GOAWAY:
            self.closed = True                    # (streams it names may still finish)


def grpc_message(body: bytes) -> bytes:
    """gRPC's length-prefixed message (uncompressed)."""
    return b"\x00" + struct.pack(">I", len(body)) + body
