"""A kernel's functional effect on the simulated GPU: applied in device memory when the
kernel completes, in stream order with the copies around it, in both simulator modes."""
from __future__ import annotations

import numpy as np
import pytest

from paella.dispatcher.devices.base import KernelInfo, ModuleImage
from paella.dispatcher.devices.sim import SimDevice, SimProcessDevice
from paella.dispatcher.devices.sim.functional import model_effect


class T:
    """A tensor as model_effect reads it."""

    def __init__(self, name, n):
        self.name, self.shape, self.dtype, self.nbytes = name, (n,), "float32", 4 * n


def run(dev, launch_args):
    """x -> [H2D] buf_in -> kernel (effect: y = 2x + 1) -> buf_out -> [D2H] out."""
    seen = []

    def compute(inputs):
        seen.append(inputs["x"].copy())
        return {"y": inputs["x"] * 2 + 1}
    effect = model_effect([T("x", 4)], [T("y", 4)], compute, own_args=1)
    f = dev.load_module(ModuleImage("m", [KernelInfo("k", 16, duration=20e-6)],
                                    effects={"k": effect}))["k"]
    src, dst = dev.alloc(16), dev.alloc(16)
    x = np.arange(4, dtype=np.float32)
    out = np.zeros(4, np.float32)
    done = []
    dev.memcpy_htod(src, x.view(np.uint8), 0)
    dev.launch(f, 1, 32, 0, 1, args=launch_args(src, dst), instrumented=False,
               on_complete=lambda: done.append("k"))
    dev.memcpy_dtoh(out.view(np.uint8), dst, 0, on_complete=lambda: done.append("d2h"))
    dev.synchronize()
    return out, seen, done


@pytest.mark.parametrize("cls", [SimDevice, SimProcessDevice])
def test_the_effect_writes_device_memory_before_the_copy_back(cls):
    dev = cls("gtx1660s", n_streams=4)
    try:
        out, seen, done = run(dev, lambda src, dst: (7, src, dst))
    finally:
        dev.close()
    assert np.array_equal(out, np.arange(4, dtype=np.float32) * 2 + 1)
    assert len(seen) == 1 and np.array_equal(seen[0], np.arange(4, dtype=np.float32))
    assert done == ["k", "d2h"]


def test_a_launch_without_the_operands_has_no_effect():
    dev = SimDevice("gtx1660s", n_streams=4)
    out, seen, _ = run(dev, lambda src, dst: (7,))        # its own argument only
    assert seen == [] and not out.any()
