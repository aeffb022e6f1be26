"""The client library on asyncio: one connection, many requests in flight, no threads.

What a network front end needs (``paella kserve``): thousands of remote requests served
from one event loop, each awaiting its answer without holding a thread or a connection
of its own. An :class:`AsyncClient` is a :class:`~paella.client.Client` in *socket* mode
whose socket the loop watches (``add_reader``): every DONE or PROGRESS frame the daemon
sends drains the completion ring and resolves the futures of the requests it holds,
whoever awaits them. Submission is the synchronous client's (an arena region, one ring
entry), never blocking: the requests in flight are bounded below the request ring's
size, so a push always finds room, and a caller past the bound awaits a slot.

Use it from one event loop only (it is not thread-safe), for example::

    c = await AsyncClient.connect()
    out = await c.infer("echo", {"x": x})
    async for token in c.generate("gpt", [1, 2, 3], max_tokens=8):
        ...
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import AsyncIterator, Mapping

import numpy as np

from paella import rings, wire
from paella.client.client import Client, default_socket
from paella.client.errors import (DaemonError, DaemonGone, PaellaError, RequestFailed,
                                  ResultTimeout)


@dataclass
class _Stream:
    """A generation being read: the outputs valid so far and, once it arrived, its end."""
    seen: int = 0
    end: tuple[int, str] | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class AsyncClient(Client):
    """A daemon connection for an asyncio loop. Make it with :meth:`connect` (the
    handshake runs in a worker thread); close it with :meth:`close`."""

    def __init__(self, path: str, arena_bytes: int | None = None, timeout: float = 5.0):
        super().__init__(path, "socket", arena_bytes, timeout)
        self._loop: asyncio.AbstractEventLoop | None = None
        #: Requests awaited: req id -> the future of their (status, reason).
        self._pending: dict[int, asyncio.Future] = {}
        self._streams: dict[int, _Stream] = {}
        self._reply_waiters: list[asyncio.Future] = []
        self._gone: PaellaError | None = None
        # one slot short of the ring: a push always finds room (the daemon frees a slot
        # before it answers the request that held it)
        self._slots: asyncio.Semaphore | None = None

    @classmethod
    async def connect(cls, socket_path: str | None = None, arena_bytes: int | None = None,
                      timeout: float = 5.0) -> "AsyncClient":
        """Connect to the daemon at ``socket_path`` (default :func:`default_socket`)."""
        loop = asyncio.get_running_loop()
        c = await loop.run_in_executor(None, lambda: cls(socket_path or default_socket(),
                                                         arena_bytes, timeout))
        c._attach(loop)
        return c

    def _attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._sock.setblocking(False)
        self._slots = asyncio.Semaphore(max(1, self._seg.layout.req_slots - 1))
        loop.add_reader(self._sock.fileno(), self._on_readable)

    @property
    def alive(self) -> bool:
        """False once the daemon went away or the client was closed."""
        return self._gone is None and not self.closed

    @property
    def load(self) -> int:
        """Requests in flight on this connection (a pool picks the least loaded)."""
        return len(self._pending) + len(self._streams)

    def close(self) -> None:
        if self.closed:
            return
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._sock.fileno())
        self._fail_all(DaemonGone("the connection was closed"))
        super().close()

    # -- reception ---------------------------------------------------------------------
    def _on_readable(self) -> None:
        try:
            data = self._sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            return self._lost(f"lost the daemon at {self.path}: {e}")
        if not data:
            return self._lost(f"the daemon at {self.path} closed the connection "
                              f"({self.load} requests were in flight)")
        try:
            frames = self._reader.feed(data)
        except wire.WireError as e:
            return self._lost(f"the daemon sent a malformed frame: {e}")
        for kind, msg in frames:
            if kind in (wire.MODELS, wire.STATUS_REPLY, wire.ERROR):
                if self._reply_waiters:
                    f = self._reply_waiters.pop(0)
                    if not f.done():
                        f.set_result((kind, msg))
            elif kind not in (wire.DONE, wire.WAKE, wire.PROGRESS):
                return self._lost(f"the daemon sent an unexpected {wire.NAMES[kind]}")
        self._drain()

    def _drain(self) -> None:
        """Every entry on the completion ring, to whoever awaits it."""
        pop = self._completions.pop
        while (got := pop()) is not None:
            req_id, status, value = got
            stream = self._streams.get(req_id)
            if status == rings.PROGRESS:
                if stream is not None and value > stream.seen:     # type: ignore[operator]
                    stream.seen = value                             # type: ignore[assignment]
                    stream.changed.set()
                continue
            if stream is not None:
                stream.end = (status, value)                         # type: ignore[assignment]
                stream.changed.set()
            elif (off := self._orphans.pop(req_id, None)) is not None:
                self._alloc.free(off)        # its caller gave up (a timeout, a cancel)
                self._slots.release()
            elif (f := self._pending.pop(req_id, None)) is not None and not f.done():
                f.set_result((status, value))

    def _lost(self, why: str) -> None:
        self._fail_all(DaemonGone(why))
        if self._loop is not None and not self.closed:
            self._loop.remove_reader(self._sock.fileno())

    def _fail_all(self, err: PaellaError) -> None:
        if self._gone is None:
            self._gone = err
        for f in [*self._pending.values(), *self._reply_waiters]:
            if not f.done():
                f.set_exception(err)
        self._pending.clear()
        self._reply_waiters.clear()
        for s in self._streams.values():
            s.changed.set()

    # -- submission --------------------------------------------------------------------
    def _push(self, model_id: int, length: int, off: int, options: int, priority: int) -> int:
        """One ring entry (room is guaranteed by the slots); its request id."""
        if self._gone is not None:
            raise self._gone
        if type(priority) is not int or not 0 <= priority <= wire.MAX_PRIORITY:
            raise ValueError(f"priority must be an int 0..{wire.MAX_PRIORITY} (0: none, 1: the "
                             f"highest), got {priority!r}")
        req_id = self._next_id
        self._next_id += 1
        if not self._requests.push(req_id, model_id, off, length | priority << wire.PRIORITY_SHIFT,
                                   options):
            raise DaemonGone("the request ring is full although every slot is accounted for: "
                             "the daemon's head is inconsistent")
        if self._requests.daemon_sleeping():
            self._kick()
        return req_id

    def _kick(self) -> None:
        try:
            self._sock.send(wire.KICK_FRAME)
        except (BlockingIOError, InterruptedError):
            pass          # a full socket buffer: the daemon has frames to read anyway
        except OSError as e:
            self._lost(f"lost the daemon at {self.path}: {e}")

    async def _slot(self, deadline: float | None) -> None:
        """A place among the requests in flight (ResultTimeout if none frees in time)."""
        if self._gone is not None:
            raise self._gone
        if not self._slots.locked():      # the common case: no task, no timer
            await self._slots.acquire()
            return
        try:
            await asyncio.wait_for(self._slots.acquire(), _left(self._loop, deadline))
        except asyncio.TimeoutError:
            raise ResultTimeout(f"no room for another request on the connection to "
                                f"{self.path} in time ({self.load} in flight)") from None

    async def infer(self, model: str | int, inputs: Mapping[str, np.ndarray],
                    variant: int = 0, timeout: float | None = None, *, rows: int | None = None,
                    seq_len: int = 0, priority: int = 0) -> dict[str, np.ndarray]:
        """:meth:`Client.infer`, awaited: the outputs (copies). ``timeout`` (seconds)
        raises :class:`ResultTimeout`; the region stays reserved until the daemon
        answers, as does a cancelled call's."""
        m = self.model(model)
        deadline = _deadline(self._loop, timeout)
        await self._slot(deadline)
        try:
            off, nbytes, options, outs = self._place(m, inputs, variant, rows, seq_len)
        except BaseException:
            self._slots.release()
            raise
        try:
            req_id = self._push(m.model_id, nbytes, off, options, priority)
        except BaseException:
            self._alloc.free(off)
            self._slots.release()
            raise
        fut = self._loop.create_future()
        self._pending[req_id] = fut
        # a timer on the future itself: asyncio.wait_for would make a task per request
        timer = None if deadline is None else self._loop.call_at(deadline, _expire, fut)
        try:
            status, reason = await fut
        except (_Expired, asyncio.CancelledError) as e:
            self._abandon(req_id, off)
            if isinstance(e, _Expired):
                raise ResultTimeout(f"no answer from the daemon at {self.path} within "
                                    f"{timeout} s ({self.load} in flight)") from None
            raise
        except PaellaError:
            self._alloc.free(off)        # the daemon is gone: nothing writes it any more
            self._slots.release()
            raise
        finally:
            if timer is not None:
                timer.cancel()
        try:
            self._result(req_id, status, reason)
            return {k: a.copy() for k, a in outs.items()}
        finally:
            self._alloc.free(off)
            self._slots.release()

    def _abandon(self, req_id: int, off: int) -> None:
        """A caller stopped waiting: the region is freed (and the slot given back) when
        the daemon answers, since it may write the region until then."""
        self._pending.pop(req_id, None)
        self._streams.pop(req_id, None)
        if self._gone is None:
            self._orphans[req_id] = off
        else:
            self._alloc.free(off)
            self._slots.release()

    async def generate(self, model: str | int, prompt_ids, max_tokens: int,
                       timeout: float | None = None, *, priority: int = 0
                       ) -> AsyncIterator[int]:
        """:meth:`Client.generate`, awaited: each token as its iteration completes. A
        refusal before the first token raises :class:`RequestFailed` from the first
        ``__anext__``; a caller that stops early leaves the generation to finish in the
        daemon (its region is freed then)."""
        m = self.model(model)
        prompt = self._generation_args(m, prompt_ids, max_tokens)
        deadline = _deadline(self._loop, timeout)
        await self._slot(deadline)
        v = m.variants[0]
        try:
            off = self._alloc.alloc(v.io_bytes)
        except BaseException:
            self._slots.release()
            raise
        done = False
        try:
            out = self._place_generation(m, off, prompt, max_tokens)
            stream = _Stream()
            req_id = self._push(m.model_id, v.io_bytes, off, wire.STREAM, priority)
            self._streams[req_id] = stream
        except BaseException:
            self._alloc.free(off)
            self._slots.release()
            raise
        tokens, given = out["tokens"], 0
        try:
            while True:
                if self._gone is not None and stream.end is None:
                    done = True                   # nothing will write the region now
                    raise self._gone
                n = stream.seen
                if stream.end is not None:
                    done = True
                    if stream.end[0] == rings.OK:
                        n = int(out["n_tokens"][0])
                for t in tokens[given:min(n, tokens.size)].tolist():
                    yield t
                given = max(given, min(n, tokens.size))
                if stream.end is not None:
                    self._result(req_id, *stream.end)
                    return
                stream.changed.clear()
                try:
                    await asyncio.wait_for(stream.changed.wait(), _left(self._loop, deadline))
                except asyncio.TimeoutError:
                    raise ResultTimeout(f"the generation by {m.name} did not finish within "
                                        f"{timeout} s") from None
        finally:
            self._streams.pop(req_id, None)
            if done:
                self._alloc.free(off)
                self._slots.release()
            else:
                self._abandon(req_id, off)

    # -- control ------------------------------------------------------------------------
    async def _ask(self, frame: bytes, timeout: float) -> tuple[int, dict]:
        if self._gone is not None:
            raise self._gone
        fut = self._loop.create_future()
        self._reply_waiters.append(fut)
        try:
            self._sock.send(frame)
        except OSError as e:
            self._lost(f"lost the daemon at {self.path}: {e}")
            raise self._gone from None       # type: ignore[misc]
        try:
            kind, msg = await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            # (the cancelled future stays queued: its late reply is read and dropped,
            # so later replies still reach their own waiters)
            raise ResultTimeout(f"the daemon at {self.path} did not answer within "
                                f"{timeout} s") from None
        if kind == wire.ERROR:
            raise DaemonError(msg.get("error", "?"), msg.get("message", ""))
        return kind, msg

    async def list_models_async(self, timeout: float = 5.0) -> dict[str, wire.ModelInfo]:
        """Ask the daemon for its models again (it reloads them on SIGHUP)."""
        _, msg = await self._ask(wire.encode(wire.LIST_MODELS), timeout)
        self._set_models(msg["models"])
        return self.models

    def learn_models(self, models: dict[str, wire.ModelInfo]) -> None:
        """Take a model list another connection to the same daemon fetched."""
        self.models = dict(models)
        self._ids = {m.model_id for m in models.values()}

    async def status_async(self, timeout: float = 5.0) -> dict:
        """The daemon's STATUS reply, as :meth:`Client.status`."""
        _, msg = await self._ask(wire.encode(wire.STATUS), timeout)
        return msg["status"]


class _Expired(Exception):
    """A request's own timer fired (becomes ResultTimeout)."""


def _expire(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_exception(_Expired())


def _deadline(loop: asyncio.AbstractEventLoop, timeout: float | None) -> float | None:
    if timeout is None:
        return None
    if not timeout >= 0:
        raise ValueError(f"timeout must be >= 0 seconds or None, got {timeout}")
    return loop.time() + timeout


def _left(loop: asyncio.AbstractEventLoop, deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - loop.time())


__all__ = ["AsyncClient"]
