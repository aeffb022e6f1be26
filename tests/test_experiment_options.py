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
