"""SqueezeNet 1.1 (Iandola et al. 2016; torchvision's v1.1 variant), 224x224 input."""
from __future__ import annotations

from tvm.relax.frontend import nn

from .base import ModelDef, export
from .layers import ConvReLU, concat, global_avg_pool, max_pool


class Fire(nn.Module):
    def __init__(self, cin: int, squeeze: int, e1: int, e3: int):
        self.squeeze = ConvReLU(cin, squeeze, 1)
        self.e1 = ConvReLU(squeeze, e1, 1)
        self.e3 = ConvReLU(squeeze, e3, 3, padding=1)

    def forward(self, x):
        s = self.squeeze(x)
        return concat([self.e1(s), self.e3(s)])


class SqueezeNet11(nn.Module):
    def __init__(self, classes: int = 1000):
        self.stem = ConvReLU(3, 64, 3, stride=2)
        self.f = nn.ModuleList([Fire(64, 16, 64, 64), Fire(128, 16, 64, 64), Fire(128, 32, 128, 128),
                                Fire(256, 32, 128, 128), Fire(256, 48, 192, 192), Fire(384, 48, 192, 192),
                                Fire(384, 64, 256, 256), Fire(512, 64, 256, 256)])
        self.classifier = ConvReLU(512, classes, 1)

    def forward(self, x):
        y = max_pool(self.stem(x), 3, 2, ceil_mode=True)
        y = max_pool(self.f[1](self.f[0](y)), 3, 2, ceil_mode=True)
        y = max_pool(self.f[3](self.f[2](y)), 3, 2, ceil_mode=True)
        for i in range(4, 8):
            y = self.f[i](y)
        return global_avg_pool(self.classifier(y))


def squeezenet11(batch: int = 1) -> ModelDef:
    return export("squeezenet1_1", SqueezeNet11(), {"x": ((batch, 3, 224, 224), "float32")},
                  description=f"SqueezeNet 1.1, batch {batch}, 224x224, seeded random weights")
