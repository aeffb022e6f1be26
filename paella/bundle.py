"""The bundle: what ``paella compile`` writes and what the dispatcher loads.

A bundle is one directory (format described in docs/bundle.md):

    manifest.json    this module's schema, ``format_version`` = FORMAT_VERSION
    kernels.cu       the (instrumented) CUDA source TVM generated, header prepended
    kernels.ptx      PTX built by nvcc from kernels.cu
    kernels.cubin    cubin for the bundle's arch (ptxas gave the register counts)
    params.npz       every param buffer's initial contents, keyed by buffer name
    cpu.so           the same model built for llvm: reference outputs on the CPU

The manifest holds a LIST of variants (batch sizes, sequence buckets, stage slices
later); each variant has its own tensors, buffers, kernels and launch plan.
The loader checks the format version and the manifest's internal consistency, and
refuses anything else with a :class:`BundleError` that names the cause and the fix.
"""
from __future__ import annotations

import functools
import json
import math
import os
import types
import typing
import zipfile
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

import numpy as np

from paella.protocol import MAX_GROUP
from paella.rings import MAX_ARENA_BYTES
from paella.tvm_loader import load_tvm

#: Where the compiled model zoo lives (override with $PAELLA_ZOO_DIR): `make zoo` fills it,
#: the experiments read it, `paella profile NAME` finds a model there by name.
DEFAULT_ZOO_DIR = Path(os.environ.get("PAELLA_ZOO_DIR", Path.home() / ".cache" / "paella" / "zoo"))

FORMAT = "paella-bundle"
#: 2: instrumented kernels take ``paella_block_offset`` (slicing), passed by the plan.
FORMAT_VERSION = 2
MANIFEST = "manifest.json"
#: Byte alignment of each tensor in the request's io buffer.
IO_ALIGN = 64

BUFFER_KINDS = ("input", "param", "intermediate", "workspace")
#: numpy dtype kinds a tensor may have: bool, signed, unsigned, float, complex.
NUMERIC_KINDS = "biufc"
STREAM_DEFAULT = 0


def check_shared_object(path: str) -> None:
    """Refuse a shared object that is not a whole 64-bit little-endian ELF file before
    the dynamic loader maps it: a truncated one (a copy cut short) is mapped all the
    same, and the first touch of a page past the file's end is a SIGBUS that kills the
    whole process, the daemon serving every other model included. Checked: the header,
    the program and section header tables, and every loadable segment's file bytes."""
    import struct
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(64)
        if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
            raise BundleError(f"{path} is not a 64-bit little-endian ELF shared object; "
                              f"compile the bundle again (paella compile)")
        phoff, shoff = struct.unpack_from("<QQ", head, 32)
        phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", head, 54)
        ends = [phoff + phentsize * phnum, shoff + shentsize * shnum]
        if ends[0] <= size and phentsize >= 56:
            f.seek(phoff)
            table = f.read(phentsize * phnum)
            for i in range(phnum):
                p_type, _, p_offset = struct.unpack_from("<IIQ", table, i * phentsize)
                p_filesz = struct.unpack_from("<Q", table, i * phentsize + 32)[0]
                if p_type == 1:                  # PT_LOAD
                    ends.append(p_offset + p_filesz)
    if max(ends) > size:
        raise BundleError(f"{path} is truncated ({size} bytes, its ELF headers need "
                          f"{max(ends)}); copy or compile the bundle again (paella compile)")


class BundleError(Exception):
    """A bundle that is missing, of an unknown format, or inconsistent."""


@dataclass
class TensorSpec:
    """An input or output: where it lives in the io buffer and on the device."""

    name: str
    shape: list[int]
    dtype: str
    offset: int            # byte offset in the request's io buffer
    nbytes: int
    buffer: int            # device buffer id holding it
    buffer_offset: int = 0


@dataclass
class BufferSpec:
    id: int
    name: str
    nbytes: int
    kind: str              # one of BUFFER_KINDS


@dataclass
class KernelArg:
    """A launch argument: a device buffer (+ byte offset) or a scalar."""

    buffer: int | None = None
    offset: int = 0
    scalar: int | float | None = None
    dtype: str | None = None

    def to_dict(self) -> dict:
        if self.buffer is not None:
            return {"buffer": self.buffer, "offset": self.offset}
        return {"scalar": self.scalar, "dtype": self.dtype}


