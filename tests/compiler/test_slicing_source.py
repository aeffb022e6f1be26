"""Kernel slicing in the generated CUDA (issue 38): a kernel launched as slices runs every
block of its compiled grid exactly once, computing what the unsliced launch computes.

The kernels below store, for each block, a value made of its block indices at an address
made of them. The test takes the CUDA that TVM generates after the Paella pass, reads the
two statements that matter (the linear block number and the store), evaluates them for
every block of every launch (the whole grid at offset 0, and slices as 1-D launches at
their offsets) and checks coverage and values; nvcc then compiles the source.
"""
from __future__ import annotations

import re
import subprocess

import pytest
import tvm
from tvm.script import tirx as T

from paella.compiler_pass import nvcc
from paella.compiler_pass.instrument import (InstrumentOptions, instrument_kernel, override_global_func,
                                             postproc_hook)
from paella.dispatcher.slicing import slices

_TARGET = {"kind": "cuda", "arch": "sm_75", "keys": ["cuda", "gpu"], "max_num_threads": 1024,
           "thread_warp_size": 32}


@T.prim_func
def grid2d(A_ptr: T.handle("int32", "global")):
    T.func_attr({"calling_conv": 2, "target": T.target(_TARGET), "tirx.is_global_func": True,
                 "tirx.kernel_launch_params": ["blockIdx.x", "blockIdx.y", "threadIdx.x"], "tirx.noalias": True})
    A = T.decl_buffer((7 * 5,), "int32", data=A_ptr)
    with T.launch_thread("blockIdx.x", 7) as bx:
        by = T.launch_thread("blockIdx.y", 5)
        tx = T.launch_thread("threadIdx.x", 32)
        if tx == 0:
            A[by * 7 + bx] = bx * 1000 + by


@T.prim_func
def grid3d(A_ptr: T.handle("int32", "global")):
    T.func_attr({"calling_conv": 2, "target": T.target(_TARGET), "tirx.is_global_func": True,
                 "tirx.kernel_launch_params": ["blockIdx.x", "blockIdx.y", "blockIdx.z", "threadIdx.x"],
                 "tirx.noalias": True})
    A = T.decl_buffer((3 * 4 * 6,), "int32", data=A_ptr)
    with T.launch_thread("blockIdx.x", 3) as bx:
        by = T.launch_thread("blockIdx.y", 4)
        bz = T.launch_thread("blockIdx.z", 6)
        tx = T.launch_thread("threadIdx.x", 32)
        if tx == 0:
            A[(bz * 4 + by) * 3 + bx] = bx * 1000000 + by * 1000 + bz


def _source(name: str, func, sliceable: bool = True) -> str:
    mod = tvm.IRModule({name: instrument_kernel(func, sliceable)})
    with postproc_hook(InstrumentOptions()), override_global_func(
            "tvm_callback_cuda_compile", lambda _p: (lambda code, *a: b"")):
        rt = tvm.get_global_func("target.build.cuda")(mod, tvm.target.Target({"kind": "cuda", "arch": "sm_75"}))
    return rt.inspect_source()


def _py(expr: str) -> str:
    """A C integer expression of the generated code as Python (operands are >= 0)."""
    return re.sub(r"\(int\)", "", expr).replace("/", "//")


def _statements(source: str, name: str) -> tuple[str, str, str]:
    body = source[source.index(f"{name}("):]
    block = re.search(r"int paella_block = (.*);", body).group(1)
    index, value = re.search(r"A_ptr\[(.*)\] = (.*);", body).groups()
    return _py(block), _py(index), _py(value)


def _run(stmts: tuple[str, str, str], grid: tuple[int, int, int], offset: int) -> list[tuple[int, int]]:
    """(address, value) stored by each block of one launch."""
    block, index, value = stmts
    out = []
    for bz in range(grid[2]):
        for by in range(grid[1]):
            for bx in range(grid[0]):
                env = {"blockIdx": type("B", (), {"x": bx, "y": by, "z": bz}),
                       "paella_block_offset": offset, "threadIdx": type("T", (), {"x": 0})}
                env["paella_block"] = eval(block, {}, env)
                out.append((eval(index, {}, env), eval(value, {}, env)))
    return out


@pytest.mark.parametrize("name, func, grid", [("grid2d", grid2d, (7, 5, 1)), ("grid3d", grid3d, (3, 4, 6))])
@pytest.mark.parametrize("per_slice", [1, 4, 7, 16, 1000])
def test_slices_cover_every_block_once_with_the_unsliced_values(name, func, grid, per_slice, tmp_path):
    source = _source(name, func)
    assert re.search(rf"{name}\(int\* __restrict__ A_ptr, uint paella_block_offset, uchar\* __restrict__ "
                     r"paella_notifq, uint paella_launch_id\)", source)
    stmts = _statements(source, name)
    # the body reads no hardware block index: only paella_block's definition does
    body = source[source.index(f"{name}(int"):]
    body = body[body.index("{"):]
    assert all("blockIdx" not in ln or "paella_block =" in ln for ln in body.splitlines())
    whole = dict(_run(stmts, grid, 0))
    total = grid[0] * grid[1] * grid[2]
    assert len(whole) == total                      # the unsliced launch fills every address
    stores: list[tuple[int, int]] = []
    for offset, count in slices(total, per_slice):
        stores += _run(stmts, (count, 1, 1), offset)
    addresses = [a for a, _ in stores]
    assert sorted(addresses) == sorted(whole)       # every block exactly once
    assert dict(stores) == whole                    # and each computes what it did whole
    src = tmp_path / f"{name}.cu"
    src.write_text(source)
    subprocess.run([nvcc.find_nvcc(), "-arch=sm_75", "-ptx", str(src), "-o", str(tmp_path / f"{name}.ptx")],
                   check=True, capture_output=True)


def test_an_unsliceable_build_keeps_the_hardware_indices():
    source = _source("grid2d", grid2d, sliceable=False)
    assert "paella_block_offset" not in source and "paella_block =" not in source
    assert "blockIdx.y" in source
