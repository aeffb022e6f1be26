"""An OpenAI-compatible API for the daemon's generative models (ASGI, mounted under
``/v1`` by :class:`~paella.kserve.rest.KServeApp`).

    GET  /v1/models          the generative models (OpenAI's model list)
    POST /v1/completions     a completion: ``model``, ``prompt``, ``max_tokens`` (default
                             16), ``stream``, ``stream_options.include_usage``, ``n`` (1)

The prompt is token ids (a list of integers, as the API allows) or, for a model whose
``config.toml`` names a ``tokenizer`` (a Hugging Face ``tokenizer.json``, read with the
``tokenizers`` library), text; text for a model without one is a 400 saying so. Each
choice carries ``text`` (decoded when there is a tokenizer, else empty) and, beyond
OpenAI's fields, ``token_ids``. Decoding is the model's own (greedy): ``temperature``,
``top_p``, ``seed``, ``stop``, ``user`` and the penalties are accepted and have no
effect; ``n`` and ``best_of`` above 1, ``echo``, ``logprobs`` and ``suffix`` are refused.
A streamed completion is server-sent events in OpenAI's chunk format, one chunk per
token, the last with ``finish_reason``, then ``data: [DONE]``. Errors are OpenAI's error
objects, ``{"error": {"message", "type", "param", "code"}}``.
"""
from __future__ import annotations

import json
import logging
import os
import time
import uuid
from typing import Any

from . import http
from .http import ClientGone, Request, Send
from .rest_body import parse_json
from .service import InferenceService, ModelSpec
from .tensors import InferError

log = logging.getLogger("paella.kserve")

_ERROR_TYPE = {400: "invalid_request_error", 403: "permission_error", 404: "not_found_error",
               413: "invalid_request_error", 503: "service_unavailable", 504: "timeout"}
#: Fields accepted and ignored (decoding is the model's own).
_IGNORED = {"temperature", "top_p", "seed", "stop", "user", "presence_penalty",
            "frequency_penalty", "logit_bias"}
_REFUSED = {"echo", "logprobs", "suffix"}
#: The largest completion request: a prompt of 1 MiB of text, or its ids, with room.
MAX_COMPLETION_BODY = 2 << 20
_KNOWN = {"model", "prompt", "max_tokens", "stream", "stream_options", "n", "best_of",
          *_IGNORED, *_REFUSED}


