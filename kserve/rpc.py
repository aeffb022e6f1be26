"""The KServe v2 API over gRPC (grpcio, the protocol's own ``inference.GRPCInferenceService``
from ``grpc_predict_v2.proto``, served through generic handlers: no generated stubs).

Errors are gRPC statuses with the message: INVALID_ARGUMENT (400), NOT_FOUND (404),
UNAVAILABLE (503), DEADLINE_EXCEEDED (504), INTERNAL (500). A message larger than
``max_body`` is refused by grpcio itself (RESOURCE_EXHAUSTED).
"""
from __future__ import annotations

import logging
from concurrent import futures
from typing import Any, Callable

import grpc
import numpy as np

from . import grpc_predict_v2_pb2 as pb
from .service import VERSION, InferenceService, ModelSpec, request_priority
from .tensors import InferError, check_input, from_bytes

log = logging.getLogger("paella.kserve")

SERVICE = "inference.GRPCInferenceService"
_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND,
          411: grpc.StatusCode.INVALID_ARGUMENT, 413: grpc.StatusCode.RESOURCE_EXHAUSTED,
          503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED}
#: InferTensorContents field of each datatype (the typed alternative to raw contents).
_CONTENTS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
             "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents",
             "UINT16": "uint_contents", "UINT32": "uint_contents", "UINT64": "uint64_contents",
             "FP32": "fp32_contents", "FP64": "fp64_contents"}


class Servicer:
    """The RPCs, each a function of (request, context)."""

    def __init__(self, service: InferenceService):
        self.svc = service

    def ServerLive(self, req: pb.ServerLiveRequest, ctx) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    def ServerReady(self, req: pb.ServerReadyRequest, ctx) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.svc.ready())

    def ModelReady(self, req: pb.ModelReadyRequest, ctx) -> pb.ModelReadyResponse:
        try:
            self.svc.model(req.name, req.version)
        except InferError as e:
            if e.status != 404:
                raise
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=True)

    def ServerMetadata(self, req: pb.ServerMetadataRequest, ctx) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(**self.svc.server_metadata())

    def ModelMetadata(self, req: pb.ModelMetadataRequest, ctx) -> pb.ModelMetadataResponse:
        md = self.svc.model(req.name, req.version).metadata()
        tensors = lambda ts: [pb.ModelMetadataResponse.TensorMetadata(**t) for t in ts]  # noqa: E731
        return pb.ModelMetadataResponse(name=md["name"], versions=md["versions"],
                                        platform=md["platform"], inputs=tensors(md["inputs"]),
                                        outputs=tensors(md["outputs"]))

    def ModelInfer(self, req: pb.ModelInferRequest, ctx) -> pb.ModelInferResponse:
        m = self.svc.model(req.model_name, req.model_version)
        inputs = read_inputs(m, req)
        p = req.parameters["priority"] if "priority" in req.parameters else None
        kind = p.WhichOneof("parameter_choice") if p is not None else None
        priority = request_priority(getattr(p, kind) if kind else None)
        outputs = self.svc.infer(m, inputs, priority)
        names = [o.name for o in req.outputs] or [t.name for t in m.outputs]
        by_name = {t.name: t for t in m.outputs}
        resp = pb.ModelInferResponse(model_name=m.name, model_version=VERSION, id=req.id)
        for name in names:
            spec = by_name.get(name)
            if spec is None:
                raise InferError(400, f"model {m.name!r} has outputs {', '.join(by_name)}; "
                                      f"asked for {name[:40]!r}")
            resp.outputs.add(name=name, datatype=spec.datatype, shape=list(spec.shape))
            resp.raw_output_contents.append(
                np.ascontiguousarray(outputs[name], dtype=spec.dtype.newbyteorder("<")).tobytes())
        return resp


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


def _unary(fn: Callable, req_cls: Any, resp_cls: Any) -> grpc.RpcMethodHandler:
    # The body is decoded here, not by grpcio: a deserializer that raises makes grpcio
    # answer INTERNAL ("Exception deserializing request!"), which blames the server for
    # the client's bytes. Here they get INVALID_ARGUMENT naming the message expected.
    def call(body: bytes, ctx):
        try:
            req = req_cls.FromString(body)
        except Exception as e:  # noqa: BLE001 - DecodeError, or protobuf's own limits
            ctx.abort(grpc.StatusCode.INVALID_ARGUMENT,
                      f"the request is not a valid inference.{req_cls.__name__} message "
                      f"({type(e).__name__}: {e}); send one encoded as grpc_predict_v2.proto says")
        try:
            return fn(req, ctx)
        except InferError as e:
            code = _CODES.get(e.status, grpc.StatusCode.INTERNAL)
            ctx.abort(code, str(e))
        except Exception as e:  # noqa: BLE001 - a bug fails this call only
            log.exception("KServe gRPC %s failed", fn.__name__)
            ctx.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}")
    return grpc.unary_unary_rpc_method_handler(call,
                                               response_serializer=resp_cls.SerializeToString)


def make_server(service: InferenceService, addr: str, workers: int = 8,
                max_body: int = 64 << 20) -> tuple[grpc.Server, int]:
    """A started-later grpc server bound to ``addr`` ("host:port"); returns it and the
    port it bound (``:0`` picks one)."""
    s = Servicer(service)
    handlers = {name: _unary(getattr(s, name), getattr(pb, f"{name}Request"),
                             getattr(pb, f"{name}Response"))
                for name in ("ServerLive", "ServerReady", "ModelReady", "ServerMetadata",
                             "ModelMetadata", "ModelInfer")}
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers),
                         options=[("grpc.max_receive_message_length", max_body),
                                  ("grpc.max_send_message_length", max_body)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = server.add_insecure_port(addr)
    if port == 0:
        raise OSError(f"cannot bind the gRPC port {addr}")
    return server, port
