"""Inception v3 (Szegedy et al. 2016), torchvision layout without the aux head, 299x299."""
from __future__ import annotations

from tvm.relax.frontend import nn

from .base import ModelDef, export
from .layers import ConvBN, avg_pool, concat, global_avg_pool, max_pool


def _seq(*convs):
    return nn.ModuleList(list(convs))


def _run(seq, x):
    for m in seq:
        x = m(x)
    return x


class InceptionA(nn.Module):
    def __init__(self, cin: int, pool: int):
        self.b1 = ConvBN(cin, 64, 1)
        self.b5 = _seq(ConvBN(cin, 48, 1), ConvBN(48, 64, 5, padding=2))
        self.b3 = _seq(ConvBN(cin, 64, 1), ConvBN(64, 96, 3, padding=1), ConvBN(96, 96, 3, padding=1))
        self.bp = ConvBN(cin, pool, 1)

    def forward(self, x):
        return concat([self.b1(x), _run(self.b5, x), _run(self.b3, x), self.bp(avg_pool(x, 3, 1, 1))])


class InceptionB(nn.Module):
    def __init__(self, cin: int):
        self.b3 = ConvBN(cin, 384, 3, 2)
        self.bd = _seq(ConvBN(cin, 64, 1), ConvBN(64, 96, 3, padding=1), ConvBN(96, 96, 3, 2))

    def forward(self, x):
        return concat([self.b3(x), _run(self.bd, x), max_pool(x, 3, 2)])


class InceptionC(nn.Module):
    def __init__(self, cin: int, c7: int):
        self.b1 = ConvBN(cin, 192, 1)
        self.b7 = _seq(ConvBN(cin, c7, 1), ConvBN(c7, c7, (1, 7), padding=(0, 3)),
                       ConvBN(c7, 192, (7, 1), padding=(3, 0)))
        self.bd = _seq(ConvBN(cin, c7, 1), ConvBN(c7, c7, (7, 1), padding=(3, 0)),
                       ConvBN(c7, c7, (1, 7), padding=(0, 3)), ConvBN(c7, c7, (7, 1), padding=(3, 0)),
                       ConvBN(c7, 192, (1, 7), padding=(0, 3)))
        self.bp = ConvBN(cin, 192, 1)

    def forward(self, x):
        return concat([self.b1(x), _run(self.b7, x), _run(self.bd, x), self.bp(avg_pool(x, 3, 1, 1))])


class InceptionD(nn.Module):
    def __init__(self, cin: int):
        self.b3 = _seq(ConvBN(cin, 192, 1), ConvBN(192, 320, 3, 2))
        self.b7 = _seq(ConvBN(cin, 192, 1), ConvBN(192, 192, (1, 7), padding=(0, 3)),
                       ConvBN(192, 192, (7, 1), padding=(3, 0)), ConvBN(192, 192, 3, 2))

    def forward(self, x):
        return concat([_run(self.b3, x), _run(self.b7, x), max_pool(x, 3, 2)])


class InceptionE(nn.Module):
    def __init__(self, cin: int):
        self.b1 = ConvBN(cin, 320, 1)
        self.b3 = ConvBN(cin, 384, 1)
        self.b3a, self.b3b = ConvBN(384, 384, (1, 3), padding=(0, 1)), ConvBN(384, 384, (3, 1), padding=(1, 0))
        self.bd = _seq(ConvBN(cin, 448, 1), ConvBN(448, 384, 3, padding=1))
        self.bda, self.bdb = ConvBN(384, 384, (1, 3), padding=(0, 1)), ConvBN(384, 384, (3, 1), padding=(1, 0))
        self.bp = ConvBN(cin, 192, 1)

    def forward(self, x):
        y3 = self.b3(x)
        yd = _run(self.bd, x)
        return concat([self.b1(x), self.b3a(y3), self.b3b(y3), self.bda(yd), self.bdb(yd),
                       self.bp(avg_pool(x, 3, 1, 1))])


class InceptionV3(nn.Module):
    def __init__(self, classes: int = 1000):
        self.stem = _seq(ConvBN(3, 32, 3, 2), ConvBN(32, 32, 3), ConvBN(32, 64, 3, padding=1))
        self.stem2 = _seq(ConvBN(64, 80, 1), ConvBN(80, 192, 3))
        self.mixed = nn.ModuleList([
            InceptionA(192, 32), InceptionA(256, 64), InceptionA(288, 64), InceptionB(288),
            InceptionC(768, 128), InceptionC(768, 160), InceptionC(768, 160), InceptionC(768, 192),
            InceptionD(768), InceptionE(1280), InceptionE(2048)])
        self.fc = nn.Linear(2048, classes)

    def forward(self, x):
        y = max_pool(_run(self.stem, x), 3, 2)
        y = max_pool(_run(self.stem2, y), 3, 2)
        for m in self.mixed:
            y = m(y)
        return self.fc(global_avg_pool(y))


def inceptionv3(batch: int = 1) -> ModelDef:
    return export("inceptionv3", InceptionV3(), {"x": ((batch, 3, 299, 299), "float32")},
                  description=f"Inception v3, batch {batch}, 299x299, seeded random weights")
