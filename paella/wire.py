"""Control-socket messages between a client and the daemon: encode and decode in one place.

The control channel is a Unix stream socket. It carries the handshake (the segment's
name and layout, plus its file descriptor through SCM_RIGHTS), the model list, the
"almost finished" wake-ups and errors. Request data never crosses it: that lives in
the shared-memory segment (``paella.rings``).

Every message is a frame: an 8-byte header ``<HHI`` (type, flags = 0, payload length)
then the payload. Control payloads are UTF-8 JSON objects; the two hot messages (WAKE,
DONE) carry one little-endian uint64 request id and are packed with a precompiled
``struct`` so sending one allocates almost nothing.

    type  name         direction  payload
    1     HELLO        c -> d     {"version", "mode": hybrid|polling|socket, "arena_bytes"}
    2     WELCOME      d -> c     {"client_id", "segment", "layout", "models"} + fd
    3     LIST_MODELS  c -> d     {}
    4     MODELS       d -> c     {"models": [model descriptions]}
    5     WAKE         d -> c     req_id: the job is almost finished (hybrid mode)
    6     DONE         d -> c     req_id: the completion is on the ring (socket mode)
    7     ERROR        d -> c     {"error": code name, "message": text}
    8     KICK         c -> d     {} or empty: "I pushed onto a ring while you slept"
    9     STATUS       c -> d     {} or empty: what is the daemon doing? (``paella status``;
                                  allowed before HELLO: it needs no segment)
    10    STATUS_REPLY d -> c     {"status": {...}}: models, clients, in flight, occupancy
    11    PROGRESS     d -> c     req_id: a progress entry is on the completion ring (hybrid
                                  and socket modes; only for requests sent with STREAM)
    12    TRACE        c -> d     {"milliseconds"}: record a kernel-level trace for that long
                                  (``paella trace``; allowed before HELLO; the daemon's owner
                                  or a uid of [access] trace_users only)
    13    TRACE_REPLY  d -> c     {"trace": {"events", "requests", "kernels", "truncated",
                                  "bytes"}} + fd: the Trace Event JSON, in a memfd
    14    REPOSITORY_INDEX        c -> d  {} or empty: the model folders of the daemon's
                                          repository and their states (``paella model
                                          index``; allowed before HELLO)
    15    REPOSITORY_INDEX_REPLY  d -> c  {"models": [{"name", "version", "state",
                                          "reason"}]}: state one of :data:`MODEL_STATES`
    16    LOAD         c -> d     {"name"}: load (or reload) that model folder of the
                                  repository; answered once it is served, or with ERROR
                                  (allowed before HELLO; the daemon's owner or a user of
                                  [access] control_users only)
    17    LOAD_REPLY   d -> c     {"model": {"name", "version", "state", "reason"}}
    18    UNLOAD       c -> d     {"name"}: serve that model no more (its requests in
                                  flight finish); as LOAD for who may
    19    UNLOAD_REPLY d -> c     {"model": {"name", "version", "state", "reason"}}

Decoding is where a hostile peer's bytes are first interpreted, so it is strict and
total: every failure, whatever Python would raise (a JSON syntax error, an integer of
5000 digits, nesting deep enough to exhaust the recursion limit), becomes one
:class:`WireError` with a code the peer receives in an ERROR frame. Nesting deeper
than :data:`MAX_DEPTH` is refused before the parser runs, and every field of every
message is checked against :data:`SCHEMAS` with exact types: a JSON ``true`` is not
an integer (Python's ``bool`` is an ``int``), ``1.0`` is not ``1``, and a field the
message does not define is an error rather than silently ignored.
"""
from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from paella.shapes import Slot

PROTOCOL_VERSION = 1

(HELLO, WELCOME, LIST_MODELS, MODELS, WAKE, DONE, ERROR, KICK, STATUS, STATUS_REPLY,
 PROGRESS, TRACE, TRACE_REPLY, REPOSITORY_INDEX, REPOSITORY_INDEX_REPLY, LOAD, LOAD_REPLY,
 UNLOAD, UNLOAD_REPLY) = range(1, 20)
