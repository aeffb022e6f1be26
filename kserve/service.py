"""What the KServe v2 front end does, whatever the transport (REST, gRPC, OpenAI).

It is a local client of the daemon on asyncio: a few :class:`paella.client.aio.AsyncClient`
connections, each carrying many requests at once, so a remote request goes through the
same shared-memory rings as a local one (one copy of its inputs into the arena, one of
its outputs out) and holds no thread while it waits. A connection the daemon dropped is
replaced on the next request; while no daemon answers, ``ready`` is false and inference
answers 503.
"""
from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator, Mapping

import numpy as np

from paella import rings, wire
from paella.client import (DaemonGone, DaemonUnavailable, PaellaError, RequestFailed,
                           ResultTimeout)
from paella.client.aio import AsyncClient

from .tensors import InferError, TensorSpec, spec_of

log = logging.getLogger("paella.kserve")

#: A request the daemon refused, by its status: the client's fault (400: bad options or
#: values, such as a prompt past the model's context), a model gone meanwhile (404), a
#: daemon shutting down (503); anything else, the model's failure (500).
_FAILED_STATUS = {rings.E_OPTIONS: 400, rings.E_LENGTH: 400, rings.E_RANGE: 400,
                  rings.E_MODEL: 404, rings.E_CANCELLED: 503}

#: The one version every model has: the daemon serves one version of each at a time.
VERSION = "1"
#: Protocol extensions served (names as Triton reports them).
EXTENSIONS = ["binary_tensor_data", "generate"]


@dataclass(frozen=True)
class ModelSpec:
    """A served model as KServe sees it: its first variant's tensors."""
    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    #: A generative model's tokenizer.json (its config.toml's ``tokenizer``), if any.
    tokenizer: str | None = None

    @property
    def generative(self) -> bool:
        """A model that generates tokens (served by a streaming scheduler, ``orca``)."""
        return ({t.name for t in self.inputs} == {"prompt", "lengths"}
                and {t.name for t in self.outputs} == {"tokens", "n_tokens"})

    def metadata(self) -> dict:
        return {"name": self.name, "versions": [VERSION], "platform": "paella",
                "inputs": [t.to_dict() for t in self.inputs],
                "outputs": [t.to_dict() for t in self.outputs]}

    def input(self, name: str) -> TensorSpec:
        for t in self.inputs:
            if t.name == name:
                return t
        raise InferError(400, f"model {self.name!r} has no input {str(name)[:40]!r} (inputs: "
                              f"{', '.join(t.name for t in self.inputs)})")


def model_spec(info: wire.ModelInfo) -> ModelSpec | None:
    """None for a model whose tensors KServe cannot describe (no such model today)."""
    v = info.variants[0]
    try:
        return ModelSpec(info.name, tuple(spec_of(t.name, t.dtype, t.shape) for t in v.inputs),
                         tuple(spec_of(t.name, t.dtype, t.shape) for t in v.outputs),
                         info.tokenizer or None)
    except ValueError as e:
        log.warning("model %s not offered over KServe: %s", info.name, e)
        return None


