"""DenseNet-121 (Huang et al. 2017): growth 32, blocks (6, 12, 24, 16), 224x224 input."""
from __future__ import annotations

from tvm.relax.frontend import nn

from .base import ModelDef, export
from .layers import BatchNorm, ConvBN, avg_pool, concat, global_avg_pool, max_pool


class BNReLUConv(nn.Module):
    """DenseNet's pre-activation order: BN, ReLU, then conv."""

    def __init__(self, cin: int, cout: int, k: int, padding: int = 0):
        self.bn = BatchNorm(cin)
        self.conv = nn.Conv2D(cin, cout, k, padding=padding, bias=False)

    def forward(self, x):
        return self.conv(nn.op.relu(self.bn(x)))


class DenseLayer(nn.Module):
    def __init__(self, cin: int, growth: int = 32):
        self.a = BNReLUConv(cin, 4 * growth, 1)
        self.b = BNReLUConv(4 * growth, growth, 3, 1)

    def forward(self, x):
        return concat([x, self.b(self.a(x))])


class DenseNet121(nn.Module):
    def __init__(self, classes: int = 1000, growth: int = 32, blocks=(6, 12, 24, 16)):
        self.stem = ConvBN(3, 64, 7, 2, 3)
        layers, c = [], 64
        self.structure = []
        for i, n in enumerate(blocks):
            for _ in range(n):
                layers.append(DenseLayer(c, growth))
                c += growth
                self.structure.append("layer")
            if i != len(blocks) - 1:
                layers.append(BNReLUConv(c, c // 2, 1))
                c //= 2
                self.structure.append("transition")
        self.layers = nn.ModuleList(layers)
        self.final_bn = BatchNorm(c)
        self.fc = nn.Linear(c, classes)

    def forward(self, x):
        y = max_pool(self.stem(x), 3, 2, 1)
        for kind, layer in zip(self.structure, self.layers):
            y = layer(y)
            if kind == "transition":
                y = avg_pool(y, 2, 2)
        return self.fc(global_avg_pool(nn.op.relu(self.final_bn(y))))


def densenet121(batch: int = 1) -> ModelDef:
    return export("densenet121", DenseNet121(), {"x": ((batch, 3, 224, 224), "float32")},
                  description=f"DenseNet-121, batch {batch}, 224x224, seeded random weights")
