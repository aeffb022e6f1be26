"""The experiments' numeric options are checked before anything runs: finite, not
negative, positive where the default is, and 0 accepted where it means something."""
import argparse

import pytest

from paella.cli import CLIError
from paella.experiments.cli import _checked


def parser_with(**defaults) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    for name, d in defaults.items():
        p.add_argument("--" + name.replace("_", "-"), type=type(d), default=d)
    return p


def test_cpu_scale_0_is_a_free_dispatcher_whatever_the_default():
    p = parser_with(cpu_scale=1.0, rate=5.0)        # (cellular's default is 1)
    run = _checked(p, lambda args: args.cpu_scale)
    assert run(p.parse_args(["--cpu-scale", "0"])) == 0.0
    with pytest.raises(CLIError, match="--cpu-scale must be a finite number >= 0, got -1.0"):
        run(p.parse_args(["--cpu-scale", "-1"]))
    with pytest.raises(CLIError, match="--rate must be a finite number > 0, got 0.0"):
        run(p.parse_args(["--rate", "0"]))
    with pytest.raises(CLIError, match="--rate must be a finite number > 0, got nan"):
        run(p.parse_args(["--rate", "nan"]))


def _paella(*args: str):
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-c", "import sys; from paella.cli import main; "
                           "sys.exit(main())", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args, expected", [
    (["experiment", "hol", "--quick", "--json", "/nonexistent/x.json"],
     "--json /nonexistent/x.json: cannot write into /nonexistent"),
    (["experiment", "hol", "--quick", "--json", "/dev/full"],        # (after the run, before)
     "--json /dev/full: not a regular file"),
    (["experiment", "hol", "--quick", "--plot", "/tmp"], "--plot /tmp: not a regular file"),
    (["demo", "--models", "nosuch"], "--models: unknown zoo model(s) nosuch; zoo models: "),
    (["demo", "--clients", "-1"], "--clients must be at least 1, got -1"),
    (["demo", "--rate", "0"], "--rate must be a finite number > 0"),
    (["demo", "--sigma", "-1"], "--sigma must be a finite number >= 0"),
    (["demo", "--seconds", "nan"], "--seconds must be a finite number > 0"),
    (["demo", "--daemon-args", "--socket /tmp/x.sock"], "--daemon-args may not set --socket"),
    (["demo", "--daemon-args", "'x"], "--daemon-args: No closing quotation"),
])
def test_bad_paths_and_names_are_refused_before_anything_runs(args, expected):
    r = _paella(*args)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(f"paella: error: {expected}")


def test_a_report_over_a_corrupt_figure_or_into_an_unwritable_file_is_a_clean_error(tmp_path):
    (tmp_path / "hol.json").write_text("{not json")
    r = _paella("experiment", "report", "--figures", str(tmp_path), "-o", str(tmp_path / "r.md"))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"{tmp_path}/hol.json is not an experiment's JSON" in r.stderr
    (tmp_path / "hol.json").unlink()
    r = _paella("experiment", "report", "--figures", str(tmp_path), "-o", "/proc/nope/r.md")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("paella: error: ")


def test_a_demo_whose_daemon_cannot_start_says_so_at_once():
    """It waited 5 minutes for a READY that would never come."""
    import time
    t0 = time.monotonic()
    r = _paella("demo", "--models", "squeezenet1_1", "--seconds", "1", "--policy", "nosuch")
    assert time.monotonic() - t0 < 100
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "unknown scheduling policy 'nosuch'" in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(
        "paella: error: the daemon exited with status 2 before it was ready")
