"""SmallReduction: window reductions (depthwise conv, pooling) get one thread per output.

Without it TVM's GeneralReduction launches one 256-thread block per output element
(MobileNetV2: 2.3M blocks per request). Checked here: which rule takes which PrimFunc,
the launch configuration in a compiled bundle, instrumentation and plan consistency, and
(on the CPU, thread bindings turned into serial loops) that the schedule computes what the
unscheduled PrimFunc computes.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import tvm
from tvm import relax, s_tir, tirx
from tvm.relax.backend.cuda import pipeline as tvm_cuda
from tvm.relax.frontend import nn
from tvm.s_tir.schedule import Trace

from paella.bundle import check_variant, load_bundle
from paella.compiler_pass.build import compile_bundle, cuda_relax_pipeline, global_functions, gpu_target
from paella.compiler_pass.schedules import MAX_REDUCTION_EXTENT, SmallReduction, cuda_schedule_rules, rule_of
from paella.models.base import export
from paella.models.layers import ConvBN, avg_pool, max_pool

THREADS = 1024          # SmallReduction's default on CUDA: the target's max threads per block


class DepthwiseBlock(nn.Module):
    """MobileNetV2's depthwise stage: 3x3 groups=C conv, folded BN, ReLU6."""

    def __init__(self, c: int = 16):
        self.dw = ConvBN(c, c, 3, 1, 1, groups=c, act="relu6")

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        return self.dw(x)


class Pools(nn.Module):
    """A padded 3x3/2 max-pool, then a 3x3/1 average pool (count_include_pad=False)."""

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        return avg_pool(max_pool(x, 3, 2, 1), 3, 1, 1)


class SmallMatmul(nn.Module):
    """A matmul with K = 32 <= MAX_REDUCTION_EXTENT: still GEMM-shaped, so Matmul's."""

    def __init__(self):
        self.fc = nn.Linear(32, 64, bias=False)

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        return self.fc(x)


def _dw_model():
    # 16 x 20 x 20 = 6400 outputs: 7 blocks of 1024 threads, the last one partial
    return export("test_dw", DepthwiseBlock(16), {"x": ((1, 16, 20, 20), "float32")})


def _pool_model():
    # 16 x 11 x 11 = 1936 outputs per pool: 2 blocks of 1024 threads
    return export("test_pools", Pools(), {"x": ((1, 16, 21, 21), "float32")})


def _matmul_model():
    return export("test_small_matmul", SmallMatmul(), {"x": ((16, 32), "float32")})


def _fused_primfuncs(model) -> dict[str, tirx.PrimFunc]:
    """The PrimFuncs DLight sees: TVM's CUDA legalize passes up to (not including) the
    ApplyDefaultSchedule pass."""
    target = gpu_target("sm_75")
    passes = [p for p in tvm_cuda.legalize_passes(target) if p.info.name != "ApplyDefaultSchedule"]
    with target:
        mod = tvm.transform.Sequential(passes)(model.mod)
    return {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)}


def _rules(model) -> dict[str, str | None]:
    target = gpu_target("sm_75")
    with target:
        return {name: rule_of(f, target) for name, f in _fused_primfuncs(model).items()}


# ---------------------------------------------------------------------- rule selection


def test_rule_list_is_ours_first_then_tvm_defaults_in_order():
    assert [type(r).__name__ for r in cuda_schedule_rules()] == \
        ["SmallReduction", "Matmul", "GEMV", "Reduction", "GeneralReduction", "Fallback"]


def test_depthwise_and_pools_are_small_reductions():
    rules = _rules(_dw_model())
    assert list(rules.values()) == ["SmallReduction"], rules
    rules = _rules(_pool_model())
    assert sorted(rules) == ["avg_pool2d", "max_pool2d"] and set(rules.values()) == {"SmallReduction"}