@dataclass
class KernelSpec:
    name: str
    grid: list[int]
    block: list[int]
    dyn_smem: int
    static_smem: int
    registers: int
    flops: float
    bytes: int
    params: list[dict]     # [{name, kind: buffer|scalar, dtype, access}] excluding the notifQ pair
    instrumented: bool

    @property
    def blocks(self) -> int:
        return int(np.prod(self.grid))


@dataclass
class Op:
    """One step of the launch plan. ``op`` is "h2d", "launch" or "d2h", or, in a
    multi-stream plan, "record" / "wait" of plan-level event ``event`` on ``stream``
    (see :class:`paella.dispatcher.adaptor.PlanOp`)."""

    op: str
    stream: int = STREAM_DEFAULT
    # copies
    buffer: int | None = None
    buffer_offset: int = 0
    io_offset: int | None = None
    nbytes: int | None = None
    # launches
    kernel: str | None = None
    grid: list[int] | None = None
    block: list[int] | None = None
    dyn_smem: int = 0
    args: list[KernelArg] = field(default_factory=list)
    # events
    event: int = 0

    def to_dict(self) -> dict:
        if self.op in ("record", "wait"):
            return {"op": self.op, "stream": self.stream, "event": self.event}
        if self.op == "launch":
            return {"op": "launch", "stream": self.stream, "kernel": self.kernel, "grid": self.grid,
                    "block": self.block, "dyn_smem": self.dyn_smem,
                    "args": [a.to_dict() for a in self.args]}
        return {"op": self.op, "stream": self.stream, "buffer": self.buffer,
                "buffer_offset": self.buffer_offset, "io_offset": self.io_offset, "nbytes": self.nbytes}


@dataclass
class ViewSpec:
    """A tensor as a kernel call sees it: ``shape`` ``dtype`` at byte ``offset`` of
    device buffer ``buffer`` (a TVM storage may hold several over time)."""

    buffer: int
    offset: int
    shape: list[int]
    dtype: str

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


@dataclass
class CallSpec:
    """One call of a fused PrimFunc in the plan: its launches are plan launches
    ``launches[0]`` .. ``launches[1] - 1`` (counting launch steps only), its arguments
    the tensors it was called with (``None``: not a tensor). The unit DVABatch slicing
    cuts between (:mod:`paella.compiler_pass.stage_variants`); the CPU replay of a plan
    (:meth:`Bundle.run_stage_cpu`) calls the PrimFunc itself (``fused_cpu`` file)."""

    primfunc: str
    launches: list[int]
    args: list[ViewSpec | None]

    def to_dict(self) -> dict:
        return {"primfunc": self.primfunc, "launches": list(self.launches),
                "args": [asdict(a) if a is not None else None for a in self.args]}

    @staticmethod
    def from_dict(d: dict) -> "CallSpec":
        return CallSpec(d["primfunc"], d["launches"],
                        [ViewSpec(**a) if a is not None else None for a in d["args"]])


@dataclass
class Variant:
    """One compiled shape of the model. ``batch``: its batch size (rows on axis 0 of
    every input and output; 0 in bundles compiled without ``--batch-sizes``: then the
    first input's axis 0); ``seq_len``: its length bucket (axis 1 of the tensors that
    have one; 0: the model has no length axis). ``files``: this variant's own files
    (kernels, params, CPU build), keyed like the manifest's; missing keys fall back to
    the manifest's (variant 0 uses those).

    DVABatch stages (``paella compile --stages N``, docs/dvabatch.md "Compiled stages"):
    ``stage`` is this variant's stage (-1: the whole model), ``cuts`` the call indices
    (into the whole model's ``calls``) where the model was cut, the same for every
    variant of the bundle, and ``stage_seconds`` this stage's profiled time at this
    batch size on the simulated GPU it was sliced for. A stage variant's io holds its
    boundary-in tensors, then its boundary-out tensors, each batch-major (axis 0 is
    ``batch`` x a constant), so rows ``k..k+n`` of a batch are bytes
    ``k*row .. (k+n)*row`` of each (see :func:`split_rows`)."""
    name: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    buffers: list[BufferSpec]
    kernels: list[KernelSpec]
    plan: list[Op]
    io_bytes: int
    batch: int = 0
    seq_len: int = 0
    files: dict[str, str] = field(default_factory=dict)
    calls: list[CallSpec] = field(default_factory=list)
    stage: int = -1
    cuts: list[int] = field(default_factory=list)
    stage_seconds: float = 0.0

    @property
    def rows(self) -> int:
        """Its batch size: ``batch``, or the first input's axis 0 (1 for scalars)."""
        if self.batch:
            return self.batch
        shape = self.inputs[0].shape if self.inputs else []
        return int(shape[0]) if shape else 1

    def kernel(self, name: str) -> KernelSpec:
        for k in self.kernels:
            if k.name == name:
                return k
        raise KeyError(name)

    def launches(self) -> list[Op]:
        return [op for op in self.plan if op.op == "launch"]

    def to_dict(self) -> dict:
        return {"name": self.name, "io_bytes": self.io_bytes, "batch": self.batch,
                "seq_len": self.seq_len, "files": dict(self.files),
                "inputs": [asdict(t) for t in self.inputs], "outputs": [asdict(t) for t in self.outputs],
                "buffers": [asdict(b) for b in self.buffers], "kernels": [asdict(k) for k in self.kernels],
                "plan": [op.to_dict() for op in self.plan],
                "calls": [c.to_dict() for c in self.calls], "stage": self.stage,
                "cuts": list(self.cuts), "stage_seconds": self.stage_seconds}


