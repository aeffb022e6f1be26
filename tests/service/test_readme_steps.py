"""The README as a new user reads it: its links resolve, its client snippet runs as
written against a real daemon, and what it promises the command line does exists."""
from __future__ import annotations

import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import paella

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _python_blocks(text: str, section: str) -> list[str]:
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", body, re.S)


def test_every_relative_link_of_the_readme_and_docs_exists():
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" in target:
                continue
            assert (doc.parent / target).exists(), f"{doc.name} links {target}, which is missing"
    assert "ARCHITECTURE.md" not in README


def test_the_client_snippet_runs_as_written(daemon):
    [snippet] = _python_blocks(README, "Using it")
    assert 'ins["x"][:] = x' in snippet              # the zero-copy line, as the README has it
    code = snippet.replace('"/tmp/paella.sock"', repr(daemon.socket))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_readme_tells_of_the_builtin_models_and_the_foreground():
    assert "`echo`" in README and "`noop`" in README
    assert "runs in the foreground" in README


def test_paella_version():
    r = subprocess.run([str(Path(sys.executable).with_name("paella")), "--version"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"paella {version('paella-py')}"
    assert paella.__version__ == version("paella-py")
