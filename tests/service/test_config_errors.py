"""Bad configurations through the real ``paella serve`` command line: each one is a
``paella: error: ...`` line naming the setting and what it accepts, exit status 2, no
traceback, and nothing left behind (no socket, no lock file)."""
from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from bundles_for_tests import set_dtype, tiny_mlp

#: The real entry point of the ``paella`` command (what the console script runs).
PAELLA_CLI = (sys.executable, "-c", "import sys; from paella.cli import main; sys.exit(main())")

CASES = [
    # (id, command-line arguments, config file text or None, expected text)
    ("unknown-policy", ["--policy", "nope"], None,
     "unknown scheduling policy 'nope'; known policies: fifo, ms-jbj, ms-kbk, paella, priority, "
     "rr, sjf"),
    ("unknown-policy-parameter", ["--policy-param", "bogus=1"], None,
     "policy 'paella' has no parameter 'bogus'; valid parameters: extra_blocks, "
     "fairness_threshold, fairness_unit, hold_factor, saturation_backlog"),
    ("parameter-of-another-policy", ["--policy", "fifo", "--policy-param", "hold_factor=1"], None,
     "policy 'fifo' has no parameter 'hold_factor'; valid parameters: extra_blocks, "
     "saturation_backlog"),
    ("parameter-type", [], '[policy]\nfairness_threshold = "abc"\n',
     "policy parameter fairness_threshold must be a number, got 'abc'"),
    ("parameter-value", ["--policy-param", "fairness_threshold=-1"], None,
     "fairness_threshold must be >= 0, got -1"),
    ("extra-blocks", ["--policy-param", "extra_blocks=-3"], None,
     "policy parameter extra_blocks must be >= 0 (and below 2**31), got -3"),
    ("extra-blocks-huge", ["--policy-param", "extra_blocks=100000000000000000000"], None,
     "policy parameter extra_blocks must be >= 0 (and below 2**31), got 100000000000000000000"),
    ("lookahead-huge", ["--lookahead", "99999999999999999999"], None,
     "lookahead must be an int 1..65536"),
    ("saturation-backlog", ["--policy-param", "saturation_backlog=-1"], None,
     "policy parameter saturation_backlog must be >= 0 (and below 2**31), got -1"),
    ("saturation-backlog-type", [], '[policy]\nsaturation_backlog = "many"\n',
     "policy parameter saturation_backlog must be an int, got 'many'"),
    ("socket-mode-file", [], '[access]\nsocket_mode = "999"\n',
     'socket_mode must be an octal file mode such as "0660", got \'999\''),
    ("socket-mode-flag", ["--socket-mode", "999"], None,
     'socket_mode must be an octal file mode such as "0660", got \'999\''),
    ("effect-workers-flag", ["--effect-workers", "-1"], None,
     "effect_workers must be an int 0..256 (processes computing the simulated GPU's answers"),
    ("effect-queue-flag", ["--effect-queue", "0"], None,
     "effect_queue must be an int 1..1048576 (answers waiting for a worker"),
    ("effect-deadline-flag", ["--effect-deadline-seconds", "0.5"], None,
     "effect_deadline_seconds must be in [1, 86400.0]"),
    ("effect-queue-file", [], "[daemon]\neffect_queue = 0\n",
     "effect_queue must be an int 1..1048576 (answers waiting for a worker"),
    ("buffer-sets-ahead-file", [], "[daemon]\nbuffer_sets_ahead = -1\n",
     "buffer_sets_ahead must be an int 0..65536 (per-request buffer sets each model makes"),
    ("buffer-sets-ahead-flag", ["--buffer-sets-ahead", "70000"], None,
     "buffer_sets_ahead must be an int 0..65536"),
    ("buffer-sets-ahead-type", [], '[daemon]\nbuffer_sets_ahead = "many"\n',
     "setting buffer_sets_ahead must be int, got 'many'"),
    ("effect-deadline-file", [], "[daemon]\neffect_deadline_seconds = 0.5\n",
     "effect_deadline_seconds must be in [1, 86400.0]"),
    ("drain-seconds-file", [], "[daemon]\ndrain_seconds = -1.0\n",
     "drain_seconds must be 0..86400.0"),
    ("drain-seconds-flag", ["--drain-seconds", "-0.5"], None, "drain_seconds must be 0..86400.0"),
    ("drain-seconds-inf", ["--drain-seconds", "inf"], None, "drain_seconds must be 0..86400.0"),
    # Past epoll's millisecond range these used to crash the daemon at the first
    # connection that sent no HELLO.
    ("handshake-nan", [], "[limits]\nhandshake_seconds = nan\n",
     "handshake_seconds must be in [0.1, 86400.0]"),
    ("gpu-unknown", ["--gpu", "nosuch", "--no-noop"], None,
     "gpu: unknown GPU preset 'nosuch'; known presets: "),
    ("ring-slots", ["--ring-slots", "3"], None,
     "ring_slots (each client's request and completion rings): req_slots must be a power of "
     "two"),
    ("float-given-true", [], "[daemon]\ndrain_seconds = true\n",
     "setting drain_seconds must be float, got True"),
    ("config-not-a-file", ["--config", "/dev/zero"], None,
     "config /dev/zero is not a regular file"),
    ("handshake-tiny", [], "[limits]\nhandshake_seconds = 1e-300\n",
     "handshake_seconds must be in [0.1, 86400.0]"),
    ("arena-tiny", ["--arena-bytes", "1"], None,
     "arena_bytes must be at least 4096 (one page; a client's tensors live in its arena), got 1"),
    ("plugin-timeout-nan", [], "[daemon]\nplugin_timeout_seconds = nan\n",
     "plugin_timeout_seconds must be 0 (never interrupt) or in [0.1, 86400.0]"),
    ("plugin-timeout-tiny", ["--plugin-timeout-seconds", "0.001"], None,
     "plugin_timeout_seconds must be 0 (never interrupt) or in [0.1, 86400.0]"),
    ("handshake-huge", ["--handshake-seconds", "3000000"], None,
     "handshake_seconds must be in [0.1, 86400.0]"),
    ("max-arena", ["--max-arena-bytes", str(2 ** 41)], None,
     "max_arena_bytes must be at most 2**40"),
    ("idle-spin", ["--idle-spin-us", "-5"], None, "idle_spin_us must be >= 0 (microseconds), got -5"),
    ("wake-lead-flag", ["--wake-lead-us", "-1"], None,
     "wake_lead_us must be an int 0..1000000 (microseconds"),
    ("wake-lead-file", [], "[daemon]\nwake_lead_us = 0.5\n",
     "setting wake_lead_us must be int, got 0.5"),
    ("wake-lead-huge", [], "[daemon]\nwake_lead_us = 2000000\n",
     "wake_lead_us must be an int 0..1000000 (microseconds"),
    ("slice-flag", ["--slice-us", "-1"], None,
     "slice_us must be an int 0..1000000 (microseconds: the longest a kernel slice"),
    ("slice-file", [], "[daemon]\nslice_us = 2.5\n", "setting slice_us must be int, got 2.5"),
    ("device-memory-negative", ["--device-memory", "-1"], None,
     "device_memory must be a number of bytes >= 0"),
    ("device-memory-text", [], "[limits]\ndevice_memory = \"2GiB\"\n",
     "setting device_memory must be int"),
    ("policy-name-type", [], "[policy]\nname = 3\n", "[policy] name must be a string, got 3"),
    ("metrics-port", ["--metrics-port", "70000"], None,
     "metrics_port must be a TCP port 1..65535 (0: no metrics), got 70000"),
    # str.isdigit() takes these; int() did not (a traceback at pinning)
    ("cpu-superscript", ["--cpu", "\u00b2"], None, "cpu must be auto, none or a core number"),
    ("allowed-groups-nested", [], "[access]\nallowed_groups = [[]]\n",
     "allowed_groups must list user or group names or numeric ids, got []"),
    ("allowed-users-nul", [], '[access]\nallowed_users = ["a\\u0000b"]\n',
     "allowed_users must list user or group names or numeric ids"),
    ("allow-user-unknown", ["--allow-user", "\u00b2"], None, "allowed user '\u00b2' does not exist"),
    ("control-users-empty-group", [], '[access]\ncontrol_users = ["@"]\n',
     'control_users must list user names, uids or "@group" names (who may load and unload '
     'models besides the daemon\'s owner and root), got \'@\''),
    ("control-users-bool", [], "[access]\ncontrol_users = [true]\n",
     'control_users must list user names, uids or "@group" names'),
    ("control-users-not-a-list", [], '[access]\ncontrol_users = "ops"\n',
     "setting control_users must be list, got 'ops'"),
    ("control-user-unknown", ["--control-user", "no_such_user_x"], None,
     "[access] control_users: there is no user 'no_such_user_x' on this system; correct the "
     "name or remove it"),
    ("allow-user-huge", ["--allow-user", "99999999999"], None,
     "allowed user: 99999999999 is not a user id (0..4294967294)"),
    ("allowed-users-huge", [], "[access]\nallowed_users = [99999999999]\n",
     "allowed_users must list user or group names or numeric ids, got 99999999999"),
    ("max-clients-huge", ["--max-clients", "99999999999999999999"], None,
     "max_clients must be 1..1048576, got 99999999999999999999"),
    ("trace-user-unknown", ["--trace-user", "no_such_user_x"], None,
     "[access] trace_users: there is no user 'no_such_user_x' on this system"),
    ("class-default-unknown", ["--class-default", "no_such_user_x=2"], None,
     "[access] class_default: there is no user 'no_such_user_x' on this system"),
    ("control-group-unknown", ["--control-user", "@no_such_group_x"], None,
     "[access] control_users: there is no group 'no_such_group_x' on this system"),
    # TOML reads 440 and 0o670 alike: an integer mode was taken as 0o670 (rw-rwx---).
    ("socket-mode-int", [], "[access]\nsocket_mode = 440\n",
     'socket_mode must be a string holding an octal file mode, such as "0660", got 440'),
    # A huge value is not echoed whole (the check on every case: the line stays short).
    ("log-level-huge", [], '[daemon]\nlog_level = "' + "x" * 200_000 + '"\n',
     "log_level must be one of ('debug', 'info', 'warning', 'error'), got 'xxxx"),
    ("metrics-addr", ["--metrics-port", "59999", "--metrics-addr", "not an addr"], None,
     "cannot serve metrics on 'not an addr': Name or service not known; --metrics-addr must "
     "be an address of this machine"),
]