@dataclass
class Manifest:
    model: str
    arch: str
    instrumented: bool
    group: int
    variants: list[Variant]
    files: dict[str, str]
    cache_key: str = ""
    tvm_version: str = ""
    compile_seconds: float = 0.0
    format_version: int = FORMAT_VERSION

    def to_dict(self) -> dict:
        return {"format": FORMAT, "format_version": self.format_version, "model": self.model,
                "arch": self.arch, "instrumented": self.instrumented, "group": self.group,
                "tvm_version": self.tvm_version, "cache_key": self.cache_key,
                "compile_seconds": round(self.compile_seconds, 3), "files": self.files,
                "variants": [v.to_dict() for v in self.variants]}


# ---------------------------------------------------------------- parsing + checks


def _require(d: dict, key: str, where: str) -> Any:
    if key not in d:
        raise BundleError(f"manifest: {where} lacks required field {key!r}; the bundle is corrupt "
                          "or from another tool: recompile it with `paella compile`")
    return d[key]


#: The most work one kernel may declare: 1e15 FLOPs is 50 s at an A100's FP32 peak
#: (19.5 TFLOP/s), 1e14 bytes 50 s at its 2 TB/s. A bundle's kernels are far below
#: (a batch-64 4096x4096 GEMM is 2e12 FLOPs).
MAX_KERNEL_FLOPS = 1e15
MAX_KERNEL_BYTES = 1e14
#: The largest integer a manifest may hold (sizes, offsets, counts): far above any real
#: one, and below what numpy's int64 arithmetic on them could overflow.
MAX_MANIFEST_INT = 1 << 53


def _check_types(obj: Any, where: str) -> None:
    """Every field of the manifest record ``obj`` (a dataclass, nested ones included) has
    its annotated JSON type: ``int`` an integer (not a bool, not 1.0) of at most
    :data:`MAX_MANIFEST_INT` in size, ``float`` a finite number, ``str``/``bool``
    exactly, lists and dicts of those. A wrong type would otherwise fail far from the
    file, per request or in the middle of the daemon's swap of models (a variant named
    null crashed it)."""
    for name, hint in _hints(type(obj)):
        _check_value(getattr(obj, name), hint, f"{where}: {name}")


@functools.cache
def _hints(cls: type) -> tuple[tuple[str, Any], ...]:
    """A record's fields and their types (resolved once: ``get_type_hints`` evaluates the
    annotations, 0.5 ms a call)."""
    hints = typing.get_type_hints(cls)
    return tuple((f.name, hints[f.name]) for f in fields(cls))


def _check_value(value: Any, hint: Any, where: str) -> None:
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        errors = []
        for h in typing.get_args(hint):
            try:
                return _check_value(value, h, where)
            except BundleError as e:
                errors.append(e)
        raise errors[0]                      # (the first type named: not None)
    if hint is type(None):
        ok = value is None
    elif hint is bool or hint is str:
        ok = type(value) is hint
    elif hint is int:
        ok = type(value) is int and abs(value) <= MAX_MANIFEST_INT
    elif hint is float:
        ok = type(value) in (int, float) and math.isfinite(value) and abs(value) <= 1e30
    elif origin is list:
        if type(value) is not list:
            raise BundleError(f"manifest: {where} must be a list, got {value!r:.60}")
        (item,) = typing.get_args(hint)
        for i, v in enumerate(value):
            _check_value(v, item, f"{where}[{i}]")
        return
    elif origin is dict or hint is dict:
        if type(value) is not dict:
            raise BundleError(f"manifest: {where} must be an object, got {value!r:.60}")
        if origin is dict:
            kt, vt = typing.get_args(hint)
            for k, v in value.items():
                _check_value(k, kt, where)
                _check_value(v, vt, f"{where}[{k!r:.40}]")
        return
    elif is_dataclass(hint):
        if not isinstance(value, hint):
            raise BundleError(f"manifest: {where} must be an object, got {value!r:.60}")
        return _check_types(value, where)
    else:
        ok = True
    if not ok:
        name = getattr(hint, "__name__", str(hint))
        raise BundleError(f"manifest: {where} must be {'an' if name == 'int' else 'a'} {name}"
                          f"{' of at most 2**53' if name == 'int' else ''}, got {value!r:.60}; "
                          f"the bundle is corrupt or from another tool: recompile it")


