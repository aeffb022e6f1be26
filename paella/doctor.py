"""``paella doctor``: what this machine offers the system, and which backend ``auto`` picks.

It reports the NVIDIA driver and GPUs (through the same probe ``open_device`` uses), nvcc,
TVM and cuda-python versions, without importing TVM (package metadata only), so it runs
in well under a second on a machine with no GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
from importlib import metadata
from typing import Any

NVCC_CANDIDATES = ("/usr/local/cuda/bin/nvcc",)


def find_nvcc() -> str | None:
    """nvcc on PATH, else under $CUDA_HOME / $CUDA_PATH, else /usr/local/cuda."""
    found = shutil.which("nvcc")
    if found:
        return found
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(var)
        if root and os.access(os.path.join(root, "bin", "nvcc"), os.X_OK):
            return os.path.join(root, "bin", "nvcc")
    for cand in NVCC_CANDIDATES:
        if os.access(cand, os.X_OK):
            return cand
    return None


def nvcc_version(nvcc: str | None) -> str | None:
    """``"13.0 (V13.0.88)"`` from ``nvcc --version``; None if nvcc is missing or fails."""
    if nvcc is None:
        return None
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"release (\d+\.\d+), (V[\d.]+)", out)
    return f"{m.group(1)} ({m.group(2)})" if m else None


def package_version(*names: str) -> str | None:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def collect(driver: Any = None) -> dict:
    """Everything the report shows, as plain data (``driver``: a stand-in driver module)."""
    from paella.dispatcher import native
    from paella.dispatcher.devices import probe_driver
    probe = probe_driver(driver)
    nvcc = find_nvcc()
    return {
        "driver": {"ok": probe.ok, "version": probe.driver_version_str if probe.driver_version else None,
                   "detail": probe.reason},
        "gpus": [{"ordinal": g.ordinal, "name": g.name, "arch": f"sm_{g.arch}", "sms": g.sm_count}
                 for g in probe.gpus],
        "nvcc": {"path": nvcc, "version": nvcc_version(nvcc)},
        "tvm": package_version("apache-tvm", "tvm"),
        "cuda_python": package_version("cuda-bindings", "cuda-python"),
        "compiled": native.status(),
        "auto_backend": "cuda" if probe.ok else "sim",
        "auto_reason": (f"NVIDIA driver {probe.driver_version_str}, {probe.reason}" if probe.ok
                        else probe.reason),
    }


def format_report(info: dict) -> str:
    d = info["driver"]
    lines = [f"NVIDIA driver : {'CUDA ' + d['version'] if d['ok'] else 'not usable'}"
             + ("" if d["ok"] else f" ({d['detail']})")]
    if info["gpus"]:
        for g in info["gpus"]:
            lines.append(f"GPU {g['ordinal']:<9} : {g['name']} ({g['arch']}, {g['sms']} SMs)")
    else:
        lines.append("GPUs          : none")
    nv = info["nvcc"]
    lines.append("nvcc          : " + (f"{nv['version']} at {nv['path']}" if nv["version"]
                                       else f"found at {nv['path']} but --version failed" if nv["path"]
                                       else "not found (set CUDA_HOME or put nvcc on PATH)"))
    lines.append(f"TVM           : {info['tvm'] or 'not installed (pip install apache-tvm)'}")
    lines.append(f"cuda-python   : {info['cuda_python'] or 'not installed (pip install cuda-python)'}")
    broken = {k: v for k, v in info["compiled"].items() if v is not None}
    lines.append("compiled      : " + (", ".join(info["compiled"]) + " loaded" if not broken
                                       else "; ".join(broken.values())))
    lines.append(f"backend auto  : {info['auto_backend']} ({info['auto_reason']})")
    if info["auto_backend"] == "sim":
        lines.append("                the cuda backend is unavailable here; `paella serve` runs on the "
                     "simulated GPU")
    return "\n".join(lines)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="report the driver, GPUs, nvcc, TVM and the backend auto picks",
                       description="Report what this machine offers: NVIDIA driver and GPUs, nvcc, "
                                   "TVM, cuda-python, and which device backend `auto` selects and why.")
    p.add_argument("--json", action="store_true", help="print a JSON object")
    p.set_defaults(func=_doctor)


def _doctor(args: argparse.Namespace) -> int:
    info = collect()
    print(json.dumps(info, indent=2) if args.json else format_report(info))
    return 0
