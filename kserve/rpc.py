"""The KServe v2 API over gRPC on grpc.aio (the protocol's own
``inference.GRPCInferenceService`` from ``grpc_predict_v2.proto``, served through generic
handlers: no generated stubs), in the front end's one event loop.

Errors are gRPC statuses with the message: INVALID_ARGUMENT (400), NOT_FOUND (404),
PERMISSION_DENIED (403), UNAVAILABLE (503), DEADLINE_EXCEEDED (504), INTERNAL (500). A
message larger than ``max_body`` is refused by grpcio itself (RESOURCE_EXHAUSTED).

``ModelStreamInfer`` (Triton's streaming call) takes any number of requests on one
stream and answers each as it completes, matched by ``id``: one response for an
ordinary model, and for a generative model one response per token (output ``token``,
INT32 [1]; parameter ``index``) then a last, empty one whose parameter
``triton_final_response`` is true, as Triton's decoupled models answer. A request that
fails is a response with ``error_message``; the stream goes on. A generative request
gives the model's inputs (``prompt`` padded to its capacity and ``lengths`` = [prompt
length, max tokens]) or, shorter, ``prompt_ids`` (INT32 [n]) and the parameter
``max_tokens``. At most ``STREAM_INFLIGHT`` requests of one stream run at once; a client
that stops reading stops its stream's progress (gRPC's flow control), nobody else's.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Callable

import grpc
import numpy as np

from . import grpc_predict_v2_pb2 as pb
from .repository_control import RepositoryControl, check_parameters
from .rest_body import request_timeout
from .service import VERSION, InferenceService, ModelSpec, request_priority
from .tensors import InferError, check_input, from_bytes

log = logging.getLogger("paella.kserve")

SERVICE = "inference.GRPCInferenceService"
_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 403: grpc.StatusCode.PERMISSION_DENIED,
          404: grpc.StatusCode.NOT_FOUND, 409: grpc.StatusCode.ABORTED,
          411: grpc.StatusCode.INVALID_ARGUMENT, 413: grpc.StatusCode.RESOURCE_EXHAUSTED,
          503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED}
#: InferTensorContents field of each datatype (the typed alternative to raw contents).
_CONTENTS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
             "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents",
             "UINT16": "uint_contents", "UINT32": "uint_contents", "UINT64": "uint64_contents",
             "FP32": "fp32_contents", "FP64": "fp64_contents"}
#: Requests of one stream served at once (more wait for one to finish).
STREAM_INFLIGHT = 64


def _param(params, name: str) -> Any:
    """A request parameter's value (whichever of InferParameter's fields holds it)."""
    if name not in params:
        return None
    p = params[name]
    kind = p.WhichOneof("parameter_choice")
    return getattr(p, kind) if kind else None


class Servicer:
    """The RPCs, each a coroutine of (request, context)."""

    def __init__(self, service: InferenceService, control: RepositoryControl):
        self.svc = service
        self.control = control

    async def ServerLive(self, req: pb.ServerLiveRequest, ctx) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, req: pb.ServerReadyRequest, ctx) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=await self.svc.ready())

    async def ModelReady(self, req: pb.ModelReadyRequest, ctx) -> pb.ModelReadyResponse:
        try:
            await self.svc.model(req.name, req.version)
        except InferError as e:
            if e.status != 404:
                raise
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=True)

    async def ServerMetadata(self, req: pb.ServerMetadataRequest, ctx
                             ) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(**self.svc.server_metadata())

    async def ModelMetadata(self, req: pb.ModelMetadataRequest, ctx) -> pb.ModelMetadataResponse:
        md = (await self.svc.model(req.name, req.version)).metadata()
        tensors = lambda ts: [pb.ModelMetadataResponse.TensorMetadata(**t) for t in ts]  # noqa: E731
        return pb.ModelMetadataResponse(name=md["name"], versions=md["versions"],
                                        platform=md["platform"], inputs=tensors(md["inputs"]),
                                        outputs=tensors(md["outputs"]))

    async def ModelInfer(self, req: pb.ModelInferRequest, ctx) -> pb.ModelInferResponse:
        m = await self.svc.model(req.model_name, req.model_version)
        inputs = read_inputs(m, req)
        names = _requested(m, req)
        outputs = await self.svc.infer(m, inputs, request_priority(_param(req.parameters,
                                                                          "priority")),
                                       _timeout(req))
        resp = pb.ModelInferResponse(model_name=m.name, model_version=VERSION, id=req.id)
        by_name = {t.name: t for t in m.outputs}
        for name in names:
            spec = by_name[name]
            resp.outputs.add(name=name, datatype=spec.datatype, shape=list(spec.shape))
            resp.raw_output_contents.append(
                np.ascontiguousarray(outputs[name], dtype=spec.dtype.newbyteorder("<")).tobytes())
        return resp

    # -- streaming -------------------------------------------------------------------
    async def ModelStreamInfer(self, bodies: AsyncIterator[bytes], ctx) -> None:
        # Responses go out with ctx.write inside a try, not by yielding: a generator that
        # yields into a cancelled call makes grpc log a traceback per stream.
        out: asyncio.Queue = asyncio.Queue(maxsize=STREAM_INFLIGHT)
        room = asyncio.Semaphore(STREAM_INFLIGHT)
        tasks: set[asyncio.Task] = set()

        async def serve(body: bytes) -> None:
            try:
                async for resp in self._stream_one(body):
                    await out.put(resp)
            finally:
                room.release()

        async def read() -> None:
            try:
                async for body in bodies:
                    await room.acquire()
                    t = asyncio.ensure_future(serve(body))
                    tasks.add(t)
                    t.add_done_callback(tasks.discard)
                if tasks:
                    await asyncio.gather(*tasks, return_exceptions=True)
            except asyncio.CancelledError:
                raise                             # (the call is over: nobody reads out)
            except Exception:  # noqa: BLE001 - the client's half broke: end the stream
                pass
            await out.put(None)

        reader = asyncio.ensure_future(read())
        try:
            while (resp := await out.get()) is not None:
                await ctx.write(resp)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - the call ended under us (cancelled, reset)
            return
        finally:
            reader.cancel()
            for t in list(tasks):
                t.cancel()

    async def _stream_one(self, body: bytes) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """The responses to one request of a stream (an error is a response too)."""
        rid = ""
        try:
            req = _decode(pb.ModelInferRequest, body)
            rid = req.id
            m = await self.svc.model(req.model_name, req.model_version)
            if m.generative:
                async for resp in self._generation(m, req):
                    yield resp
                return
            resp = await self.ModelInfer(req, None)
            resp.parameters["triton_final_response"].bool_param = True
            yield pb.ModelStreamInferResponse(infer_response=resp)
        except InferError as e:
            yield _stream_error(rid, str(e))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a bug fails this request only
            log.exception("KServe gRPC stream request failed")
            yield _stream_error(rid, f"internal error: {type(e).__name__}: {e}")

    async def _generation(self, m: ModelSpec, req: pb.ModelInferRequest
                          ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        prompt, max_tokens = generation_inputs(m, req)
        tokens = self.svc.generate(m, prompt, max_tokens,
                                   request_priority(_param(req.parameters, "priority")))
        n = 0
        try:
            async for tok in tokens:
                r = pb.ModelInferResponse(model_name=m.name, model_version=VERSION, id=req.id)
                r.outputs.add(name="token", datatype="INT32", shape=[1])
                r.raw_output_contents.append(np.int32(tok).tobytes())
                r.parameters["index"].int64_param = n
                r.parameters["triton_final_response"].bool_param = False
                yield pb.ModelStreamInferResponse(infer_response=r)
                n += 1
        finally:
            await tokens.aclose()
        last = pb.ModelInferResponse(model_name=m.name, model_version=VERSION, id=req.id)
        last.parameters["triton_final_response"].bool_param = True
        last.parameters["n_tokens"].int64_param = n
        yield pb.ModelStreamInferResponse(infer_response=last)

    # -- model control ---------------------------------------------------------------
    async def RepositoryIndex(self, req: pb.RepositoryIndexRequest, ctx
                              ) -> pb.RepositoryIndexResponse:
        models = await self.control.index(req.ready)
        return pb.RepositoryIndexResponse(models=[
            pb.RepositoryIndexResponse.ModelIndex(
                name=str(m.get("name", "")), version=str(m.get("version", "")),
                state=str(m.get("state", "")), reason=str(m.get("reason", "")))
            for m in models])

    async def RepositoryModelLoad(self, req: pb.RepositoryModelLoadRequest, ctx
                                  ) -> pb.RepositoryModelLoadResponse:
        check_parameters("load", req.parameters)
        await self.control.load(req.model_name)
        self.svc.forget_models()
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, req: pb.RepositoryModelUnloadRequest, ctx
                                    ) -> pb.RepositoryModelUnloadResponse:
        check_parameters("unload", req.parameters)
        await self.control.unload(req.model_name)
        self.svc.forget_models()
        return pb.RepositoryModelUnloadResponse()


def _timeout(req: pb.ModelInferRequest) -> float | None:
    t = _param(req.parameters, "timeout")
    return request_timeout({} if t is None else {"timeout": t})


def _requested(m: ModelSpec, req: pb.ModelInferRequest) -> list[str]:
    """The outputs asked for (all by default), checked before the daemon runs it."""
    by_name = {t.name: t for t in m.outputs}
    names = [o.name for o in req.outputs] or list(by_name)
    for name in names:
        if name not in by_name:
            raise InferError(400, f"model {m.name!r} has outputs {', '.join(by_name)}; "
                                  f"asked for {name[:40]!r}")
    return names


def _stream_error(rid: str, message: str) -> pb.ModelStreamInferResponse:
    r = pb.ModelStreamInferResponse(error_message=message)
    r.infer_response.id = rid
    return r


def generation_inputs(m: ModelSpec, req: pb.ModelInferRequest) -> tuple[list[int], int]:
    """A generative request's prompt and token budget: from ``prompt_ids`` and the
    ``max_tokens`` parameter, or from the model's own inputs."""
    names = [t.name for t in req.inputs]
    if names == ["prompt_ids"]:
        t = req.inputs[0]
        if t.datatype != "INT32" or len(t.shape) != 1 or not 0 <= t.shape[0] <= 1 << 20:
            raise InferError(400, "prompt_ids must be INT32 [n]")
        raw = list(req.raw_input_contents)
        if raw:
            if len(raw) != 1 or len(raw[0]) != 4 * t.shape[0]:
                raise InferError(400, f"prompt_ids INT32 [{t.shape[0]}] is "
                                      f"{4 * t.shape[0]} bytes")
            ids = np.frombuffer(raw[0], "<i4").tolist()
        else:
            ids = list(t.contents.int_contents)
            if len(ids) != t.shape[0]:
                raise InferError(400, f"prompt_ids: shape [{t.shape[0]}], {len(ids)} values")
        budget = _param(req.parameters, "max_tokens")
        if type(budget) is not int or not 0 <= budget < 2 ** 31:
            raise InferError(400, "a generation with prompt_ids needs the parameter "
                                  "max_tokens: an integer 0..2**31-1")
        if any(not 0 <= i < 2 ** 31 for i in ids):
            raise InferError(400, "prompt_ids must be token ids in 0..2**31-1")
        return ids, budget
    inputs = read_inputs(m, req)
    length, budget = (int(v) for v in inputs["lengths"].reshape(-1)[:2])
    prompt = inputs["prompt"].reshape(-1)
    if not 0 <= length <= prompt.size or budget < 0:
        raise InferError(400, f"lengths must be [prompt length 0..{prompt.size}, max tokens "
                              f">= 0], got [{length}, {budget}]")
    return prompt[:length].tolist(), budget


