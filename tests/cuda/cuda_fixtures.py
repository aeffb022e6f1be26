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


def stand_in_cubins(path):
    """The bundle at ``path`` (a copy the test owns) with every variant's cubin replaced
    by a stand-in image of the same kernels (parameter sizes from the manifest, then the
    notifQ pair), loaded again. Each cubin is unlinked first: a fresh file, never one
    shared by a hard link with the compile cache."""
    import numpy as np

    from paella.bundle import load_bundle
    b = load_bundle(path)
    for k, v in enumerate(b.variants):
        specs = [kernel_spec(kn.name, [8 if p["kind"] == "buffer" else np.dtype(p["dtype"]).itemsize
                                       for p in kn.params] + [8, 4], regs=kn.registers,
                             smem=kn.static_smem) for kn in v.kernels]
        cubin = b.file("cubin", k)
        cubin.unlink()
        cubin.write_bytes(fake_cubin(75, specs))
    return load_bundle(path)
