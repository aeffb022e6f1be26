"""A hybrid client's "almost finished" wake-up through the real daemon: with
``--wake-lead-us`` it arrives once the job's estimated work left is within the lead,
without it just before the job's last copy (the paper's rule)."""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from paella.client import connect

from bundles_for_tests import make_slow_running, tiny_mlp
from service_daemon import cleanup, start_daemon

#: The tiny MLP's two matmuls are made to last this long; its two transposes stay short
#: (memory-bound: make_slow_running scales FLOPs), so a request takes ~0.12 s.
KERNEL_SECONDS = 0.06


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("models")
    tiny_mlp(repo / "slow_mlp")
    make_slow_running(repo / "slow_mlp", kernel_seconds=KERNEL_SECONDS)
    return repo


def seconds_to_wake_and_done(repo: Path, *daemon_args: str) -> tuple[float, float]:
    """One request from a hybrid client: seconds from predict to the WAKE frame, and to
    its completion."""
    dp = start_daemon("--models", str(repo), "--no-noop", *daemon_args)
    try:
        with connect(dp.socket, mode="hybrid") as c:
            n = c.models["slow_mlp"].variants[0].io_bytes
            off = c.alloc(n)
            c.wait(c.predict("slow_mlp", n, off), timeout=30)      # warm
            t0 = time.monotonic()
            rid = c.predict("slow_mlp", n, off)
            while c._notified <= 1:                 # (the warm-up request's is the first)
                c._pump(block=True, timeout=10)     # the socket alone: WAKE frames
                assert time.monotonic() - t0 < 10, dp.log()
            woken = time.monotonic() - t0
            c.wait(rid, timeout=30)
            return woken, time.monotonic() - t0
    finally:
        cleanup(dp)


def test_a_wake_lead_wakes_the_client_that_much_ahead(repo):
    # A lead longer than the job: the wake-up goes with the first kernel, at once.
    woken, done = seconds_to_wake_and_done(repo, "--wake-lead-us", "1000000")
    assert woken < 0.25 * done and done > 1.5 * KERNEL_SECONDS, (woken, done)
    # Half a matmul: the wake-up goes with the last kernel (the second matmul), released
    # once the first has completed, about half-way (after it, nothing is left unreleased;
    # before it, that matmul's 0.06 s, more than the lead).
    woken, done = seconds_to_wake_and_done(repo, "--wake-lead-us", "30000")
    assert 0.3 * done < woken < 0.7 * done, (woken, done)


def test_without_a_lead_the_wake_up_comes_with_the_last_copy(repo):
    woken, done = seconds_to_wake_and_done(repo)
    assert woken > done - 0.5 * KERNEL_SECONDS, (woken, done)
