"""Wrong policy plug-ins, installed for real, with a real daemon.

The plug-ins are a module on PYTHONPATH and a distribution's ``.dist-info`` directory
beside it declaring their entry points (group ``paella.policies``), which is what
``pip install`` leaves; another distribution, in a second directory, names a module
that does not exist. The
daemon finds them through ``importlib.metadata`` as it would any installed plug-in.
"""
from __future__ import annotations

import os
import subprocess
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from paella.client import connect
from paella.client.errors import RequestFailed
from service_daemon import PAELLA

PLUGINS = '''
"""Policies that are wrong in the ways a plug-in can be."""
import time

from paella.dispatcher.policies import HeapPolicy
from paella.dispatcher.policies.fifo import Fifo


class NotAJob(Fifo):
    """Right for the start-up profiling runs, then answers a string for clients' jobs."""
    def pick(self):
        job = super().pick()
        return "not a job" if job is not None and job.client_id >= 0 else job


class RaisingInit(Fifo):
    def __init__(self, dispatcher=None, **options):
        raise RuntimeError("plug-in bug in __init__")


class ExitingInit(Fifo):
    def __init__(self, dispatcher=None, **options):
        raise SystemExit(7)


class NeverPicks(Fifo):
    def pick(self):
        return None


class ExitsInPick(Fifo):
    """Right for the start-up profiling runs, then calls sys.exit() in a client's pick."""
    def pick(self):
        job = super().pick()
        if job is not None and job.client_id >= 0:
            raise SystemExit(3)
        return job


class LoopsInPick(Fifo):
    """Right for the start-up profiling runs, then never returns from a client's pick."""
    def pick(self):
        job = super().pick()
        while job is not None and job.client_id >= 0:
            pass
        return job


class SwallowsInPick(Fifo):
    """Like LoopsInPick, and keeps every exception it is given."""
    kept = Exception

    def pick(self):
        job = super().pick()
        while job is not None and job.client_id >= 0:
            try:
                time.sleep(0.01)
            except self.kept:
                pass
        return job


class CatchesAll(SwallowsInPick):
    """Keeps BaseException too."""
    kept = BaseException


class LoopsInInit(Fifo):
    def __init__(self, dispatcher=None, **options):
        while True:
            time.sleep(0.05)


class Arrival(HeapPolicy):
    """A correct plug-in: arrival order, gated by the +B rule."""
    def key(self, job):
        return job.seq
'''

TEST_POLICIES = """
    [paella.policies]
    not-a-job = paella_test_policies:NotAJob
    raising-init = paella_test_policies:RaisingInit
    exiting-init = paella_test_policies:ExitingInit
    never-picks = paella_test_policies:NeverPicks
    arrival = paella_test_policies:Arrival
    loops-in-pick = paella_test_policies:LoopsInPick
    exits-in-pick = paella_test_policies:ExitsInPick
    swallows-in-pick = paella_test_policies:SwallowsInPick
    loops-in-init = paella_test_policies:LoopsInInit
    catches-all = paella_test_policies:CatchesAll
"""
BROKEN = """
    [paella.policies]
    broken = paella_missing_module:Policy
    exits = paella_exiting_module:Policy
"""


def install(root: Path, name: str, version: str, entry_points: str) -> None:
    """What ``pip install`` leaves for a distribution: NAME-VERSION.dist-info."""
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points).lstrip())


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("plugins")
    (root / "paella_test_policies.py").write_text(PLUGINS)
    install(root, "paella-test-policies", "1.0", TEST_POLICIES)
    return str(root)


@pytest.fixture(scope="module")
def broken_path(tmp_path_factory) -> str:
    """A second site directory with a distribution whose module does not exist."""
    root = tmp_path_factory.mktemp("broken")
    (root / "paella_exiting_module.py").write_text("import sys\nsys.exit(1)\n")
    install(root, "paella-broken-plugin", "0.1", BROKEN)
    return str(root)


def env_with(*paths: str) -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join([*paths, *filter(None, [os.environ.get("PYTHONPATH")])])}


