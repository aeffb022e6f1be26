"""A model ready for the compiler: a Relax module plus its weights.

Every model source (the ``tvm.relax.frontend.nn`` zoo, ONNX files) ends as a
:class:`ModelDef`: an IRModule whose entry ``main`` takes the inputs first
(``num_input`` of them) and then the weights, and the weights' values in order.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import tvm
import tvm_ffi
from tvm.relax.frontend import nn

#: Seed of the zoo's random weights (no weights can be downloaded here).
DEFAULT_SEED = 0


@dataclass
class ModelDef:
    name: str
    mod: tvm.IRModule
    params: list[np.ndarray]
    description: str = ""
    #: optional reference check data: input arrays and expected outputs (ONNX tests)
    sample_inputs: dict[str, np.ndarray] = field(default_factory=dict)
    expected_outputs: list[np.ndarray] = field(default_factory=list)
    #: the outputs' names (ONNX models keep theirs; empty: output0, output1, ...)
    output_names: list[str] = field(default_factory=list)
    #: the batch size and length bucket it was built for (0: not declared)
    batch: int = 0
    seq_len: int = 0

    def fingerprint(self) -> str:
        """Content hash of the model: its IR text, its structural hash (which covers
        embedded constants' data) and every weight's bytes."""
        h = hashlib.sha256(self.mod.script(show_meta=False).encode())
        h.update(str(tvm_ffi.structural_hash(self.mod)).encode())
        for p in self.params:
            h.update(str((p.shape, p.dtype)).encode())
            h.update(np.ascontiguousarray(p).tobytes())
        return h.hexdigest()

    def input_specs(self) -> list[tuple[str, tuple[int, ...], str]]:
        f = self.mod["main"]
        n = int(f.attrs["num_input"])
        return [(v.name, tuple(int(d) for d in v.ty.shape.values), str(v.ty.dtype))
                for v in f.params[:n]]


def random_weights(named: list[tuple[str, nn.Parameter]], seed: int = DEFAULT_SEED) -> list[np.ndarray]:
    """Seeded weights that keep activations in range through deep nets.

    Multi-dimensional weights get He-normal values (std sqrt(2/fan_in)); 1-D
    tensors named ``*scale*`` (folded batch-norm scale) get values near 1, other
    1-D tensors (biases, shifts) small values near 0.

    The last set drawn is kept (read-only): a model exported at many batch sizes and
    lengths has the same weights each time, and drawing a BERT-base's 85M values costs
    seconds per variant.
    """
    key = (tuple((name, tuple(int(s) for s in p.shape), str(p.dtype)) for name, p in named), seed)
    if _LAST_WEIGHTS and _LAST_WEIGHTS[0] == key:
        return list(_LAST_WEIGHTS[1])
    out = _draw_weights(named, seed)
    for v in out:
        v.flags.writeable = False
    _LAST_WEIGHTS[:] = [key, out]
    return list(out)


_LAST_WEIGHTS: list = []


def _draw_weights(named: list[tuple[str, nn.Parameter]], seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for name, p in named:
        shape = tuple(int(s) for s in p.shape)
        dtype = np.dtype(p.dtype)
        if len([s for s in shape if s > 1]) > 1:
            fan_in = int(np.prod(shape[1:])) or 1
            v = rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)
        elif "scale" in name:
            v = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            v = 0.05 * rng.standard_normal(shape)
        out.append(v.astype(dtype))
    return out


def export(name: str, module: nn.Module, inputs: dict[str, tuple[tuple[int, ...], str]],
           seed: int = DEFAULT_SEED, description: str = "",
           weights: dict[str, np.ndarray] | None = None) -> ModelDef:
    """Export an ``nn.Module`` (its ``forward``) as entry ``main`` with seeded weights,
    or with ``weights`` by parameter name (a model's stage takes the whole model's)."""
    spec = {"forward": {k: nn.spec.Tensor(shape, dtype) for k, (shape, dtype) in inputs.items()}}
    mod, named = module.export_tvm(spec=spec)
    gv = mod.get_global_var("forward")
    func = mod[gv].with_attr("global_symbol", "main")
    new = tvm.IRModule({k: v for k, v in mod.functions.items() if k.name_hint != "forward"})
    new["main"] = func
    values = random_weights(named, seed) if weights is None else [weights[n] for n, _ in named]
    return ModelDef(name, new, values, description)


def named_weights(module: nn.Module, inputs: dict[str, tuple[tuple[int, ...], str]],
                  seed: int = DEFAULT_SEED) -> dict[str, np.ndarray]:
    """``module``'s seeded weights by parameter name (what :func:`export` gives it)."""
    spec = {"forward": {k: nn.spec.Tensor(shape, dtype) for k, (shape, dtype) in inputs.items()}}
    _, named = module.export_tvm(spec=spec)
    return dict(zip((n for n, _ in named), random_weights(named, seed)))
