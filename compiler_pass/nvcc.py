"""nvcc driver: build PTX and cubin from the generated source; read ptxas's resource report.

``ptxas -v`` prints, per entry function, the registers per thread and the static
shared memory; those are the figures the occupancy tracker needs, so they come from
the real assembler, not from an estimate.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_ARCHS = ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90")

_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\d+a?)'")
_USED = re.compile(r"Used (\d+) registers(?:.*?, (\d+) bytes smem)?")


class NvccError(Exception):
    """nvcc is missing or rejected the source."""


@dataclass(frozen=True)
class KernelResources:
    registers: int
    static_smem: int


def find_nvcc() -> str:
    """Path of nvcc: $PAELLA_NVCC, then PATH, then /usr/local/cuda/bin."""
    for cand in (os.environ.get("PAELLA_NVCC"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and Path(cand).is_file():
            return cand
    raise NvccError("nvcc not found: install the CUDA toolkit or set PAELLA_NVCC=/path/to/nvcc")


def check_arch(arch: str) -> str:
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unsupported arch {arch!r}; use one of {', '.join(SUPPORTED_ARCHS)}")
    return arch


def _run(cmd: list[str], what: str) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise NvccError(f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}\n"
                        + diagnostics(proc.stderr or proc.stdout))
    return proc.stderr + proc.stdout


def diagnostics(output: str, tail: int = 25) -> str:
    """The lines a reader needs from a failed nvcc/ptxas run: every error line (ptxas
    reports e.g. "Entry function ... uses too much shared data" before pages of info
    lines, which a plain tail would hide), then the last ``tail`` lines."""
    lines = output.strip().splitlines()
    errors = [ln for ln in lines[:-tail] if "error" in ln.lower()]
    shown = errors + (["..."] if errors else []) + lines[-tail:]
    return "\n".join(shown)


def parse_ptxas(report: str) -> dict[str, KernelResources]:
    """Per-kernel resources from ``ptxas -v`` output."""
    out: dict[str, KernelResources] = {}
    current = None
    for line in report.splitlines():
        m = _ENTRY.search(line)
        if m:
            current = m.group(1)
            continue
        m = _USED.search(line)
        if m and current is not None:
            out[current] = KernelResources(int(m.group(1)), int(m.group(2) or 0))
            current = None
    return out


def build(source: Path, arch: str, out_dir: Path) -> tuple[Path, Path, dict[str, KernelResources]]:
    """Compile ``source`` to ``kernels.ptx`` and ``kernels.cubin``; return their resources."""
    nvcc = find_nvcc()
    check_arch(arch)
    ptx, cubin = out_dir / "kernels.ptx", out_dir / "kernels.cubin"
    common = [nvcc, f"-arch={arch}", "-O3", "-diag-suppress=177,550"]
    _run(common + ["-ptx", str(source), "-o", str(ptx)], "nvcc -ptx")
    ptxas = str(Path(nvcc).with_name("ptxas"))
    if not Path(ptxas).is_file():
        ptxas = shutil.which("ptxas") or ptxas
    report = _run([ptxas, "-v", f"-arch={arch}", str(ptx), "-o", str(cubin)], "ptxas")
    return ptx, cubin, parse_ptxas(report)
