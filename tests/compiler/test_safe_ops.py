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
import tvm
from tvm import relax
from tvm.relax.frontend import nn

from paella.bundle import load_bundle
from paella.compiler_pass.build import compile_bundle
from paella.compiler_pass.safe_ops import UnboundedIndexError, make_safe
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
    # (index_put: one index tensor per axis of the data, rows then columns)
    "index_put": ((2, 4), "int64", (4,), np.array([[10**8, -1, 2, -10**8],
                                                   [3, 10**8, -1, -10**8]], np.int64), None),
}
_CHILD = '''
import sys, numpy as np, tvm
from tvm import relax
from paella.compiler_pass.safe_ops import UnboundedIndexError, make_safe
for case in sys.argv[1:]:
    op, safe, ids_path, out_path = case.split(",")
    run(op, safe == "1", np.load(ids_path), out_path)
'''
_CHILD_RUN = '''
def run(op, safe, ids, out_path):
    shape, dtype, upd_shape = {shapes}[op]
    bb = relax.BlockBuilder()
    data = relax.Var("data", relax.TensorType((16, 8), "float32"))
    if op == "index_put":                    # one index tensor per axis
        rows, cols = (relax.Var(n, relax.TensorType(shape[1:], dtype)) for n in ("r", "c"))
        idx, ids = relax.Tuple([rows, cols]), list(ids)
        params = [data, rows, cols]
    else:
        idx, ids = relax.Var("idx", relax.TensorType(shape, dtype)), [ids]
        params = [data, idx]
    if upd_shape:
        upd = relax.Var("upd", relax.TensorType(upd_shape, "float32"))
        params.append(upd)
    make = {{"gather_elements": lambda: relax.op.gather_elements(data, idx, 0),
             "gather_nd": lambda: relax.op.gather_nd(data, idx),
             "scatter_elements": lambda: relax.op.scatter_elements(data, idx, upd, 0),
             "scatter_nd": lambda: relax.op.scatter_nd(data, idx, upd),
             "index_tensor": lambda: relax.op.index_tensor(data, relax.Tuple([idx])),
             "index_put": lambda: relax.op.index_put(data, idx, upd)}}[op]
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(make())
        bb.emit_func_output(out)
    mod = make_safe(bb.get()) if safe else bb.get()
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    args = [np.arange(128, dtype=np.float32).reshape(16, 8), *ids]
    if upd_shape:
        args.append(np.full(upd_shape, -1.0, np.float32))
    np.save(out_path, vm["main"](*[tvm.runtime.tensor(a) for a in args]).numpy())
'''


def _run_child(d, cases: list[tuple[str, bool, np.ndarray]]) -> tuple[subprocess.CompletedProcess,
                                                                      list]:
    """Build and run each ``(op, safe, ids)`` in one child process (an unchecked index
    kills it with SIGSEGV, not this test); returns the process and each case's output
    file. (One child for many cases: importing TVM takes seconds.)"""
    script = d / "child.py"
    shapes = {k: v[:3] for k, v in _OPS.items()}
    head, loop = _CHILD.split("for case in")
    script.write_text(head + _CHILD_RUN.format(shapes=repr(shapes)) + "for case in" + loop)
    argv, outs = [], []
    for i, (op, safe, ids) in enumerate(cases):
        np.save(d / f"ids{i}.npy", ids)
        outs.append(d / f"out{i}.npy")
        argv.append(f"{op},{int(safe)},{d / f'ids{i}.npy'},{outs[-1]}")
    proc = subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True,
                          timeout=300)
    return proc, outs


def _in_range(op: str) -> np.ndarray:
    """Valid indices for ``op`` (one negative, counted from the end), seeded."""
    shape, dtype = _OPS[op][:2]
    bound = np.array((16, 8)[:shape[-1]]) if op == "gather_nd" else 16
    ids = (np.random.default_rng(3).integers(0, 1 << 30, shape) % bound).astype(dtype)
    ids.flat[0] = -1
    return ids


_IN_RANGE = ("gather_elements", "gather_nd", "index_tensor")


@pytest.fixture(scope="module")
def indexed(tmp_path_factory):
    """Every op's answer to its hostile indices, and three ops' to indices in range."""
    d = tmp_path_factory.mktemp("indexed")
    keys = [("hostile", op) for op in sorted(_OPS)] + [("in range", op) for op in _IN_RANGE]
    proc, outs = _run_child(d, [(op, True, _OPS[op][3] if kind == "hostile" else _in_range(op))
                                for kind, op in keys])
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {k: np.load(o) for k, o in zip(keys, outs)}


@pytest.mark.parametrize("op", sorted(_OPS))
def test_hostile_indices_stay_inside_the_tensor(indexed, op):
    shape, dtype, upd_shape, hostile, reference = _OPS[op]
    got = indexed[("hostile", op)]
    clamped = np.clip(np.where(hostile < 0, hostile + np.array(
        (16, 8)[:hostile.shape[-1]] if op in ("gather_nd", "scatter_nd") else 16), hostile),
        0, np.array((15, 7)[:hostile.shape[-1]] if op in ("gather_nd", "scatter_nd") else 15))
    if reference is not None:
        np.testing.assert_array_equal(got, reference(clamped))
    else:                                    # a scatter of -1s: they land at the clamped places
        want = _DATA.copy()
        if op == "scatter_nd":
            want[clamped[:, 0], clamped[:, 1]] = -1.0
        elif op == "index_put":
            rows = np.clip(np.where(hostile[0] < 0, hostile[0] + 16, hostile[0]), 0, 15)
            cols = np.clip(np.where(hostile[1] < 0, hostile[1] + 8, hostile[1]), 0, 7)
            want[rows, cols] = -1.0
        else:
            np.put_along_axis(want, clamped, -1.0, 0)
        np.testing.assert_array_equal(got, want)


