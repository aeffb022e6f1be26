"""The shipped files: the systemd unit verifies, the example config loads."""
from __future__ import annotations

import configparser
import os
import tomllib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from paella.client import DEFAULT_SOCKET
from paella.dispatcher.daemon import DaemonConfig, ConfigError, load_config

DIST = Path(__file__).resolve().parents[2] / "dist"


def test_unit_is_type_notify_with_a_sandbox():
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str
    unit.read(DIST / "paella.service")
    svc = unit["Service"]
    assert svc["Type"] == "notify"
    assert svc["User"] == "paella" and svc["RuntimeDirectory"] == "paella"
    assert "--config /etc/paella/paella.toml" in svc["ExecStart"]
    assert svc["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert svc["ProtectSystem"] == "strict" and svc["NoNewPrivileges"] == "yes"


def test_shipped_unit_is_the_generated_one_for_usr_local_bin():
    from paella.dispatcher.daemon.unit import render
    assert (DIST / "paella.service").read_text() == render("/usr/local/bin/paella")


def test_paella_unit_names_this_installations_command():
    r = subprocess.run([str(Path(sys.executable).with_name("paella")), "unit"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    exec_start = next(ln for ln in r.stdout.splitlines() if ln.startswith("ExecStart="))
    path = exec_start.split("=", 1)[1].split()[0]
    assert os.path.isabs(path) and os.access(path, os.X_OK), path
    r = subprocess.run([str(Path(sys.executable).with_name("paella")), "unit", "--exec", "paella"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "absolute path" in r.stderr


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed (apt-get install systemd)")
def test_generated_unit_passes_systemd_analyze_verify_unchanged(tmp_path):
    # verify checks that ExecStart exists: `paella unit` names this installation's
    # command, so its output verifies as it is (the README's operator steps use it).
    r = subprocess.run([str(Path(sys.executable).with_name("paella")), "unit"],
                       capture_output=True, text=True, timeout=60)
    unit = tmp_path / "paella.service"
    unit.write_text(r.stdout)
    r = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True,
                       cwd=tmp_path, env=dict(os.environ, SYSTEMD_LOG_LEVEL="warning"))
    assert r.returncode == 0, r.stderr
    assert "paella.service" not in r.stderr, r.stderr     # no warning about our unit


def test_example_config_loads_and_agrees_with_the_client():
    cfg = load_config(str(DIST / "paella.toml"))
    cfg.check()
    assert cfg.socket == DEFAULT_SOCKET
    assert cfg.allowed_groups == ["paella"] and cfg.socket_mode == 0o666
    assert cfg.policy == "paella" and cfg.idle == "adaptive"
    default = DaemonConfig()
    for name in ("backend", "idle_spin_us", "max_clients", "arena_bytes", "ring_slots"):
        assert getattr(cfg, name) == getattr(default, name), name


def test_example_config_lists_every_key_and_option():
    """docs/service.md says dist/paella.toml lists every key: each section's keys are
    set in it, and its header names each one's command-line option."""
    import re
    from paella.dispatcher.daemon.config import SECTIONS
    text = (DIST / "paella.toml").read_text()
    data = tomllib.loads(text)
    header = text.split("[daemon]")[0]
    for section, keys in SECTIONS.items():
        assert set(data[section]) == set(keys), section
    import argparse
    from paella.dispatcher.daemon import register
    sub = argparse.ArgumentParser().add_subparsers()
    register(sub)
    serve = sub.choices["serve"]
    parser_options = {o[2:] for a in serve._actions for o in a.option_strings
                      if o.startswith("--") and not o.startswith("--no-")} - {"help", "config"}
    assert parser_options == set(re.findall(r"--(?:\[no-\])?([a-z-]+)", header)) - {"config"}


@pytest.mark.parametrize("text, msg", [
    ("[daemon]\nsocket = 3\n", "socket must be str"),
    ("[daemon]\nbogus = 1\n", "unknown setting 'bogus'"),
    ("[nope]\nx = 1\n", "unknown section"),
    ("[daemon\n", "not valid TOML"),
])
def test_bad_config_is_named(tmp_path, text, msg):
    p = tmp_path / "bad.toml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=msg):
        load_config(str(p))


def test_command_line_overrides_the_file(tmp_path):
    import argparse
    from paella.dispatcher.daemon import config_from_args, register
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["serve", "--config", str(DIST / "paella.toml"), "--idle", "spin",
                              "--policy-param", "extra_blocks=8", "--ring-slots", "256",
                              "--no-echo", "--cpu", "0"])
    cfg = config_from_args(args)
    assert (cfg.idle, cfg.ring_slots, cfg.echo, cfg.cpu) == ("spin", 256, False, "0")
    assert cfg.policy_params == {"extra_blocks": 8}
    assert cfg.socket == DEFAULT_SOCKET                       # untouched: from the file
