"""open_device / pick_backend: auto falls back to the simulator and says why; an explicit
cuda backend without a driver fails fast with a message naming libcuda.so.1."""
from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time

import pytest
from cuda.bindings import driver as real
from cuda_fake_driver import FakeDriver

from paella import doctor
from paella.cli import main
from paella.dispatcher import devices
from paella.dispatcher.devices import NoDriverError, open_device, pick_backend, probe_driver
from paella.dispatcher.devices.cuda import CudaDevice
from paella.dispatcher.devices.sim import SimDevice


@pytest.fixture
def no_driver(monkeypatch):
    def fail(name):
        raise OSError(f"{name}: cannot open shared object file: No such file or directory")
    monkeypatch.setattr(devices, "_load_library", fail)


def test_without_the_driver_library_auto_picks_sim_and_names_libcuda(no_driver):
    backend, reason = pick_backend()
    assert backend == "sim"
    assert reason.startswith("no NVIDIA driver found (libcuda.so.1: cannot open shared object file")


def test_this_machine_has_no_driver_and_cuda_fails_fast():
    if probe_driver().ok:
        pytest.skip("a real NVIDIA driver is present")
    t = time.perf_counter()
    with pytest.raises(NoDriverError, match=r"no NVIDIA driver found \(libcuda\.so\.1.*--backend sim"):
        open_device("cuda")
    assert time.perf_counter() - t < 2.0


def test_auto_opens_the_simulator_with_its_options_and_logs_why(no_driver, caplog):
    caplog.set_level(logging.INFO, "paella.devices")
    dev = open_device("auto", gpu="gtx1660s", n_streams=3, seed=4)
    assert isinstance(dev, SimDevice)
    assert dev.props.name == "gtx1660s" and len(dev.streams) == 3
    assert "using the simulated GPU (gtx1660s): no NVIDIA driver found" in caplog.text


def test_auto_drops_cuda_only_options_with_a_log_line(no_driver, caplog):
    caplog.set_level(logging.INFO, "paella.devices")
    assert isinstance(open_device("auto", counter_pairs=64), SimDevice)
    assert "ignoring option(s) counter_pairs" in caplog.text


def test_explicit_backend_refuses_options_of_the_other_backend():
    with pytest.raises(ValueError, match="counter_pairs do not apply to the sim backend"):
        open_device("sim", counter_pairs=64)
    with pytest.raises(ValueError, match="jitter, realtime do not apply to the cuda backend"):
        open_device("cuda", realtime=True, jitter=0.1, driver=FakeDriver())


def test_unknown_backend_lists_the_choices():
    with pytest.raises(ValueError, match="unknown device backend 'gpu'; choose one of auto, sim, cuda"):
        open_device("gpu")


def test_auto_picks_cuda_when_a_device_is_present(caplog):
    caplog.set_level(logging.INFO, "paella.devices")
    drv = FakeDriver()
    backend, reason = pick_backend(drv)
    assert backend == "cuda" and "NVIDIA driver 13.0" in reason and "0: Fake t4 (sm_75, 40 SMs)" in reason
    dev = open_device("auto", driver=drv, n_streams=2, notifq_slots=64, counter_pairs=8, seed=1)
    assert isinstance(dev, CudaDevice) and len(dev.streams) == 2
    assert "ignoring option(s) seed" in caplog.text
    dev.close()


def test_a_driver_without_devices_means_sim():
    backend, reason = pick_backend(FakeDriver(devices=0))
    assert backend == "sim" and "sees no CUDA device" in reason


def test_a_driver_that_fails_to_initialise_means_sim_and_names_the_result():
    drv = FakeDriver()
    drv.fail("cuInit", real.CUresult.CUDA_ERROR_NO_DEVICE)
    backend, reason = pick_backend(drv)
    assert backend == "sim"
    assert "does not initialise: cuInit failed: CUDA_ERROR_NO_DEVICE" in reason
    drv.fail("cuInit", real.CUresult.CUDA_ERROR_NO_DEVICE)
    with pytest.raises(NoDriverError, match="CUDA_ERROR_NO_DEVICE.*--backend sim"):
        open_device("cuda", driver=drv)


def test_explicit_cuda_with_a_device_opens_the_requested_ordinal():
    drv = FakeDriver(devices=2)
    dev = open_device("cuda", device=1, driver=drv, n_streams=1, notifq_slots=64, counter_pairs=8)
    assert dev.ordinal == 1 and ("cuDeviceGet", (1,)) in drv.calls
    dev.close()


# --- paella doctor ---------------------------------------------------------------------------

def test_doctor_report_without_a_driver(no_driver):
    info = doctor.collect()
    assert info["auto_backend"] == "sim" and info["gpus"] == [] and not info["driver"]["ok"]
    text = doctor.format_report(info)
    assert "NVIDIA driver : not usable (no NVIDIA driver found (libcuda.so.1" in text
    assert "backend auto  : sim (" in text
    assert "cuda-python   : 13." in text
    assert ("compiled      : _tracker, _pqueue, _replay, _kcore, devices.sim._engine, devices.sim._offload "
            "loaded") in text


def test_doctor_names_a_compiled_module_that_does_not_load(no_driver, monkeypatch):
    from paella.dispatcher import native
    monkeypatch.setattr(native, "MODULES", ("_tracker", "_missing"))
    text = doctor.format_report(doctor.collect())
    assert "compiled      : the dispatcher's compiled module paella.dispatcher._missing" in text
    assert "make install" in text


def test_doctor_blames_a_missing_dependency_not_the_build():
    """A client-only install lacks the daemon's packages: the report names the package
    and the extra, not a C build that is fine."""
    code = ("import sys; sys.modules['posix_ipc'] = None\n"
            "from paella.dispatcher import native\n"
            "print(native.status()['devices.sim._engine'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "needs the Python package 'posix_ipc'" in out.stdout
    assert "paella-py[serve]" in out.stdout and "dispatcher/" not in out.stdout


def test_doctor_report_with_a_gpu():
    info = doctor.collect(FakeDriver())
    text = doctor.format_report(info)
    assert "NVIDIA driver : CUDA 13.0" in text
    assert "GPU 0         : Fake t4 (sm_75, 40 SMs)" in text
    assert "backend auto  : cuda (NVIDIA driver 13.0" in text


def test_doctor_finds_nvcc_and_parses_its_version(tmp_path, monkeypatch):
    fake = tmp_path / "bin" / "nvcc"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.4, V12.4.131'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(fake.parent))
    assert doctor.find_nvcc() == str(fake)
    assert doctor.nvcc_version(str(fake)) == "12.4 (V12.4.131)"
    assert doctor.nvcc_version(None) is None
    monkeypatch.setenv("PATH", "")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    assert doctor.find_nvcc() == str(fake)


def test_paella_doctor_command(no_driver, capsys):
    assert main(["doctor", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["auto_backend"] == "sim" and "libcuda.so.1" in info["auto_reason"]
    assert main(["doctor"]) == 0
    assert "backend auto  : sim" in capsys.readouterr().out


def test_doctor_registers_its_subcommand():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    doctor.register(sub)
    assert parser.parse_args(["doctor", "--json"]).func is doctor._doctor
