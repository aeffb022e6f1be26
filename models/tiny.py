"""Tiny models for fast tests: each compiles in seconds and has a numpy reference."""
from __future__ import annotations

import numpy as np
from tvm.relax.frontend import nn

from .base import ModelDef, export
from .layers import global_avg_pool


class TinyMLP(nn.Module):
    def __init__(self, din: int = 16, hidden: int = 32, dout: int = 8):
        self.fc1 = nn.Linear(din, hidden)
        self.fc2 = nn.Linear(hidden, dout)

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        return self.fc2(nn.op.relu(self.fc1(x)))


class TinyCNN(nn.Module):
    def __init__(self):
        self.conv = nn.Conv2D(3, 8, 3, padding=1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        y = global_avg_pool(nn.op.relu(self.conv(x)))
        return nn.op.softmax(self.fc(y), axis=-1)


def tiny_mlp(batch: int = 2) -> ModelDef:
    return export("tiny_mlp", TinyMLP(), {"x": ((batch, 16), "float32")},
                  description=f"Linear-ReLU-Linear, 16->32->8, batch {batch}")


def tiny_cnn(batch: int = 1) -> ModelDef:
    return export("tiny_cnn", TinyCNN(), {"x": ((batch, 3, 8, 8), "float32")},
                  description="3x3 conv, ReLU, global average pool, linear, softmax on 8x8")


# ------------------------------------------------------------------ numpy references
# The params arrive in the order export() lists them (the module's attribute order).


def tiny_mlp_reference(x: np.ndarray, params: list[np.ndarray]) -> np.ndarray:
    w1, b1, w2, b2 = params
    h = np.maximum(x @ w1.T + b1, 0.0)
    return h @ w2.T + b2


def tiny_cnn_reference(x: np.ndarray, params: list[np.ndarray]) -> np.ndarray:
    w, b, fw, fb = params
    n, c, hh, ww = x.shape
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    y = np.zeros((n, w.shape[0], hh, ww), dtype=np.float64)
    for i in range(3):
        for j in range(3):
            y += np.einsum("nchw,oc->nohw", xp[:, :, i:i + hh, j:j + ww], w[:, :, i, j])
    y = np.maximum(y + b.reshape(1, -1, 1, 1), 0.0).mean(axis=(2, 3))
    z = y @ fw.T + fb
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)
