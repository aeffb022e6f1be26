"""The native build: the device header's test kernels compile for sm_75, sm_80 and sm_90
through CMake and nvcc (the project's CMakeLists.txt), with register counts from ptxas."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NVCC = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"


def _cmake() -> str | None:
    local = Path(sys.executable).parent / "cmake"       # the dev extra installs it in the venv
    return str(local) if local.exists() else shutil.which("cmake")


@pytest.mark.skipif(not Path(NVCC).exists(), reason="nvcc (the CUDA toolkit) is not installed")
def test_header_test_kernels_build_for_every_architecture(tmp_path):
    cmake = _cmake()
    assert cmake, "cmake not found: `pip install cmake` (the dev extra does) or install it"
    env = dict(os.environ, CUDACXX=NVCC)
    cfg = subprocess.run([cmake, "-S", str(ROOT), "-B", str(tmp_path)], env=env,
                         capture_output=True, text=True)
    assert cfg.returncode == 0, cfg.stdout + cfg.stderr
    build = subprocess.run([cmake, "--build", str(tmp_path), "--verbose"], env=env,
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    log = build.stdout + build.stderr
    for arch in ("sm_75", "sm_80", "sm_90"):
        assert re.search(rf"Compiling entry function 'paella_probe_two_exits' for '{arch}'", log), arch
        assert re.search(rf"Compiling entry function 'paella_probe_figure2' for '{arch}'", log), arch
    objects = list(tmp_path.rglob("*.o"))
    assert len(objects) >= 4, objects
