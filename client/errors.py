"""Exceptions of the client library: each says what went wrong and what to do."""
from __future__ import annotations


class PaellaError(RuntimeError):
    """Base class of every error the client library raises."""


class DaemonUnavailable(PaellaError):
    """No daemon answers on the socket, or it refused this client."""


class DaemonGone(PaellaError):
    """The daemon closed the connection (it stopped, crashed, or dropped this client)."""


class DaemonError(PaellaError):
    """The daemon answered a control message with an error."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class UnknownModel(PaellaError, KeyError):
    """The daemon does not serve a model of that name or id."""

    def __str__(self) -> str:   # KeyError would quote the message
        return str(self.args[0])


class NothingInFlight(PaellaError):
    """A blocking read_result with no request outstanding would wait forever."""


class ResultTimeout(PaellaError, TimeoutError):
    """No completion arrived within the caller's ``timeout``: the daemon is busy, hung or
    stopped. The request stays in flight; its io region is freed when its completion
    finally arrives (or when the client closes), never while the daemon may still write it."""


class RingFull(PaellaError):
    """The request ring stayed full: the daemon is not taking requests (read results?)."""


class ArenaFull(PaellaError):
    """No room left in the shared-memory arena for another request's io region."""


class RequestFailed(PaellaError):
    """A request completed with an error status; ``reason`` is the daemon's text."""

    def __init__(self, req_id: int, status: int, reason: str):
        from paella.rings import STATUS_NAMES
        super().__init__(f"request {req_id} failed ({STATUS_NAMES.get(status, status)}): {reason}")
        self.req_id = req_id
        self.status = status
        self.reason = reason
