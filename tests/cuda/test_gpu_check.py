"""benchmarks/gpu_check: its check logic, parsing and report without a GPU, and its
device steps on a CudaDevice over the recording stand-in driver."""
from __future__ import annotations

import shutil
from types import SimpleNamespace

import numpy as np
import pytest
from cuda_fake_driver import FakeDriver, fake_cubin, kernel_spec

from paella import protocol
from paella.benchmarks import gpu_check as gc
from paella.dispatcher.devices.base import KernelInfo, ModuleImage
from paella.dispatcher.devices.cuda import CudaDevice


def words_for(lid: int, blocks: int, group: int, sms: int = 40) -> list[int]:
    """The entries the device header should post, from protocol.group_posts."""
    out = []
    for kind in (protocol.PLACEMENT, protocol.COMPLETION):
        for off, count in protocol.group_posts(0, blocks, blocks, group):
            out.append(protocol.encode(kind, off % sms, count, lid))
    return out


@pytest.mark.parametrize("blocks,group", [(1, 16), (15, 16), (16, 16), (17, 16), (1000, 16), (7, 1)])
def test_correct_entries_pass(blocks, group):
    assert gc.check_notifications(words_for(9, blocks, group), 9, blocks, group, 40) == []


def test_a_missing_entry_is_reported_by_kind_and_count():
    w = words_for(9, 40, 16)
    w.pop()                                               # the last COMPLETION (8 blocks)
    problems = gc.check_notifications(w, 9, 40, 16, 40)
    assert "2 COMPLETION entries, expected ceil(40/16) = 3" in problems
    assert "COMPLETION counts sum to 32, expected 40 blocks" in problems


def test_wrong_launch_id_count_and_sm_are_reported():
    w = words_for(9, 17, 16)
    w[0] = protocol.encode(protocol.PLACEMENT, 0, 16, 8)            # another launch's id
    assert any("another launch id ([8]" in p for p in gc.check_notifications(w, 9, 17, 16, 40))
    w = words_for(9, 17, 16)
    w[1] = protocol.encode(protocol.PLACEMENT, 0, 3, 9)              # 3 is neither 16 nor 1
    assert any("counts [3] are neither 16 nor the remainder 1" in p
               for p in gc.check_notifications(w, 9, 17, 16, 40))
    w = words_for(9, 17, 16)
    w[2] = protocol.encode(protocol.COMPLETION, 45, 16, 9)
    assert any("SM ids [45]" in p for p in gc.check_notifications(w, 9, 17, 16, 40))


def test_parse_args_defaults_and_errors(capsys):
    a = gc.parse_args([])
    assert a.grids == list(gc.DEFAULT_GRIDS) and a.device == 0 and a.bundle is None
    assert gc.parse_args(["--grids", "3,5", "--fig15-grids", "2"]).grids == [3, 5]
    for bad in (["--grids", "a"], ["--grids", "0"], ["--iterations", "3"]):
        with pytest.raises(SystemExit):
            gc.parse_args(bad)
    assert "comma-separated integers" in capsys.readouterr().err


def test_report_and_exit_status():
    ok = [gc.CheckResult("a", "PASS"), gc.CheckResult("b", "SKIP", "no bundle")]
    text = gc.format_report("Fake t4", ok)
    assert text.splitlines()[-1] == "PASS: 1 passed, 0 failed, 1 skipped"
    assert "  SKIP  b: no bundle" in text and gc.exit_status(ok) == 0
    bad = ok + [gc.CheckResult("c", "FAIL", "2 entries")]
    assert gc.format_report("x", bad).splitlines()[-1].startswith("FAIL: 1 passed, 1 failed")
    assert gc.exit_status(bad) == 1


def test_overhead_summary_in_microseconds():
    s = gc.overhead_summary([10e-6] * 10, [12e-6] * 9 + [20e-6])
    assert s["overhead_p50_us"] == pytest.approx(2.0)
    assert s["p90_us"] == pytest.approx(12.8) and s["base_p90_us"] == pytest.approx(10.0)


