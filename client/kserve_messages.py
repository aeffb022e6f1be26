"""The few KServe v2 protobuf messages ``paella perf`` sends and reads over gRPC, encoded
by hand: the client library does not import the front end (``paella.kserve``, where the
generated module is), and these are a handful of fields (``grpc_predict_v2.proto``;
tests/service/test_perf.py checks them against the generated messages).
"""
from __future__ import annotations

from typing import Iterator, Sequence

# The few KServe v2 messages the generator sends and reads, encoded by hand: the client
# library does not import the front end (paella.kserve, where the generated module is),
# and these are a handful of fields (grpc_predict_v2.proto).
def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1                        # (an int64 below zero: two's complement)
    out = bytearray()
    while n >= 128:
        out.append(n & 127 | 128)
        n >>= 7
    out.append(n)
    return bytes(out)


def pb_bytes(no: int, data: bytes) -> bytes:
    """A length-delimited field (string, bytes, message, packed numbers)."""
    return _varint(no << 3 | 2) + _varint(len(data)) + data


def _pb_fields(buf: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """(field number, wire type, value) of each field of a message: an int for a varint,
    bytes otherwise."""
    i, n = 0, len(buf)
    while i < n:
        key, i = _read_varint(buf, i)
        kind = key & 7
        if kind == 0:
            value, i = _read_varint(buf, i)
            yield key >> 3, kind, value
            continue
        if kind == 2:
            size, i = _read_varint(buf, i)
        elif kind in (1, 5):
            size = 8 if kind == 1 else 4
        else:
            raise ValueError(f"protobuf wire type {kind} is not one this message has")
        if i + size > n:
            raise ValueError("a truncated protobuf message")
        yield key >> 3, kind, buf[i:i + size]
        i += size


def _read_varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(buf) or shift > 63:
            raise ValueError("a truncated protobuf varint")
        b = buf[i]
        i += 1
        value |= (b & 127) << shift
        if b < 128:
            return value - (1 << 64) if value >= 1 << 63 else value, i
        shift += 7


def infer_request(model: str, tensors: Sequence[tuple[str, str, Sequence[int], bytes]],
                  params: dict[str, int]) -> bytes:
    """A ModelInferRequest: inputs (name, datatype, shape, raw little-endian contents)
    and int64 request parameters."""
    out = [pb_bytes(1, model.encode())]
    for key, value in params.items():        # map entry: key 1, InferParameter 2
        out.append(pb_bytes(4, pb_bytes(1, key.encode())
                             + pb_bytes(2, _varint(2 << 3) + _varint(value))))
    for name, datatype, shape, _ in tensors:
        out.append(pb_bytes(5, pb_bytes(1, name.encode()) + pb_bytes(2, datatype.encode())
                             + pb_bytes(3, b"".join(_varint(d) for d in shape))))
    out += [pb_bytes(7, raw) for *_, raw in tensors]
    return b"".join(out)


def _tensor_metadata(buf: bytes) -> tuple[str, str, tuple[int, ...]]:
    name, datatype, shape = "", "", []
    for no, kind, value in _pb_fields(buf):
        if no == 1 and kind == 2:
            name = bytes(value).decode()                    # type: ignore[arg-type]
        elif no == 2 and kind == 2:
            datatype = bytes(value).decode()                # type: ignore[arg-type]
        elif no == 3 and kind == 0:
            shape.append(value)                             # (unpacked)
        elif no == 3 and kind == 2:
            i = 0
            while i < len(value):                           # type: ignore[arg-type]
                d, i = _read_varint(value, i)               # type: ignore[arg-type]
                shape.append(d)
    return name, datatype, tuple(shape)                     # type: ignore[arg-type]


def model_metadata(buf: bytes) -> tuple[dict[str, tuple[str, tuple[int, ...]]], set[str]]:
    """A ModelMetadataResponse: ({input: (datatype, shape)}, output names)."""
    inputs, outputs = {}, set()
    for no, kind, value in _pb_fields(buf):
        if kind == 2 and no in (4, 5):
            name, datatype, shape = _tensor_metadata(value)  # type: ignore[arg-type]
            if no == 4:
                inputs[name] = (datatype, shape)
            else:
                outputs.add(name)
    return inputs, outputs


def stream_response(buf: bytes) -> tuple[str, bool]:
    """A ModelStreamInferResponse: (its error message, whether it is a request's final
    response: parameter ``triton_final_response`` true)."""
    error, final = "", False
    for no, kind, value in _pb_fields(buf):
        if no == 1 and kind == 2:
            error = bytes(value).decode(errors="replace")   # type: ignore[arg-type]
        elif no == 2 and kind == 2:
            for no2, kind2, entry in _pb_fields(value):     # type: ignore[arg-type]
                if no2 == 4 and kind2 == 2 and b"triton_final_response" in entry:  # type: ignore
                    final = final or _bool_parameter(entry)  # type: ignore[arg-type]
    return error, final


def _bool_parameter(entry: bytes) -> bool:
    """A parameters map entry's value as its bool (False for another key or kind)."""
    key, value = b"", b""
    for no, kind, v in _pb_fields(entry):
        if kind == 2 and no == 1:
            key = v                                         # type: ignore[assignment]
        elif kind == 2 and no == 2:
            value = v                                       # type: ignore[assignment]
    return key == b"triton_final_response" and any(
        no == 1 and kind == 0 and v for no, kind, v in _pb_fields(value))