def serve(tmp_path, args: list[str], config: str | None = None,
          socket: str | None = None) -> tuple[subprocess.CompletedProcess, str]:
    sock = socket or str(tmp_path / "p.sock")
    cmd = [*PAELLA_CLI, "serve", "--socket", sock, "--cpu", "none", "--rt-priority", "0", *args]
    if config is not None:
        (tmp_path / "paella.toml").write_text(config)
        cmd += ["--config", str(tmp_path / "paella.toml")]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120), sock


def assert_clean_error(r: subprocess.CompletedProcess, sock: str, expected: str) -> None:
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("paella: error: ") and expected in last, r.stderr
    assert len(r.stderr) < 4000, r.stderr[:4000]
    assert not os.path.exists(sock) and not os.path.exists(sock + ".lock")


@pytest.mark.parametrize("args, config, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_bad_setting_is_a_clean_error(tmp_path, args, config, expected):
    r, sock = serve(tmp_path, args, config)
    assert_clean_error(r, sock, expected)


def test_a_socket_path_with_a_nul_byte_is_a_clean_error(tmp_path):
    """(Only a config file can carry one: a command line cannot.)"""
    (tmp_path / "paella.toml").write_text(f'[daemon]\nsocket = "{tmp_path}/a\\u0000b.sock"\n')
    r = subprocess.run([*PAELLA_CLI, "serve", "--config", str(tmp_path / "paella.toml"),
                        "--cpu", "none", "--rt-priority", "0"],
                       capture_output=True, text=True, timeout=120)
    assert_clean_error(r, str(tmp_path / "a"), "contains a NUL byte; a path cannot")
    assert os.listdir(tmp_path) == ["paella.toml"]


def test_what_is_not_the_daemons_own_is_never_replaced(tmp_path):
    """The daemon often runs as root: a file at the socket path, a symlink or someone's
    file at the lock path are refused, and left as they were."""
    sock = tmp_path / "p.sock"
    sock.write_text("precious")
    r, _ = serve(tmp_path, [], socket=str(sock))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"{sock} exists and is not a socket; refusing to replace it" in r.stderr
    assert sock.read_text() == "precious" and not os.path.exists(f"{sock}.lock")
    sock.unlink()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    os.symlink(victim, f"{sock}.lock")
    r, _ = serve(tmp_path, [], socket=str(sock))
    assert r.returncode == 2 and "(a symlink: refused)" in r.stderr, r.stderr
    assert victim.read_text() == "keep me" and os.path.islink(f"{sock}.lock")
    os.unlink(f"{sock}.lock")
    (tmp_path / "p.sock.lock").write_text("not a pid at all\n")
    r, _ = serve(tmp_path, [], socket=str(sock))
    assert r.returncode == 2 and "is not a paella daemon's lock file" in r.stderr, r.stderr
    assert (tmp_path / "p.sock.lock").read_text() == "not a pid at all\n"
    os.unlink(f"{sock}.lock")
    os.mkfifo(f"{sock}.lock")                    # (it said "Illegal seek")
    r, _ = serve(tmp_path, [], socket=str(sock))
    assert r.returncode == 2 and "is not a paella daemon's lock file" in r.stderr, r.stderr
    assert stat.S_ISFIFO(os.lstat(f"{sock}.lock").st_mode)
    os.unlink(f"{sock}.lock")
    (tmp_path / "p.sock.lock").write_text("not a pid at all\n")
    assert not sock.exists()


def test_a_missing_socket_directory_is_a_clean_error(tmp_path):
    missing = tmp_path / "no" / "such" / "dir"
    r, sock = serve(tmp_path, [], socket=str(missing / "p.sock"))
    assert_clean_error(r, sock, f"the directory of the socket {missing}/p.sock does not exist; "
                                f"create {missing}")


def test_a_repository_of_bad_bundles_is_a_clean_error(tmp_path):
    """A repository whose every bundle is bad (here, an unknown dtype) serves nothing of
    what it was pointed at: refused, with each bundle's reason. (One bad bundle among
    good ones is served around: test_lifecycle.py.)"""
    repo = tmp_path / "models"
    repo.mkdir()
    set_dtype(tiny_mlp(repo / "tiny_mlp"), "float33")
    r, sock = serve(tmp_path, ["--models", str(repo)])
    assert_clean_error(r, sock, f"no bundle of the model repository {repo} can be served: "
                                f"{repo / 'tiny_mlp'}: variant 'default': tensor 'x' has dtype "
                                f"'float33', which is not a numeric numpy dtype")


def test_models_pointed_at_a_bundle_names_the_repository_to_use(tmp_path):
    # A new user's mistake: --models bundles/resnet18 instead of --models bundles. It
    # used to serve only the built-in models, silently.
    bundle = tiny_mlp(tmp_path / "repo" / "tiny_mlp")
    r, sock = serve(tmp_path, ["--models", str(bundle)])
    assert_clean_error(r, sock, f"--models {bundle} is a bundle, not a model repository")
    assert f"point --models at the directory that holds it ({tmp_path / 'repo'})" in r.stderr


def test_unreadable_config_text_a_tiny_device_memory_and_a_long_socket_are_clean_errors(tmp_path):
    conf = tmp_path / "bad.toml"
    conf.write_bytes(b"[daemon]\nlog_level = \"\xff\xfe\"\n")          # not UTF-8
    sock = str(tmp_path / "p.sock")
    cmd = [*PAELLA_CLI, "serve", "--socket", sock, "--cpu", "none", "--rt-priority", "0"]
    r = subprocess.run([*cmd, "--config", str(conf)], capture_output=True, text=True, timeout=120)
    assert_clean_error(r, sock, f"config {conf} is not valid TOML (UTF-8 text)")
    conf.write_text("a = " + "[" * 3000 + "]" * 3000 + "\n")            # nested too deeply
    r = subprocess.run([*cmd, "--config", str(conf)], capture_output=True, text=True, timeout=120)
    assert_clean_error(r, sock, "nested too deeply to read")
    r, sock = serve(tmp_path, ["--device-memory", "1"])    # below noop's one buffer set
    assert_clean_error(r, sock, "the built-in model noop cannot be served")
    assert "raise device_memory or serve without it (--no-noop)" in r.stderr
    long_dir = tmp_path / ("d" * 100)
    long_dir.mkdir()
    r, sock = serve(tmp_path, [], socket=str(long_dir / "paella.sock"))
    assert_clean_error(r, sock, "longer than a Unix socket's limit of 107 bytes")


def test_a_bundle_whose_cpu_build_is_cut_short_is_refused_not_a_crash(tmp_path):
    """A truncated shared object is mapped by the dynamic loader all the same, and the
    first touch past its end is a SIGBUS that killed the daemon with no message."""
    repo = tmp_path / "models"
    repo.mkdir()
    b = tiny_mlp(repo / "tiny_mlp")
    so = next(b.glob("cpu*.so"))
    with open(so, "r+b") as f:
        f.truncate(1000)
    r, sock = serve(tmp_path, ["--models", str(repo)])
    assert_clean_error(r, sock, f"{so} is truncated (1000 bytes, its ELF headers need")


@pytest.mark.parametrize("damage, expected", [
    ("cpu_params", "is not JSON"),
    ("params", "cannot be read"),
])
def test_a_bundle_with_a_damaged_file_is_refused_naming_the_file(tmp_path, damage, expected):
    repo = tmp_path / "models"
    repo.mkdir()
    b = tiny_mlp(repo / "tiny_mlp")
    target = next(b.glob("cpu_params*.json") if damage == "cpu_params" else b.glob("params*.npz"))
    target.write_bytes(target.read_bytes()[:max(1, target.stat().st_size // 3)])
    r, sock = serve(tmp_path, ["--models", str(repo)])
    assert_clean_error(r, sock, f"{target} {expected}")
