"""The model zoo: names -> model constructors (``paella compile NAME``).

Table 2 of the paper (ResNet-18/34/50, MobileNetV2, SqueezeNet 1.1, DenseNet-121,
GoogLeNet, Inception v3) at their real shapes with seeded random weights; NASNet-A,
AmoebaNet-A and DARTS-like cell networks (:mod:`.nas_cells`); tiny models for tests;
and the onnx package's light models as ``onnx_<name>``.
"""
from __future__ import annotations

import inspect
from difflib import get_close_matches
from typing import Callable

from .base import ModelDef

#: The paper's Table 2, in its order; `paella compile --zoo` builds these.
TABLE2 = ["resnet18", "mobilenetv2", "resnet34", "squeezenet1_1", "resnet50", "densenet121",
          "googlenet", "inceptionv3"]


class UnknownModel(KeyError):
    def __str__(self) -> str:
        return self.args[0]


def _registry() -> dict[str, Callable[[], ModelDef]]:
    from . import densenet, googlenet, inception, mobilenet, nas_cells, resnet, squeezenet, tiny, transformer, unet
    from .onnx_models import light, light_models
    reg: dict[str, Callable[[], ModelDef]] = {
        "tiny_mlp": tiny.tiny_mlp, "tiny_cnn": tiny.tiny_cnn,
        "resnet18": resnet.resnet18, "resnet34": resnet.resnet34, "resnet50": resnet.resnet50,
        "mobilenetv2": mobilenet.mobilenetv2, "squeezenet1_1": squeezenet.squeezenet11,
        "densenet121": densenet.densenet121, "googlenet": googlenet.googlenet,
        "inceptionv3": inception.inceptionv3,
        "bert_encoder": transformer.bert_encoder, "tiny_encoder": transformer.tiny_encoder,
        # Branchy cells for Nimble's streams (docs/nimble.md).
        "nasnet_mobile": nas_cells.nasnet_mobile, "amoebanet": nas_cells.amoebanet,
        "darts": nas_cells.darts,
        # DVABatch's models (docs/dvabatch.md), full size and test size.
        "bert_base": transformer.bert_base, "resnet152": resnet.resnet152, "resnet152_small": resnet.resnet152_small,
        "unet": unet.unet, "unet_small": unet.unet_small,
    }
    for n in light_models():
        reg[f"onnx_{n}"] = (lambda n=n: light(n))
    return reg


def names() -> list[str]:
    return list(_registry())


def get(name: str, batch: int | None = None, seq_len: int | None = None) -> ModelDef:
    """The zoo model ``name``; ``batch``/``seq_len``: built for that batch size / length
    (a ValueError if the model has no such parameter)."""
    reg = _registry()
    if name not in reg:
        close = get_close_matches(name, reg, n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise UnknownModel(f"unknown model {name!r}{hint}; zoo models: {', '.join(reg)}; "
                           "or pass a path to an .onnx file")
    make = reg[name]
    kw = {}
    params = inspect.signature(make).parameters
    for key, value in (("batch", batch), ("seq_len", seq_len)):
        if value is None:
            continue
        if key not in params:
            raise ValueError(f"zoo model {name!r} has no {key} parameter: it cannot be "
                             f"compiled with --{'batch-sizes' if key == 'batch' else 'seq-lens'}")
        kw[key] = value
    md = make(**kw)
    md.batch = kw.get("batch", md.batch)
    md.seq_len = kw.get("seq_len", md.seq_len)
    return md
