"""TVM, imported without torch.

TVM's FFI layer (``tvm_ffi``, with apache-tvm 0.27) imports torch at its own import
whenever torch is installed, for DLPack interop with torch tensors. Paella never hands
TVM a torch tensor (the compiler reads ONNX and its own model builders; a bundle's CPU
build takes numpy arrays), yet every process that imports TVM would pay for torch:
about 3 s of start-up on this 2-core machine (``import tvm.relax``: 4.3 s with torch,
1.3 s without) and its memory. Those processes are the daemon's effect workers (a
bundle's answers), ``paella compile``, the demo and the experiments that compile.

Trick (labelled): :func:`install` (``import paella`` calls it) puts a finder first on
``sys.meta_path``. While ``tvm`` or ``tvm_ffi`` is being imported for the first time,
it answers ``import torch`` with ModuleNotFoundError, which tvm_ffi takes as "torch is
not installed"; at any other time it finds nothing and the import goes on as usual, so
``import torch`` afterwards (WindTunnel's networks) works. Where torch was imported
before TVM, nothing is hidden (it is in ``sys.modules`` already). TVM then does not
convert torch tensors by itself, which nothing here asks of it.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import threading
from types import ModuleType
from typing import Any, Sequence

#: The packages whose first import hides torch.
_HIDING_FOR = ("tvm", "tvm_ffi")


class _HideTorchDuringTVM(importlib.abc.MetaPathFinder):
    """The finder of the module docstring."""

    def __init__(self) -> None:
        self._depth = threading.local()

    def _inside(self) -> int:
        return getattr(self._depth, "n", 0)

    def find_spec(self, name: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if name == "torch" and self._inside():
            raise ModuleNotFoundError("torch is not imported with TVM (paella.tvm_loader)",
                                      name="torch")
        if name not in _HIDING_FOR or "torch" in sys.modules:
            return None
        spec = _spec_from_others(self, name, path, target)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Hiding(spec.loader, self)
        return spec


class _Hiding(importlib.abc.Loader):
    """The real loader of ``tvm`` or ``tvm_ffi``, run with torch hidden."""

    def __init__(self, loader: Any, finder: _HideTorchDuringTVM):
        self.loader, self.finder = loader, finder

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        depth = self.finder._depth
        depth.n = getattr(depth, "n", 0) + 1
        os.environ.setdefault("TVM_FFI_DISABLE_TORCH_C_DLPACK", "1")
        try:
            self.loader.exec_module(module)
        finally:
            depth.n -= 1

    def __getattr__(self, name: str) -> Any:      # (get_resource_reader, is_package, ...)
        return getattr(self.loader, name)


def _spec_from_others(me: Any, name: str, path: Any, target: Any
                      ) -> importlib.machinery.ModuleSpec | None:
    for finder in sys.meta_path:
        if finder is me or not hasattr(finder, "find_spec"):
            continue
        spec = finder.find_spec(name, path, target)
        if spec is not None:
            return spec
    return None


_FINDER = _HideTorchDuringTVM()


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def load_tvm() -> ModuleType:
    """``tvm`` with ``tvm.relax``, imported without torch (see the module docstring)."""
    install()
    import tvm
    import tvm.relax  # noqa: F401
    return tvm