NAMES = {HELLO: "HELLO", WELCOME: "WELCOME", LIST_MODELS: "LIST_MODELS", MODELS: "MODELS",
         WAKE: "WAKE", DONE: "DONE", ERROR: "ERROR", KICK: "KICK", STATUS: "STATUS",
         STATUS_REPLY: "STATUS_REPLY", PROGRESS: "PROGRESS", TRACE: "TRACE",
         TRACE_REPLY: "TRACE_REPLY", REPOSITORY_INDEX: "REPOSITORY_INDEX",
         REPOSITORY_INDEX_REPLY: "REPOSITORY_INDEX_REPLY", LOAD: "LOAD",
         LOAD_REPLY: "LOAD_REPLY", UNLOAD: "UNLOAD", UNLOAD_REPLY: "UNLOAD_REPLY"}
JSON_TYPES = frozenset({HELLO, WELCOME, LIST_MODELS, MODELS, ERROR, STATUS, STATUS_REPLY,
                        TRACE, TRACE_REPLY, REPOSITORY_INDEX, REPOSITORY_INDEX_REPLY, LOAD,
                        LOAD_REPLY, UNLOAD, UNLOAD_REPLY})
ID_TYPES = frozenset({WAKE, DONE, PROGRESS})

#: A model's state in the repository index and the LOAD / UNLOAD replies (Triton's
#: names): served; not served (``reason`` says why: "unloaded", a load error, ...); its
#: load running or waiting its turn; unloaded, its requests in flight still finishing.
MODEL_STATES = ("READY", "UNAVAILABLE", "LOADING", "UNLOADING")
#: The one version of every model, as clients see it (KServe's model version).
MODEL_VERSION = "1"

#: Client wait modes (HELLO "mode"): which notification the daemon sends per request.
MODES = ("hybrid", "polling", "socket")

HEADER = struct.Struct("<HHI")
ID_FRAME = struct.Struct("<HHIQ")
MAX_PAYLOAD = 1 << 20
#: What a client may send in one frame (HELLO is the largest, ~80 bytes): the daemon's
#: readers use this bound, so one frame never costs the loop more than a small parse.
MAX_CLIENT_PAYLOAD = 64 << 10
#: Deepest nesting of arrays and objects a payload may have (a MODELS reply has 8).
MAX_DEPTH = 16

KICK_FRAME = HEADER.pack(KICK, 0, 0)


class WireError(ValueError):
    """A malformed frame or message. ``code`` is a short machine-readable name."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def encode(kind: int, payload: dict[str, Any] | None = None) -> bytes:
    """One JSON-carrying frame."""
    if kind not in JSON_TYPES and kind != KICK:
        raise ValueError(f"message type {kind} does not carry JSON")
    body = b"" if payload is None else json.dumps(payload, separators=(",", ":")).encode()
    if len(body) > MAX_PAYLOAD:
        raise WireError("too_large", f"{NAMES[kind]} payload of {len(body)} bytes exceeds "
                                     f"{MAX_PAYLOAD}")
    return HEADER.pack(kind, 0, len(body)) + body


def encode_id(kind: int, req_id: int) -> bytes:
    """A WAKE or DONE frame (hot path)."""
    return ID_FRAME.pack(kind, 0, 8, req_id)


def error(code: str, message: str) -> bytes:
    return encode(ERROR, {"error": code, "message": message})


#: The fields of every JSON-carrying message: name -> (exact type, required). ``int``
#: is a JSON integer only; ``list``/``dict`` contents are checked by their readers
#: (:meth:`ModelInfo.from_dict`, ``rings.Layout.from_dict``).
SCHEMAS: dict[int, dict[str, tuple[type, bool]]] = {
    HELLO: {"version": (int, True), "mode": (str, False), "arena_bytes": (int, False)},
    WELCOME: {"client_id": (int, True), "segment": (str, True), "layout": (dict, True),
              "models": (list, True)},
    LIST_MODELS: {},
    MODELS: {"models": (list, True)},
    ERROR: {"error": (str, True), "message": (str, True)},
    KICK: {},
    STATUS: {},
    STATUS_REPLY: {"status": (dict, True)},
    TRACE: {"milliseconds": (int, True)},
    TRACE_REPLY: {"trace": (dict, True)},
    REPOSITORY_INDEX: {},
    REPOSITORY_INDEX_REPLY: {"models": (list, True)},
    LOAD: {"name": (str, True)},
    LOAD_REPLY: {"model": (dict, True)},
    UNLOAD: {"name": (str, True)},
    UNLOAD_REPLY: {"model": (dict, True)},
}

_JSON_NAMES = {int: "an integer", str: "a string", dict: "an object", list: "an array"}


def check_fields(kind: int, obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` unchanged if it has exactly the fields ``SCHEMAS[kind]`` allows, each of
    its exact type; else WireError("bad_field") naming the field and what it must be."""
    schema = SCHEMAS[kind]
    for name, value in obj.items():
        if name not in schema:
            raise WireError("bad_field", f"{NAMES[kind]} has no field {name[:40]!r} (its fields: "
                                         f"{', '.join(schema) or 'none'})")
        want = schema[name][0]
        if type(value) is not want:            # exact: a bool is not an int, 1.0 is not 1
            raise WireError("bad_field", f"{NAMES[kind]} field {name!r} must be "
                                         f"{_JSON_NAMES[want]}, got {json.dumps(value)[:40]}")
    for name, (_, required) in schema.items():
        if required and name not in obj:
            raise WireError("bad_field", f"{NAMES[kind]} needs the field {name!r}")
    return obj


