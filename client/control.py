"""One control message to the daemon and its one reply, without a session (no HELLO, no
segment): what ``paella status`` and ``paella trace`` send."""
from __future__ import annotations

import os
import socket
import time

from paella import wire
from paella.client.client import default_socket
from paella.client.errors import DaemonError, DaemonUnavailable


def ask(frame: bytes, want: int, path: str | None = None, timeout: float = 5.0,
        fds: int = 0) -> tuple[dict, list[int]]:
    """Send ``frame`` to the daemon at ``path`` and wait ``timeout`` seconds at most for
    a frame of kind ``want``: its message and the descriptors that came with it (up to
    ``fds``; the caller closes them). An ERROR reply raises :class:`DaemonError`; no
    daemon, a hang-up or a malformed frame :class:`DaemonUnavailable`."""
    path = path or default_socket()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    deadline = time.monotonic() + timeout
    got: list[int] = []
    try:
        try:
            s.settimeout(timeout)
            s.connect(path)
            s.sendall(frame)
        except OSError as e:
            raise DaemonUnavailable(f"no paella daemon answers on {path} ({e}); start one "
                                    f"with `paella serve` or pass --socket") from None
        reader = wire.FrameReader(wire.MAX_PAYLOAD)
        while True:
            s.settimeout(max(0.001, deadline - time.monotonic()))
            try:
                data, new, _, _ = socket.recv_fds(s, 1 << 16, max(fds, 1))
            except socket.timeout:
                raise DaemonUnavailable(f"the daemon at {path} did not answer within "
                                        f"{timeout:g} s (hung or stopped?)") from None
            got += new
            if not data:
                raise DaemonUnavailable(f"the daemon at {path} closed the connection")
            try:
                frames = reader.feed(data)
            except wire.WireError as e:
                raise DaemonUnavailable(f"the daemon sent a malformed frame: {e}") from None
            for kind, msg in frames:
                if kind == wire.ERROR:
                    raise DaemonError(msg["error"], msg["message"])
                if kind == want:
                    result, got = (msg, got[:fds]), got[fds:]
                    return result
    finally:
        for fd in got:
            os.close(fd)
        s.close()
