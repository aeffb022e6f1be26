"""The KServe v2 REST API as an ASGI application (served by uvicorn: :mod:`.command`).

    GET  /v2/health/live                            200 while the process runs
    GET  /v2/health/ready                           200 when a daemon answers, else 503
    GET  /v2                                        server metadata
    GET  /v2/models/NAME[/versions/V]               model metadata
    GET  /v2/models/NAME[/versions/V]/ready         200 if served, else 404
    POST /v2/models/NAME[/versions/V]/infer         inference (JSON, binary-tensor extension)
    POST /v2/models/NAME[/versions/V]/generate      a generation, all its tokens at once
    POST /v2/models/NAME[/versions/V]/generate_stream   ... each token as a server-sent event
    POST /v2/repository/index                       model repository: every model, its state
    POST /v2/repository/models/NAME/load            load (or reload) a model
    POST /v2/repository/models/NAME/unload          stop serving a model
    /v1/...                                         the OpenAI-compatible API (:mod:`.openai_api`)

Errors are KServe error bodies, ``{"error": "..."}``, with a 4xx/5xx status. A hostile
body costs its own connection at most (:mod:`.http` bounds it, :mod:`.rest_body` checks
it); any other failure is a 500 for that request, and the server keeps serving.

The generate extension (Triton's ``generate`` and ``generate_stream``, for the daemon's
generative models): the body is JSON, ``{"prompt_ids": [ids], "max_tokens": N,
"parameters": {"priority": P}}`` (``max_tokens`` may also be a parameter). ``generate``
answers ``{"model_name", "model_version", "token_ids"}``; ``generate_stream`` answers
``text/event-stream``, one ``data: {"model_name", "model_version", "token_id",
"index"}`` event per token as the daemon makes it, then ``data: {"model_name",
"model_version", "done": true, "n_tokens"}``. A request the daemon refuses before its
first token gets an error status as ``infer``'s; a failure after it is a last event
``data: {"error": "..."}``.

The application is one object, :class:`KServeApp`, so another ASGI server or framework
can mount it (the multi-GPU deployment's ingress does).
"""
from __future__ import annotations

import json
import logging

from . import http
from .http import ClientGone, Request, Send
from .repository_control import RepositoryControl, check_parameters
from .http import LENGTH
from .rest_body import (HEADER_LENGTH, body_limit, encode_response, generate_args, params_of,
                        parse_json, read_inputs, request_timeout, requested_outputs)
from .service import VERSION, InferenceService, ModelSpec, request_priority
from .tensors import InferError

log = logging.getLogger("paella.kserve")

_POSTS = ("infer", "generate", "generate_stream")