def _variant_from_dict(d: dict) -> Variant:
    name = _require(d, "name", "variant")
    where = f"variant {name!r}"
    tensors = lambda key: [TensorSpec(**t) for t in _require(d, key, where)]  # noqa: E731
    plan = []
    for o in _require(d, "plan", where):
        o = dict(o)
        o["args"] = [KernelArg(**a) for a in o.get("args", [])]
        plan.append(Op(**o))
    v = Variant(name=name, inputs=tensors("inputs"), outputs=tensors("outputs"),
                buffers=[BufferSpec(**b) for b in _require(d, "buffers", where)],
                kernels=[KernelSpec(**k) for k in _require(d, "kernels", where)],
                plan=plan, io_bytes=_require(d, "io_bytes", where),
                batch=d.get("batch", 0), seq_len=d.get("seq_len", 0),
                files=d.get("files", {}),
                calls=[CallSpec.from_dict(c) for c in d.get("calls", [])],
                stage=d.get("stage", -1), cuts=d.get("cuts", []),
                stage_seconds=d.get("stage_seconds", 0.0))
    _check_types(v, f"variant {name!r:.60}")
    return v


def manifest_from_dict(d: dict) -> Manifest:
    if d.get("format") != FORMAT:
        raise BundleError(f"manifest: format is {d.get('format')!r}, expected {FORMAT!r}: "
                          "this is not a Paella bundle")
    version = d.get("format_version")
    if version != FORMAT_VERSION:
        raise BundleError(f"manifest: format_version {version!r} is not supported (this paella reads "
                          f"version {FORMAT_VERSION}); recompile the model with this version's "
                          "`paella compile`")
    try:
        variants = [_variant_from_dict(v) for v in _require(d, "variants", "manifest")]
    except TypeError as e:  # unexpected/missing dataclass fields
        raise BundleError(f"manifest: malformed entry ({e}); recompile the bundle") from None
    if not variants:
        raise BundleError("manifest: no variants; a bundle holds at least one compiled variant")
    group = _require(d, "group", "manifest")
    if type(group) is not int or not 1 <= group <= MAX_GROUP:
        raise BundleError(f"manifest: group {group!r:.40} is not 1..{MAX_GROUP} (thread blocks "
                          f"per notification); recompile the bundle")
    return Manifest(model=_require(d, "model", "manifest"), arch=_require(d, "arch", "manifest"),
                    instrumented=bool(_require(d, "instrumented", "manifest")),
                    group=group, variants=variants,
                    files=dict(_require(d, "files", "manifest")), cache_key=d.get("cache_key", ""),
                    tvm_version=d.get("tvm_version", ""),
                    compile_seconds=float(d.get("compile_seconds", 0.0)), format_version=version)