def test_without_the_clamp_a_hostile_index_kills_the_process(tmp_path):
    """(Why the pass exists: the same gather_nd, unclamped, segfaults.)"""
    proc, _ = _run_child(tmp_path, [("gather_nd", False, _OPS["gather_nd"][3])])
    assert proc.returncode == -11, (proc.returncode, proc.stderr[-500:])


@pytest.mark.parametrize("op", _IN_RANGE)
def test_indices_in_range_are_unchanged(indexed, op):
    ids = _in_range(op)                      # negatives count from the end (ONNX)
    bound = np.array((16, 8)[:ids.shape[-1]]) if op == "gather_nd" else 16
    wrapped = np.where(ids < 0, ids + bound, ids)
    np.testing.assert_array_equal(indexed[("in range", op)], _OPS[op][4](wrapped))


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
from paella.compiler_pass.safe_ops import UnboundedIndexError, make_safe
for case in sys.argv[1:]:
    op, dtype, safe, x_path, y_path, out_path = case.split(",")
    x_in, y_in = np.load(x_path), np.load(y_path)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(x_in.shape, dtype))
    y = relax.Var("y", relax.TensorType(y_in.shape, dtype))
    with bb.function("main", [x, y]):
        with bb.dataflow():
            out = bb.emit_output(getattr(relax.op, op)(x, y))
        bb.emit_func_output(out)
    mod = make_safe(bb.get()) if safe == "1" else bb.get()
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    np.save(out_path, vm["main"](tvm.runtime.tensor(x_in), tvm.runtime.tensor(y_in)).numpy())
'''


def _divide_in_child(d, cases: list[tuple[str, str, bool, np.ndarray, np.ndarray]]):
    """Each ``(op, dtype, safe, x, y)`` built and run in one child process (a trap kills
    it with SIGFPE, not this test); returns the process and each case's output file."""
    (d / "child.py").write_text(_DIVIDE_CHILD)
    argv, outs = [], []
    for i, (op, dtype, safe, x, y) in enumerate(cases):
        np.save(d / f"x{i}.npy", x)
        np.save(d / f"y{i}.npy", y)
        outs.append(d / f"out{i}.npy")
        argv.append(f"{op},{dtype},{int(safe)},{d / f'x{i}.npy'},{d / f'y{i}.npy'},{outs[-1]}")
    proc = subprocess.run([sys.executable, str(d / "child.py"), *argv], capture_output=True,
                          text=True, timeout=300)
    return proc, outs


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


_DIVISIONS = ("divide", "floor_divide", "mod", "floor_mod")
_INT_TYPES = ("int32", "int64", "uint32")


def _operands(dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Seeded operands with divisors of 0 and, signed, the most negative value over -1."""
    info = np.iinfo(dtype)
    rng = np.random.default_rng(7)
    x = rng.integers(max(info.min, -1000), 1000, 64).astype(dtype)
    y = rng.integers(max(info.min, -9), 10, 64).astype(dtype)
    y[:4] = 0
    if info.min < 0:
        x[4:8], y[4:8] = info.min, -1        # the other trap: most negative / -1
    return x, y


@pytest.fixture(scope="module")
def divided(tmp_path_factory):
    keys = [(op, dtype) for op in _DIVISIONS for dtype in _INT_TYPES]
    proc, outs = _divide_in_child(tmp_path_factory.mktemp("divided"),
                                  [(op, dtype, True, *_operands(dtype)) for op, dtype in keys])
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {k: np.load(o) for k, o in zip(keys, outs)}


@pytest.mark.parametrize("op", _DIVISIONS)
@pytest.mark.parametrize("dtype", _INT_TYPES)
def test_integer_division_by_anything_is_defined(divided, op, dtype):
    np.testing.assert_array_equal(divided[(op, dtype)], _expected(op, *_operands(dtype)))


def test_without_the_guard_a_zero_divisor_kills_the_process(tmp_path):
    """(Why the guard exists: the same floor_mod, unguarded, dies of SIGFPE.)"""
    x, y = np.array([7, 8], np.int32), np.array([0, 3], np.int32)
    proc, _ = _divide_in_child(tmp_path, [("floor_mod", "int32", False, x, y)])
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


def test_an_index_into_a_tensor_of_unknown_shape_is_refused_with_the_fix():
    """Bounds it cannot know are not guessed: the compile stops with a ValueError (which
    ``paella compile`` prints as its error) naming the op and the fix."""
    n = tvm.tirx.Var("n", "int64")
    bb = relax.BlockBuilder()
    data = relax.Var("data", relax.TensorType([n, 8], "float32"))
    idx = relax.Var("idx", relax.TensorType((4, 8), "int64"))
    with bb.function("main", [data, idx]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.gather_elements(data, idx, 0))
        bb.emit_func_output(out)
    with pytest.raises(UnboundedIndexError, match="gather_elements .*unknown shape.*fixed shape"):
        make_safe(bb.get())
    assert issubclass(UnboundedIndexError, ValueError)
