"""GoogLeNet / Inception v1 (Szegedy et al. 2015), torchvision layout with BN, 224x224."""
from __future__ import annotations

from tvm.relax.frontend import nn

from .base import ModelDef, export
from .layers import ConvBN, concat, global_avg_pool, max_pool


class Inception(nn.Module):
    def __init__(self, cin: int, c1: int, c3r: int, c3: int, c5r: int, c5: int, pool: int):
        self.b1 = ConvBN(cin, c1, 1)
        self.b2a, self.b2b = ConvBN(cin, c3r, 1), ConvBN(c3r, c3, 3, padding=1)
        self.b3a, self.b3b = ConvBN(cin, c5r, 1), ConvBN(c5r, c5, 3, padding=1)  # torchvision uses 3x3 here
        self.b4 = ConvBN(cin, pool, 1)

    def forward(self, x):
        return concat([self.b1(x), self.b2b(self.b2a(x)), self.b3b(self.b3a(x)),
                       self.b4(max_pool(x, 3, 1, 1))])


_CFG = {"3a": (192, 64, 96, 128, 16, 32, 32), "3b": (256, 128, 128, 192, 32, 96, 64),
        "4a": (480, 192, 96, 208, 16, 48, 64), "4b": (512, 160, 112, 224, 24, 64, 64),
        "4c": (512, 128, 128, 256, 24, 64, 64), "4d": (512, 112, 144, 288, 32, 64, 64),
        "4e": (528, 256, 160, 320, 32, 128, 128), "5a": (832, 256, 160, 320, 32, 128, 128),
        "5b": (832, 384, 192, 384, 48, 128, 128)}


class GoogLeNet(nn.Module):
    def __init__(self, classes: int = 1000):
        self.c1 = ConvBN(3, 64, 7, 2, 3)
        self.c2 = ConvBN(64, 64, 1)
        self.c3 = ConvBN(64, 192, 3, padding=1)
        self.inc = nn.ModuleList([Inception(*cfg) for cfg in _CFG.values()])
        self.fc = nn.Linear(1024, classes)

    def forward(self, x):
        y = max_pool(self.c1(x), 3, 2, ceil_mode=True)
        y = max_pool(self.c3(self.c2(y)), 3, 2, ceil_mode=True)
        for name, m in zip(_CFG, self.inc):
            y = m(y)
            if name in ("3b", "4e"):
                y = max_pool(y, 3 if name == "3b" else 2, 2, ceil_mode=True)
        return self.fc(global_avg_pool(y))


def googlenet(batch: int = 1) -> ModelDef:
    return export("googlenet", GoogLeNet(), {"x": ((batch, 3, 224, 224), "float32")},
                  description=f"GoogLeNet (Inception v1), batch {batch}, 224x224, seeded random weights")
