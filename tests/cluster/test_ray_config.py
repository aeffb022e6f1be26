"""``paella cluster CONFIG``'s config: checked before anything starts, every mistake a
``paella: error: ...`` with status 2 naming the key, never a traceback. (No Ray cluster
is started here; tests/cluster/test_ray_cluster.py runs one.)

The mistakes run the command in this process (``paella.cli.main``: the same parser,
the same ``paella: error`` and status); one of them, and the good config, also as a
process of its own (``python -m paella.cli``), as a user runs it: a process costs
about a second here."""
from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("ray")

from paella.cluster.ray_config import ConfigError, parse_config  # noqa: E402

GOOD = 'models = ["echo"]\n[gpus]\nbackend = "sim"\ncount = 2\n'


def _paella_here(capsys, *args: str) -> tuple[int, str, str]:
    """``paella ARGS`` in this process: (status, stdout, stderr)."""
    from paella.cli import main
    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def _paella(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "paella.cli", *args], capture_output=True,
                          text=True, timeout=60)


def test_a_good_config_checks(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('router = "p2c-queue"\nplacement = {echo = 1}\n' + GOOD)
    r = _paella("cluster", str(f), "--check")
    assert r.returncode == 0, r.stderr
    assert "1 model(s), 2 sim GPU(s), router p2c-queue" in r.stdout


@pytest.mark.parametrize("text, says", [
    ("models = [", "not valid TOML"),
    ("", "models must be a non-empty list"),
    ('models = ["echo", "echo"]', "named twice"),
    ('models = ["resnet18"]', "not a built-in"),
    ('models = ["echo"]\nmodel_repository = "/nonexistent"', "is not a directory"),
    ('models = ["echo"]\nrouter = "fastest"', "router must be one of"),
    ('models = ["echo"]\nplacment = "all"', "unknown key(s) placment"),
    ('models = ["echo"]\n[gpus]\ncount = 0', "gpus.count must be an integer"),
    ('models = ["echo"]\n[gpus]\nbackend = "tpu"', "gpus.backend must be one of"),
    ('models = ["echo"]\n[gpus]\ncount = 2\nplacement = 3', "unknown key(s) gpus.placement"),
    ('models = ["echo"]\nplacement = {echo = 3}\n[gpus]\ncount = 2', "placement"),
    ('models = ["echo"]\nplacement = {echo = "x"}', "placement.echo"),
    ('models = ["echo"]\n[daemon]\nargs = ["--socket", "/x"]', "may not set --socket"),
    ('models = ["echo"]\n[daemon]\ntimeout_s = -1', "daemon.timeout_s"),
    ('models = ["echo"]\n[http]\nport = 70000', "http.port"),
    ('models = ["echo"]\ngpus = 3', "gpus must be a table"),
    ('models = ["echo"]\n[grpc]\nport = 0', "grpc.port must be an integer from 1"),
    ('models = ["echo"]\n[grpc]\nport = "8001"', "grpc.port must be an integer"),
    ('models = ["echo"]\n[grpc]\nhost = "0.0.0.0"', "[grpc] needs a port"),
    ('models = ["echo"]\n[grpc]\nport = 8000', "grpc.port 8000 is http.port too"),
    ('models = ["echo"]\n[grpc]\nport = 8001\nhost = ""', "grpc.host must be"),
    ('models = ["echo"]\n[grpc]\nport = 8001\nreuseport = true',
     "unknown key(s) grpc.reuseport"),
    ('models = ["echo"]\ngrpc = 8001', "grpc must be a table"),
])
def test_a_bad_config_is_an_error_naming_the_key(tmp_path, capsys, text, says):
    f = tmp_path / "c.toml"
    f.write_text(text)
    code, out, err = _paella_here(capsys, "cluster", str(f), "--check")
    assert code == 2, (out, err)
    assert err.startswith("paella: error: "), err
    assert says in err


def test_a_bad_config_is_an_error_from_the_command_too(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('models = ["echo"]\n[grpc]\nport = 70000')
    r = _paella("cluster", str(f), "--check")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.startswith("paella: error: ") and "grpc.port" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_a_missing_config_is_an_error(tmp_path, capsys):
    code, _, err = _paella_here(capsys, "cluster", str(tmp_path / "none.toml"))
    assert code == 2 and "no such file" in err and "Traceback" not in err


def test_grpc_is_off_without_its_table_and_takes_the_http_host():
    assert parse_config({"models": ["echo"]}).grpc_port is None
    cfg = parse_config({"models": ["echo"], "http": {"host": "0.0.0.0"},
                        "grpc": {"port": 8001}})
    assert (cfg.grpc_host, cfg.grpc_port) == ("0.0.0.0", 8001)
    cfg = parse_config({"models": ["echo"], "grpc": {"port": 9001, "host": "10.0.0.1"}})
    assert (cfg.grpc_host, cfg.grpc_port) == ("10.0.0.1", 9001)


def test_placement_rules_read_as_the_placement_module_reads_them():
    cfg = parse_config({"models": ["echo", "noop"], "placement": {"echo": 1, "*": 2},
                        "gpus": {"count": 2}})
    assert cfg.placed(2) == [frozenset({"echo", "noop"}), frozenset({"noop"})]
    with pytest.raises(ConfigError):
        parse_config({"models": ["echo"], "placement": {"nope": 1}, "gpus": {"count": 2}})
