"""The cluster's ingress: KServe v2 over REST and gRPC, the front end's own implementation.

Ray Serve's HTTP proxy hands each request to an ingress replica as ASGI, and
``@serve.ingress`` accepts any ASGI application, so the ingress *is*
:class:`paella.kserve.rest.KServeApp`: the same routes, parsing, checks and encodings as
``paella kserve``. Only what is behind it changes: :class:`ClusterService` is the front
end's :class:`~paella.kserve.service.InferenceService` whose inference goes to a GPU
replica through a Ray deployment handle (routed by :mod:`.ray_router`) instead of to a
local daemon.

gRPC (``[grpc] port`` in the config) is the front end's own grpc.aio server
(:func:`paella.kserve.rpc.make_server`: the same servicer, ``ModelStreamInfer``
included) over a :class:`ClusterService` on the same replicas' handle, started when the
ingress replica starts and stopped, with a grace, when Ray stops it. It runs on an
event loop and thread of its own (:class:`GrpcThread`): with grpc.aio on the replica's
own loop, about one fresh cluster in five never routed a request from its ingress (REST
included); in its own loop, none in 14 tries. Ray
Serve's own gRPC proxy is not used: it needs generated ``*_pb2_grpc`` servicer modules
and does not carry bidirectional streams. The port is bound without ``SO_REUSEPORT``
(as every server of :func:`~paella.kserve.rpc.make_server`): a port in use fails the
replica, naming it. One ingress replica per node (``max_replicas_per_node=1``), placed
on the node that runs ``paella cluster``, so the port is bound once, where the command
says it is.

Faults. A request whose replica lost its daemon (or whose replica died) was not
answered: it is sent once more, to another replica if there is one (``avoid``), within
what is left of its timeout. A second failure, or a timeout, is the request's answer:
a clear 503 or 504. A request is never sent again once a replica answered it, so it is
answered at most once.

Not served through the cluster: generation (``generate``, ``generate_stream``, the
OpenAI API: 501; a generative model's request on ``ModelStreamInfer``: that stream's
``error_message``), and loading or unloading models (403, PERMISSION_DENIED: the
config's models and placement say what each replica serves). The repository index is
the config's models (:class:`ClusterControl`). See docs/cluster.md.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, AsyncIterator, Mapping

import numpy as np

from paella.kserve.repository_control import RepositoryControl
from paella.kserve.rest import KServeApp
from paella.kserve.service import VERSION, InferenceService, ModelSpec
from paella.kserve.tensors import InferError

from .ray_config import ClusterConfig
from .ray_replica import ReplicaFailure

log = logging.getLogger("paella.cluster")


class ClusterService(InferenceService):
    """The front end's service over the cluster's replicas (see the module docstring).
    ``handle``: the GPU replicas' deployment handle."""

    def __init__(self, handle: Any, models: tuple[str, ...], timeout: float,
                 name: str = "paella-cluster"):
        super().__init__(socket="", clients=1, timeout=timeout, name=name)
        self.handle = handle
        self.names = models

    async def _fetch_models(self) -> dict[str, ModelSpec]:
        """Each configured model's tensors, from a replica that serves it. A model no
        replica answers for within 5 s keeps what was known of it (a model's tensors
        do not change in a cluster), or stays out (not ready) until the next look."""
        got = await asyncio.gather(*(self._call("spec", m, min(self.timeout, 5.0))
                                     for m in self.names), return_exceptions=True)
        specs = {m: s if isinstance(s, ModelSpec) else self._models.get(m)
                 for m, s in zip(self.names, got)}
        specs = {m: s for m, s in specs.items() if s is not None}
        if not specs:
            why = next((str(e) for e in got if isinstance(e, BaseException)), "none ready")
            raise InferError(503, f"no replica of the cluster answers: {why}")
        self._models, self._models_at = specs, time.monotonic()
        return specs

    async def _remote(self, method: str, **kwargs: Any) -> Any:
        """``handle.METHOD.remote(**kwargs)``'s result, as a request of its own.

        Ray Serve gives every call made while serving one HTTP request that request's
        internal id, and its request router hands a chosen replica to the pending call
        *with that id*: two calls of one request in flight at once (the model list's
        concurrent lookups, a background refresh beside an inference) would get each
        other's replicas, so a call could land on a replica without its model, or
        never be routed. Each call here runs in its own task (``wait_for``), with a
        fresh internal id set in that task's copy of the request context."""
        from ray.serve._private.utils import generate_request_id
        from ray.serve.context import _set_request_context
        _set_request_context(_internal_request_id=generate_request_id())
        return await getattr(self.handle, method).remote(**kwargs)

    async def infer(self, m: ModelSpec, inputs: Mapping[str, np.ndarray],
                    priority: int = 0, timeout: float | None = None) -> dict[str, np.ndarray]:
        """The inference on a replica the router picks (see :meth:`_call`)."""
        limit = self.timeout if timeout is None else min(timeout, self.timeout)
        return await self._call("infer", m.name, limit, inputs=dict(inputs),
                                priority=priority)

    async def _call(self, method: str, model: str, limit: float, **kwargs: Any) -> Any:
        """``method`` of a replica serving ``model``, within ``limit`` seconds; sent once
        more, to another replica if there is one, if the first lost its daemon (or
        died) under it. An :class:`InferError` otherwise: the replica's own failure,
        the second loss, or a timeout (504)."""
        deadline = time.monotonic() + limit
        avoid = None
        for attempt in (1, 2):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            extra = {"timeout": left} if method == "infer" else {}
            try:
                return await asyncio.wait_for(
                    self._remote(method, model=model, avoid=avoid, **extra, **kwargs), left)
            except asyncio.TimeoutError:
                break
            except Exception as e:  # noqa: BLE001 - sorted below: retry, or the answer
                failure = _failure(e)
                if failure is None:
                    raise InferError(500, f"internal error: {type(e).__name__}: {e}") from None
                if not failure.daemon_lost or attempt == 2:
                    raise InferError(failure.status, failure.message) from None
                log.warning("retrying a request of %s: %s", model, failure.message)
                avoid = failure.replica or None
        raise InferError(504, f"model {model!r} did not answer within {limit:g} s "
                              f"(the cluster's replicas)")

    async def generate(self, m: ModelSpec, prompt_ids: list[int], max_tokens: int,
                       priority: int = 0) -> AsyncIterator[int]:
        raise InferError(501, "generation is not served through paella cluster yet; "
                              "use paella kserve on one daemon")
        yield 0                                                  # (an async generator)

    def close(self) -> None:
        pass


