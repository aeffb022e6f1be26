"""MobileNetV2 (Sandler et al. 2018), width 1.0, 224x224 input."""
from __future__ import annotations

from tvm.relax.frontend import nn

from .base import ModelDef, export
from .layers import ConvBN, global_avg_pool

# (expansion t, channels c, repeats n, stride s) from the paper's Table 2
_CONFIG = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)]


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, t: int):
        hidden = cin * t
        self.expand = ConvBN(cin, hidden, 1, act="relu6") if t != 1 else None
        self.dw = ConvBN(hidden, hidden, 3, stride, 1, groups=hidden, act="relu6")
        self.project = ConvBN(hidden, cout, 1, act=None)
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        y = self.expand(x) if self.expand is not None else x
        y = self.project(self.dw(y))
        return x + y if self.residual else y


class MobileNetV2(nn.Module):
    def __init__(self, classes: int = 1000):
        self.stem = ConvBN(3, 32, 3, 2, 1, act="relu6")
        blocks, cin = [], 32
        for t, c, n, s in _CONFIG:
            for i in range(n):
                blocks.append(InvertedResidual(cin, c, s if i == 0 else 1, t))
                cin = c
        self.blocks = nn.ModuleList(blocks)
        self.head = ConvBN(cin, 1280, 1, act="relu6")
        self.fc = nn.Linear(1280, classes)

    def forward(self, x):
        y = self.stem(x)
        for b in self.blocks:
            y = b(y)
        return self.fc(global_avg_pool(self.head(y)))


def mobilenetv2(batch: int = 1) -> ModelDef:
    return export("mobilenetv2", MobileNetV2(), {"x": ((batch, 3, 224, 224), "float32")},
                  description=f"MobileNetV2 1.0, batch {batch}, 224x224, seeded random weights")