_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def json_depth(body: bytes) -> int:
    """How deeply ``body``'s arrays and objects nest (brackets inside strings do not
    count). Vectorised, so a payload of a million brackets costs milliseconds."""
    brackets = np.frombuffer(_JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKETS),
                             np.uint8)
    if brackets.size == 0:
        return 0
    # '[' 0x5B and '{' 0x7B open; ']' 0x5D and '}' 0x7D close: bit 1 tells them apart.
    steps = (brackets & 2).astype(np.int64) - 1
    return int(np.cumsum(steps).max())


def decode_payload(kind: int, body: bytes) -> Any:
    """The payload of one frame: a dict for JSON frames, an int for WAKE/DONE.

    Total: any malformed payload raises WireError, never another exception."""
    if kind in ID_TYPES:
        if len(body) != 8:
            raise WireError("bad_length", f"{NAMES[kind]} payload must be 8 bytes, got {len(body)}")
        return int.from_bytes(body, "little")
    name = NAMES.get(kind, kind)
    if not body:
        obj: Any = {}
    else:
        if body.count(b"[") + body.count(b"{") > MAX_DEPTH and json_depth(body) > MAX_DEPTH:
            raise WireError("too_deep", f"{name} payload nests arrays and objects more than "
                                        f"{MAX_DEPTH} deep")
        try:
            obj = json.loads(body.decode("utf-8"))
        except (ValueError, RecursionError, MemoryError) as e:
            # ValueError covers UnicodeDecodeError, JSONDecodeError and an integer past
            # int_max_str_digits; RecursionError cannot happen after the depth check.
            raise WireError("bad_json", f"{name} payload is not valid UTF-8 JSON: "
                                        f"{str(e)[:200]}") from None
    if not isinstance(obj, dict):
        raise WireError("bad_json", f"{name} payload must be a JSON object, "
                                    f"got {type(obj).__name__}")
    return check_fields(kind, obj) if kind in SCHEMAS else obj


class FrameReader:
    """Reassembles frames from a byte stream. Framing errors cannot be resynchronised,
    so :meth:`feed` raises :class:`WireError` and the caller closes the connection."""

    def __init__(self, max_payload: int = MAX_PAYLOAD):
        self.buf = bytearray()
        self.max_payload = max_payload

    def feed(self, data: bytes) -> list[tuple[int, Any]]:
        """Append bytes; return the complete frames as (type, decoded payload).
        Callers that need per-frame error handling use :meth:`next_raw` instead."""
        self.buf += data
        out = []
        while True:
            raw = self.next_raw()
            if raw is None:
                return out
            out.append((raw[0], decode_payload(raw[0], raw[1])))

    def next_raw(self) -> tuple[int, bytes] | None:
        """Pop one complete frame as (type, payload bytes), or None if incomplete."""
        if len(self.buf) < HEADER.size:
            return None
        kind, flags, n = HEADER.unpack_from(self.buf)
        if kind not in NAMES:
            raise WireError("unknown_type", f"unknown message type {kind}")
        if flags:
            raise WireError("bad_flags", f"{NAMES[kind]} frame has reserved flags {flags:#x} set")
        if n > self.max_payload:
            raise WireError("too_large", f"{NAMES[kind]} frame announces {n} bytes "
                                         f"(limit {self.max_payload})")
        end = HEADER.size + n
        if len(self.buf) < end:
            return None
        body = bytes(self.buf[HEADER.size:end])
        del self.buf[:end]
        return kind, body