class KServeApp:
    """The ASGI application: KServe v2 under ``/v2``, OpenAI's API under ``/v1`` (when
    ``openai`` is given), model control under ``/v2/repository`` (``control``)."""

    def __init__(self, service: InferenceService, max_body: int = 64 << 20,
                 control: RepositoryControl | None = None, openai=None):
        self.service = service
        self.max_body = max_body
        self.control = control or RepositoryControl(service.socket, allowed=False)
        self.openai = openai

    async def __call__(self, scope: dict, receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return await _lifespan(receive, send)
        if scope["type"] != "http":
            return                            # (websockets: not served)
        req = Request.of(scope, receive, self.max_body)
        if self.openai is not None and req.path.startswith("/v1/"):
            return await self.openai(req, send)
        try:
            await self._route(req, send)
        except InferError as e:
            if req.method == "POST" and not req.close and e.status == 404:
                await req.discard_body()
            await http.respond_json(send, e.status, {"error": str(e)}, close=req.close, linger=req)
        except ClientGone:
            pass
        except Exception as e:  # noqa: BLE001 - a bug fails this request only
            log.exception("KServe %s %s failed", req.method, req.path[:200])
            try:
                await http.respond_json(send, 500, {"error": f"internal error: "
                                                             f"{type(e).__name__}: {e}"},
                                        close=True)
            except Exception:  # noqa: BLE001 - the answer had started, or the peer left
                pass

    async def _route(self, req: Request, send: Send) -> None:
        path, svc = req.path, self.service
        if req.method in ("GET", "HEAD"):
            if path == "/v2/health/live":
                return await http.respond(send, 200)
            if path == "/v2/health/ready":
                return await http.respond(send, 200 if await svc.ready() else 503)
            if path in ("/v2", "/v2/"):
                return await http.respond_json(send, 200, svc.server_metadata())
        where = http.segments(path, "/v2/repository")
        if where is not None and req.method == "POST":
            return await self._repository(req, send, where)
        parts = http.segments(path, "/v2/models/")
        if parts is None or not parts or not parts[0]:
            raise InferError(404, f"no such endpoint: {req.method} {path[:200]}")
        name, version, what = _model_route(parts)
        if what is None:
            raise InferError(404, f"no such endpoint: {req.method} {path[:200]}")
        if req.method == "POST" and what in _POSTS:
            m = await svc.model(name, version)
            body = await req.body(*body_limit(m, what))
            if what == "infer":
                status, payload, headers = await self._infer(m, req, body)
                return await http.respond(send, status, payload, headers)
            return await self._generate(m, body, send, stream=what == "generate_stream")
        if req.method in ("GET", "HEAD") and what in ("", "ready"):
            if what == "ready":
                try:
                    await svc.model(name, version)
                except InferError as e:
                    if e.status != 404:
                        raise
                    return await http.respond(send, 404)
                return await http.respond(send, 200)
            return await http.respond_json(send, 200, (await svc.model(name, version)).metadata())
        raise InferError(404, f"no such endpoint: {req.method} {path[:200]}")

    # -- inference -------------------------------------------------------------------
    async def _infer(self, m: ModelSpec, req: Request, body: bytes
                     ) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        hlen = req.headers.get(HEADER_LENGTH.lower())
        if hlen is not None:
            if not LENGTH.fullmatch(hlen) or int(hlen) > len(body):
                raise InferError(400, f"{HEADER_LENGTH} {hlen[:20]!r} is not a length within "
                                      f"the body's {len(body)} bytes")
            header, binary = body[:int(hlen)], memoryview(body)[int(hlen):]
        else:
            header, binary = body, memoryview(b"")
        obj = parse_json(header)
        inputs = read_inputs(m, obj, binary)
        wanted = requested_outputs(m, obj)       # (checked before the daemon runs it)
        params = params_of(obj, "request")
        outputs = await self.service.infer(m, inputs, request_priority(params.get("priority")),
                                           request_timeout(params))
        status, payload, extra = encode_response(m, obj, wanted, outputs)
        headers = [(b"content-type", b"application/octet-stream" if extra else b"application/json")]
        headers += [(k.encode(), v.encode()) for k, v in extra.items()]
        return status, payload, headers

    # -- the generate extension ------------------------------------------------------
    async def _generate(self, m: ModelSpec, body: bytes, send: Send, stream: bool) -> None:
        obj = parse_json(body)
        params = params_of(obj, "request")
        prompt, max_tokens = generate_args(obj, params)
        tokens = self.service.generate(m, prompt, max_tokens,
                                       request_priority(params.get("priority")))
        head = {"model_name": m.name, "model_version": VERSION}
        try:
            first = await _first(tokens)         # a refusal raises here: an error status
            if not stream:
                out = [] if first is None else [first, *[t async for t in tokens]]
                return await http.respond_json(send, 200, {**head, "token_ids": out})
            await http.start_events(send)
            n = 0
            try:
                if first is not None:
                    await http.event(send, json.dumps({**head, "token_id": first,
                                                       "index": 0}).encode())
                    n = 1
                    async for tok in tokens:
                        await http.event(send, json.dumps({**head, "token_id": tok,
                                                           "index": n}).encode())
                        n += 1
            except InferError as e:              # after the first token: a last event
                await http.event(send, json.dumps({"error": str(e)}).encode())
            else:
                await http.event(send, json.dumps({**head, "done": True,
                                                   "n_tokens": n}).encode())
            await http.end_events(send)
        finally:
            await tokens.aclose()                # (a caller gone: the daemon finishes)

    # -- model control ---------------------------------------------------------------
    async def _repository(self, req: Request, send: Send, where: list[str]) -> None:
        body = await req.body()
        obj = parse_json(body) if body.strip() else {}
        if where == ["index"]:
            ready_only = obj.get("ready", False)
            if type(ready_only) is not bool:
                raise InferError(400, "index: \"ready\" must be true or false")
            return await http.respond_json(send, 200, await self.control.index(ready_only))
        if len(where) == 3 and where[0] == "models" and where[2] in ("load", "unload"):
            check_parameters(where[2], params_of(obj, where[2]))
            if where[2] == "load":
                await self.control.load(where[1])
            else:
                await self.control.unload(where[1])
            self.service.forget_models()
            return await http.respond(send, 200)
        raise InferError(404, f"no such endpoint: POST {req.path[:200]}")


def _model_route(parts: list[str]) -> tuple[str, str, str | None]:
    """NAME[/versions/V][/WHAT] -> (name, version, what); what None: no such route."""
    name, rest = parts[0], parts[1:]
    version = ""
    if len(rest) >= 2 and rest[0] == "versions":
        version, rest = rest[1], rest[2:]
    if not rest:
        return name, version, ""
    if len(rest) == 1 and rest[0] in ("ready", *_POSTS):
        return name, version, rest[0]
    return name, version, None


async def _first(tokens):
    """The first item of an async iterator, or None if it has none."""
    try:
        return await tokens.__anext__()
    except StopAsyncIteration:
        return None


async def _lifespan(receive, send: Send) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif msg["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
