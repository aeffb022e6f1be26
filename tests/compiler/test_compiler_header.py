"""The device header agrees with paella.protocol and compiles for every target arch."""
from __future__ import annotations

import re
import subprocess

import pytest

from paella import protocol
from paella.compiler_pass import nvcc
from paella.compiler_pass.instrument import header_text, source_prelude

HEADER = header_text()


def _defines() -> dict[str, int]:
    out = {}
    for name, value in re.findall(r"^#define (PAELLA_\w+) (0x[0-9A-Fa-f]+|\d+)u?\s*$", HEADER, re.M):
        out[name] = int(value, 0)
    return out


def test_header_constants_equal_protocol():
    d = _defines()
    expect = {
        "PAELLA_INVALID": protocol.INVALID, "PAELLA_PLACEMENT": protocol.PLACEMENT,
        "PAELLA_COMPLETION": protocol.COMPLETION, "PAELLA_KIND_SHIFT": protocol.KIND_SHIFT,
        "PAELLA_SM_SHIFT": protocol.SM_SHIFT, "PAELLA_COUNT_SHIFT": protocol.COUNT_SHIFT,
        "PAELLA_LAUNCH_MASK": protocol.LAUNCH_MASK, "PAELLA_BYTE_MASK": protocol.BYTE_MASK,
        "PAELLA_MAX_GROUP": protocol.MAX_GROUP, "PAELLA_GROUP": protocol.DEFAULT_GROUP,
        "PAELLA_NOTIFQ_TAIL_OFFSET": protocol.NOTIFQ_TAIL_OFFSET,
        "PAELLA_NOTIFQ_SLOT_MASK_OFFSET": protocol.NOTIFQ_SLOT_MASK_OFFSET,
        "PAELLA_NOTIFQ_COUNTER_MASK_OFFSET": protocol.NOTIFQ_COUNTER_MASK_OFFSET,
        "PAELLA_NOTIFQ_HEADER_BYTES": protocol.NOTIFQ_HEADER_BYTES,
    }
    assert {k: d.get(k) for k in expect} == expect


def _function_body(name: str) -> str:
    start = HEADER.index(f"void {name}(")
    body = HEADER[HEADER.index("{", start):]
    depth = 0
    for i, ch in enumerate(body):
        depth += ch == "{"
        depth -= ch == "}"
        if depth == 0:
            return body[:i + 1]
    raise AssertionError(f"unbalanced braces in {name}")


def test_epilogue_barrier_is_reached_by_all_threads():
    body = _function_body("paella_block_end")
    # the barrier is the first statement, before (outside) the leader-only branch
    assert body.index("__syncthreads()") < body.index("if (paella_is_leader())")
    leader_branch = body[body.index("if (paella_is_leader())"):]
    assert "__syncthreads" not in leader_branch


def test_counter_layout_follows_protocol():
    body = _function_body("paella_count")
    # counters start after the slots: header + 8 * (slot_mask + 1); pairs [started, ended]
    assert "PAELLA_NOTIFQ_HEADER_BYTES + 8ull * ((unsigned long long)slot_mask + 1ull)" in body
    assert "2u * (launch_id & counter_mask) + which" in body
    assert "gridDim.x * gridDim.y * gridDim.z" in body


def _emulate_header_rule(total: int, group: int) -> list[tuple[int, int]]:
    """The header's posting decision, transcribed: (counter value, count) of each post."""
    posts = []
    for value in range(1, total + 1):
        count = group if value % group == 0 else (total % group if value == total else 0)
        if count:
            posts.append((value - 1, count))
    return posts


@pytest.mark.parametrize("group", [1, 4, 16])
def test_header_rule_matches_group_posts(group):
    body = _function_body("paella_count")
    assert "value % PAELLA_GROUP == 0u" in body and "value == total" in body and "total % PAELLA_GROUP" in body
    for total in list(range(1, 70)) + [1000, 1024]:
        assert _emulate_header_rule(total, group) == protocol.group_posts(0, total, total, group)


TEST_KERNEL = r"""
extern "C" __global__ void probe(float* out, unsigned char* paella_notifq, unsigned int paella_launch_id) {
  paella_block_start(paella_notifq, paella_launch_id);
  if (threadIdx.x < 7) { out[blockIdx.x * 7 + threadIdx.x] = 1.0f; }
  paella_block_end(paella_notifq, paella_launch_id);
}
"""


@pytest.mark.parametrize("arch", ["sm_75", "sm_80", "sm_90"])
def test_header_compiles_and_ptx_has_the_protocol(tmp_path, arch):
    src = tmp_path / "probe.cu"
    src.write_text(source_prelude(16) + TEST_KERNEL)
    ptx = tmp_path / "probe.ptx"
    subprocess.run([nvcc.find_nvcc(), f"-arch={arch}", "-ptx", str(src), "-o", str(ptx)], check=True,
                   capture_output=True)
    text = ptx.read_text()
    assert "%smid" in text
    assert re.search(r"atom\.global\.add\.u32", text)                 # tail and counters
    assert len(re.findall(r"st\.volatile\.global\.u64", text)) == 2    # one 64-bit store per post site
    assert re.search(r"membar\.sys|fence\.sc\.sys", text)              # __threadfence_system
    # ... BEFORE each entry's store (the block's outputs and counter are visible to the
    # host by the time the entry is), never only after it:
    for store in re.finditer(r"st\.volatile\.global\.u64", text):
        before = text[:store.start()].rsplit("atom.global.add", 1)[-1]
        assert re.search(r"membar\.sys|fence\.sc\.sys", before), text[max(0, store.start() - 600):store.end()]
    assert re.search(r"bar\.sync\s+0|barrier\.sync", text)             # the epilogue barrier


def test_group_out_of_range_is_a_compile_error(tmp_path):
    src = tmp_path / "bad.cu"
    src.write_text(source_prelude(17) + TEST_KERNEL)
    proc = subprocess.run([nvcc.find_nvcc(), "-arch=sm_75", "-ptx", str(src), "-o", str(tmp_path / "x")],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "PAELLA_GROUP must be in 1..PAELLA_MAX_GROUP" in proc.stderr


def test_ptxas_report_parsing():
    report = """ptxas info    : Compiling entry function 'k1' for 'sm_75'
ptxas info    : Function properties for k1
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 72 registers, used 1 barriers, 6912 bytes smem, 396 bytes cmem[0]
ptxas info    : Compiling entry function 'k2' for 'sm_75'
ptxas info    : Used 16 registers, used 1 barriers, 380 bytes cmem[0]
"""
    res = nvcc.parse_ptxas(report)
    assert res == {"k1": nvcc.KernelResources(72, 6912), "k2": nvcc.KernelResources(16, 0)}
