"""``paella compile``'s size options: a hostile or mistyped value is a one-line usage
error naming the option (exit 2), never a traceback from deep in the compiler."""
from __future__ import annotations

import subprocess
import sys

import pytest

from paella.compiler_pass.cli import MAX_SIZE

PAELLA = (sys.executable, "-c", "import sys; from paella.cli import main; sys.exit(main())")


@pytest.mark.parametrize("option, value, says", [
    ("--batch-sizes", "99999999999999", f"99999999999999 is too large: each size must be at most {MAX_SIZE}"),
    ("--seq-lens", "99999999999", f"99999999999 is too large: each size must be at most {MAX_SIZE}"),
    ("--batch-sizes", "0,1", "expected positive integers separated by commas"),
    ("--seq-lens", "a,b", "expected positive integers separated by commas"),
])
def test_a_bad_size_is_a_usage_error_naming_the_option(tmp_path, option, value, says):
    r = subprocess.run([*PAELLA, "compile", "tiny_mlp", option, value, "-o", str(tmp_path / "b")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert f"argument {option}: {says}" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "b").exists()