def noop_requests(sock: str, n: int) -> None:
    """``n`` requests of the built-in noop model (one kernel through the policy), all OK."""
    with connect(sock) as c:
        off = c.alloc(64)
        ids = [c.predict("noop", 64, off) for _ in range(n)]
        assert sorted(c.read_result() for _ in ids) == ids


def test_pick_returning_a_non_job_falls_back_to_fifo_mid_service(plugin_path, fresh_daemon):
    dp = fresh_daemon("--policy", "not-a-job", env=env_with(plugin_path))
    noop_requests(dp.socket, 20)
    log = dp.log()
    assert "scheduling policy 'not-a-job' raised in pick(); falling back to 'fifo'" in log
    assert "pick() returned 'not a job', which is not a job of this dispatcher" in log
    noop_requests(dp.socket, 20)                      # and it goes on serving
    with connect(dp.socket) as c:
        assert c.infer("echo", {"x": np.ones(256)})["y"][0] == 1
    assert dp.proc.poll() is None


def test_sys_exit_in_pick_mid_service_falls_back_and_does_not_end_the_daemon(plugin_path,
                                                                           fresh_daemon):
    dp = fresh_daemon("--policy", "exits-in-pick", env=env_with(plugin_path))
    noop_requests(dp.socket, 20)
    assert "scheduling policy 'exits-in-pick' raised in pick(); falling back to 'fifo'" \
        in dp.log()
    assert dp.proc.poll() is None
    assert dp.stop() == 0


def test_a_policy_raising_in_init_fails_start_up_cleanly(plugin_path, tmp_path):
    """Decision: start-up refuses (nothing is served yet, so nothing is lost, and the
    operator sees the cause at once), exit 2 with the plug-in's error; no traceback."""
    sock = str(tmp_path / "p.sock")
    r = subprocess.run([*PAELLA, "--socket", sock, "--cpu", "none", "--rt-priority", "0",
                        "--policy", "raising-init"], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, **env_with(plugin_path)))
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "paella: error: scheduling policy 'raising-init' failed to start: RuntimeError: plug-in "
        "bug in __init__; fix the plug-in or choose another policy (--policy, [policy] name)")
    assert not os.path.exists(sock) and not os.path.exists(sock + ".lock")
    # sys.exit() in __init__ is the same error, not the daemon's silent exit
    r = subprocess.run([*PAELLA, "--socket", sock, "--cpu", "none", "--rt-priority", "0",
                        "--policy", "exiting-init"], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, **env_with(plugin_path)))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "paella: error: scheduling policy 'exiting-init' failed to start: SystemExit: 7; fix "
        "the plug-in or choose another policy (--policy, [policy] name)")


def test_a_policy_that_never_picks_does_not_hang_start_up(plugin_path, fresh_daemon):
    """Start-up profiles the noop model through the policy: a pick() that always says
    None while the GPU is idle is a stall, detected after POLICY_STALL_SECONDS (1 s),
    and the daemon goes on with fifo (fresh_daemon waits 30 s at most for READY)."""
    dp = fresh_daemon("--policy", "never-picks", env=env_with(plugin_path))
    log = dp.log()
    assert "scheduling policy 'never-picks' raised in pick(); falling back to 'fifo'" in log
    assert "pick() returned None for 1 s while 1 job(s) had a ready kernel" in log
    noop_requests(dp.socket, 20)


def test_a_broken_distribution_does_not_break_the_other_plugins(plugin_path, broken_path,
                                                                fresh_daemon, tmp_path):
    dp = fresh_daemon("--policy", "arrival", env=env_with(plugin_path, broken_path))
    noop_requests(dp.socket, 20)
    log = dp.log()
    assert "scheduling policy plug-in skipped: entry point broken = 'paella_missing_module:" \
           "Policy' of distribution paella-broken-plugin 0.1 failed to load: " \
           "ModuleNotFoundError: No module named 'paella_missing_module'" in log
    assert "entry point exits = 'paella_exiting_module:Policy' of distribution " \
           "paella-broken-plugin 0.1 failed to load: SystemExit: 1" in log
    assert "falling back" not in log
    # Asked for by name, the broken one is a clean error that says why.
    sock = str(tmp_path / "p.sock")
    r = subprocess.run([*PAELLA, "--socket", sock, "--cpu", "none", "--rt-priority", "0",
                        "--policy", "broken"], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, **env_with(plugin_path, broken_path)))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(
        "paella: error: scheduling policy 'broken' is unavailable: entry point broken = "
        "'paella_missing_module:Policy' of distribution paella-broken-plugin 0.1 failed to load: "
        "ModuleNotFoundError: No module named 'paella_missing_module'"), r.stderr


