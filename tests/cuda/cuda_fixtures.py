"""The cuda tests' shared kernels and images (a module of its own: a test importing from
``conftest`` would get whichever conftest.py pytest loaded last)."""
from __future__ import annotations

from cuda_fake_driver import fake_cubin, fake_ptx, kernel_spec
from paella.dispatcher.devices.base import KernelInfo, ModuleImage

SLOTS, PAIRS = 64, 8


#: An instrumented kernel (float* x, int n, notifQ, launch id) that adds 1 to x[:n],
#: an uninstrumented one, and one with a float and an 8-byte scalar.
KERNELS = [
    kernel_spec("add1", [8, 4, 8, 4], regs=24, body="add1_f32"),
    kernel_spec("plain", [8], instrumented=False, regs=16),
    kernel_spec("mixed", [4, 8, 8, 4], regs=40, smem=1024),
]
INFOS = [KernelInfo("add1", regs_per_thread=24), KernelInfo("plain", regs_per_thread=16),
         KernelInfo("mixed", regs_per_thread=32, static_smem=0)]


def image(arch: int = 75, *, cubin: bool = True, ptx: bool = True) -> ModuleImage:
    return ModuleImage("m", INFOS, cubin=fake_cubin(arch, KERNELS) if cubin else None,
                       ptx=fake_ptx(KERNELS, terminate=False) if ptx else None)
