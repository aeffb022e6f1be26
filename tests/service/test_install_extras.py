"""The base install is the client: with only numpy importable, the client library, ``paella
status``/``perf``/``occupancy`` work, and every other command says which extra it needs."""
from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: Everything the extras bring; the test's interpreter pretends none is installed.
EXTRAS_MODULES = ["greenlet", "posix_ipc", "tvm", "onnx", "matplotlib", "cuda", "grpc",
                  "google.protobuf", "prometheus_client", "torch", "tritonclient", "sklearn"]

BLOCKER = f"""
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == m or name.startswith(m + ".") for m in {EXTRAS_MODULES!r}):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Block())
import importlib.util
_find = importlib.util.find_spec
def find_spec(name, package=None):
    if any(name == m or name.startswith(m + ".") for m in {EXTRAS_MODULES!r}):
        return None
    return _find(name, package)
importlib.util.find_spec = find_spec
"""


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCKER + code], capture_output=True,
                          text=True, timeout=120)


def test_base_dependencies_are_numpy_only_and_the_extras_exist():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert [d.split(">")[0] for d in project["dependencies"]] == ["numpy"]
    extras = project["optional-dependencies"]
    assert {"serve", "compile", "cuda", "plots", "kserve", "text", "all", "dev"} <= set(extras)
    assert extras["all"] == ["paella-py[serve,compile,cuda,plots,kserve,text]"]
    assert extras["cuda"] == ["cuda-python>=12.6,<14"]     # docs/cuda-backend.md, "Versions"
    assert "'.[all,dev,windtunnel,ray]'" in (ROOT / "Makefile").read_text()   # (ray: paella cluster's tests)


def test_client_and_its_commands_work_with_numpy_alone(daemon):
    r = run(f"""
import numpy as np, paella
from paella.cli import main
c = paella.connect({daemon.socket!r})
x = np.ones(256, np.float32)
assert (c.infer("echo", {{"x": x}}, timeout=10)["y"] == x).all()
c.close()
assert main(["status", "--socket", {daemon.socket!r}]) == 0
assert main(["occupancy", "--threads", "256", "--regs", "64"]) == 0
assert main(["serve", "--socket", "/tmp/x"]) == 2
assert main(["compile", "resnet18", "-o", "x"]) == 2
assert main(["kserve"]) == 2
import paella.client.perf
for m in ("greenlet", "tvm", "grpc", "matplotlib"):
    assert m not in sys.modules, m
""")
    assert r.returncode == 0, r.stderr
    assert "paella serve needs the 'serve' extra (greenlet is not installed): " \
           "pip install 'paella-py[serve]'" in r.stderr
    assert "paella compile needs the 'compile' extra" in r.stderr
    assert "paella kserve needs the 'kserve' extra" in r.stderr
