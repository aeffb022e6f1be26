"""KServe v2 tensors: datatypes, JSON ``data``, the binary-tensor extension, checks.

Everything a remote client sends is checked here before any of it reaches the daemon:
the tensor names, datatypes and shapes must be the model's exactly (the error names
what the model takes), the data must hold exactly as many elements as the shape says.
The errors are :class:`InferError` with the HTTP status they map to.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

#: KServe v2 datatype <-> numpy dtype name (BYTES, strings, is not served: no model takes it).
DATATYPES = {"BOOL": "bool", "UINT8": "uint8", "UINT16": "uint16", "UINT32": "uint32",
             "UINT64": "uint64", "INT8": "int8", "INT16": "int16", "INT32": "int32",
             "INT64": "int64", "FP16": "float16", "FP32": "float32", "FP64": "float64"}
KSERVE_TYPE = {v: k for k, v in DATATYPES.items()}


class InferError(Exception):
    """A request the front end refuses, or that failed: ``status`` is the HTTP status
    (400 bad request, 404 unknown model, 413 too large, 503 daemon unavailable, 504
    timed out, 500 the model failed)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a model as KServe describes it."""
    name: str
    datatype: str
    shape: tuple[int, ...]

    @cached_property
    def dtype(self) -> np.dtype:
        return np.dtype(DATATYPES[self.datatype])

    @cached_property
    def nbytes(self) -> int:            # (cached: asked for every tensor of every request)
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def to_dict(self) -> dict:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


def spec_of(name: str, dtype: str, shape: tuple[int, ...]) -> TensorSpec:
    if dtype not in KSERVE_TYPE:
        raise ValueError(f"tensor {name!r} has dtype {dtype}, which KServe v2 cannot carry")
    return TensorSpec(name, KSERVE_TYPE[dtype], tuple(int(d) for d in shape))


def check_input(spec: TensorSpec, model: str, datatype: Any, shape: Any) -> None:
    """The client's declared datatype and shape are the model's."""
    if datatype != spec.datatype:
        raise InferError(400, f"model {model!r} input {spec.name!r} has datatype "
                              f"{spec.datatype}, got {str(datatype)[:40]}")
    if (not isinstance(shape, (list, tuple)) or len(shape) > 16
            or not all(type(d) is int for d in shape) or tuple(shape) != spec.shape):
        raise InferError(400, f"model {model!r} input {spec.name!r} has shape "
                              f"{list(spec.shape)}, got {str(shape)[:80]}")


def from_json_data(spec: TensorSpec, model: str, data: Any) -> np.ndarray:
    """A tensor from JSON ``data`` (flat, or nested row-major as KServe allows)."""
    if not isinstance(data, list):
        raise InferError(400, f"input {spec.name!r}: data must be a JSON array")
    try:
        a = np.asarray(data)
    except (ValueError, RecursionError) as e:     # ragged nesting, too deep
        raise InferError(400, f"input {spec.name!r}: data is not a regular array "
                              f"({str(e)[:80]})") from None
    if a.dtype == object or a.dtype.kind not in "biuf":
        raise InferError(400, f"input {spec.name!r}: data must be numbers (or booleans) "
                              f"for datatype {spec.datatype}")
    n = int(np.prod(spec.shape, dtype=np.int64))
    if a.size != n:
        raise InferError(400, f"input {spec.name!r}: shape {list(spec.shape)} needs {n} "
                              f"elements, data has {a.size}")
    if spec.datatype == "BOOL" and a.dtype.kind != "b":
        raise InferError(400, f"input {spec.name!r}: BOOL data must be true/false")
    if spec.datatype != "BOOL" and a.dtype.kind == "f" and spec.dtype.kind in "iu":
        if not np.all(np.isfinite(a)) or not np.all(a == np.round(a)):
            raise InferError(400, f"input {spec.name!r}: {spec.datatype} data must be "
                                  f"integers")
    try:
        with np.errstate(all="ignore"):
            return a.astype(spec.dtype).reshape(spec.shape)
    except (ValueError, OverflowError) as e:
        raise InferError(400, f"input {spec.name!r}: {e}") from None


def from_bytes(spec: TensorSpec, data: bytes | memoryview) -> np.ndarray:
    """A tensor from raw little-endian bytes (binary extension, gRPC raw contents)."""
    if len(data) != spec.nbytes:
        raise InferError(400, f"input {spec.name!r}: {spec.datatype} {list(spec.shape)} is "
                              f"{spec.nbytes} bytes, got {len(data)}")
    return np.frombuffer(data, dtype=spec.dtype.newbyteorder("<")).reshape(spec.shape)


def to_json_data(a: np.ndarray) -> list:
    """A tensor as KServe's flat JSON ``data``."""
    return a.reshape(-1).tolist()
