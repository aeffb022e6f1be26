"""The KServe v2 REST API over HTTP/1.1 (the standard library's threading HTTP server).

    GET  /v2/health/live                            200 while the process runs
    GET  /v2/health/ready                           200 when a daemon answers, else 503
    GET  /v2                                        server metadata
    GET  /v2/models/NAME[/versions/V]               model metadata
    GET  /v2/models/NAME[/versions/V]/ready         200 if served, else 404
    POST /v2/models/NAME[/versions/V]/infer         inference (JSON, binary-tensor extension)
    POST /v2/models/NAME[/versions/V]/generate      a generation, all its tokens at once
    POST /v2/models/NAME[/versions/V]/generate_stream   ... each token as a server-sent event

Errors are KServe error bodies, ``{"error": "..."}``, with a 4xx/5xx status. A hostile
body costs its own connection at most: the length must be declared and within
``max_body`` (else 411/413 and the connection closes without reading it), the JSON is
parsed with its nesting bounded, and every field is checked before anything reaches
the daemon (:mod:`.tensors`). Any other failure is a 500 for that request; the server
keeps serving.

The binary-tensor extension: a request whose ``Inference-Header-Content-Length`` header
is N carries N bytes of JSON and then the raw tensors, in input order, of the inputs
whose ``parameters.binary_data_size`` says how many bytes are theirs. Outputs are sent
raw the same way when the request asks (``binary_data`` on an output, or
``binary_data_output`` on the request), else as JSON ``data``.

The generate extension (Triton's ``generate`` and ``generate_stream``, for the daemon's
generative models): the body is JSON, ``{"prompt_ids": [ids], "max_tokens": N,
"parameters": {"priority": P}}`` (``max_tokens`` may also be a parameter). ``generate``
answers ``{"model_name", "model_version", "token_ids"}``; ``generate_stream`` answers
``text/event-stream``, one ``data: {"model_name", "model_version", "token_id",
"index"}`` event per token as the daemon makes it, then ``data: {"model_name",
"model_version", "done": true, "n_tokens"}``, and closes the connection. A request the
daemon refuses before its first token gets an error status as ``infer``'s; a failure
after it is a last event ``data: {"error": "..."}``.
"""
from __future__ import annotations

import itertools
import json
import logging
import re
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote

import numpy as np

from paella.wire import MAX_DEPTH, json_depth

from .service import VERSION, InferenceService, ModelSpec, request_priority
from .tensors import InferError, TensorSpec, check_input, from_bytes, from_json_data, to_json_data

log = logging.getLogger("paella.kserve")

HEADER_LENGTH = "Inference-Header-Content-Length"
_MODEL = re.compile(r"^/v2/models/([^/]+)(?:/versions/([^/]+))?"
                    r"(/ready|/infer|/generate|/generate_stream)?/?$")
_POSTS = ("/infer", "/generate", "/generate_stream")
#: A length header: ASCII digits (str.isdigit also takes "²"), at most 18 of them.
_LENGTH = re.compile(r"[0-9]{1,18}")


