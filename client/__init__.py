"""The Paella client library: ``connect``, ``predict``, ``read_result``, ``infer``,
``generate``.

``paella.client.predict`` and ``paella.client.read_result`` use a default connection
made on first use (socket from ``$PAELLA_SOCKET``, else ``/run/paella/paella.sock``).
"""
from __future__ import annotations

import threading

from paella.client.client import DEFAULT_SOCKET, NONBLOCK, Client, connect, default_socket
from paella.client.errors import (ArenaFull, DaemonError, DaemonGone, DaemonUnavailable,
                                  NothingInFlight, PaellaError, RequestFailed, ResultTimeout,
                                  RingFull,
                                  UnknownModel)

_default: Client | None = None
_default_lock = threading.Lock()


def default_client() -> Client:
    """The module-level connection, made on first use (thread-safe)."""
    global _default
    with _default_lock:
        if _default is None or _default.closed:
            _default = connect()
        return _default


def predict(model: str | int, length: int, io_offset: int, options: int = 0, *,
            priority: int = 0) -> int:
    """§5.1 ``paella.predict`` on the default connection."""
    return default_client().predict(model, length, io_offset, options, priority=priority)


def infer(model: str | int, inputs, variant: int = 0, timeout: float | None = None, *,
          rows: int | None = None, seq_len: int = 0, priority: int = 0) -> dict:
    """One request on the default connection, inputs in, outputs back
    (:meth:`Client.infer`): ``paella.infer("resnet18", {"x": x})``."""
    return default_client().infer(model, inputs, variant, timeout, rows=rows, seq_len=seq_len,
                                  priority=priority)


def read_result(options: int = 0, timeout: float | None = None) -> int:
    """§5.3 ``paella.readResult`` on the default connection."""
    return default_client().read_result(options, timeout)


def generate(model: str | int, prompt_ids, max_tokens: int, timeout: float | None = None, *,
             priority: int = 0):
    """Stream the tokens of one generation on the default connection
    (:meth:`Client.generate`)."""
    return default_client().generate(model, prompt_ids, max_tokens, timeout, priority=priority)


__all__ = ["Client", "generate", "infer", "connect", "default_socket", "DEFAULT_SOCKET", "default_client", "predict", "read_result",
           "NONBLOCK", "PaellaError", "DaemonUnavailable", "DaemonGone", "DaemonError",
           "UnknownModel", "NothingInFlight", "RingFull", "ArenaFull", "RequestFailed",
           "ResultTimeout"]
