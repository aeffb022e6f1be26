"""`paella compile` end to end: ONNX import, caching, and bad input refused cleanly."""
from __future__ import annotations

import numpy as np
import onnx
import onnx.reference
import pytest
from onnx import TensorProto, helper, numpy_helper

from paella.bundle import load_bundle
from paella.compiler_pass import cli
from paella.compiler_pass.build import CompileError, compile_bundle
from paella.models import tiny, zoo
from paella.models.base import export
from paella.models.onnx_models import ModelSourceError, load_onnx


def _small_onnx(path, dynamic: bool = False):
    rng = np.random.default_rng(7)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32)
    fw = rng.standard_normal((5, 4 * 6 * 6)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Flatten", ["r"], ["f"]),
             helper.make_node("Gemm", ["f", "fw"], ["y"], transB=1)]
    batch = "n" if dynamic else 1
    graph = helper.make_graph(nodes, "small", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, 6, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 5])],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b"),
                               numpy_helper.from_array(fw, "fw")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    onnx.save(model, str(path))
    return model


def _no_leftovers(parent):
    return [p.name for p in parent.iterdir() if p.name.startswith(".")] == []


def test_onnx_model_matches_onnx_reference(tmp_path, cache_dir):
    model = _small_onnx(tmp_path / "small.onnx")
    out = tmp_path / "b"
    assert cli.main([str(tmp_path / "small.onnx"), "-o", str(out), "--cache-dir", str(cache_dir), "-q"]) == 0
    bundle = load_bundle(out)
    x = np.random.default_rng(8).standard_normal((1, 3, 6, 6)).astype(np.float32)
    [ref] = onnx.reference.ReferenceEvaluator(model).run(None, {"x": x})
    got = bundle.run_cpu({bundle.inputs[0].name: x})["y"]        # the ONNX output name, kept
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
    # the weights were initializers: they became param buffers of the plan
    assert sum(b.kind == "param" for b in bundle.buffers) >= 3
    assert _no_leftovers(tmp_path)


@pytest.mark.slow
def test_light_onnx_model_matches_shipped_output(tmp_path, cache_dir):
    # AlexNet is the quickest of the shipped light models to compile (~15 s).
    model = zoo.get("onnx_bvlc_alexnet")
    bundle = load_bundle(compile_bundle(model, tmp_path / "alexnet", cache_dir=cache_dir))
    got = list(bundle.run_cpu(model.sample_inputs).values())[0]
    np.testing.assert_allclose(got, model.expected_outputs[0], rtol=1e-3, atol=1e-7)
    assert len(bundle.kernels) >= 8 and all(k.instrumented for k in bundle.kernels)


def test_cache_hit_and_copy(tmp_path, cache_dir, cnn_bundle):
    msgs = []
    compile_bundle(tiny.tiny_cnn(), cnn_bundle.path, cache_dir=cache_dir, progress=msgs.append)
    assert any("up to date" in m for m in msgs)
    msgs.clear()
    other = tmp_path / "again"
    compile_bundle(tiny.tiny_cnn(), other, cache_dir=cache_dir, progress=msgs.append)
    assert any("cached bundle" in m for m in msgs) and not any("nvcc" in m for m in msgs)
    assert load_bundle(other).manifest.cache_key == cnn_bundle.manifest.cache_key


def test_unknown_zoo_name(tmp_path, capsys):
    assert cli.main(["resnet19", "-o", str(tmp_path / "x"), "-q"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'resnet19'" in err and "resnet18" in err
    assert not (tmp_path / "x").exists()


def test_corrupt_onnx_file(tmp_path, capsys):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x08\x07garbage that is not a protobuf" * 10)
    assert cli.main([str(bad), "-o", str(tmp_path / "x"), "-q"]) == 2
    assert "not a valid ONNX model" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_unsupported_onnx_op(tmp_path):
    node = helper.make_node("Unique", ["x"], ["y"])
    graph = helper.make_graph([node], "u", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(tmp_path / "u.onnx"))
    with pytest.raises((ModelSourceError, CompileError)):
        compile_bundle(load_onnx(tmp_path / "u.onnx"), tmp_path / "x", cache_dir=tmp_path / "c")
    assert not (tmp_path / "x").exists() and _no_leftovers(tmp_path)


def test_dynamic_onnx_input(tmp_path):
    _small_onnx(tmp_path / "dyn.onnx", dynamic=True)
    with pytest.raises(ModelSourceError, match="dynamic shape"):
        load_onnx(tmp_path / "dyn.onnx")


def test_dynamic_shapes_refused_without_half_written_bundle(tmp_path):
    model = export("dyn_mlp", tiny.TinyMLP(), {"x": (("n", 16), "float32")})
    with pytest.raises(CompileError, match="static shapes|symbolic|could not compile"):
        compile_bundle(model, tmp_path / "dyn", cache_dir=tmp_path / "c")
    assert not (tmp_path / "dyn").exists() and _no_leftovers(tmp_path)


def test_unwritable_output(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    assert cli.main(["tiny_mlp", "-o", str(f / "bundle"), "-q"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli.main(["tiny_mlp", "-o", str(f), "-q"]) == 2
    assert "not a directory" in capsys.readouterr().err
    with pytest.raises(CompileError, match="cannot write"):
        compile_bundle(tiny.tiny_mlp(), "/proc/paella-bundle", cache_dir=tmp_path / "c")


def test_bad_group_and_arch(tmp_path, capsys):
    assert cli.main(["tiny_mlp", "-o", str(tmp_path / "x"), "--group", "32", "-q"]) == 2
    assert "group must be in 1..16" in capsys.readouterr().err
    assert cli.main(["tiny_mlp", "-o", str(tmp_path / "x"), "--arch", "sm_61", "-q"]) == 2
    assert "unsupported arch" in capsys.readouterr().err
