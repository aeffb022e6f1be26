"""A client's out-of-range index cannot read outside a tensor: every ``take`` (embeddings,
ONNX Gather) is compiled in clip mode, for the GPU kernels and the CPU build the daemon
runs as the simulator's functional effect (which segfaulted the daemon on token 10**8)."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
from tvm.relax.frontend import nn

from paella.bundle import load_bundle
from paella.compiler_pass.bounded_indexing import bounded_indexing
from paella.compiler_pass.build import compile_bundle
from paella.models.base import export


class Embedding(nn.Module):
    def __init__(self):
        self.table = nn.Parameter((16, 8), "float32")

    def forward(self, ids: nn.Tensor) -> nn.Tensor:
        return nn.op.take(self.table, ids, axis=0)


def _model():
    return export("embedding", Embedding(), {"ids": ((4,), "int32")})


def test_every_take_clamps():
    mod = bounded_indexing(_model().mod)
    text = mod.script()
    assert 'mode="clip"' in text and 'mode="fast"' not in text


def test_hostile_ids_get_the_nearest_rows_and_no_crash(tmp_path):
    md = _model()
    out = compile_bundle(md, tmp_path / "emb", cache_dir=tmp_path / "cache")
    # In a child process: an unchecked take would kill it with SIGSEGV, not this test.
    code = f"""
import numpy as np
from paella.bundle import load_bundle
b = load_bundle({str(out)!r})
y = b.run_cpu({{"ids": np.array([0, 10**8, -10**8, 15], np.int32)}})
print(list(y.values())[0].tobytes().hex())
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = np.frombuffer(bytes.fromhex(proc.stdout.strip()), np.float32).reshape(4, 8)
    table = md.params[0]
    np.testing.assert_array_equal(got, table[[0, 15, 0, 15]])
    assert load_bundle(out).variants[0].inputs[0].dtype == "int32"