class ClusterControl(RepositoryControl):
    """Triton's model-repository extension through the cluster, for REST and gRPC: the
    index is the config's models (READY while a replica answers for the model,
    UNAVAILABLE otherwise); loading and unloading are refused (403)."""

    def __init__(self, service: ClusterService):
        super().__init__("", allowed=False)
        self.service = service

    def _check(self) -> None:
        raise InferError(403, "model control is not served through paella cluster: the "
                              "config's models and placement say what each replica serves")

    async def index(self, ready_only: bool = False) -> list[dict]:
        try:
            ready = await self.service.models()
        except InferError:
            ready = {}
        rows = [{"name": m, "version": VERSION, "state": "READY"} if m in ready else
                {"name": m, "version": VERSION, "state": "UNAVAILABLE",
                 "reason": "no replica answers for it"} for m in self.service.names]
        return [r for r in rows if r["state"] == "READY"] if ready_only else rows


def _failure(e: BaseException) -> ReplicaFailure | None:
    """What a replica's failure means for the request: a :class:`ReplicaFailure` (its
    own, as Ray re-raises it), one standing for a dead replica (retried like a lost
    daemon), or None (anything else: a bug)."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
    cause = getattr(e, "cause", None)          # (Ray's RayTaskError wraps the original)
    if isinstance(cause, ReplicaFailure):
        return cause
    if isinstance(e, ReplicaFailure):
        return ReplicaFailure(e.status, e.message, e.replica, e.daemon_lost)
    if isinstance(e, (ActorDiedError, ActorUnavailableError, RayActorError)):
        return ReplicaFailure(503, f"a replica died under the request: {e}", "", True)
    return None


#: Seconds the gRPC server gives calls in flight when the ingress replica stops.
GRPC_GRACE_S = 5.0


async def start_grpc(service: InferenceService, host: str, port: int,
                     control: RepositoryControl | None = None) -> Any:
    """The front end's gRPC server over ``service`` on ``host:port``, started in the
    running loop; an :class:`OSError` naming the address if it cannot bind."""
    from paella.kserve.rpc import make_server
    try:
        server, _ = make_server(service, f"{host}:{port}", control)
    except (OSError, RuntimeError) as e:
        raise OSError(f"the ingress cannot listen for gRPC on {host}:{port} (in use?): "
                      f"{e}") from None
    await server.start()
    log.info("KServe v2 gRPC on %s:%d", host, port)
    return server


class GrpcThread:
    """The gRPC server on an event loop and thread of its own, over a
    :class:`ClusterService` of its own on the same replicas' handle: the replica's own
    loop (REST, Ray's calls) does not carry grpc.aio. Raises :class:`OSError` naming the
    address if the port cannot be bound."""

    def __init__(self, replicas: Any, config: ClusterConfig):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                       name="paella-grpc")
        self.thread.start()

        async def start() -> Any:
            svc = ClusterService(replicas, config.models, config.timeout_s)
            return await start_grpc(svc, config.grpc_host, config.grpc_port,
                                    ClusterControl(svc))
        try:
            self.server = asyncio.run_coroutine_threadsafe(start(), self.loop).result(60)
        except BaseException:
            self._end()
            raise

    async def stop(self, grace: float) -> None:
        """Stop the server (calls in flight get ``grace`` seconds), then the thread."""
        try:
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
                self.server.stop(grace), self.loop))
        finally:
            self._end()

    def _end(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def ingress_deployment(config: ClusterConfig, node: str | None = None):
    """The ingress deployment class: :class:`KServeApp` on :class:`ClusterService`, and
    the gRPC server on it if the config has a gRPC port. ``node``: the IP of the node
    the ingress runs on (Ray's ``node:IP`` resource; with gRPC, the node of ``paella
    cluster``)."""
    from ray import serve

    class PaellaIngress:
        """Ray Serve's ASGI ingress: the KServe v2 REST front end over the cluster, and
        its gRPC server (:class:`GrpcThread`) if the config has a port."""

        async def __init__(self, replicas: Any):
            self.service = ClusterService(replicas, config.models, config.timeout_s)
            self.control = ClusterControl(self.service)
            self.grpc = None
            if config.grpc_port is not None:
                self.grpc = await asyncio.to_thread(GrpcThread, replicas, config)

        def __serve_build_asgi_app__(self) -> KServeApp:
            return KServeApp(self.service, control=self.control)

        async def __del__(self):
            server, self.grpc = getattr(self, "grpc", None), None
            if server is not None:                   # (calls in flight get the grace)
                await server.stop(GRPC_GRACE_S)

    options: dict[str, Any] = {"num_cpus": 0}
    if node is not None:
        options["resources"] = {f"node:{node}": 0.001}
    return serve.deployment(serve.ingress()(PaellaIngress), name="PaellaIngress",
                            num_replicas=1, max_replicas_per_node=1,
                            # (a gRPC port in use stays in use: a few tries, then failed)
                            max_constructor_retry_count=3,
                            ray_actor_options=options, max_ongoing_requests=1000)
