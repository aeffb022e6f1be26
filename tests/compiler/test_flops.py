"""FLOP estimates in the manifest: taken before scheduling, and not divided by reuse."""
from collections import Counter

from tvm.relax.frontend import nn

from paella.bundle import load_bundle
from paella.compiler_pass.build import compile_bundle
from paella.models.base import export


class Repeated(nn.Module):
    """Three identical 64x64 layers: one fused PrimFunc, called three times."""

    def __init__(self):
        self.a = nn.Linear(64, 64, bias=False)
        self.b = nn.Linear(64, 64, bias=False)
        self.c = nn.Linear(64, 64, bias=False)

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        return self.c(self.b(self.a(x)))


def test_manifest_flops_equal_the_model_arithmetic(tmp_path):
    b = load_bundle(compile_bundle(export("repeated", Repeated(), {"x": ((32, 64), "float32")}),
                                   tmp_path / "rep"))
    v = b.variants[0]
    calls = Counter(op.kernel for op in v.plan if op.op == "launch")
    assert max(calls.values()) == 3                         # the kernel is reused, as intended
    total = sum(k.flops * calls[k.name] for k in v.kernels)
    assert total == 3 * 2 * 32 * 64 * 64                    # 2 FLOPs per multiply-add
