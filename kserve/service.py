"""What the KServe v2 front end does, whatever the transport (REST or gRPC).

It is a local client of the daemon: a small pool of :class:`paella.client.Client`
connections, one taken by each request being served, so a remote request goes through
the same shared-memory rings as a local one (one copy of its inputs into the arena,
one of its outputs out). A connection the daemon dropped is replaced on the next
request; while no daemon answers, ``ready`` is false and inference answers 503.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Mapping

import numpy as np

from paella import wire
from paella.client import (Client, DaemonGone, DaemonUnavailable, PaellaError, RequestFailed,
                           ResultTimeout, connect)

from .tensors import InferError, TensorSpec, spec_of

log = logging.getLogger("paella.kserve")

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
                         tuple(spec_of(t.name, t.dtype, t.shape) for t in v.outputs))
    except ValueError as e:
        log.warning("model %s not offered over KServe: %s", info.name, e)
        return None


class InferenceService:
    """The front end's logic. ``clients``: connections to the daemon, at most as many
    requests in flight at once; ``timeout``: seconds an inference may take."""

    #: Seconds the model list is reused before asking the daemon again (SIGHUP reloads).
    MODELS_TTL = 1.0

    def __init__(self, socket: str, clients: int = 4, timeout: float = 30.0,
                 name: str = "paella", version: str = "0"):
        if clients < 1:
            raise ValueError(f"clients must be >= 1, got {clients}")
        self.socket = socket
        self.timeout = timeout
        self.name, self.version = name, version
        self._idle: queue.LifoQueue[Client] = queue.LifoQueue()
        self._slots = threading.BoundedSemaphore(clients)
        self._lock = threading.Lock()
        self._models: dict[str, ModelSpec] = {}
        self._models_at = -1e9

    # -- connections -----------------------------------------------------------------
    def _take(self, wait: bool = True) -> Client | None:
        """A connection (made if none is idle); None if ``wait`` is false and all are busy."""
        if not wait:
            if not self._slots.acquire(blocking=False):
                return None
        elif not self._slots.acquire(timeout=self.timeout):
            raise InferError(503, f"all {self._slots._initial_value} connections to the daemon "
                                  f"stayed busy for {self.timeout} s")
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            pass
        try:
            # socket mode: the server's threads share one interpreter, and a hybrid or
            # polling waiter spins holding the GIL (paella perf measured 0.34 against
            # 0.10 ms p50 for echo, one thread, on this host)
            return connect(self.socket, mode="socket", timeout=min(self.timeout, 5.0))
        except DaemonUnavailable as e:
            self._slots.release()
            raise InferError(503, f"the paella daemon is unavailable: {e}") from None

    def _give(self, c: Client, broken: bool = False) -> None:
        if broken:
            c.close()
        else:
            self._idle.put(c)
        self._slots.release()

    def close(self) -> None:
        while True:
            try:
                self._idle.get_nowait().close()
            except queue.Empty:
                return

    # -- health and metadata ---------------------------------------------------------
    def server_metadata(self) -> dict:
        return {"name": self.name, "version": self.version, "extensions": EXTENSIONS}

    def ready(self) -> bool:
        """A daemon answers (a connection is made or kept)."""
        try:
            self.models()
        except InferError:
            return False
        return True

    def models(self) -> dict[str, ModelSpec]:
        with self._lock:
            if time.monotonic() - self._models_at < self.MODELS_TTL:
                return self._models
            known = self._models_at > 0
        # With a list already known, a refresh never waits for a busy connection: health
        # checks and metadata stay instant under load (the list is then a little older).
        c = self._take(wait=not known)
        if c is None:
            return self._models
        broken = False
        try:
            infos = c.list_models(timeout=self.timeout)
        except PaellaError as e:
            broken = True
            raise InferError(503, f"the paella daemon is unavailable: {e}") from None
        finally:
            self._give(c, broken)
        specs = {n: s for n, s in ((n, model_spec(i)) for n, i in infos.items()) if s}
        with self._lock:
            self._models, self._models_at = specs, time.monotonic()
        return specs

    def model(self, name: str, version: str = "") -> ModelSpec:
        m = self.models().get(name)
        if m is None:
            raise InferError(404, f"unknown model {name[:80]!r}; served: "
                                  f"{', '.join(sorted(self.models())) or 'none'}")
        if version not in ("", VERSION):
            raise InferError(404, f"model {name!r} has no version {version[:20]!r} (versions: "
                                  f"{VERSION})")
        return m

    # -- inference -------------------------------------------------------------------
    @contextmanager
    def _session(self, m: ModelSpec, what: str) -> Iterator[Client]:
        """A connection for one request of ``m``, given back after it; the client
        library's errors as KServe statuses (``what``: the model did not ``what`` in
        time)."""
        c = self._take()
        broken = False
        try:
            yield c
        except ValueError as e:                  # the request's own arguments
            raise InferError(400, str(e)) from None
        except ResultTimeout:
            raise InferError(504, f"model {m.name!r} did not {what} within {self.timeout} s") \
                from None
        except RequestFailed as e:
            raise InferError(500, f"model {m.name!r} failed: {e.reason}") from None
        except (DaemonGone, DaemonUnavailable) as e:
            broken = True
            raise InferError(503, f"lost the paella daemon: {e}") from None
        except PaellaError as e:        # unknown model (reloaded away), arena full, ...
            raise InferError(503, f"{type(e).__name__}: {e}") from None
        finally:
            self._give(c, broken)

    def infer(self, m: ModelSpec, inputs: Mapping[str, np.ndarray],
              priority: int = 0) -> dict[str, np.ndarray]:
        """Run ``inputs`` (checked against ``m`` by the caller) through the daemon, at
        ``priority`` (the request's ``priority`` parameter; see :func:`request_priority`)."""
        missing = [t.name for t in m.inputs if t.name not in inputs]
        if missing:
            raise InferError(400, f"model {m.name!r} needs the input(s) {', '.join(missing)}")
        with self._session(m, "answer") as c:
            return c.infer(m.name, inputs, timeout=self.timeout, priority=priority)

    def generate(self, m: ModelSpec, prompt_ids: list[int], max_tokens: int,
                 priority: int = 0) -> Iterator[int]:
        """The tokens of a generation by a generative model (one served by a streaming
        scheduler such as ``orca``), as the daemon streams them (``Client.generate``).
        A refusal before the first token raises :class:`InferError` from the first
        ``next()``, so a stream can still answer with an error status; a failure later
        raises it mid-stream. The connection is held until the iterator is exhausted
        or closed (a caller that stops early: the daemon finishes the generation and
        the client library drops what remains)."""
        with self._session(m, "finish") as c:
            yield from c.generate(m.name, prompt_ids, max_tokens, timeout=self.timeout,
                                  priority=priority)


def request_priority(value: object) -> int:
    """The ``priority`` request parameter (Triton's KServe extension: 1 is the highest
    level, 0 or absent none), checked: what Client.infer takes (``paella.wire``)."""
    if value is None:
        return 0
    if type(value) is not int or not 0 <= value <= wire.MAX_PRIORITY:
        raise InferError(400, f"parameter priority must be an integer 0..{wire.MAX_PRIORITY} "
                              f"(1 the highest, 0 none), got {str(value)[:20]!r}")
    return value
