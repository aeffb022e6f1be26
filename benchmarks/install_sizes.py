"""Benchmark (not a test): what each install extra costs on disk.

    python -m paella.benchmarks.install_sizes [--extras serve,compile,...] [--json F]

Builds the project's wheel once, then for the base install and each extra makes a fresh
virtual environment, ``pip install``s the wheel with that extra, and reports the size of
what was added to the environment's site-packages (MB, 1e6 bytes), the empty
environment's pip and setuptools not counted. Needs the package index the machine's
pip is configured for.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

EXTRAS = ["", "serve", "kserve", "plots", "compile", "cuda", "all"]
ROOT = Path(__file__).resolve().parents[1]


def tree_bytes(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            p = os.path.join(dirpath, f)
            if not os.path.islink(p):
                total += os.path.getsize(p)
    return total


def site_packages(venv: Path) -> Path:
    return next((venv / "lib").glob("python3*/site-packages"))


def measure(wheel: Path, extra: str, work: Path) -> dict:
    venv = work / (extra or "base")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    empty = tree_bytes(site_packages(venv))
    spec = f"{wheel}[{extra}]" if extra else str(wheel)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", spec], check=True,
                   stderr=subprocess.DEVNULL)
    sp = site_packages(venv)
    pkgs = subprocess.run([str(venv / "bin" / "pip"), "list", "--format=freeze"],
                          capture_output=True, text=True).stdout.split()
    return {"extra": extra or "(base)", "mb": round((tree_bytes(sp) - empty) / 1e6, 1),
            "packages": len(pkgs) - 2}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--extras", default=",".join(EXTRAS), help="comma-separated ('' = base)")
    p.add_argument("--json", help="write the table here")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="paella-sizes.") as tmp:
        work = Path(tmp)
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w",
                        str(work / "wheel"), str(ROOT)], check=True, stderr=subprocess.DEVNULL)
        wheel = next((work / "wheel").glob("*.whl"))
        rows = [measure(wheel, e, work) for e in a.extras.split(",")]
    print("| install | added to site-packages | packages |\n|---|---:|---:|")
    for r in rows:
        name = "pip install paella-py" + (f"[{r['extra']}]" if r["extra"] != "(base)" else "")
        print(f"| `{name}` | {r['mb']:.0f} MB | {r['packages']} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
