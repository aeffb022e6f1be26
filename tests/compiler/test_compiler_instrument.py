"""The TIR pass instruments every kernel of a compiled model, on every exit path."""
from __future__ import annotations

import re
import subprocess

import tvm
from tvm.script import tirx as T

from paella.compiler_pass import nvcc
from paella.compiler_pass.build import global_functions
from paella.compiler_pass.instrument import (InstrumentKernels, InstrumentOptions, override_global_func,
                                             postproc_hook)


_ALLOC = re.compile(r"^(__shared__ )?(alignas\(\d+\) )?[\w:]+ \w+\[\d+\];$")


def _kernel_bodies(source: str) -> dict[str, tuple[str, str]]:
    """name -> (parameter list, body) for every __global__ definition."""
    out = {}
    for m in re.finditer(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\s*\(([^)]*)\)\s*\{", source):
        i, depth = m.end() - 1, 0
        for j in range(i, len(source)):
            depth += source[j] == "{"
            depth -= source[j] == "}"
            if depth == 0:
                out[m.group(1)] = (m.group(2), source[i + 1:j].strip())
                break
    return out


def test_every_kernel_is_instrumented(cnn_bundle):
    source = cnn_bundle.file("cuda_source").read_text()
    bodies = _kernel_bodies(source)
    assert len(bodies) == len(global_functions(source)) == len(cnn_bundle.kernels) >= 4
    assert set(bodies) == {k.name for k in cnn_bundle.kernels}
    for name, (params, body) in bodies.items():
        assert params.rstrip().endswith("uint paella_block_offset, uchar* __restrict__ paella_notifq, "
                                        "uint paella_launch_id"), name
        lines = [ln.strip() for ln in body.splitlines() if ln.strip()]
        start = lines.index("paella_block_start(paella_notifq, paella_launch_id);")
        # only allocations (local/shared arrays) may precede the prologue
        assert all(_ALLOC.match(ln) for ln in lines[:start]), (name, lines[:start])
        assert lines[-1] == "paella_block_end(paella_notifq, paella_launch_id);", name
        assert body.count("paella_block_end(") == 1 and "return" not in body, name
        # slicing: the block indices come from paella_block, computed once, after the prologue
        if "blockIdx" in body:
            assert re.match(r"(int|int64_t) paella_block = ", lines[start + 1]), name
            assert all("blockIdx" not in ln for ln in lines[start + 2:]), name
    assert "#define PAELLA_GROUP 16" in source
    assert all(k.instrumented for k in cnn_bundle.kernels)


def test_nvcc_built_every_kernel(cnn_bundle):
    assert cnn_bundle.file("cubin").stat().st_size > 0
    ptx = cnn_bundle.file("ptx").read_text()
    for k in cnn_bundle.kernels:
        assert f".entry {k.name}(" in ptx
        assert k.registers > 0
        assert k.static_smem >= 0 and k.dyn_smem >= 0
    # a tiled conv uses shared memory; ptxas saw it
    assert any(k.static_smem > 0 for k in cnn_bundle.kernels)


def test_group_option_reaches_the_source(mlp_bundle):
    source = mlp_bundle.file("cuda_source").read_text()
    assert "#define PAELLA_GROUP 1\n" in source
    assert mlp_bundle.manifest.group == 1


def test_plain_build_has_no_instrumentation(plain_bundle, cnn_bundle):
    source = plain_bundle.file("cuda_source").read_text()
    assert "paella_block_start" not in source and "paella_notifq" not in source
    assert not plain_bundle.manifest.instrumented
    assert not any(k.instrumented for k in plain_bundle.kernels)
    # same kernels, same launch configurations, same plan either way, but for the block
    # offset the instrumented kernels take last (slicing), which the plan passes as 0
    assert [(k.name, k.grid, k.block) for k in plain_bundle.kernels] == \
        [(k.name, k.grid, k.block) for k in cnn_bundle.kernels]
    plain = [o.to_dict() for o in plain_bundle.plan]
    for o in plain:
        if o["op"] == "launch":
            o["args"].append({"scalar": 0, "dtype": "uint32"})
    assert plain == [o.to_dict() for o in cnn_bundle.plan]


@T.prim_func
def early_exit_kernel(A_ptr: T.handle("float32", "global"), n: T.int32):
    T.func_attr({"calling_conv": 2, "target": T.target({"kind": "cuda", "arch": "sm_75", "keys": ["cuda", "gpu"],
                                                        "max_num_threads": 1024, "thread_warp_size": 32}),
                 "tirx.is_global_func": True, "tirx.kernel_launch_params": ["blockIdx.x", "threadIdx.x"],
                 "tirx.noalias": True})
    A = T.decl_buffer((1024,), data=A_ptr)
    with T.launch_thread("blockIdx.x", 4) as bx:
        tx = T.launch_thread("threadIdx.x", 256)
        if bx * 256 + tx >= n:
            return 0
        A[bx * 256 + tx] = T.float32(1)


def test_early_return_cannot_skip_the_epilogue(tmp_path):
    mod = InstrumentKernels(tvm.IRModule({"early_exit_kernel": early_exit_kernel}))
    with postproc_hook(InstrumentOptions()), override_global_func(
            "tvm_callback_cuda_compile", lambda _p: (lambda code, *a: b"")):
        rt = tvm.get_global_func("target.build.cuda")(mod, tvm.target.Target({"kind": "cuda", "arch": "sm_75"}))
    source = rt.inspect_source()
    _params, body = _kernel_bodies(source)["early_exit_kernel"]
    assert "return" not in body
    assert "PAELLA_EXIT();" in body
    # the jump target sits right before the single epilogue, after the scoped body
    assert body.rstrip().endswith("PAELLA_EPILOGUE();\n  paella_block_end(paella_notifq, paella_launch_id);")
    src = tmp_path / "early.cu"
    src.write_text(source)
    subprocess.run([nvcc.find_nvcc(), "-arch=sm_75", "-ptx", str(src), "-o", str(tmp_path / "early.ptx")],
                   check=True, capture_output=True)
    ptx = (tmp_path / "early.ptx").read_text()
    # after the guard's branch, both paths meet at one barrier; the kernel has exactly one
    assert len(re.findall(r"bar\.sync|barrier\.sync", ptx)) == 1