def check_variant(v: Variant) -> None:
    """Internal consistency: ids, sizes, io layout, and dataflow order of the plan.

    Every buffer an op reads must have been written earlier in the plan (inputs by
    their H2D copy, intermediates by a kernel); params count as written at load.
    """
    def bad(msg: str) -> BundleError:
        return BundleError(f"variant {v.name!r}: {msg}; the bundle is inconsistent, recompile it")

    ids = [b.id for b in v.buffers]
    if ids != list(range(len(ids))):
        raise bad("buffer ids must be 0..n-1 in order")
    for k in v.kernels:
        # Work the simulator times a kernel by: a real number, finite and >= 0 (an
        # infinite one never completes; a string fails deep in the cost model).
        for what, most in (("flops", MAX_KERNEL_FLOPS), ("bytes", MAX_KERNEL_BYTES)):
            x = getattr(k, what)
            if type(x) not in (int, float) or not 0 <= x <= most:
                raise bad(f"kernel {k.name!r} has {what} {x!r}; it must be a number from 0 to "
                          f"{most:g} (one kernel of a served model; more would run for minutes "
                          f"on any GPU, and the daemon profiles every model at load)")
    for b in v.buffers:
        if b.kind not in BUFFER_KINDS or b.nbytes < 0:
            raise bad(f"buffer {b.id} has kind {b.kind!r} / size {b.nbytes}")
    end = 0
    for t in v.inputs + v.outputs:
        try:
            dtype = np.dtype(t.dtype)
        except TypeError:
            dtype = None
        if dtype is None or dtype.kind not in NUMERIC_KINDS:
            raise bad(f"tensor {t.name!r} has dtype {t.dtype!r}, which is not a numeric numpy "
                      f"dtype (such as float32, int64, uint8)")
        expect = int(np.prod(t.shape, dtype=np.int64)) * dtype.itemsize
        if t.nbytes != expect:
            raise bad(f"tensor {t.name!r} has {t.nbytes} bytes but shape {t.shape} {t.dtype} needs {expect}")
        if t.offset < end or not 0 <= t.buffer < len(ids):
            raise bad(f"tensor {t.name!r} overlaps the previous one in the io buffer or names no buffer")
        if t.buffer_offset + t.nbytes > v.buffers[t.buffer].nbytes:
            raise bad(f"tensor {t.name!r} does not fit in buffer {t.buffer}")
        end = t.offset + t.nbytes
    if end > v.io_bytes:
        raise bad(f"io_bytes {v.io_bytes} is smaller than the tensors need ({end})")
    if v.io_bytes > MAX_ARENA_BYTES:
        raise bad(f"io_bytes {v.io_bytes} is larger than any client's arena can be "
                  f"(2**40 bytes): no request could carry it")
    kernels = {k.name: k for k in v.kernels}
    written = {b.id for b in v.buffers if b.kind == "param"}
    recorded: set[int] = set()
    for i, op in enumerate(v.plan):
        where = f"plan op {i} ({op.op})"
        if not isinstance(op.stream, int) or op.stream < 0:
            raise bad(f"{where}: stream {op.stream!r} is not a non-negative integer")
        if op.op in ("record", "wait"):
            if not isinstance(op.event, int) or op.event < 0:
                raise bad(f"{where}: event {op.event!r} is not a non-negative integer")
            if op.op == "record":
                recorded.add(op.event)
            elif op.event not in recorded:
                raise bad(f"{where} waits for event {op.event} before any record of it")
        elif op.op in ("h2d", "d2h"):
            if op.buffer is None or not 0 <= op.buffer < len(ids):
                raise bad(f"{where} names no valid buffer")
            if op.buffer_offset + op.nbytes > v.buffers[op.buffer].nbytes or op.io_offset + op.nbytes > v.io_bytes:
                raise bad(f"{where} copies past the end of its buffer or of the io buffer")
            if op.op == "h2d":
                written.add(op.buffer)
            elif op.buffer not in written:
                raise bad(f"{where} reads buffer {op.buffer} before anything wrote it")
        elif op.op == "launch":
            k = kernels.get(op.kernel)
            if k is None:
                raise bad(f"{where} launches unknown kernel {op.kernel!r}")
            if len(op.args) != len(k.params):
                raise bad(f"{where} passes {len(op.args)} args to {op.kernel} which takes {len(k.params)}")
            for a, p in zip(op.args, k.params):
                if p["kind"] == "buffer":
                    if a.buffer is None or not 0 <= a.buffer < len(ids):
                        raise bad(f"{where}: arg {p['name']} must be a buffer")
                    if "r" in p["access"] and "w" not in p["access"] and a.buffer not in written:
                        raise bad(f"{where}: {op.kernel} reads buffer {a.buffer} before anything wrote it")
            for a, p in zip(op.args, k.params):
                if p["kind"] == "buffer" and "w" in p["access"]:
                    written.add(a.buffer)
        else:
            raise bad(f"{where}: unknown op kind {op.op!r} (expected h2d, launch, d2h, record or wait)")


# ---------------------------------------------------------------- the loaded bundle


