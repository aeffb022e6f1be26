"""The import structure: no cycle among the project's modules, the dispatcher's layers, and
the forbidden dependencies, as pyproject.toml's import-linter contracts state them.

The repository maps its folders into ``paella.*`` (pyproject's package-dir), which a
static import graph cannot see from the source tree, so the test lays out the installed
package as a tree of symbolic links and runs ``lint-imports`` on it. A second run on the
same tree with one planted upward import shows that a breach fails the check.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")


def installed_layout(dest: Path) -> Path:
    """``dest/paella/...`` as pip installs it: one symbolic link per Python file."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package, folder in mapping.items():
        target = dest.joinpath(*package.split("."))
        for src in (ROOT / folder).rglob("*.py"):
            rel = src.relative_to(ROOT / folder)
            if any(part.startswith((".", "__pycache__")) for part in rel.parts):
                continue
            link = target / rel
            if link.exists():
                continue                     # a mapped sub-folder wins over the walk
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(src)
    return dest


def lint(tree: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(tree))
    return subprocess.run([str(LINT), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
                          cwd=tree, env=env, capture_output=True, text=True, timeout=300)


def test_the_import_contracts_hold(tmp_path):
    r = lint(installed_layout(tmp_path))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout and "Analyzed" in r.stdout


def test_an_upward_import_breaks_them(tmp_path):
    """The waitlist (a bottom layer) importing the dispatcher core: a layer breach and a
    cycle, both reported."""
    tree = installed_layout(tmp_path)
    waitlist = tree / "paella" / "dispatcher" / "waitlist.py"
    text = waitlist.read_text()
    waitlist.unlink()
    waitlist.write_text(text + "\nfrom paella.dispatcher import core  # noqa: planted\n")
    r = lint(tree)
    assert r.returncode != 0
    assert "No import cycle among the project's modules BROKEN" in r.stdout
    assert "The dispatcher's layers, top to bottom BROKEN" in r.stdout


def test_a_scheduler_reaching_past_the_context_breaks_them(tmp_path):
    """A scheduler plug-in (Orca's) importing the dispatcher's core, or the batching stage
    it is served by: the schedulers' contract (only the scheduler context and the job
    API) reports each, and nothing else breaks."""
    for planted in ("from paella.dispatcher import core", "from paella.dispatcher.batchers import stage"):
        tree = installed_layout(tmp_path / planted.split()[-1])
        plugin = tree / "paella" / "stepsched" / "orca_plugin.py"
        text = plugin.read_text()
        plugin.unlink()
        plugin.write_text(text + f"\n{planted}  # noqa: planted\n")
        r = lint(tree)
        assert r.returncode != 0, planted
        assert ("Schedulers reach the dispatcher only through the scheduler context BROKEN"
                in r.stdout), planted
        assert "1 broken" in r.stdout, r.stdout[-2000:]
