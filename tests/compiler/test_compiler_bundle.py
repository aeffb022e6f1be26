"""Bundles: plan consistency, CPU reference outputs, and the loader's refusals."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from paella.bundle import FORMAT_VERSION, BundleError, check_variant, load_bundle
from paella.models import tiny


def _views(bundle):
    """(buffer, offset, nbytes) of each tensor a launch touches, from the kernel params."""
    return bundle.buffers


def test_manifest_shape(cnn_bundle):
    m = cnn_bundle.manifest
    assert m.format_version == FORMAT_VERSION and m.arch == "sm_75" and m.instrumented and m.group == 16
    assert len(cnn_bundle.variants) == 1
    [x] = cnn_bundle.inputs
    [y] = cnn_bundle.outputs
    assert (x.name, x.shape, x.dtype, x.offset, x.nbytes) == ("x", [1, 3, 8, 8], "float32", 0, 768)
    assert (y.shape, y.dtype, y.nbytes) == ([1, 10], "float32", 40)
    assert y.offset >= x.offset + x.nbytes and y.offset % 64 == 0
    assert cnn_bundle.io_bytes == y.offset + y.nbytes
    kinds = {b.kind for b in cnn_bundle.buffers}
    assert {"input", "param", "intermediate"} <= kinds


def test_plan_is_h2d_launches_d2h_and_consistent(cnn_bundle):
    plan = cnn_bundle.plan
    assert plan[0].op == "h2d" and plan[-1].op == "d2h"
    assert all(op.op == "launch" for op in plan[1:-1])
    assert all(op.stream == 0 for op in plan)
    check_variant(cnn_bundle.variants[0])      # written-before-read, sizes, ids
    by_name = {k.name: k for k in cnn_bundle.kernels}
    for op in cnn_bundle.variants[0].launches():
        k = by_name[op.kernel]
        assert (op.grid, op.block, op.dyn_smem) == (k.grid, k.block, k.dyn_smem)
        # the buffers, then the block offset (slicing) the instrumented kernels take, 0
        *buffers, offset = op.args
        assert (offset.buffer, offset.scalar, offset.dtype) == (None, 0, "uint32")
        for arg in buffers:
            assert arg.buffer is not None and arg.offset < cnn_bundle.buffers[arg.buffer].nbytes
    # the d2h copy reads exactly the output tensor from its buffer
    out = cnn_bundle.outputs[0]
    assert (plan[-1].buffer, plan[-1].nbytes, plan[-1].io_offset) == (out.buffer, out.nbytes, out.offset)


def test_plan_sequence_matches_relax_call_order(cnn_bundle):
    names = [op.kernel for op in cnn_bundle.variants[0].launches()]
    assert names[0].startswith("fused_conv2d")
    assert names[-1].startswith("softmax")
    assert any("matmul" in n for n in names)


def test_params_file_matches_buffers(cnn_bundle):
    blobs = cnn_bundle.param_bytes()
    params = [b for b in cnn_bundle.buffers if b.kind == "param"]
    assert len(blobs) == len(params) == 4
    for b in params:
        assert len(blobs[b.id]) == b.nbytes
    model = tiny.tiny_cnn()
    np.testing.assert_array_equal(cnn_bundle.params()["conv.weight"], model.params[0])


def test_cpu_build_matches_numpy_cnn(cnn_bundle):
    model = tiny.tiny_cnn()
    x = np.random.default_rng(3).standard_normal((1, 3, 8, 8)).astype(np.float32)
    got = cnn_bundle.run_cpu({"x": x})["output0"]
    np.testing.assert_allclose(got, tiny.tiny_cnn_reference(x, model.params), rtol=1e-5, atol=1e-6)


def test_cpu_build_matches_numpy_mlp(mlp_bundle):
    model = tiny.tiny_mlp()
    x = np.random.default_rng(4).standard_normal((2, 16)).astype(np.float32)
    got = mlp_bundle.run_cpu({"x": x})["output0"]
    np.testing.assert_allclose(got, tiny.tiny_mlp_reference(x, model.params), rtol=1e-5, atol=1e-5)


def test_io_pack_roundtrip(cnn_bundle):
    x = np.arange(192, dtype=np.float32).reshape(1, 3, 8, 8)
    io = cnn_bundle.pack_inputs({"x": x})
    assert io.nbytes == cnn_bundle.io_bytes
    np.testing.assert_array_equal(io[:768].view(np.float32).reshape(1, 3, 8, 8), x)
    with pytest.raises(ValueError, match="needs"):
        cnn_bundle.pack_inputs({"x": x.astype(np.float64)})
    with pytest.raises(ValueError, match="missing input 'x'"):
        cnn_bundle.run_cpu({})


@pytest.fixture
def bundle_copy(cnn_bundle, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(cnn_bundle.path, dst)
    return dst


def _edit(path, fn):
    m = json.loads((path / "manifest.json").read_text())
    fn(m)
    (path / "manifest.json").write_text(json.dumps(m))


def test_loader_refuses_unknown_version(bundle_copy):
    _edit(bundle_copy, lambda m: m.update(format_version=99))
    with pytest.raises(BundleError, match="format_version 99 is not supported"):
        load_bundle(bundle_copy)


def test_loader_refuses_foreign_json(bundle_copy):
    (bundle_copy / "manifest.json").write_text('{"hello": 1}')
    with pytest.raises(BundleError, match="not a Paella bundle"):
        load_bundle(bundle_copy)
    (bundle_copy / "manifest.json").write_text("{truncated")
    with pytest.raises(BundleError, match="not valid JSON"):
        load_bundle(bundle_copy)
    for text, kind in (("[1, 2]", "list"), ('"x"', "str"), ("3", "int")):
        (bundle_copy / "manifest.json").write_text(text)
        with pytest.raises(BundleError, match=f"is not a manifest \\(JSON {kind}, not an object"):
            load_bundle(bundle_copy)


def test_loader_refuses_missing_files(bundle_copy, tmp_path):
    (bundle_copy / "kernels.cubin").unlink()
    with pytest.raises(BundleError, match="kernels.cubin.*missing"):
        load_bundle(bundle_copy)
    with pytest.raises(BundleError, match="no manifest.json"):
        load_bundle(tmp_path / "nowhere")


def test_loader_refuses_read_before_write(bundle_copy):
    def swap(m):
        plan = m["variants"][0]["plan"]
        plan[1], plan[2] = plan[2], plan[1]       # pool before the conv that feeds it
    _edit(bundle_copy, swap)
    with pytest.raises(BundleError, match="before anything wrote it"):
        load_bundle(bundle_copy)


def test_loader_refuses_wrong_sizes(bundle_copy):
    _edit(bundle_copy, lambda m: m["variants"][0]["inputs"][0].update(shape=[1, 3, 8, 9]))
    with pytest.raises(BundleError, match="needs"):
        load_bundle(bundle_copy)


def test_loader_refuses_an_io_buffer_no_client_could_send(bundle_copy):
    """2**45 bytes used to fail later, in an allocation, with a MemoryError naming no file."""
    _edit(bundle_copy, lambda m: m["variants"][0].update(io_bytes=2 ** 45))
    with pytest.raises(BundleError, match="io_bytes 35184372088832 is larger than any "
                                          "client's arena can be"):
        load_bundle(bundle_copy)


@pytest.mark.parametrize("group", [0, -1, 1.5, "1", 1 << 40])
def test_loader_refuses_a_notification_group_out_of_range(bundle_copy, group):
    _edit(bundle_copy, lambda m: m.update(group=group))
    with pytest.raises(BundleError, match=r"manifest: group .* is not 1\.\.\d+ \(thread blocks "
                                          r"per notification\)"):
        load_bundle(bundle_copy)


def _set(path, value):
    """An edit setting ``variants[0]`` field ``path`` (keys and indices) to ``value``."""
    def edit(m):
        d = m["variants"][0]
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value
    return edit


@pytest.mark.parametrize("path, value, expected", [
    (("name",), None, "variant None: name must be a str, got None"),
    (("name",), 0, "variant 0: name must be a str"),
    (("plan", 0, "buffer_offset"), 0.0, "plan[0]: buffer_offset must be an int of at most "
                                        "2**53, got 0.0"),
    (("plan", 0, "io_offset"), 1.5, "plan[0]: io_offset must be"),
    (("plan", 1, "grid"), ["x"], "plan[1]: grid[0] must be an int"),
    (("plan", 1, "grid"), 3, "plan[1]: grid must be a list"),
    (("plan", 1, "dyn_smem"), None, "plan[1]: dyn_smem must be an int"),
    (("plan", 1, "args", 0, "offset"), "x", "plan[1]: args[0]: offset must be an int"),
    (("io_bytes",), float("inf"), "io_bytes must be an int"),
    (("inputs", 0, "shape", 0), 2 ** 70, "inputs[0]: shape[0] must be an int of at most 2**53"),
    (("kernels", 0, "flops"), 2 ** 70, "has flops 1180591620717411303424; it must be a number "
                                       "from 0 to 1e+15"),
    (("batch",), True, "batch must be an int"),
])
def test_loader_refuses_a_field_of_the_wrong_type_naming_it(bundle_copy, path, value, expected):
    """A variant named null crashed the daemon's swap of models (and a SIGHUP with it, a
    serving daemon); a float offset hung its start-up; the others failed per request or
    with a bare TypeError."""
    _edit(bundle_copy, _set(path, value))
    with pytest.raises(BundleError) as e:
        load_bundle(bundle_copy)
    assert expected in str(e.value)


def test_loader_refuses_bad_kernel_args(bundle_copy):
    _edit(bundle_copy, lambda m: m["variants"][0]["plan"][1]["args"].pop())
    with pytest.raises(BundleError, match="passes 4 args .* which takes 5"):  # 4 buffers + the block offset
        load_bundle(bundle_copy)