def test_small_matmul_stays_with_matmul():
    funcs = _fused_primfuncs(_matmul_model())
    target = gpu_target("sm_75")
    [(name, f)] = [(n, f) for n, f in funcs.items() if "matmul" in n]
    with target:
        assert SmallReduction().apply(f, target, False) is None
        assert rule_of(f, target) == "Matmul"


def test_large_window_is_left_to_the_default_rules():
    # a 9x9 window (81 > 64) is not ours, a 7x7 one (49) is
    class Big(nn.Module):
        def forward(self, x):
            return max_pool(x, 9, 1, 4)

    class Seven(nn.Module):
        def forward(self, x):
            return max_pool(x, 7, 1, 3)
    shape = {"x": ((1, 4, 12, 12), "float32")}
    assert 49 <= MAX_REDUCTION_EXTENT < 81
    assert set(_rules(export("big", Big(), shape)).values()) != {"SmallReduction"}
    assert set(_rules(export("seven", Seven(), shape)).values()) == {"SmallReduction"}


def test_rule_refuses_non_gpu_targets_and_bad_options():
    [f] = _fused_primfuncs(_dw_model()).values()
    llvm = tvm.target.Target("llvm")
    with llvm:
        assert SmallReduction().apply(f, llvm, False) is None
    with pytest.raises(ValueError, match="max_extent >= 1"):
        SmallReduction(max_extent=0)


# ---------------------------------------------------------------------- numerics


def _run_llvm(func: tirx.PrimFunc, args: list[np.ndarray]) -> np.ndarray:
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target="llvm")
    dev_args = [tvm.runtime.tensor(a) for a in args]
    lib(*dev_args)
    return dev_args[-1].numpy()


@pytest.mark.parametrize("make", [_dw_model, _pool_model], ids=["depthwise", "pools"])
def test_schedule_computes_what_the_primfunc_computes(make):
    """Replay the rule's schedule without its ``bind`` steps (blockIdx/threadIdx become serial
    loops) and run it on the CPU against the unscheduled PrimFunc."""
    target = gpu_target("sm_75")
    rng = np.random.default_rng(0)
    for name, f in _fused_primfuncs(make()).items():
        with target:
            sch = SmallReduction().apply(f, target, False)
        assert sch is not None, name
        kinds = [inst.kind.name for inst in sch.trace.insts]
        assert kinds.count("Bind") == 2 and "ComputeAt" in kinds, (name, kinds)
        serial = s_tir.Schedule(f)
        Trace([i for i in sch.trace.insts if i.kind.name != "Bind"], {}).apply_to_schedule(
            serial, remove_postproc=False)
        args = [rng.standard_normal([int(d) for d in p.ty.shape]).astype(str(p.ty.dtype)) for p in f.params]
        np.testing.assert_array_equal(_run_llvm(serial.mod["main"], [a.copy() for a in args]),
                                      _run_llvm(f, [a.copy() for a in args]), err_msg=name)


# ---------------------------------------------------------------------- compiled bundles


@pytest.fixture(scope="module")
def dw_bundle(tmp_path_factory):
    out = tmp_path_factory.mktemp("sched") / "dw"
    compile_bundle(_dw_model(), out, cache_dir=tmp_path_factory.mktemp("cache"))
    return load_bundle(out)


@pytest.fixture(scope="module")
def pool_bundle(tmp_path_factory):
    out = tmp_path_factory.mktemp("sched") / "pools"
    compile_bundle(_pool_model(), out, cache_dir=tmp_path_factory.mktemp("cache"))
    return load_bundle(out)


def _check_one_thread_per_output(bundle, expected: dict[str, int]):
    """Every kernel whose name starts with a key of ``expected`` (its output count) is
    launched with ceil(outputs / 1024) blocks of min(outputs, 1024) threads."""
    v = bundle.variants[0]
    check_variant(v)
    kernels = {k.name: k for k in v.kernels}
    seen = set()
    for op in v.launches():
        [prefix] = [p for p in expected if op.kernel.startswith(p)]
        n = expected[prefix]
        threads = min(n, THREADS)
        assert op.block == [threads, 1, 1], (op.kernel, op.block)
        assert op.grid == [math.ceil(n / threads), 1, 1], (op.kernel, op.grid)
        assert kernels[op.kernel].blocks == math.ceil(n / threads)
        seen.add(prefix)
    assert seen == set(expected)


