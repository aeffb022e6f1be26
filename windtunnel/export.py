"""Serving a translated network: ONNX graph, then a Paella bundle.

The ONNX graph is written directly with ``onnx.helper`` from the network's current
weights, one small group of standard operators per block (``Block.to_onnx``), instead
of tracing it with ``torch.onnx.export``. Why:

* it is deterministic: the same weights give the same bytes, so ``paella compile``'s
  content-hash cache hits on a re-export (torch's exporters name values after the
  trace and, in 2.x, go through the dynamo exporter and onnxscript);
* it needs nothing beyond ``onnx``, already a dependency, and runs in milliseconds;
* the operators are chosen for the compiler: MatMul, Add, Mul, Tanh, Gather, Equal,
  Cast, Reshape, Transpose, ReduceSum, Concat, Sigmoid, Softmax, all imported by TVM's Relax ONNX
  frontend; masks and the tree structure are folded into constant weights.

The graph has one float32 input ``x`` of shape ``(batch, in_dim)`` and one output ``y``
(what :meth:`WindTunnelNet.forward` returns); shapes are static, as ``paella compile``
requires, so a bundle serves a fixed batch (pad a smaller one). :func:`run_onnx`
evaluates a graph with onnx's reference evaluator (the tests compare it with torch);
:func:`compile_network` builds the bundle that ``paella serve`` loads.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from .network import WindTunnelNet

INPUT, OUTPUT = "x", "y"
#: Opset 17: every operator used here, as TVM 0.27's frontend imports it.
OPSET = 17


class OnnxGraph:
    """Collects nodes and constant initializers with unique names."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._n = 0

    def _name(self, hint: str) -> str:
        self._n += 1
        return f"{hint}_{self._n}"

    def const(self, value: np.ndarray, hint: str = "c") -> str:
        name = self._name(hint)
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    def weight(self, value: torch.Tensor, hint: str = "w") -> str:
        """A float32 constant from a tensor (a parameter, or an expression of them)."""
        return self.const(value.detach().cpu().numpy().astype(np.float32), hint)

    def op(self, op_type: str, inputs: list[str], **attrs) -> str:
        out = self._name(op_type.lower())
        self.nodes.append(helper.make_node(op_type, inputs, [out], **attrs))
        return out


def to_onnx(net: WindTunnelNet, batch: int, name: str = "windtunnel") -> onnx.ModelProto:
    """The network's current weights as an ONNX model with input ``x`` of ``(batch, in_dim)``."""
    g = OnnxGraph()
    with torch.no_grad():
        out = net.to_onnx(g, INPUT)
    g.nodes.append(helper.make_node("Identity", [out], [OUTPUT]))
    graph = helper.make_graph(
        g.nodes, name,
        [helper.make_tensor_value_info(INPUT, TensorProto.FLOAT, [batch, net.in_dim])],
        [helper.make_tensor_value_info(OUTPUT, TensorProto.FLOAT, [batch, net.out_dim])],
        g.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="paella.windtunnel")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def save_onnx(net: WindTunnelNet, path: str | Path, batch: int) -> Path:
    path = Path(path)
    onnx.save(to_onnx(net, batch, path.stem), str(path))
    return path


def run_onnx(model: onnx.ModelProto, X: np.ndarray) -> np.ndarray:
    """Evaluate the graph on rows ``X`` with onnx's reference evaluator."""
    from onnx.reference import ReferenceEvaluator
    return ReferenceEvaluator(model).run(None, {INPUT: np.asarray(X, np.float32)})[0]


def compile_network(net: WindTunnelNet, out: str | Path, batch: int, name: str | None = None,
                    cache_dir: str | Path | None = None, onnx_path: str | Path | None = None,
                    progress: Callable[[str], None] = lambda _m: None) -> Path:
    """Export ``net`` for ``batch`` rows and compile it into the bundle directory ``out``
    (what ``paella compile model.onnx -o out`` does; cached on the graph's content). The
    ONNX file goes to ``onnx_path`` if given, else to a temporary directory, so that a
    model repository holds bundles only."""
    import tempfile

    from paella.compiler_pass.build import compile_bundle
    from paella.models.onnx_models import load_onnx
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    model_name = name or out.name
    with tempfile.TemporaryDirectory(prefix="windtunnel-onnx") as tmp:
        path = save_onnx(net, Path(onnx_path) if onnx_path else Path(tmp) / f"{model_name}.onnx", batch)
        return compile_bundle(load_onnx(path, model_name), out, cache_dir=cache_dir, progress=progress)