def read_inputs(m: ModelSpec, req: pb.ModelInferRequest) -> dict[str, np.ndarray]:
    """The inputs, from ``raw_input_contents`` (one per input, in order: what tritonclient
    sends) or each input's typed ``contents``."""
    if not req.inputs:
        raise InferError(400, "request needs inputs")
    raw = list(req.raw_input_contents)
    if raw and len(raw) != len(req.inputs):
        raise InferError(400, f"{len(raw)} raw_input_contents for {len(req.inputs)} inputs")
    out: dict[str, np.ndarray] = {}
    for i, t in enumerate(req.inputs):
        spec = m.input(t.name)
        if spec.name in out:
            raise InferError(400, f"input {spec.name!r} given twice")
        check_input(spec, m.name, t.datatype, list(t.shape))
        if raw:
            out[spec.name] = from_bytes(spec, raw[i])
            continue
        field = _CONTENTS.get(spec.datatype)
        values = getattr(t.contents, field) if field else []
        n = int(np.prod(spec.shape, dtype=np.int64))
        if len(values) != n:
            raise InferError(400, f"input {spec.name!r}: shape {list(spec.shape)} needs {n} "
                                  f"elements in contents.{field or '(raw only for FP16)'}, "
                                  f"got {len(values)}")
        with np.errstate(all="ignore"):
            out[spec.name] = np.asarray(values).astype(spec.dtype).reshape(spec.shape)
    return out


