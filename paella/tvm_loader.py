"""TVM, imported without torch.

TVM's FFI layer (``tvm_ffi``, with apache-tvm 0.27) imports torch at its own import
whenever torch is installed, for DLPack interop with torch tensors. Paella never hands
TVM a torch tensor (the compiler reads ONNX and its own model builders; a bundle's CPU
build takes numpy arrays), yet every process that imports TVM would pay for torch:
about 3 s of start-up on this 2-core machine (``import tvm.relax``: 4.3 s with torch,
1.3 s without) and its memory. That process is the daemon serving bundles on the
simulated GPU, each of its effect workers (a bundle's first answer), and ``paella
compile``.

Trick (labelled): while TVM is imported, ``sys.modules["torch"]`` is None, which makes
``import torch`` raise ImportError, which tvm_ffi takes as "torch is not installed";
the entry is removed afterwards, so a later ``import torch`` (WindTunnel's networks)
works as usual. Where torch was imported first, nothing is hidden.
"""
from __future__ import annotations

import os
import sys
from types import ModuleType


def load_tvm() -> ModuleType:
    """``tvm`` with ``tvm.relax``, imported without torch (see the module docstring)."""
    tvm = sys.modules.get("tvm")
    if tvm is not None and "tvm.relax" in sys.modules:
        return tvm
    hide = "torch" not in sys.modules
    if hide:
        sys.modules["torch"] = None               # type: ignore[assignment]
        os.environ.setdefault("TVM_FFI_DISABLE_TORCH_C_DLPACK", "1")
    try:
        import tvm
        import tvm.relax  # noqa: F401
    finally:
        if hide and sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]
    return tvm
