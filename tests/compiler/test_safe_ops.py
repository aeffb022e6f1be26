"""What a client's values reach cannot crash the process (compiler_pass/safe_ops.py): an
out-of-range index cannot leave its tensor (every ``take`` in clip mode, the index of
every other indexing op clamped), and an integer division by 0, or of the most negative
value by -1, is defined. Both for the GPU kernels and the CPU build the daemon runs as
the simulator's functional effect (which segfaulted the daemon on token 10**8)."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from tvm import relax
from tvm.relax.frontend import nn

from paella.bundle import load_bundle
from paella.compiler_pass.safe_ops import make_safe
from paella.compiler_pass.build import compile_bundle
from paella.models.base import export


class Embedding(nn.Module):
    def __init__(self):
        self.table = nn.Parameter((16, 8), "float32")

    def forward(self, ids: nn.Tensor) -> nn.Tensor:
        return nn.op.take(self.table, ids, axis=0)


def _model():
    return export("embedding", Embedding(), {"ids": ((4,), "int32")})


def test_every_take_clamps():
    mod = make_safe(_model().mod)
    text = mod.script()
    assert 'mode="clip"' in text and 'mode="fast"' not in text


def test_hostile_ids_get_the_nearest_rows_and_no_crash(tmp_path):
    md = _model()
    out = compile_bundle(md, tmp_path / "emb", cache_dir=tmp_path / "cache")
    # In a child process: an unchecked take would kill it with SIGSEGV, not this test.
    code = f"""
import numpy as np
import pytest
from paella.bundle import load_bundle
b = load_bundle({str(out)!r})
y = b.run_cpu({{"ids": np.array([0, 10**8, -10**8, 15], np.int32)}})
print(list(y.values())[0].tobytes().hex())
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = np.frombuffer(bytes.fromhex(proc.stdout.strip()), np.float32).reshape(4, 8)
    table = md.params[0]
    np.testing.assert_array_equal(got, table[[0, 15, 0, 15]])
    assert load_bundle(out).variants[0].inputs[0].dtype == "int32"


# -- every other indexing op: the index operand is clamped ----------------------------------
# (op, index shape and dtype, updates shape or None, hostile indices, what the clamp gives:
#  negatives count from the end, then every index is clipped into its axis)
_DATA = np.arange(128, dtype=np.float32).reshape(16, 8)
_OPS = {
    "gather_elements": ((4, 8), "int32", None,
                        np.array([[-1] * 8, [3] * 8, [-10**8] * 8, [10**8] * 8], np.int32),
                        lambda ix: np.take_along_axis(_DATA, ix, 0)),
    "gather_nd": ((4, 2), "int64", None,
                  np.array([[10**8, 3], [2, 5], [-1, -1], [-10**9, 10**9]], np.int64),
                  lambda ix: _DATA[ix[:, 0], ix[:, 1]]),
    "scatter_elements": ((4, 8), "int64", (4, 8),
                         np.array([[10**8] * 8, [0] * 8, [-1] * 8, [-10**8] * 8], np.int64),
                         None),
    "scatter_nd": ((4, 2), "int64", (4,),
                   np.array([[10**8, 3], [0, 0], [-1, -1], [-10**9, 10**9]], np.int64), None),
    "index_tensor": ((4,), "int64", None, np.array([10**8, -1, 2, -10**8], np.int64),
                     lambda ix: _DATA[ix]),
}
_CHILD = '''
import sys, numpy as np, tvm
from tvm import relax
from paella.compiler_pass.safe_ops import make_safe
op, safe = sys.argv[1], sys.argv[2] == "1"
shape, dtype, upd_shape = {shapes}[op]
ids = np.load(sys.argv[3])
bb = relax.BlockBuilder()
data = relax.Var("data", relax.TensorType((16, 8), "float32"))
idx = relax.Var("idx", relax.TensorType(shape, dtype))
params = [data, idx]
if upd_shape:
    upd = relax.Var("upd", relax.TensorType(upd_shape, "float32"))
    params.append(upd)
make = {{"gather_elements": lambda: relax.op.gather_elements(data, idx, 0),
         "gather_nd": lambda: relax.op.gather_nd(data, idx),
         "scatter_elements": lambda: relax.op.scatter_elements(data, idx, upd, 0),
         "scatter_nd": lambda: relax.op.scatter_nd(data, idx, upd),
         "index_tensor": lambda: relax.op.index_tensor(data, relax.Tuple([idx]))}}[op]
with bb.function("main", params):
    with bb.dataflow():
        out = bb.emit_output(make())
    bb.emit_func_output(out)
mod = make_safe(bb.get()) if safe else bb.get()
vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
args = [np.arange(128, dtype=np.float32).reshape(16, 8), ids]
if upd_shape:
    args.append(np.full(upd_shape, -1.0, np.float32))
np.save(sys.argv[4], vm["main"](*[tvm.runtime.tensor(a) for a in args]).numpy())
'''


