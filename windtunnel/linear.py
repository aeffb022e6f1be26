"""Translated linear models (paper §5.2.1): a model is its prediction function.

``LinearRegression`` (and the other least-squares models that predict ``x @ w + b``:
``Ridge``, ``Lasso``, ``ElasticNet``) and ``LogisticRegression`` all become one linear
layer with the fitted coefficients; the logistic link (sigmoid for two classes,
softmax for more, as scikit-learn 1.9's ``predict_proba``) is the network's output
link, so fine-tuning reads the logits.
"""
from __future__ import annotations

import numpy as np
import torch

from .errors import WindTunnelError
from .network import Block, OnnxBuilder, param, uniform_


class Linear(Block):
    """``x @ weight + bias``."""

    def __init__(self, weight: np.ndarray, bias: np.ndarray):
        super().__init__(weight.shape[0], weight.shape[1])
        self.weight = param(weight)
        self.bias = param(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + self.bias

    def to_onnx(self, g: OnnxBuilder, x: str) -> str:
        return g.op("Add", [g.op("MatMul", [x, g.weight(self.weight, "weight")]), g.weight(self.bias, "bias")])

    def cold_init(self, gen: torch.Generator) -> None:
        uniform_(self.weight, self.in_dim, gen)
        uniform_(self.bias, self.in_dim, gen)


def from_linear_model(est) -> tuple[Linear, str, np.ndarray | None]:
    """(block, link, classes) for a fitted linear regressor or logistic regression."""
    coef = np.atleast_2d(np.asarray(est.coef_, np.float64))          # (targets, features)
    bias = np.atleast_1d(np.asarray(est.intercept_, np.float64))
    if bias.shape[0] != coef.shape[0]:
        bias = np.broadcast_to(bias, (coef.shape[0],))
    classes = getattr(est, "classes_", None)
    if classes is None:
        return Linear(coef.T, bias), "identity", None
    if len(classes) > 2 and getattr(est, "solver", "") == "liblinear":
        raise WindTunnelError("LogisticRegression(solver='liblinear') with more than two classes is one-vs-rest, "
                              "which this translation does not reproduce: use the default multinomial solver")
    return Linear(coef.T, bias), ("sigmoid" if len(classes) == 2 else "softmax"), np.asarray(classes)
