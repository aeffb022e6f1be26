"""Building blocks for the zoo, on ``tvm.relax.frontend.nn``.

Batch norm appears in inference form, folded into a per-channel ``scale`` and
``shift`` (what TVM's own BN folding produces), so the compiled graph is what a
deployed model runs. Pooling comes from Relax ops, which ``nn.op`` lacks.
"""
from __future__ import annotations

from tvm import relax
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn.core import wrap_nested


class BatchNorm(nn.Module):
    """Inference batch norm: y = x * scale[c] + shift[c]."""

    def __init__(self, channels: int):
        self.scale = nn.Parameter((1, channels, 1, 1), "float32")
        self.shift = nn.Parameter((1, channels, 1, 1), "float32")

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        return x * self.scale + self.shift


class ConvBN(nn.Module):
    """Conv (no bias) + folded batch norm + optional ReLU/ReLU6."""

    def __init__(self, cin: int, cout: int, k, stride: int = 1, padding=0, groups: int = 1,
                 act: str | None = "relu"):
        self.conv = nn.Conv2D(cin, cout, k, stride=stride, padding=padding, groups=groups, bias=False)
        self.bn = BatchNorm(cout)
        self.act = act

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        y = self.bn(self.conv(x))
        if self.act == "relu":
            y = nn.op.relu(y)
        elif self.act == "relu6":
            y = nn.op.relu6(y)
        return y


class ConvReLU(nn.Module):
    """Conv with bias + ReLU (SqueezeNet, which has no batch norm)."""

    def __init__(self, cin: int, cout: int, k, stride: int = 1, padding=0):
        self.conv = nn.Conv2D(cin, cout, k, stride=stride, padding=padding, bias=True)

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        return nn.op.relu(self.conv(x))


def max_pool(x: nn.Tensor, k: int, stride: int, padding: int = 0, ceil_mode: bool = False) -> nn.Tensor:
    return wrap_nested(relax.op.nn.max_pool2d(x._expr, k, stride, padding, ceil_mode=ceil_mode), "max_pool2d")


def avg_pool(x: nn.Tensor, k: int, stride: int, padding: int = 0) -> nn.Tensor:
    return wrap_nested(relax.op.nn.avg_pool2d(x._expr, k, stride, padding, count_include_pad=False), "avg_pool2d")


def global_avg_pool(x: nn.Tensor) -> nn.Tensor:
    """(N, C, H, W) -> (N, C)."""
    y = wrap_nested(relax.op.nn.adaptive_avg_pool2d(x._expr, (1, 1)), "global_avg_pool")
    return nn.op.reshape(y, (x.shape[0], x.shape[1]))


def concat(xs: list[nn.Tensor]) -> nn.Tensor:
    return nn.op.concat(xs, dim=1)