def _decode(cls: Any, body: bytes) -> Any:
    # The body is decoded here, not by grpcio: a deserializer that raises makes grpcio
    # answer INTERNAL ("Exception deserializing request!"), which blames the server for
    # the client's bytes. Here they get INVALID_ARGUMENT naming the message expected.
    try:
        return cls.FromString(body)
    except Exception as e:  # noqa: BLE001 - DecodeError, or protobuf's own limits
        raise InferError(400, f"the request is not a valid inference.{cls.__name__} message "
                              f"({type(e).__name__}: {e}); send one encoded as "
                              f"grpc_predict_v2.proto says") from None


def _unary(fn: Callable, req_cls: Any, resp_cls: Any) -> grpc.RpcMethodHandler:
    async def call(body: bytes, ctx: grpc.aio.ServicerContext):
        try:
            return await fn(_decode(req_cls, body), ctx)
        except InferError as e:
            await ctx.abort(_CODES.get(e.status, grpc.StatusCode.INTERNAL), str(e))
        except Exception as e:  # noqa: BLE001 - a bug fails this call only
            if isinstance(e, grpc.aio.AbortError):
                raise
            log.exception("KServe gRPC %s failed", fn.__name__)
            await ctx.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}")
    return grpc.unary_unary_rpc_method_handler(call,
                                               response_serializer=resp_cls.SerializeToString)


