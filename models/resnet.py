"""ResNet-18/34/50/152 (He et al. 2016), torchvision layout, 224x224 input; and a
ResNet-152-like network at test size (:func:`resnet152_small`: the same bottleneck
blocks, fewer and narrower, 32x32 in), for DVABatch's compiled stages."""
from __future__ import annotations

from tvm.relax.frontend import nn

from .base import ModelDef, export
from .layers import ConvBN, global_avg_pool, max_pool


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, width: int, stride: int):
        self.c1 = ConvBN(cin, width, 3, stride, 1)
        self.c2 = ConvBN(width, width, 3, 1, 1, act=None)
        self.down = ConvBN(cin, width, 1, stride, 0, act=None) if stride != 1 or cin != width else None

    def forward(self, x):
        y = self.c2(self.c1(x))
        return nn.op.relu(y + (self.down(x) if self.down is not None else x))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int):
        out = width * 4
        self.c1 = ConvBN(cin, width, 1)
        self.c2 = ConvBN(width, width, 3, stride, 1)
        self.c3 = ConvBN(width, out, 1, act=None)
        self.down = ConvBN(cin, out, 1, stride, 0, act=None) if stride != 1 or cin != out else None

    def forward(self, x):
        y = self.c3(self.c2(self.c1(x)))
        return nn.op.relu(y + (self.down(x) if self.down is not None else x))


class ResNet(nn.Module):
    def __init__(self, block, layers: list[int], classes: int = 1000, base: int = 64):
        self.stem = ConvBN(3, base, 7, 2, 3)
        blocks, cin = [], base
        for i, n in enumerate(layers):
            width = base * 2 ** i
            for j in range(n):
                blocks.append(block(cin, width, 2 if (j == 0 and i > 0) else 1))
                cin = width * block.expansion
        self.blocks = nn.ModuleList(blocks)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        y = max_pool(self.stem(x), 3, 2, 1)
        for b in self.blocks:
            y = b(y)
        return self.fc(global_avg_pool(y))


def _resnet(name: str, block, layers: list[int], batch: int, size: int = 224, classes: int = 1000,
            base: int = 64) -> ModelDef:
    return export(name, ResNet(block, layers, classes, base), {"x": ((batch, 3, size, size), "float32")},
                  description=f"{name}, batch {batch}, {size}x{size}, seeded random weights")


def resnet18(batch: int = 1) -> ModelDef:
    return _resnet("resnet18", BasicBlock, [2, 2, 2, 2], batch)


def resnet34(batch: int = 1) -> ModelDef:
    return _resnet("resnet34", BasicBlock, [3, 4, 6, 3], batch)


def resnet50(batch: int = 1) -> ModelDef:
    return _resnet("resnet50", Bottleneck, [3, 4, 6, 3], batch)


def resnet152(batch: int = 1) -> ModelDef:
    """ResNet-152: bottleneck blocks [3, 8, 36, 3], DVABatch's deepest image model."""
    return _resnet("resnet152", Bottleneck, [3, 8, 36, 3], batch)


def resnet152_small(batch: int = 1) -> ModelDef:
    """ResNet-152-like at test size: bottleneck blocks [1, 2, 3, 1] of width 8..64,
    32x32 in, 10 classes (the same kinds of operators as ResNet-152, in seconds)."""
    return _resnet("resnet152_small", Bottleneck, [1, 2, 3, 1], batch, size=32, classes=10, base=8)