# --- model descriptions (MODELS and WELCOME payloads) ---------------------------------
@dataclass(frozen=True)
class TensorInfo(Slot):
    """One tensor of a model variant, at a byte offset in the request's io region (a
    :class:`~paella.shapes.Slot` that travels in MODELS and WELCOME payloads)."""

    def to_dict(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype,
                "offset": self.offset}

    @classmethod
    def from_dict(cls, d: dict) -> "TensorInfo":
        return cls(str(d["name"]), tuple(int(x) for x in d["shape"]), str(d["dtype"]),
                   int(d["offset"]))


@dataclass(frozen=True)
class VariantInfo:
    """One compiled variant; a request selects it with ``options & VARIANT_MASK``, or
    gives its shape (``paella.shapes``) and the daemon's batcher chooses. ``batch``:
    its batch size (0: the model takes whole-variant requests only); ``seq_len``: its
    length bucket (0: no length axis)."""
    io_bytes: int
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]
    batch: int = 0
    seq_len: int = 0

    def to_dict(self) -> dict:
        return {"io_bytes": self.io_bytes, "inputs": [t.to_dict() for t in self.inputs],
                "outputs": [t.to_dict() for t in self.outputs], "batch": self.batch,
                "seq_len": self.seq_len}

    @classmethod
    def from_dict(cls, d: dict) -> "VariantInfo":
        return cls(int(d["io_bytes"]), tuple(TensorInfo.from_dict(t) for t in d["inputs"]),
                   tuple(TensorInfo.from_dict(t) for t in d["outputs"]),
                   int(d.get("batch", 0)), int(d.get("seq_len", 0)))


@dataclass(frozen=True)
class ModelInfo:
    """What a client needs to know about a served model."""
    model_id: int
    name: str
    variants: tuple[VariantInfo, ...]
    #: A generative model's tokenizer.json (absolute path on the daemon's host; "" none):
    #: the network front end reads it to take text prompts.
    tokenizer: str = ""

    def to_dict(self) -> dict:
        d = {"id": self.model_id, "name": self.name,
             "variants": [v.to_dict() for v in self.variants]}
        if self.tokenizer:
            d["tokenizer"] = self.tokenizer
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelInfo":
        try:
            return cls(int(d["id"]), str(d["name"]),
                       tuple(VariantInfo.from_dict(v) for v in d["variants"]),
                       str(d.get("tokenizer", "")))
        except (KeyError, TypeError, ValueError) as e:
            raise WireError("bad_model", f"malformed model description {d!r}: {e}") from None


#: Request options: the low 16 bits select the model variant; or, with bit 31
#: (``paella.shapes.SHAPED``) set, the word carries the request's shape (rows, sequence
#: length: see ``paella.shapes``). The bits in between are reserved and must be 0 (the
#: daemon rejects unknown bits rather than ignoring them), except ``STREAM`` (bit 30, on
#: an unshaped request): the client wants progress entries (``paella.rings.PROGRESS``)
#: before the completion. A daemon older than streaming rejects the bit (E_OPTIONS,
#: "unknown option bits"), so a streaming client learns it at once; a client that never
#: sets it never sees a progress entry: protocol version 1 either way.
VARIANT_MASK = 0xFFFF
SHAPED = 1 << 31
STREAM = 1 << 30
KNOWN_OPTIONS = VARIANT_MASK | STREAM

#: Request priority: the top 8 bits of a ring entry's length word (an io region is at
#: most 2**40 bytes, the largest arena). 0: none (the batcher's default level); 1 is the
#: highest and larger numbers are lower, as Triton's priority levels. What orders by it
#: reads ``Request.priority``: the ``dynamic`` batcher with ``priority_levels``, ``orca``
#: with ``priorities = true``, the ``priority`` kernel policy; the rest ignore it.
#: A daemon older than priorities refuses a length with these bits (E_RANGE).
PRIORITY_SHIFT = 56
MAX_PRIORITY = 255
LENGTH_MASK = (1 << PRIORITY_SHIFT) - 1
#: Where a request without a priority ranks among 1..255 where no configuration says
#: otherwise (orca, the ``priority`` policy): the middle, as a Triton request without one
#: takes the default level. (``dynamic`` has its own ``default_priority_level``.)
DEFAULT_PRIORITY = (MAX_PRIORITY + 1) // 2
