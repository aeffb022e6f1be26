"""The KServe v2 REST bodies, apart from any server: parsing and checking a request's
JSON (and binary tensors), encoding the answer.

Everything a remote client sends is checked here before any of it reaches the daemon:
the JSON's nesting is bounded before the parser runs, every field's type is checked,
and the tensors are the model's exactly (:mod:`.tensors`). The errors are
:class:`InferError` with the HTTP status they map to.

The binary-tensor extension: a body whose ``Inference-Header-Content-Length`` header
is N carries N bytes of JSON and then the raw tensors, in input order, of the inputs
whose ``parameters.binary_data_size`` says how many bytes are theirs. Outputs are sent
raw the same way when the request asks (``binary_data`` on an output, or
``binary_data_output`` on the request), else as JSON ``data``.
"""
from __future__ import annotations

import json

import numpy as np

from paella.wire import MAX_DEPTH, json_depth

from .service import VERSION, ModelSpec
from .tensors import InferError, TensorSpec, check_input, from_bytes, from_json_data, to_json_data

HEADER_LENGTH = "Inference-Header-Content-Length"


#: Room for a request's JSON besides its tensors' data (names, shapes, parameters).
JSON_ROOM = 64 << 10
#: The most characters a number takes in JSON data ("-1.2345678901234567e-308,").
NUMBER_CHARS = 32


def body_limit(m: ModelSpec, what: str) -> tuple[int, str]:
    """The largest body a request to ``m``'s ``what`` route can need, and why: its
    tensors as JSON numbers or raw bytes, whichever is larger, plus room for the rest
    (a generation: its prompt's ids)."""
    if what == "infer":
        n = sum(t.nbytes // t.dtype.itemsize for t in m.inputs)
        return (JSON_ROOM + n * NUMBER_CHARS + sum(t.nbytes for t in m.inputs),
                f"what model {m.name!r}'s inputs can take")
    cap = max((t.shape[0] for t in m.inputs if t.name == "prompt" and t.shape), default=0)
    return JSON_ROOM + cap * NUMBER_CHARS, f"model {m.name!r} takes prompts of at most {cap} tokens"


def request_timeout(params: dict) -> float | None:
    """Triton's ``timeout`` request parameter (microseconds, 0 or absent: none), in
    seconds."""
    value = params.get("timeout")
    if value is None or value == 0:
        return None
    if type(value) is not int or not 0 < value < 2 ** 63:
        raise InferError(400, f"parameter timeout must be a positive integer of "
                              f"microseconds, got {str(value)[:20]!r}")
    return value / 1e6


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


def params_of(obj: dict, where: str) -> dict:
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
        size = params_of(item, f"input {spec.name!r}").get("binary_data_size")
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
    binary_all = bool(params_of(req, "request").get("binary_data_output", False))
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
        p = params_of(o, f"output {name!r}")
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
