"""The models every daemon can serve without a bundle: ``echo`` (computed on the host)
and ``noop`` (the smallest job through the whole device path)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from paella import wire


@dataclass
class HostModel:
    """A model the daemon computes on its own CPU, without the device path.

    The only one is the built-in ``echo`` (output = input): a health check for the
    service path (socket, rings, validation, wake-ups) that needs no bundle and no
    GPU. It is what the front-end tests and the round-trip benchmark's baseline use.
    """
    info: wire.ModelInfo
    run: Callable[[np.ndarray], None]


ECHO_FLOATS = 256


def echo_model(model_id: int) -> HostModel:
    n = ECHO_FLOATS * 4
    x = wire.TensorInfo("x", (ECHO_FLOATS,), "float32", 0)
    y = wire.TensorInfo("y", (ECHO_FLOATS,), "float32", n)
    info = wire.ModelInfo(model_id, "echo", (wire.VariantInfo(2 * n, (x,), (y,)),))

    def run(io: np.ndarray) -> None:
        io[n:2 * n] = io[:n]
    return HostModel(info, run)


NOOP_IO = 64
NOOP_KERNEL_SECONDS = 5e-6


def noop_adaptor():
    """The built-in ``noop`` model: 64 input bytes copied to the device, one 1-block
    kernel of 5 us, no output (so the wake-up goes before its only kernel, the paper's
    pinned-output case). It is the smallest job that takes the whole device path
    (dispatcher, policy, notifQ, simulated GPU): the round-trip benchmark's model."""
    from paella.dispatcher.adaptor import PlanAdaptor, synthetic_plan
    return PlanAdaptor(synthetic_plan("noop", [("noop_kernel", 1, 32, 8, NOOP_KERNEL_SECONDS)],
                                      in_bytes=NOOP_IO))


def noop_info(model_id: int) -> wire.ModelInfo:
    x = wire.TensorInfo("x", (NOOP_IO,), "uint8", 0)
    return wire.ModelInfo(model_id, "noop", (wire.VariantInfo(NOOP_IO, (x,), ()),))