def test_a_pick_that_never_returns_is_interrupted_and_the_daemon_goes_on(plugin_path,
                                                                        fresh_daemon):
    """The watchdog interrupts the plug-in call after plugin_timeout_seconds; the policy
    falls back to fifo, the requests waiting behind it are served, and SIGTERM works."""
    dp = fresh_daemon("--policy", "loops-in-pick", "--plugin-timeout-seconds", "0.5",
                      env=env_with(plugin_path))
    t0 = time.monotonic()
    noop_requests(dp.socket, 20)
    assert time.monotonic() - t0 > 0.4                # they did wait for the interruption
    log = dp.log()
    assert "the plug-in call paella_test_policies.LoopsInPick.pick" in log
    assert "without returning (an endless loop?): interrupting it" in log
    assert "scheduling policy 'loops-in-pick' raised in pick(); falling back to 'fifo'" in log
    assert "PluginTimeout" in log      # (the log's traceback shows where the plug-in looped)
    noop_requests(dp.socket, 20)
    assert dp.stop() == 0
    assert dp.segments() == []


def test_a_plugin_that_swallows_the_interruption_stops_the_daemon_cleanly(plugin_path,
                                                                          fresh_daemon):
    """Interrupted twice and still running: the daemon answers the request it holds,
    exits 4 naming the plug-in (the unit restarts it) and leaves nothing behind."""
    dp = fresh_daemon("--policy", "swallows-in-pick", "--plugin-timeout-seconds", "0.3",
                      env=env_with(plugin_path))
    with connect(dp.socket) as c:
        off = c.alloc(64)
        ids = {c.predict("noop", 64, off) for _ in range(4)}
        answered = set()
        for _ in ids:                        # each one answered, with the reason
            with pytest.raises(RequestFailed) as err:
                c.read_result(timeout=20)
            answered.add(err.value.req_id)
            assert "the daemon stopped" in str(err.value) or "shutting down" in str(err.value)
        assert answered == ids
    assert dp.proc.wait(20) == 4
    log = dp.log()
    assert "kept running after 2 interruptions" in log and "Traceback" not in log, log
    assert not os.path.exists(dp.socket)
    assert dp.segments() == []


def test_a_policy_init_that_never_returns_fails_start_up(plugin_path, tmp_path):
    sock = str(tmp_path / "p.sock")
    r = subprocess.run([*PAELLA, "--socket", sock, "--cpu", "none", "--rt-priority", "0",
                        "--policy", "loops-in-init", "--plugin-timeout-seconds", "0.5"],
                       capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, **env_with(plugin_path)))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("paella: error: scheduling policy 'loops-in-init' failed to start: "
                           "PluginTimeout: the plug-in call paella_test_policies.LoopsInInit."
                           "__init__"), last
    assert "ran for more than 0.5 s without returning (plugin_timeout_seconds)" in last
    assert not os.path.exists(sock)


def test_a_plugin_that_catches_everything_ends_the_daemon_as_a_last_resort(plugin_path,
                                                                          fresh_daemon):
    """Nothing can unwind it: the watchdog's thread exits the process (status 4) after
    STRIKES + 2 timeouts, removing the socket; the line goes to stderr, not through the
    logging lock the loop may hold."""
    dp = fresh_daemon("--policy", "catches-all", "--plugin-timeout-seconds", "0.3",
                      env=env_with(plugin_path))
    with connect(dp.socket) as c:
        off = c.alloc(64)
        c.predict("noop", 64, off)
        assert dp.proc.wait(20) == 4
    log = dp.log()
    assert "CRITICAL the plug-in call paella_test_policies.SwallowsInPick.pick" in log
    assert "could not be interrupted; exiting now with status 4" in log
    assert not os.path.exists(dp.socket) and not os.path.exists(dp.socket + ".lock")