def test_time_launches_uses_the_clock_and_drains_the_ring():
    dev, mods = fake_device(16)
    ticks = iter(range(100))
    lat = gc.time_launches(dev, mods["paella_check_empty"], 20, 10, instrumented=True, group=16,
                           first_id=5, clock=lambda: next(ticks))
    assert lat == [1] * 10 and not dev.notifq.any()
    dev.close()


# --- device steps on the stand-in driver ------------------------------------------------------

KERNELS = [kernel_spec("paella_check_empty", [8, 4]), kernel_spec("paella_check_empty_plain", [], instrumented=False),
           kernel_spec("paella_check_add1", [8, 4, 8, 4], body="add1_f32")]


def fake_device(group: int, device_group: int | None = None):
    drv = FakeDriver(group=device_group or group)
    dev = CudaDevice(driver=drv, n_streams=2, notifq_slots=4096, counter_pairs=64)
    infos = [KernelInfo(k["name"], 32) for k in KERNELS]
    return dev, dev.load_module(ModuleImage("g", infos, cubin=fake_cubin(75, KERNELS)))


@pytest.mark.parametrize("group", [16, 1])
def test_notif_check_passes_on_a_device_that_posts_correctly(group):
    dev, mods = fake_device(group)
    r = gc.notif_check(dev, mods["paella_check_empty"], [1, 15, 16, 17, 40, 1000], 128, group, 100)
    assert r.status == "PASS", r.detail
    dev.close()


def test_notif_check_fails_on_a_device_that_aggregates_differently():
    dev, mods = fake_device(16, device_group=8)
    r = gc.notif_check(dev, mods["paella_check_empty"], [40], 128, 16, 100)
    assert r.status == "FAIL" and "5 PLACEMENT entries, expected ceil(40/16) = 3" in r.detail
    dev.close()


def test_add1_check_round_trips():
    dev, mods = fake_device(16)
    r = gc.add1_check(dev, mods["paella_check_add1"], 1000, 7)
    assert r.status == "PASS"
    dev.close()


def test_run_bundle_walks_the_plan_and_compares_with_the_cpu_build(tmp_path):
    (tmp_path / "k.cubin").write_bytes(fake_cubin(75, KERNELS))
    kern = SimpleNamespace(name="paella_check_add1", registers=32, static_smem=0, flops=0, bytes=0,
                           instrumented=True)
    op = lambda **kw: SimpleNamespace(**{"stream": 0, "buffer_offset": 0, "dyn_smem": 0, **kw})  # noqa: E731
    arg = lambda **kw: SimpleNamespace(**{"buffer": None, "offset": 0, "scalar": None, "dtype": None, **kw})  # noqa: E731
    variant = SimpleNamespace(
        kernels=[kern], buffers=[SimpleNamespace(id=0, nbytes=64)], kernel=lambda n: kern,
        plan=[op(op="h2d", buffer=0, io_offset=0, nbytes=64),
              op(op="launch", kernel=kern.name, grid=[1], block=[32],
                 args=[arg(buffer=0), arg(scalar=16, dtype="int32")]),
              op(op="d2h", buffer=0, io_offset=64, nbytes=64)])

    class Bundle:
        model, variants = "fake", [variant]
        manifest = SimpleNamespace(files={"cubin": "k.cubin"}, group=16)
        inputs = [SimpleNamespace(name="x", shape=[16], dtype="float32")]

        def file(self, key):
            return tmp_path / "k.cubin"

        def param_bytes(self):
            return {}

        def pack_inputs(self, inputs):
            io = np.zeros(128, np.uint8)
            io[:64] = inputs["x"].view(np.uint8)
            return io

        def unpack_outputs(self, io):
            return {"y": io[64:].view(np.float32).copy()}

        def run_cpu(self, inputs):
            return {"y": inputs["x"] + 1}

    dev, _ = fake_device(16)
    assert gc.bundle_check(dev, Bundle()).status == "PASS"
    Bundle.run_cpu = lambda self, inputs: {"y": inputs["x"] + 2}
    r = gc.bundle_check(dev, Bundle())
    assert r.status == "FAIL" and "y: max abs error 1" in r.detail
    dev.close()