class OpenAIError(InferError):
    """An API error with the request field it is about."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(status, message)
        self.param = param


class Tokenizers:
    """Tokenizer files by path, read once (and again when the file changes)."""

    def __init__(self) -> None:
        self._cache: dict[str, tuple[float, Any]] = {}

    def get(self, path: str | None):
        if not path:
            return None
        try:
            mtime = os.stat(path).st_mtime
        except OSError as e:
            raise OpenAIError(503, f"the model's tokenizer {path} cannot be read: "
                                   f"{e.strerror}") from None
        hit = self._cache.get(path)
        if hit is not None and hit[0] == mtime:
            return hit[1]
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise OpenAIError(503, "text prompts need the tokenizers library: pip install "
                                   "'paella-py[text]'") from None
        try:
            tok = Tokenizer.from_file(path)
        except Exception as e:  # noqa: BLE001 - the library's own error types
            raise OpenAIError(503, f"the model's tokenizer {path} is not a tokenizer.json: "
                                   f"{str(e)[:200]}") from None
        self._cache[path] = (mtime, tok)
        return tok


class OpenAIApp:
    """The ``/v1`` routes over ``service``."""

    def __init__(self, service: InferenceService, max_body: int = 1 << 20):
        self.service = service
        self.max_body = max_body
        self.tokenizers = Tokenizers()

    async def __call__(self, req: Request, send: Send) -> None:
        try:
            if req.path.rstrip("/") == "/v1/models" and req.method in ("GET", "HEAD"):
                return await self._models(send)
            if req.path.rstrip("/") == "/v1/completions" and req.method == "POST":
                return await self._completions(req, send)
            raise OpenAIError(404, f"no such endpoint: {req.method} {req.path[:200]} (served: "
                                   f"GET /v1/models, POST /v1/completions)")
        except InferError as e:
            if req.method == "POST" and not req.close and e.status == 404:
                await req.discard_body()
            await http.respond_json(send, e.status, error_body(e), close=req.close, linger=req)
        except ClientGone:
            pass
        except Exception as e:  # noqa: BLE001 - a bug fails this request only
            log.exception("OpenAI %s %s failed", req.method, req.path[:200])
            try:
                await http.respond_json(send, 500, error_body(
                    InferError(500, f"internal error: {type(e).__name__}: {e}")), close=True)
            except Exception:  # noqa: BLE001 - the answer had started, or the peer left
                pass

    async def _models(self, send: Send) -> None:
        models = await self.service.models()
        await http.respond_json(send, 200, {"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "paella"}
            for name, m in sorted(models.items()) if m.generative]})

    async def _model(self, name: Any) -> ModelSpec:
        if type(name) is not str or not name:
            raise OpenAIError(400, "\"model\" must be the name of a generative model", "model")
        models = await self.service.models()
        m = models.get(name)
        if m is None or not m.generative:
            served = ", ".join(n for n, s in sorted(models.items()) if s.generative)
            raise OpenAIError(404, f"the model {name[:80]!r} does not exist or is not "
                                   f"generative; generative models: {served or 'none'}", "model")
        return m

    async def _completions(self, req: Request, send: Send) -> None:
        body = parse_json(await req.body(MAX_COMPLETION_BODY, "a completion request's JSON"))
        args = completion_args(body)
        m = await self._model(body.get("model"))
        tok = self.tokenizers.get(m.tokenizer)
        prompt = args["prompt"]
        if isinstance(prompt, str):
            if tok is None:
                raise OpenAIError(400, f"model {m.name!r} has no tokenizer, so its prompt must "
                                       f"be token ids (a list of integers); name a tokenizer "
                                       f"in its config.toml to send text", "prompt")
            prompt = tok.encode(prompt, add_special_tokens=False).ids
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "created": int(time.time()), "model": m.name}
        tokens = self.service.generate(m, prompt, args["max_tokens"])
        try:
            if args["stream"]:
                return await self._stream(send, head, tokens, tok, len(prompt), args)
            ids = [t async for t in tokens]
        finally:
            await tokens.aclose()
        choice = {"text": tok.decode(ids) if tok is not None else "", "index": 0,
                  "logprobs": None, "finish_reason": _finish(ids, args["max_tokens"]),
                  "token_ids": ids}
        await http.respond_json(send, 200, {**head, "choices": [choice],
                                            "usage": _usage(len(prompt), len(ids))})

    async def _stream(self, send: Send, head: dict, tokens, tok, n_prompt: int,
                      args: dict) -> None:
        from .rest import _first
        first = await _first(tokens)     # a refusal raises here: an error status
        await http.start_events(send)
        ids: list[int] = []
        text = ""
        try:
            nxt = first
            while nxt is not None:
                ids.append(nxt)
                piece = ""
                if tok is not None:
                    full = tok.decode(ids)
                    piece, text = full[len(text):], full
                await http.event(send, json.dumps({**head, "choices": [
                    {"text": piece, "index": 0, "logprobs": None, "finish_reason": None,
                     "token_ids": [nxt]}]}).encode())
                nxt = await _first(tokens)
        except InferError as e:                  # after the first token: a last event
            await http.event(send, json.dumps(error_body(e)).encode())
            await http.event(send, b"[DONE]")
            return await http.end_events(send)
        await http.event(send, json.dumps({**head, "choices": [
            {"text": "", "index": 0, "logprobs": None,
             "finish_reason": _finish(ids, args["max_tokens"]), "token_ids": []}]}).encode())
        if args["include_usage"]:
            await http.event(send, json.dumps({**head, "choices": [],
                                               "usage": _usage(n_prompt, len(ids))}).encode())
        await http.event(send, b"[DONE]")
        await http.end_events(send)


def completion_args(body: dict) -> dict:
    """A completion request's arguments, checked (OpenAIError naming the field)."""
    unknown = sorted(set(body) - _KNOWN)
    if unknown:
        raise OpenAIError(400, f"unknown field(s) {', '.join(unknown)[:120]}; this server takes "
                               f"{', '.join(sorted(_KNOWN))}", unknown[0][:40])
    for name in _REFUSED:
        if body.get(name) not in (None, False, 0, ""):
            raise OpenAIError(400, f"{name} is not supported by this server", name)
    for name in ("n", "best_of"):
        if body.get(name, 1) != 1 or type(body.get(name, 1)) is not int:
            raise OpenAIError(400, f"{name} must be 1 (one completion per request)", name)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]                      # a batch of one prompt
    if isinstance(prompt, str):
        if len(prompt) > 1 << 20:
            raise OpenAIError(400, "the prompt is longer than 1 MiB of text", "prompt")
    elif (not isinstance(prompt, list) or len(prompt) > 1 << 20
          or any(type(t) is not int or not 0 <= t < 2 ** 31 for t in prompt)):
        raise OpenAIError(400, "\"prompt\" must be a string or a list of token ids (integers "
                               "0..2**31-1); one prompt per request", "prompt")
    max_tokens = body.get("max_tokens", 16)
    if max_tokens is None:
        max_tokens = 16
    if type(max_tokens) is not int or not 0 <= max_tokens < 2 ** 31:
        raise OpenAIError(400, f"max_tokens must be an integer 0..2**31-1, got "
                               f"{str(max_tokens)[:20]!r}", "max_tokens")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if type(stream) is not bool:
        raise OpenAIError(400, "stream must be true or false", "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict) or set(opts) - {"include_usage"}:
        raise OpenAIError(400, "stream_options takes only include_usage", "stream_options")
    include_usage = opts.get("include_usage", False)
    if type(include_usage) is not bool:
        raise OpenAIError(400, "stream_options.include_usage must be true or false",
                          "stream_options")
    return {"prompt": prompt, "max_tokens": max_tokens, "stream": stream,
            "include_usage": include_usage}


def error_body(e: InferError) -> dict:
    """OpenAI's error object for ``e``."""
    return {"error": {"message": str(e), "type": _ERROR_TYPE.get(e.status, "server_error"),
                      "param": getattr(e, "param", None), "code": e.status}}


def _finish(ids: list[int], max_tokens: int) -> str:
    return "length" if len(ids) >= max_tokens else "stop"


def _usage(n_prompt: int, n_out: int) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out,
            "total_tokens": n_prompt + n_out}