class Bundle:
    """A loaded bundle. Attribute shortcuts refer to the first variant."""

    def __init__(self, path: Path, manifest: Manifest) -> None:
        self.path = path
        self.manifest = manifest
        self._params: dict[str, dict[str, np.ndarray]] = {}
        self._param_bytes: dict[str, dict[str, bytes]] = {}  # by params file, then name
        self._vm: dict[str, Any] = {}                          # by CPU build file
        self._orders: dict[str, list[str]] = {}                # by CPU params order file

    # shortcuts to variants[0]
    @property
    def variants(self) -> list[Variant]:
        return self.manifest.variants

    @property
    def model(self) -> str:
        return self.manifest.model

    @property
    def kernels(self) -> list[KernelSpec]:
        return self.variants[0].kernels

    @property
    def plan(self) -> list[Op]:
        return self.variants[0].plan

    @property
    def inputs(self) -> list[TensorSpec]:
        return self.variants[0].inputs

    @property
    def outputs(self) -> list[TensorSpec]:
        return self.variants[0].outputs

    @property
    def buffers(self) -> list[BufferSpec]:
        return self.variants[0].buffers

    @property
    def io_bytes(self) -> int:
        return self.variants[0].io_bytes

    def file(self, key: str, variant: int = 0) -> Path:
        """The file ``key`` of ``variant`` (its own, else the manifest's)."""
        name = self.variants[variant].files.get(key) or self.manifest.files.get(key)
        if name is None:
            raise BundleError(f"bundle {self.path} has no {key!r} file in its manifest")
        return self.path / name

    def params(self, variant: int = 0) -> dict[str, np.ndarray]:
        """Param buffer contents keyed by buffer name (what the device uploads once)."""
        path = self.file("params", variant)
        if str(path) not in self._params:
            try:
                with np.load(path, allow_pickle=False) as z:
                    self._params[str(path)] = {k: z[k] for k in z.files}
            except (ValueError, OSError, EOFError, zipfile.BadZipFile) as e:
                raise BundleError(f"{path} cannot be read ({type(e).__name__}: {e}); copy or "
                                  f"compile the bundle again (paella compile)") from None
        return self._params[str(path)]

    def param_bytes(self, variant: int = 0) -> dict[int, bytes]:
        """Initial contents per param buffer id. Variants that share a params file get the
        same ``bytes`` objects (made once per file and buffer name), so a device that
        keys its copies by them (:class:`paella.dispatcher.adaptor.SharedParams`) holds
        one copy of a model's weights, not one per variant."""
        path = str(self.file("params", variant))
        p = self.params(variant)
        made = self._param_bytes.setdefault(path, {})
        out = {}
        for b in self.variants[variant].buffers:
            if b.kind == "param":
                data = made.get(b.name)
                if data is None:
                    data = made[b.name] = p[b.name].tobytes()
                out[b.id] = data
        return out

    def pack_inputs(self, inputs: dict[str, np.ndarray], variant: int = 0) -> np.ndarray:
        """An io buffer (uint8) holding ``inputs`` at their offsets, outputs zeroed."""
        v = self.variants[variant]
        io = np.zeros(v.io_bytes, dtype=np.uint8)
        for t in v.inputs:
            a = _checked_input(t, inputs)
            io[t.offset:t.offset + t.nbytes] = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
        return io

    def unpack_outputs(self, io: np.ndarray, variant: int = 0) -> dict[str, np.ndarray]:
        v = self.variants[variant]
        return {t.name: io[t.offset:t.offset + t.nbytes].view(np.dtype(t.dtype)).reshape(t.shape).copy()
                for t in v.outputs}

    def run_cpu(self, inputs: dict[str, np.ndarray], variant: int = 0) -> dict[str, np.ndarray]:
        """Reference outputs from the CPU (llvm) build of the same model (``variant``'s)."""
        v = self.variants[variant]
        if v.stage >= 0:
            raise BundleError(f"variant {v.name!r} is stage {v.stage} of a sliced model and has no "
                              f"CPU build of its own: take the whole model's reference with "
                              f"run_cpu_model(inputs, batch={v.rows})")
        return self._cpu(variant, [_checked_input(t, inputs) for t in v.inputs], v.outputs)

    def run_cpu_model(self, inputs: dict[str, np.ndarray], batch: int) -> dict[str, np.ndarray]:
        """The whole model's reference outputs at ``batch`` rows, in a bundle of stage
        variants (``paella compile --stages``): stage 0's inputs in, the last stage's
        outputs out, from the CPU build of the whole model the stages were cut from."""
        first = self.stage_variant(0, batch)
        last = self.stage_variant(self.n_stages - 1, batch)
        arrays = [_checked_input(t, inputs) for t in self.variants[first].inputs]
        return self._cpu(first, arrays, self.variants[last].outputs)

    def _cpu_order(self, variant: int) -> list[str]:
        """The CPU build's parameter order, read once per file like the build and the
        params: ``_cpu`` runs per request on the daemon's loop (the simulator's answers),
        where opening a file could fail on a descriptor limit that hostile clients filled."""
        order_path = self.file("cpu_params", variant)
        order = self._orders.get(str(order_path))
        if order is None:
            try:
                order = json.loads(order_path.read_text())
            except ValueError as e:
                raise BundleError(f"{order_path} is not JSON ({e}); copy or compile the bundle "
                                  f"again (paella compile)") from None
            self._orders[str(order_path)] = order
        return order

    def _cpu(self, variant: int, arrays: list[np.ndarray], outputs: list[TensorSpec]) -> dict[str, np.ndarray]:
        tvm = load_tvm()
        relax = tvm.relax
        lib_path = str(self.file("cpu_lib", variant))
        vm = self._vm.get(lib_path)
        if vm is None:
            if lib_path.endswith(".so"):
                check_shared_object(lib_path)
            lib = tvm.runtime.load_module(lib_path)
            vm = self._vm[lib_path] = relax.VirtualMachine(lib, tvm.cpu())
        p = self.params(variant)
        order = self._cpu_order(variant)
        dev = tvm.cpu()
        args = [tvm.runtime.tensor(a, dev) for a in arrays] + [tvm.runtime.tensor(p[n], dev) for n in order]
        out = vm["main"](*args)
        outs = list(out) if not hasattr(out, "numpy") else [out]
        if len(outs) != len(outputs):
            raise BundleError(f"CPU build returned {len(outs)} outputs, manifest lists {len(outputs)}")
        return {t.name: o.numpy() for t, o in zip(outputs, outs)}

    def run_stage_cpu(self, inputs: dict[str, np.ndarray], variant: int = 0) -> dict[str, np.ndarray]:
        """``variant``'s outputs computed by *replaying its plan* on the CPU: what a DVABatch
        stage variant gives (its boundary-in tensors in, its boundary-out tensors out),
        since a stage has no CPU build of its own. Works for any variant that records
        its calls.

        The whole model's CPU build says nothing about a plan: which bytes of which
        statically planned storage each kernel reads and writes. A sliced plan is right
        only if its copies in and out carry every byte the later kernels need, storage
        reuse included. So this replays the plan itself: one numpy array per device buffer
        (params loaded, the rest zero), the H2D and D2H copies as written, and each fused
        PrimFunc *call* (``Variant.calls``) run by the llvm build of the same fused,
        unscheduled PrimFunc (the ``fused_cpu`` file) on the views the call names. The
        CUDA kernels are the GPU lowering of those PrimFuncs (DLight only schedules them),
        so what it checks is the plan's dataflow, not the CUDA code generation."""
        tvm = load_tvm()
        v = self.variants[variant]
        if not v.calls:
            raise BundleError(f"variant {v.name!r} records no PrimFunc calls (a bundle from before "
                              f"they were recorded): recompile it with `paella compile`")
        path = str(self.file("fused_cpu", variant))
        lib = self._vm.get(path)
        if lib is None:
            lib = self._vm[path] = tvm.runtime.load_module(path)
        params = self.params(variant)
        mem = [np.frombuffer(params[b.name].tobytes(), np.uint8).copy() if b.kind == "param"
               else np.zeros(b.nbytes, np.uint8) for b in v.buffers]
        io = self.pack_inputs(inputs, variant)
        calls, done, launched = v.calls, 0, 0

        def run_calls(upto: int) -> None:
            nonlocal done
            while done < len(calls) and calls[done].launches[0] <= upto:
                _replay_call(lib, calls[done], mem)
                done += 1

        for op in v.plan:
            if op.op == "h2d":
                mem[op.buffer][op.buffer_offset:op.buffer_offset + op.nbytes] = io[op.io_offset:op.io_offset + op.nbytes]
            elif op.op == "launch":
                run_calls(launched)
                launched += 1
            elif op.op == "d2h":
                run_calls(launched)
                io[op.io_offset:op.io_offset + op.nbytes] = mem[op.buffer][op.buffer_offset:op.buffer_offset + op.nbytes]
        return self.unpack_outputs(io, variant)

    # DVABatch stages (paella compile --stages)
    @property
    def n_stages(self) -> int:
        """How many stages the model was cut into (0: a bundle of whole-model variants)."""
        return max((v.stage + 1 for v in self.variants), default=0)

    def stage_variant(self, stage: int, batch: int) -> int:
        """The index of the variant of ``stage`` compiled for ``batch`` rows."""
        for i, v in enumerate(self.variants):
            if v.stage == stage and v.rows == batch:
                return i
        sizes = sorted({v.rows for v in self.variants if v.stage == stage})
        raise BundleError(f"bundle {self.path} has no variant of stage {stage} for batch {batch} "
                          f"(stages: {self.n_stages}, batch sizes: {sizes}); run the rows in pieces "
                          f"(split_rows) or compile it with that batch size")