def make_server(service: InferenceService, addr: str, control: RepositoryControl | None = None,
                max_body: int = 64 << 20, options: tuple[tuple[str, Any], ...] = ()
                ) -> tuple[grpc.aio.Server, int]:
    """A grpc.aio server bound to ``addr`` ("host:port"), to be started in the running
    loop; returns it and the port it bound (``:0`` picks one). ``options``: more grpc
    channel arguments.

    The port is bound without ``SO_REUSEPORT`` (grpc's default is on): with it, a second
    server on the same port (a stale one, another ``paella kserve``, the cluster's
    ingress) would silently take half of the connections; without it, a port in use is
    an :class:`OSError` here."""
    s = Servicer(service, control or RepositoryControl(service.socket, allowed=False))
    handlers = {name: _unary(getattr(s, name), getattr(pb, f"{name}Request"),
                             getattr(pb, f"{name}Response"))
                for name in ("ServerLive", "ServerReady", "ModelReady", "ServerMetadata",
                             "ModelMetadata", "ModelInfer", "RepositoryIndex",
                             "RepositoryModelLoad", "RepositoryModelUnload")}
    handlers["ModelStreamInfer"] = grpc.stream_stream_rpc_method_handler(
        s.ModelStreamInfer,
        response_serializer=pb.ModelStreamInferResponse.SerializeToString)
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", max_body),
                                      ("grpc.max_send_message_length", max_body),
                                      ("grpc.max_concurrent_streams", 256),
                                      ("grpc.so_reuseport", 0), *options])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = server.add_insecure_port(addr)
    if port == 0:
        raise OSError(f"cannot bind the gRPC port {addr}")
    return server, port