def _offset_bundle(tmp_path, body: str, n: int = 40, threads: int = 4):
    """A one-kernel bundle whose kernel takes (x, n, block offset), as `paella compile`
    emits kernels since format 2; ``body`` says whether it honours the offset."""
    kernels = [kernel_spec("k", [8, 4, 4, 8, 4], body=body)]
    (tmp_path / "k.cubin").write_bytes(fake_cubin(75, kernels))
    kern = SimpleNamespace(name="k", registers=32, static_smem=0, flops=0, bytes=0, instrumented=True)
    op = lambda **kw: SimpleNamespace(**{"stream": 0, "buffer_offset": 0, "dyn_smem": 0, **kw})  # noqa: E731
    arg = lambda **kw: SimpleNamespace(**{"buffer": None, "offset": 0, "scalar": None, "dtype": None, **kw})  # noqa: E731
    variant = SimpleNamespace(
        kernels=[kern], buffers=[SimpleNamespace(id=0, nbytes=4 * n)], kernel=lambda name: kern,
        plan=[op(op="h2d", buffer=0, io_offset=0, nbytes=4 * n),
              op(op="launch", kernel="k", grid=[n // threads // 2, 2, 1], block=[threads],
                 args=[arg(buffer=0), arg(scalar=n, dtype="int32"), arg(scalar=0, dtype="uint32")]),
              op(op="d2h", buffer=0, io_offset=4 * n, nbytes=4 * n)])

    class Bundle:
        model, variants = "offsets", [variant]
        manifest = SimpleNamespace(files={"cubin": "k.cubin"}, group=16)
        inputs = [SimpleNamespace(name="x", shape=[n], dtype="float32")]

        def file(self, key):
            return tmp_path / "k.cubin"

        def param_bytes(self):
            return {}

        def pack_inputs(self, inputs):
            io = np.zeros(8 * n, np.uint8)
            io[:4 * n] = inputs["x"].view(np.uint8)
            return io

        def unpack_outputs(self, io):
            return {"y": io[4 * n:].view(np.float32).copy()}
    return Bundle()


def test_the_sliced_check_compares_slices_with_the_whole_grid(tmp_path):
    # Issue 38's check for the day a GPU is there: every kernel launched in 3 slices
    # (1-D launches at offsets 0, 4, 8 of a 5 x 2 grid) must give the whole launch's bytes.
    dev, _ = fake_device(16)
    good = _offset_bundle(tmp_path, "add1_f32_blocks")
    r = gc.sliced_check(dev, good)
    assert r.status == "PASS", r.detail
    launches = [rec for rec in dev.drv.launches if rec.kernel == "k"]
    assert [(rec.grid, rec.args[2]) for rec in launches] == [
        ((5, 2, 1), 0), ((4, 1, 1), 0), ((4, 1, 1), 4), ((2, 1, 1), 8)]
    # a kernel that ignores the offset (every slice redoes the grid's first blocks) fails
    r = gc.sliced_check(dev, _offset_bundle(tmp_path, "add1_f32"))
    assert r.status == "FAIL" and "y: " in r.detail and "elements differ" in r.detail
    dev.close()


# --- the real kernels compile against the compiler pass's header ------------------------------------------------

@pytest.mark.skipif(shutil.which("nvcc") is None and not shutil.os.access("/usr/local/cuda/bin/nvcc", 1),
                    reason="nvcc not installed")
@pytest.mark.parametrize("group", [1, 16])
def test_check_kernels_compile_with_nvcc(tmp_path, group):
    from paella.doctor import find_nvcc
    cubin = gc.compile_kernels(find_nvcc(), 75, group, tmp_path)
    for name in (b"paella_check_empty", b"paella_check_empty_plain", b"paella_check_add1"):
        assert b".text." + name in cubin


def test_main_without_a_driver_says_so(monkeypatch, capsys):
    from paella.dispatcher import devices
    monkeypatch.setattr(devices, "_load_library", lambda n: (_ for _ in ()).throw(OSError(f"{n}: missing")))
    assert (gc.header_dir() / "paella_notif.cuh").is_file()       # shipped with the package
    assert gc.main(["--skip-fig15"]) == 2
    assert "no NVIDIA driver found (libcuda.so.1: missing)" in capsys.readouterr().err