class InferenceService:
    """The front end's logic, on one event loop. ``clients``: connections to the daemon
    (each carries up to its request ring's size in flight; more wait for room);
    ``timeout``: seconds an inference may take."""

    #: Seconds the model list is reused before asking the daemon again (SIGHUP reloads).
    MODELS_TTL = 1.0

    def __init__(self, socket: str, clients: int = 2, timeout: float = 30.0,
                 name: str = "paella", version: str = "0"):
        if clients < 1:
            raise ValueError(f"clients must be >= 1, got {clients}")
        self.socket = socket
        self.timeout = timeout
        self.name, self.version = name, version
        self._pool: list[AsyncClient | None] = [None] * clients
        self._dialing: asyncio.Lock | None = None
        self._models: dict[str, ModelSpec] = {}
        self._models_at = -1e9
        self._refresh: asyncio.Task | None = None

    # -- connections -----------------------------------------------------------------
    async def _client(self) -> AsyncClient:
        """The least loaded live connection; a dead or missing one is made again first."""
        pool = self._pool
        best = None
        for c in pool:
            if c is None or not c.alive:
                best = None
                break
            if best is None or c.load < best.load:
                best = c
        if best is not None:
            return best
        if self._dialing is None:
            self._dialing = asyncio.Lock()
        async with self._dialing:              # one handshake at a time
            for i, c in enumerate(pool):
                if c is None or not c.alive:
                    if c is not None:
                        c.close()
                    try:
                        pool[i] = await AsyncClient.connect(self.socket,
                                                            timeout=min(self.timeout, 5.0))
                    except DaemonUnavailable as e:
                        pool[i] = None
                        raise InferError(503, f"the paella daemon is unavailable: {e}") from None
        return min(pool, key=lambda c: c.load)            # type: ignore[arg-type,return-value]

    def close(self) -> None:
        for i, c in enumerate(self._pool):
            if c is not None:
                c.close()
            self._pool[i] = None

    # -- health and metadata ---------------------------------------------------------
    def server_metadata(self) -> dict:
        return {"name": self.name, "version": self.version, "extensions": EXTENSIONS}

    async def ready(self) -> bool:
        """A daemon answers (a connection is made or kept)."""
        try:
            await self.models()
        except InferError:
            return False
        return True

    async def models(self) -> dict[str, ModelSpec]:
        """The served models, asked again at most every ``MODELS_TTL`` seconds. With a
        list already known, a refresh runs in the background: health checks and
        metadata stay instant under load (the list is then a little older)."""
        if time.monotonic() - self._models_at < self.MODELS_TTL:
            return self._models
        if self._models_at < 0:
            return await self._fetch_models()
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.ensure_future(self._fetch_quietly())
        return self._models

    async def _fetch_quietly(self) -> None:
        try:
            await self._fetch_models()
        except InferError as e:
            log.warning("could not refresh the model list: %s", e)
            self._models_at = -1e9                # the next caller asks, and sees the 503

    async def _fetch_models(self) -> dict[str, ModelSpec]:
        c = await self._client()
        try:
            infos = await c.list_models_async(timeout=min(self.timeout, 5.0))
        except PaellaError as e:
            c.close()
            raise InferError(503, f"the paella daemon is unavailable: {e}") from None
        specs = {n: s for n, s in ((n, model_spec(i)) for n, i in infos.items()) if s}
        # every connection learns the list (a request names models by what it knows)
        for other in self._pool:
            if other is not None and other is not c and other.alive:
                other.learn_models(infos)
        self._models, self._models_at = specs, time.monotonic()
        return specs

    def forget_models(self) -> None:
        """The model list changed (a load or unload): ask the daemon on the next look."""
        self._models_at = -1e9

    async def model(self, name: str, version: str = "") -> ModelSpec:
        models = await self.models()
        m = models.get(name)
        if m is None:
            raise InferError(404, f"unknown model {name[:80]!r}; served: "
                                  f"{', '.join(sorted(models)) or 'none'}")
        if version not in ("", VERSION):
            raise InferError(404, f"model {name!r} has no version {version[:20]!r} (versions: "
                                  f"{VERSION})")
        return m

    # -- inference -------------------------------------------------------------------
    @asynccontextmanager
    async def _session(self, m: ModelSpec, what: str) -> AsyncIterator[AsyncClient]:
        """A connection for one request of ``m``; the client library's errors as KServe
        statuses (``what``: the model did not ``what`` in time)."""
        c = await self._client()
        try:
            yield c
        except ValueError as e:                  # the request's own arguments
            raise InferError(400, str(e)) from None
        except ResultTimeout:
            raise InferError(504, f"model {m.name!r} did not {what} within {self.timeout} s") \
                from None
        except RequestFailed as e:
            raise InferError(_FAILED_STATUS.get(e.status, 500),
                             f"model {m.name!r} failed: {e.reason}") from None
        except (DaemonGone, DaemonUnavailable) as e:
            c.close()
            raise InferError(503, f"lost the paella daemon: {e}") from None
        except PaellaError as e:        # unknown model (reloaded away), arena full, ...
            raise InferError(503, f"{type(e).__name__}: {e}") from None

    async def infer(self, m: ModelSpec, inputs: Mapping[str, np.ndarray],
                    priority: int = 0, timeout: float | None = None) -> dict[str, np.ndarray]:
        """Run ``inputs`` (checked against ``m`` by the caller) through the daemon, at
        ``priority`` (the request's ``priority`` parameter; see :func:`request_priority`),
        within ``timeout`` seconds (the request's own, at most the front end's)."""
        missing = [t.name for t in m.inputs if t.name not in inputs]
        if missing:
            raise InferError(400, f"model {m.name!r} needs the input(s) {', '.join(missing)}")
        limit = self.timeout if timeout is None else min(timeout, self.timeout)
        async with self._session(m, "answer") as c:
            return await c.infer(m.name, inputs, timeout=limit, priority=priority)

    async def generate(self, m: ModelSpec, prompt_ids: list[int], max_tokens: int,
                       priority: int = 0) -> AsyncIterator[int]:
        """The tokens of a generation by a generative model (one served by a streaming
        scheduler such as ``orca``), as the daemon streams them. A refusal before the
        first token raises :class:`InferError` from the first ``__anext__``, so a stream
        can still answer with an error status; a failure later raises it mid-stream. A
        caller that stops early (``aclose``) leaves the generation to finish in the
        daemon, which the client library then drops."""
        async with self._session(m, "finish") as c:
            gen = c.generate(m.name, prompt_ids, max_tokens, timeout=self.timeout,
                             priority=priority)
            try:
                async for tok in gen:
                    yield tok
            finally:
                await gen.aclose()


def request_priority(value: object) -> int:
    """The ``priority`` request parameter (Triton's KServe extension: 1 is the highest
    level, 0 or absent none), checked: what Client.infer takes (``paella.wire``)."""
    if value is None:
        return 0
    if type(value) is not int or not 0 <= value <= wire.MAX_PRIORITY:
        raise InferError(400, f"parameter priority must be an integer 0..{wire.MAX_PRIORITY} "
                              f"(1 the highest, 0 none), got {str(value)[:20]!r}")
    return value