def _replay_call(lib, c: CallSpec, mem: list[np.ndarray]) -> None:
    """One fused PrimFunc call on the CPU, on copies of its views; only the views the
    call changed are written back (an argument it only reads may overlap one it writes)."""
    tvm = load_tvm()
    if any(a is None for a in c.args):
        raise BundleError(f"a call of {c.primfunc} has a non-tensor argument; the CPU replay "
                          f"handles tensor arguments only")
    views = [mem[a.buffer][a.offset:a.offset + a.nbytes] for a in c.args]
    before = [m.copy() for m in views]
    args = [tvm.runtime.tensor(b.view(a.dtype).reshape(a.shape), tvm.cpu()) for a, b in zip(c.args, before)]
    lib[c.primfunc](*args)
    for view, b, t in zip(views, before, args):
        after = np.ascontiguousarray(t.numpy()).view(np.uint8).reshape(-1)
        if not np.array_equal(after, b):
            view[:] = after


def split_rows(start: int, num: int, sizes: list[int] | tuple[int, ...]) -> list[tuple[int, int]]:
    """How a stage runs rows ``start .. start+num-1`` of a batch with the compiled batch
    sizes ``sizes``: ``[(row offset, variant batch size), ...]``, covering the rows
    exactly once, in order, with no padding. Greedy: the largest compiled size that fits
    the rows still to run, so with the powers of two it is ``num``'s binary
    decomposition (at most log2(64) + 1 = 7 runs) and with every size 1..64 one run.
    Rows are independent in these models, so each piece gives its rows' outputs; a
    stage variant's boundary tensors are batch-major, so a piece's bytes are at
    ``offset * row_bytes`` of each batch buffer."""
    avail = sorted(set(sizes), reverse=True)
    if num < 0 or start < 0:
        raise ValueError(f"rows {start}+{num}: need a non-negative start and count")
    if num and 1 not in avail:
        # Greedy is exact whenever 1 is compiled; without it some counts have no cover.
        raise ValueError(f"compiled batch sizes {sorted(avail)} lack 1: a count of rows such as "
                         f"{num} may have no exact cover; compile batch size 1 too")
    out, k, left = [], start, num
    while left:
        b = next(b for b in avail if b <= left)
        out.append((k, b))
        k, left = k + b, left - b
    return out