def _run_child(tmp_path, op: str, safe: bool, ids: np.ndarray) -> subprocess.CompletedProcess:
    """Build and run ``op`` in a child process: an unchecked index kills it (SIGSEGV)."""
    script = tmp_path / "child.py"
    shapes = {k: v[:3] for k, v in _OPS.items()}
    script.write_text(_CHILD.format(shapes=repr(shapes)))
    np.save(tmp_path / "ids.npy", ids)
    return subprocess.run([sys.executable, str(script), op, "1" if safe else "0",
                           str(tmp_path / "ids.npy"), str(tmp_path / "out.npy")],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("op", sorted(_OPS))
def test_hostile_indices_stay_inside_the_tensor(tmp_path, op):
    shape, dtype, upd_shape, hostile, reference = _OPS[op]
    proc = _run_child(tmp_path, op, True, hostile)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = np.load(tmp_path / "out.npy")
    clamped = np.clip(np.where(hostile < 0, hostile + np.array(
        (16, 8)[:hostile.shape[-1]] if op in ("gather_nd", "scatter_nd") else 16), hostile),
        0, np.array((15, 7)[:hostile.shape[-1]] if op in ("gather_nd", "scatter_nd") else 15))
    if reference is not None:
        np.testing.assert_array_equal(got, reference(clamped))
    else:                                    # a scatter of -1s: they land at the clamped places
        want = _DATA.copy()
        if op == "scatter_nd":
            want[clamped[:, 0], clamped[:, 1]] = -1.0
        else:
            np.put_along_axis(want, clamped, -1.0, 0)
        np.testing.assert_array_equal(got, want)


def test_without_the_clamp_a_hostile_index_kills_the_process(tmp_path):
    """(Why the pass exists: the same gather_nd, unclamped, segfaults.)"""
    proc = _run_child(tmp_path, "gather_nd", False, _OPS["gather_nd"][3])
    assert proc.returncode == -11, (proc.returncode, proc.stderr[-500:])


@pytest.mark.parametrize("op", ["gather_elements", "gather_nd", "index_tensor"])
def test_indices_in_range_are_unchanged(tmp_path, op):
    shape, dtype, _, _, reference = _OPS[op]
    rng = np.random.default_rng(3)
    bound = np.array((16, 8)[:shape[-1]]) if op == "gather_nd" else 16
    ids = (rng.integers(0, 1 << 30, shape) % bound).astype(dtype)
    ids.flat[0] = -1                         # negatives count from the end (ONNX)
    proc = _run_child(tmp_path, op, True, ids)
    assert proc.returncode == 0, proc.stderr[-2000:]
    wrapped = np.where(ids < 0, ids + bound, ids)
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), reference(wrapped))


class GatherND(nn.Module):
    def __init__(self):
        self.table = nn.Parameter((16, 8), "float32")

    def forward(self, ids: nn.Tensor) -> nn.Tensor:
        return nn.op.wrap_nested(relax.op.gather_nd(self.table._expr, ids._expr), "gather")