class KServeHTTPServer(ThreadingHTTPServer):
    """One thread per connection; ``service`` does the work."""
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr: tuple[str, int], service: InferenceService,
                 max_body: int = 64 << 20):
        self.service = service
        self.max_body = max_body
        super().__init__(addr, _Handler)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"          # keep-alive, as tritonclient expects
    # Headers and body leave in two writes: with Nagle's algorithm on, the body waits
    # for the client's delayed ACK of the headers, 40 ms per response.
    disable_nagle_algorithm = True
    server: KServeHTTPServer

    def log_message(self, fmt: str, *args: Any) -> None:   # the access log: debug only
        log.debug("%s " + fmt, self.address_string(), *args)

    # -- responses -------------------------------------------------------------------
    def _send(self, status: int, body: bytes = b"", ctype: str = "application/json",
              headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if body and self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, obj: Any) -> None:
        self._send(status, json.dumps(obj).encode())

    def _error(self, status: int, message: str) -> None:
        self._json(status, {"error": message})

    # -- routing ---------------------------------------------------------------------
    def _path(self) -> str:
        """The request's path without its query; the server read it as Latin-1, so raw
        UTF-8 (a model named in another script) is recovered (percent-encoding is
        decoded per segment, after matching)."""
        raw = self.path.split("?", 1)[0]
        return raw.encode("latin-1", "replace").decode("utf-8", "replace")

    def do_GET(self) -> None:
        self._guard(self._get)

    def do_POST(self) -> None:
        self._guard(self._post)

    def _guard(self, fn) -> None:
        try:
            fn()
        except InferError as e:
            self._error(e.status, str(e))
        except (ConnectionError, TimeoutError):
            self.close_connection = True          # the peer went away mid-request
        except Exception as e:  # noqa: BLE001 - a bug fails this request only
            log.exception("KServe %s %s failed", self.command, self.path[:200])
            self.close_connection = True
            try:
                self._error(500, f"internal error: {type(e).__name__}: {e}")
            except OSError:
                pass      # the connection is gone as well

    def _get(self) -> None:
        svc = self.server.service
        path = self._path()
        if path == "/v2/health/live":
            self._send(200)
        elif path == "/v2/health/ready":
            self._send(200 if svc.ready() else 503)
        elif path in ("/v2", "/v2/"):
            self._json(200, svc.server_metadata())
        else:
            m = _MODEL.match(path)
            if m is None or m.group(3) in _POSTS:
                raise InferError(404, f"no such endpoint: GET {path[:200]}")
            name, version, what = unquote(m.group(1)), unquote(m.group(2) or ""), m.group(3)
            if what == "/ready":
                try:
                    svc.model(name, version)
                except InferError as e:
                    if e.status != 404:
                        raise
                    self._send(404)
                    return
                self._send(200)
            else:
                self._json(200, svc.model(name, version).metadata())

    def _post(self) -> None:
        path = self._path()
        m = _MODEL.match(path)
        if m is None or m.group(3) not in _POSTS:
            self._discard_body()
            raise InferError(404, f"no such endpoint: POST {path[:200]}")
        body = self._read_body()
        model = self.server.service.model(unquote(m.group(1)), unquote(m.group(2) or ""))
        if m.group(3) == "/infer":
            status, payload, headers = self._infer(model, body)
            self._send(status, payload, headers=headers)
        else:
            self._generate(model, body, stream=m.group(3) == "/generate_stream")

    # -- bodies ----------------------------------------------------------------------
    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding"):
            self.close_connection = True
            raise InferError(411, "chunked bodies are not accepted: send Content-Length")
        text = self.headers.get("Content-Length")
        if text is None or not _LENGTH.fullmatch(text):
            self.close_connection = True
            raise InferError(411, "a request body needs a Content-Length")
        n = int(text)
        if n > self.server.max_body:
            self.close_connection = True          # its body is not read
            raise InferError(413, f"request body of {n} bytes exceeds the limit of "
                                  f"{self.server.max_body}")
        data = self.rfile.read(n)
        if len(data) != n:
            self.close_connection = True
            raise InferError(400, f"the body ended after {len(data)} of {n} bytes")
        return data

    def _discard_body(self) -> None:
        text = self.headers.get("Content-Length", "0")
        n = int(text) if _LENGTH.fullmatch(text) else -1
        if 0 <= n <= self.server.max_body:
            self.rfile.read(n)
        else:
            self.close_connection = True

    # -- inference -------------------------------------------------------------------
    def _infer(self, m: ModelSpec, body: bytes) -> tuple[int, bytes, dict[str, str]]:
        hlen = self.headers.get(HEADER_LENGTH)
        if hlen is not None:
            if not _LENGTH.fullmatch(hlen) or int(hlen) > len(body):
                raise InferError(400, f"{HEADER_LENGTH} {hlen[:20]!r} is not a length within "
                                      f"the body's {len(body)} bytes")
            header, binary = body[:int(hlen)], memoryview(body)[int(hlen):]
        else:
            header, binary = body, memoryview(b"")
        req = parse_json(header)
        inputs = read_inputs(m, req, binary)
        wanted = requested_outputs(m, req)       # (checked before the daemon runs it)
        priority = request_priority(_params(req, "request").get("priority"))
        outputs = self.server.service.infer(m, inputs, priority)
        return encode_response(m, req, wanted, outputs)

    # -- the generate extension ------------------------------------------------------
    def _generate(self, m: ModelSpec, body: bytes, stream: bool) -> None:
        req = parse_json(body)
        params = _params(req, "request")
        prompt, max_tokens = generate_args(req, params)
        tokens = self.server.service.generate(m, prompt, max_tokens,
                                              request_priority(params.get("priority")))
        head = {"model_name": m.name, "model_version": VERSION}
        try:
            first = next(tokens, None)           # a refusal raises here: an error status
            if not stream:
                out = [] if first is None else [first, *tokens]
                self._json(200, {**head, "token_ids": out})
                return
            self.close_connection = True         # the stream ends with the connection
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            n = 0
            try:
                for tok in itertools.chain([] if first is None else [first], tokens):
                    self._event({**head, "token_id": tok, "index": n})
                    n += 1
            except InferError as e:              # after the first token: a last event
                self._event({"error": str(e)})
                return
            self._event({**head, "done": True, "n_tokens": n})
        finally:
            tokens.close()                       # (the daemon's connection goes back)

    def _event(self, obj: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
        self.wfile.flush()


def generate_args(req: dict, params: dict) -> tuple[list[int], int]:
    """A generate request's prompt ids and token budget, checked (400 otherwise)."""
    prompt = req.get("prompt_ids")
    if (not isinstance(prompt, list) or len(prompt) > 1 << 20
            or any(type(t) is not int for t in prompt)):
        raise InferError(400, "a generate request needs \"prompt_ids\": a list of integer "
                              "token ids")
    if any(not 0 <= t < 2 ** 31 for t in prompt):
        raise InferError(400, "prompt_ids must be token ids in 0..2**31-1")
    max_tokens = req.get("max_tokens", params.get("max_tokens"))
    if type(max_tokens) is not int or not 0 <= max_tokens < 2 ** 31:
        raise InferError(400, f"a generate request needs \"max_tokens\": an integer in "
                              f"0..2**31-1, got {str(max_tokens)[:20]!r}")
    return prompt, max_tokens


def parse_json(data: bytes) -> dict:
    """The request's JSON object; nesting is bounded before the parser runs."""
    if data.count(b"[") + data.count(b"{") > MAX_DEPTH and json_depth(data) > MAX_DEPTH:
        raise InferError(400, f"request JSON nests deeper than {MAX_DEPTH}")
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise InferError(400, f"request body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(obj, dict):
        raise InferError(400, "request body must be a JSON object")
    return obj


def _params(obj: dict, where: str) -> dict:
    p = obj.get("parameters", {})
    if not isinstance(p, dict):
        raise InferError(400, f"{where}: parameters must be a JSON object")
    return p


def read_inputs(m: ModelSpec, req: dict, binary: memoryview) -> dict[str, np.ndarray]:
    """The request's input tensors, checked against the model."""
    items = req.get("inputs")
    if not isinstance(items, list) or not items:
        raise InferError(400, "request needs \"inputs\": a non-empty array")
    out: dict[str, np.ndarray] = {}
    pos = 0
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise InferError(400, "each input must be an object with a \"name\"")
        spec = m.input(item["name"])
        if spec.name in out:
            raise InferError(400, f"input {spec.name!r} given twice")
        check_input(spec, m.name, item.get("datatype"), item.get("shape"))
        size = _params(item, f"input {spec.name!r}").get("binary_data_size")
        if size is not None:
            if type(size) is not int or size < 0 or pos + size > len(binary):
                raise InferError(400, f"input {spec.name!r}: binary_data_size {str(size)[:20]} "
                                      f"exceeds the {len(binary) - pos} binary bytes left")
            out[spec.name] = from_bytes(spec, binary[pos:pos + size])
            pos += size
        elif "data" in item:
            out[spec.name] = from_json_data(spec, m.name, item["data"])
        else:
            raise InferError(400, f"input {spec.name!r} has neither \"data\" nor "
                                  f"binary_data_size")
    if pos != len(binary):
        raise InferError(400, f"{len(binary) - pos} binary bytes after the inputs' data")
    return out


def requested_outputs(m: ModelSpec, req: dict) -> list[tuple[TensorSpec, bool]]:
    """The outputs a request asks for (all by default), each with whether it goes raw."""
    binary_all = bool(_params(req, "request").get("binary_data_output", False))
    asked = req.get("outputs")
    if asked is None:
        return [(t, binary_all) for t in m.outputs]
    if not isinstance(asked, list):
        raise InferError(400, "\"outputs\" must be an array")
    by_name = {t.name: t for t in m.outputs}
    wanted = []
    for o in asked:
        name = o.get("name") if isinstance(o, dict) else None
        if type(name) is not str or name not in by_name:
            raise InferError(400, f"model {m.name!r} has outputs "
                                  f"{', '.join(by_name)}; asked for "
                                  f"{str(name if isinstance(o, dict) else o)[:40]}")
        p = _params(o, f"output {name!r}")
        wanted.append((by_name[name], bool(p.get("binary_data", binary_all))))
    return wanted


def encode_response(m: ModelSpec, req: dict, wanted: list[tuple[TensorSpec, bool]],
                    outputs: dict[str, np.ndarray]) -> tuple[int, bytes, dict[str, str]]:
    """The response body: JSON, then the raw outputs that were asked for in binary."""
    desc, chunks = [], []
    for spec, binary in wanted:
        a = np.ascontiguousarray(outputs[spec.name], dtype=spec.dtype.newbyteorder("<"))
        d = {"name": spec.name, "datatype": spec.datatype, "shape": list(spec.shape)}
        if binary:
            raw = a.tobytes()
            d["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            d["data"] = to_json_data(a)
        desc.append(d)
    resp = {"model_name": m.name, "model_version": VERSION, "outputs": desc}
    if isinstance(req.get("id"), str):
        resp["id"] = req["id"]
    header = json.dumps(resp).encode()
    if not chunks:
        return 200, header, {}
    return 200, header + b"".join(chunks), {HEADER_LENGTH: str(len(header))}