def _checked_input(t: TensorSpec, inputs: dict[str, np.ndarray]) -> np.ndarray:
    if t.name not in inputs:
        raise ValueError(f"missing input {t.name!r}; the model takes {t.name!r} {t.shape} {t.dtype}")
    a = np.asarray(inputs[t.name])
    if list(a.shape) != list(t.shape) or a.dtype != np.dtype(t.dtype):
        raise ValueError(f"input {t.name!r} is {list(a.shape)} {a.dtype}, the model needs {t.shape} {t.dtype}")
    return a


def load_bundle(path: str | Path) -> Bundle:
    """Load and check a bundle directory; raises :class:`BundleError` when unusable."""
    path = Path(path)
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise BundleError(f"{path} is not a bundle: no {MANIFEST} (create one with `paella compile MODEL -o {path}`)")
    try:
        d = json.loads(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BundleError(f"{mpath} is not valid JSON ({e}); the bundle is corrupt, recompile it") from None
    except RecursionError:
        raise BundleError(f"{mpath} is not a manifest (JSON nested too deeply to read); the "
                          f"bundle is corrupt, recompile it") from None
    if not isinstance(d, dict):
        raise BundleError(f"{mpath} is not a manifest (JSON {type(d).__name__}, not an object); "
                          f"the bundle is corrupt or from another tool, recompile it")
    try:
        m = manifest_from_dict(d)
        for key, name in [*m.files.items(), *(kv for v in m.variants for kv in v.files.items())]:
            if not (path / name).is_file():
                raise BundleError(f"bundle {path}: file {name!r} ({key}) is missing; recompile the bundle")
        for v in m.variants:
            check_variant(v)
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        # A field of the wrong JSON type (a string for a number, a list for a table):
        # the manifest is corrupt or from another tool, not a bug to trace back.
        raise BundleError(f"{mpath}: malformed manifest ({type(e).__name__}: {e}); the bundle "
                          f"is corrupt or from another tool, recompile it") from None
    return Bundle(path, m)
