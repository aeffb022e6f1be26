"""ONNX graph inputs that are not C identifiers (``gpu_0/data_0``, as in the ONNX model
zoo) compile: the importer renames them, since TVM's CUDA codegen names kernel
parameters after them."""
import numpy as np
import onnx
from onnx import TensorProto, helper

from paella.bundle import load_bundle
from paella.compiler_pass.build import compile_bundle
from paella.models.onnx_models import load_onnx


def test_a_slashed_input_name_compiles_under_a_c_identifier(tmp_path):
    graph = helper.make_graph(
        [helper.make_node("Relu", ["gpu_0/data_0"], ["y"])],
        "slashed", [helper.make_tensor_value_info("gpu_0/data_0", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])])
    path = tmp_path / "slashed.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(path))
    bundle = load_bundle(compile_bundle(load_onnx(path), tmp_path / "b",    # nvcc must accept it
                                        cache_dir=tmp_path / "cache"))
    assert [t.name for t in bundle.inputs] == ["gpu_0_data_0"]
    x = np.arange(8, dtype=np.float32).reshape(2, 4) - 3
    np.testing.assert_array_equal(bundle.run_cpu({"gpu_0_data_0": x})["y"], np.maximum(x, 0))


def test_an_initializer_listed_among_the_inputs_stays_a_constant(tmp_path):
    # Older ONNX files list initializers as graph inputs too (the zoo's ZFNet-512 does).
    b = helper.make_tensor("gpu_0/b", TensorProto.FLOAT, [2, 4], np.full(8, 0.5, np.float32).tolist())
    graph = helper.make_graph(
        [helper.make_node("Add", ["gpu_0/data_0", "gpu_0/b"], ["y"])], "with_init",
        [helper.make_tensor_value_info("gpu_0/data_0", TensorProto.FLOAT, [2, 4]),
         helper.make_tensor_value_info("gpu_0/b", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], initializer=[b])
    path = tmp_path / "with_init.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(path))
    bundle = load_bundle(compile_bundle(load_onnx(path), tmp_path / "b", cache_dir=tmp_path / "cache"))
    assert [t.name for t in bundle.inputs] == ["gpu_0_data_0"]          # b is not an input
    x = np.ones((2, 4), np.float32)
    np.testing.assert_array_equal(bundle.run_cpu({"gpu_0_data_0": x})["y"], x + 0.5)


def test_output_names_are_kept_as_in_the_model(tmp_path):
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["probs/out:0"])], "named",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("probs/out:0", TensorProto.FLOAT, [2, 4])])
    path = tmp_path / "named.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(path))
    bundle = load_bundle(compile_bundle(load_onnx(path), tmp_path / "b", cache_dir=tmp_path / "c"))
    assert [t.name for t in bundle.outputs] == ["probs/out:0"]


def test_a_dynamic_batch_axis_compiles_into_one_variant_per_batch_size(tmp_path):
    """`paella compile x.onnx` (no --batch-sizes) on a model whose batch axis is dynamic:
    variants 1,2,4,8, each with its own plan and CPU build, answering row for row."""
    from paella.compiler_pass.cli import main
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "dyn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])])
    path = tmp_path / "dyn.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(path))
    assert main([str(path), "-o", str(tmp_path / "b"), "-q", "--cache-dir", str(tmp_path / "c")]) == 0
    bundle = load_bundle(tmp_path / "b")
    assert [(v.name, v.batch, v.inputs[0].shape) for v in bundle.variants] == \
        [(f"b{n}", n, [n, 3]) for n in (1, 2, 4, 8)]
    assert bundle.variants[2].files["cubin"] == "variants/b4/kernels.cubin"
    x = np.arange(12, dtype=np.float32).reshape(4, 3) - 6
    np.testing.assert_array_equal(bundle.run_cpu({"x": x}, 2)["y"], np.maximum(x, 0))


def test_a_dynamic_axis_the_compiler_cannot_fill_is_refused_clearly(tmp_path, capsys):
    from paella.compiler_pass.cli import main
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "dyn2",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, "W"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, "W"])])
    path = tmp_path / "dyn2.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(path))
    assert main([str(path), "-o", str(tmp_path / "b"), "-q"]) == 2
    assert "input 'x' has a dynamic shape" in capsys.readouterr().err