def _check_instrumented(bundle):
    source = bundle.file("cuda_source").read_text()
    assert sorted(global_functions(source)) == sorted(k.name for k in bundle.kernels)
    source = source[source.index("__global__"):]          # the kernels, not the header's comment
    assert source.count("paella_block_start(paella_notifq, paella_launch_id);") == len(bundle.kernels)
    assert source.count("paella_block_end(paella_notifq, paella_launch_id);") == len(bundle.kernels)
    ptx = bundle.file("ptx").read_text()
    for k in bundle.kernels:
        assert k.instrumented and k.registers > 0 and f".entry {k.name}(" in ptx
        assert k.static_smem == 0, (k.name, "no shared memory: the window is reduced in registers")


def test_depthwise_bundle_one_thread_per_output(dw_bundle):
    _check_one_thread_per_output(dw_bundle, {"fused_conv2d": 16 * 20 * 20})     # 7 blocks
    assert [k.blocks for k in dw_bundle.kernels] == [7]
    _check_instrumented(dw_bundle)


def test_pool_bundle_one_thread_per_output(pool_bundle):
    _check_one_thread_per_output(pool_bundle, {"max_pool2d": 16 * 11 * 11, "avg_pool2d": 16 * 11 * 11})
    _check_instrumented(pool_bundle)


def test_bundles_cpu_reference_still_runs(dw_bundle, pool_bundle):
    """The CPU (llvm) build is unaffected by the CUDA rule list: it still matches numpy."""
    x = np.random.default_rng(1).standard_normal((1, 16, 21, 21)).astype(np.float32)
    got = pool_bundle.run_cpu({"x": x})["output0"]
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)), constant_values=-np.inf)
    mp = np.stack([xp[:, :, i:i + 21:2, j:j + 21:2] for i in range(3) for j in range(3)]).max(axis=0)
    mpp = np.pad(mp, ((0, 0), (0, 0), (1, 1), (1, 1)))
    ones = np.pad(np.ones_like(mp), ((0, 0), (0, 0), (1, 1), (1, 1)))
    s = sum(mpp[:, :, i:i + 11, j:j + 11] for i in range(3) for j in range(3))
    cnt = sum(ones[:, :, i:i + 11, j:j + 11] for i in range(3) for j in range(3))
    np.testing.assert_allclose(got, s / cnt, rtol=1e-5, atol=1e-6)
    y = dw_bundle.run_cpu({"x": np.zeros((1, 16, 20, 20), np.float32)})["output0"]
    assert y.shape == (1, 16, 20, 20)


def test_pipeline_keeps_tvm_default_passes():
    """Our pipeline is TVM's default CUDA pipeline with only the schedule pass replaced."""
    model = _pool_model()
    target = gpu_target("sm_75")
    names: list[str] = []

    @tvm.instrument.pass_instrument
    class Record:
        def run_before_pass(self, _mod, info):
            names.append(info.name)

    def run(pipeline):
        names.clear()
        with target, tvm.transform.PassContext(instruments=[Record()]):
            mod = pipeline(model.mod)
        return list(names), mod

    ours, mod = run(cuda_relax_pipeline(target))
    theirs, _ = run(relax.get_default_pipeline(target))
    assert ours[1:] == theirs[1:]          # [0] is the wrapping pipeline pass itself
    assert ours.count("ApplyDefaultSchedule") == 1
    assert all(f.attrs.get("tirx.is_scheduled") for f in mod.functions.values() if isinstance(f, tirx.PrimFunc))
