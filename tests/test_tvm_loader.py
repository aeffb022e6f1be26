"""TVM is imported without torch (paella.tvm_loader), and torch stays importable after."""
from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

pytest.importorskip("tvm")

PROG = """
import sys
from paella.tvm_loader import load_tvm
tvm = load_tvm()
assert tvm.relax.VirtualMachine and tvm.runtime.tensor
print("torch loaded with tvm:", "torch" in sys.modules)
import paella.compiler_pass.build
print("torch loaded with the compiler:", "torch" in sys.modules)
"""


def test_tvm_and_the_compiler_import_without_torch_and_torch_imports_after():
    prog = PROG
    if importlib.util.find_spec("torch") is not None:
        prog += "import torch\nprint('torch after:', torch.zeros(2).sum().item())\n"
    r = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "torch loaded with tvm: False" in r.stdout
    assert "torch loaded with the compiler: False" in r.stdout
    if "torch after" in prog:
        assert "torch after: 0.0" in r.stdout
