"""A U-Net-like segmentation network (Ronneberger et al. 2015), the image model of
DVABatch's evaluation: a convolutional encoder whose resolution halves at each level
(max pooling), a decoder that doubles it again (nearest-neighbour upsampling, then a
convolution), and skip connections that concatenate each encoder level's features to
the decoder level of the same resolution. Seeded weights, folded batch norm.

The full configuration (base width 64, four downsamplings, 256x256 RGB in, 2 classes)
is the paper's shape class; :func:`unet_small` (width 4, two levels, 16x16) compiles in
seconds for the tests. Its reference outputs are the bundle's CPU build, as for the
other convolutional zoo models.

Why it matters for DVABatch: its early and late stages run at full resolution (large
launches that fill the GPU at small batch sizes) and its middle at 1/16 of it (small
launches that want large batches) -- the operator diversity policy II splits on.
"""
from __future__ import annotations

from tvm.relax.frontend import nn

from .base import ModelDef, export
from .layers import ConvBN, max_pool


class DoubleConv(nn.Module):
    def __init__(self, cin: int, cout: int):
        self.a = ConvBN(cin, cout, 3, 1, 1)
        self.b = ConvBN(cout, cout, 3, 1, 1)

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        return self.b(self.a(x))


class UNet(nn.Module):
    def __init__(self, base: int, depth: int, classes: int, cin: int = 3):
        widths = [base * 2 ** i for i in range(depth + 1)]
        self.down = nn.ModuleList([DoubleConv(cin if i == 0 else widths[i - 1], widths[i])
                                   for i in range(depth + 1)])
        # Upsampling: nearest x2 then a 3x3 conv halving the channels (the "up-conv").
        self.up = nn.ModuleList([ConvBN(widths[i + 1], widths[i], 3, 1, 1) for i in reversed(range(depth))])
        self.dec = nn.ModuleList([DoubleConv(2 * widths[i], widths[i]) for i in reversed(range(depth))])
        self.head = nn.Conv2D(widths[0], classes, 1, bias=True)

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        skips = []
        for i, block in enumerate(self.down):
            x = block(x if i == 0 else max_pool(x, 2, 2))
            skips.append(x)
        skips.pop()
        for up, dec in zip(self.up, self.dec):
            x = up(nn.op.interpolate(x, scale_factor=2.0, mode="nearest"))
            x = dec(nn.op.concat([skips.pop(), x], dim=1))
        return self.head(x)


def _unet(name: str, batch: int, base: int, depth: int, size: int, classes: int) -> ModelDef:
    return export(name, UNet(base, depth, classes), {"x": ((batch, 3, size, size), "float32")},
                  description=f"U-Net-like, width {base}, {depth} levels, {size}x{size}, "
                              f"{classes} classes, batch {batch}, seeded random weights")


def unet(batch: int = 1) -> ModelDef:
    """U-Net-like at full size: width 64..1024, four downsamplings, 256x256 in, 2 classes."""
    return _unet("unet", batch, 64, 4, 256, 2)


def unet_small(batch: int = 1) -> ModelDef:
    """The same network at test size: width 4..16, two downsamplings, 16x16 in."""
    return _unet("unet_small", batch, 4, 2, 16, 2)
