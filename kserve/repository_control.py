"""Model control (Triton's model-repository extension) for the network front ends:
``index``, ``load`` and ``unload`` passed to the daemon over its control socket.

Two gates: the front end's own ``--model-control`` flag (off by default, so a network
client cannot change what is served unless the operator says so), and the daemon's
``[access] control_users``, which must name the front end's user. The daemon's calls
are short control messages made in a worker thread (a load can take seconds: the event
loop keeps serving meanwhile).
"""
from __future__ import annotations

import asyncio

from paella.client import DaemonError, DaemonUnavailable

from .tensors import InferError

#: Daemon error codes -> HTTP statuses (anything else: 400, the request's fault).
_STATUS = {"permission": 403, "unknown_model": 404, "busy": 409}


def check_parameters(what: str, names) -> None:
    """A load or unload takes no parameters: the model folder is what is loaded (Triton's
    ``config`` and ``file:`` overrides are not served). ``unload_dependents``, which
    tritonclient always sends, is accepted: no model here depends on another."""
    others = sorted(n for n in names if n != "unload_dependents")
    if others:
        raise InferError(400, f"{what}: parameters are not supported (got "
                              f"{', '.join(others)[:80]}); the model's folder in the "
                              f"repository is what is loaded")


class RepositoryControl:
    """``allowed``: the front end lets its clients control models at all."""

    def __init__(self, socket: str, allowed: bool = False, timeout: float = 120.0):
        self.socket = socket
        self.allowed = allowed
        self.timeout = timeout

    def _check(self) -> None:
        if not self.allowed:
            raise InferError(403, "model control is off in this front end: start "
                                  "`paella kserve --model-control` (and name its user in the "
                                  "daemon's [access] control_users)")

    async def index(self, ready_only: bool = False) -> list[dict]:
        """Every model of the daemon's repository with its state (READY, UNAVAILABLE,
        ...); ``ready_only``: the READY ones. Reading the index needs no permission."""
        from paella.client import repository
        models = await self._call(repository.index, path=self.socket, timeout=10.0)
        return [m for m in models if m.get("state") == "READY"] if ready_only else models

    async def load(self, name: str) -> None:
        self._check()
        from paella.client import repository
        await self._call(repository.load, name, path=self.socket, timeout=self.timeout)

    async def unload(self, name: str) -> None:
        self._check()
        from paella.client import repository
        await self._call(repository.unload, name, path=self.socket, timeout=self.timeout)

    @staticmethod
    async def _call(fn, *args, **kw):
        try:
            return await asyncio.to_thread(fn, *args, **kw)
        except DaemonError as e:
            raise InferError(_STATUS.get(e.code, 400), f"{e.code}: {e.message}") from None
        except DaemonUnavailable as e:
            raise InferError(503, f"the paella daemon is unavailable: {e}") from None
