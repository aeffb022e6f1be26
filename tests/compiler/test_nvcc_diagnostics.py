"""A failed nvcc/ptxas run shows its error lines even when pages of info lines follow."""
from pathlib import Path

import pytest

from paella.compiler_pass import nvcc


def test_error_lines_survive_a_long_report():
    report = "\n".join(["ptxas error   : Entry function 'k' uses too much shared data (0x10000 bytes, 0xc000 max)"]
                       + [f"ptxas info    : line {i}" for i in range(200)])
    shown = nvcc.diagnostics(report)
    assert "uses too much shared data" in shown
    assert "line 199" in shown and "line 100" not in shown


def test_short_report_is_shown_whole():
    assert nvcc.diagnostics("a\nb") == "a\nb"


def test_real_ptxas_error_is_reported(tmp_path: Path):
    try:
        nvcc.find_nvcc()
    except nvcc.NvccError:
        pytest.skip("nvcc not installed")
    src = tmp_path / "k.cu"
    # 64 KiB of static shared memory: more than sm_75 allows (48 KiB static).
    src.write_text('extern "C" __global__ void k(float* o) { __shared__ float s[16384];'
                   ' s[threadIdx.x] = 1; __syncthreads(); o[threadIdx.x] = s[threadIdx.x ^ 1]; }\n')
    with pytest.raises(nvcc.NvccError) as e:
        nvcc.build(src, "sm_75", tmp_path)
    assert "error" in str(e.value).lower() and "shared" in str(e.value).lower()
