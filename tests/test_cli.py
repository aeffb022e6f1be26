"""The ``paella`` command line: a command imports its own module, not every command's."""
from __future__ import annotations

import subprocess
import sys

PROG = """
import sys
from paella.cli import main
code = main(sys.argv[1:])
heavy = sorted(m for m in ("paella.experiments.cli", "paella.compiler_pass.cli",
                           "paella.kserve.command", "paella.dispatcher.daemon.command",
                           "networkx", "tvm") if m in sys.modules)
print("exit", code, "imported", heavy)
"""


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROG, *argv], capture_output=True,
                          text=True, timeout=120)


def test_a_command_imports_only_its_own_module(tmp_path):
    r = _run("status", "--socket", str(tmp_path / "none.sock"))
    assert "exit 2 imported []" in r.stdout, (r.stdout, r.stderr)
    assert "paella: error:" in r.stderr and "Traceback" not in r.stderr


def test_a_misspelt_command_still_lists_every_command():
    r = _run("servve")
    assert r.returncode == 2
    for name in ("serve", "status", "compile", "experiment", "kserve", "cluster"):
        assert f"'{name}'" in r.stderr, r.stderr