def test_a_bundle_with_gather_nd_answers_hostile_indices(tmp_path):
    """The whole compile (the clamp is planned and lowered like any other kernel): the
    bundle's CPU build, in a child process, answers hostile indices with the clamped rows."""
    md = export("gather_nd", GatherND(), {"ids": ((4, 2), "int64")})
    out = compile_bundle(md, tmp_path / "gnd", cache_dir=tmp_path / "cache")
    code = f"""
import numpy as np
from paella.bundle import load_bundle
y = load_bundle({str(out)!r}).run_cpu({{"ids": np.array([[10**8, 3], [2, 5], [-1, -1],
                                                         [-10**9, 10**9]], np.int64)}})
print(list(y.values())[0].tobytes().hex())
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = np.frombuffer(bytes.fromhex(proc.stdout.strip()), np.float32)
    np.testing.assert_array_equal(got, md.params[0][[15, 2, 15, 0], [3, 5, 7, 7]])
    assert sum(op.op == "launch" for op in load_bundle(out).variants[0].plan) >= 2


# -- integer division: a divisor of 0, or -1 under the most negative value, cannot trap -----
_DIVIDE_CHILD = '''
import sys, numpy as np, tvm
from tvm import relax
from paella.compiler_pass.safe_ops import make_safe
op, dtype, safe = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
x_in, y_in = np.load(sys.argv[4]), np.load(sys.argv[5])
bb = relax.BlockBuilder()
x = relax.Var("x", relax.TensorType(x_in.shape, dtype))
y = relax.Var("y", relax.TensorType(y_in.shape, dtype))
with bb.function("main", [x, y]):
    with bb.dataflow():
        out = bb.emit_output(getattr(relax.op, op)(x, y))
    bb.emit_func_output(out)
mod = make_safe(bb.get()) if safe else bb.get()
vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
np.save(sys.argv[6], vm["main"](tvm.runtime.tensor(x_in), tvm.runtime.tensor(y_in)).numpy())
'''


def _divide_in_child(tmp_path, op, dtype, safe, x, y):
    (tmp_path / "child.py").write_text(_DIVIDE_CHILD)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    return subprocess.run([sys.executable, str(tmp_path / "child.py"), op, dtype,
                           "1" if safe else "0", str(tmp_path / "x.npy"), str(tmp_path / "y.npy"),
                           str(tmp_path / "out.npy")], capture_output=True, text=True, timeout=300)


def _expected(op: str, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The guarded rule: by 0, quotient x and remainder 0; by -1, quotient -x (wrapping)
    and remainder 0; otherwise the op (divide and mod truncate, the floor ones floor)."""
    ok = (y != 0) & (y != -1) if np.issubdtype(x.dtype, np.signedinteger) else y != 0
    d = np.where(ok, y, 1).astype(x.dtype)
    with np.errstate(over="ignore"):
        q = {"divide": np.sign(x) * np.sign(d) * (np.abs(x) // np.abs(d)),
             "floor_divide": np.floor_divide(x, d), "mod": np.fmod(x, d),
             "floor_mod": np.mod(x, d)}[op].astype(x.dtype)
        neg = (np.zeros_like(x) - x) if op in ("divide", "floor_divide") else np.zeros_like(x)
    by_zero = x if op in ("divide", "floor_divide") else np.zeros_like(x)
    return np.where(ok, q, np.where(y == 0, by_zero, neg))


@pytest.mark.parametrize("op", ["divide", "floor_divide", "mod", "floor_mod"])
@pytest.mark.parametrize("dtype", ["int32", "int64", "uint32"])
def test_integer_division_by_anything_is_defined(tmp_path, op, dtype):
    info = np.iinfo(dtype)
    rng = np.random.default_rng(7)
    x = rng.integers(max(info.min, -1000), 1000, 64).astype(dtype)
    y = rng.integers(max(info.min, -9), 10, 64).astype(dtype)
    y[:4] = 0
    if info.min < 0:
        x[4:8], y[4:8] = info.min, -1        # the other trap: most negative / -1
    proc = _divide_in_child(tmp_path, op, dtype, True, x, y)
    assert proc.returncode == 0, proc.stderr[-2000:]
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), _expected(op, x, y))


def test_without_the_guard_a_zero_divisor_kills_the_process(tmp_path):
    """(Why the guard exists: the same floor_mod, unguarded, dies of SIGFPE.)"""
    x, y = np.array([7, 8], np.int32), np.array([0, 3], np.int32)
    proc = _divide_in_child(tmp_path, "floor_mod", "int32", False, x, y)
    assert proc.returncode == -8, (proc.returncode, proc.stderr[-500:])


def test_a_constant_divisor_free_of_zero_and_minus_one_is_left_alone():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4,), "int32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            a = bb.emit(relax.op.floor_divide(x, relax.const(4, "int32")))
            out = bb.emit_output(relax.op.floor_mod(a, relax.const(np.array([0, 1, 2, 3],
                                                                            np.int32), "int32")))
        bb.emit_func_output(out)
    text = make_safe(bb.get()).script()
    assert text.count("R.where") == 2, text      # only the mod by a constant holding 0
