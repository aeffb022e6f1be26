"""Triton's dynamic-batching rules through the real daemon (issue 40, part 1).

One daemon serves the tiny MLP compiled at batch sizes 1, 2, 4, 8 under five names, each
with its own ``config.toml``; the batch-4 and batch-8 variants are made slow (about
0.4 s on the simulated T4, which runs in real time), so that a batch is in flight while
the client queues more requests, and the batch-1 variant stays fast (so a later batch
can end first). Each test quotes the Triton rule it checks. Bad configs are refused at
start-up with ``paella: error:`` and exit 2."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from paella.client import connect
from paella.client.errors import RequestFailed
from service_daemon import cleanup, start_daemon

SIZES = (1, 2, 4, 8)
SLOW_S = 0.4                      # the batch-4 and batch-8 variants' time on the GPU

CONFIGS = {
    # Issue 40's case: max_batch_size 8, preferred [4], one batch in flight at a time.
    "pref": """
[batching]
batcher = "dynamic"
max_batch_size = 8
preferred_batch_size = [4]
max_queue_delay_microseconds = 1500000
max_inflight_batches = 1
""",
    "reject": """
[batching]
batcher = "dynamic"
max_inflight_batches = 1
[batching.default_queue_policy]
default_timeout_microseconds = 100000
timeout_action = "REJECT"
""",
    "delayed": """
[batching]
batcher = "dynamic"
max_batch_size = 1
max_inflight_batches = 1
[batching.default_queue_policy]
default_timeout_microseconds = 200000
timeout_action = "DELAY"
""",
    "full": """
[batching]
batcher = "dynamic"
max_inflight_batches = 1
[batching.default_queue_policy]
max_queue_size = 1
""",
    "ordered": """
[batching]
batcher = "dynamic"
preserve_ordering = true
""",
}
NO_PROFILING = "\n[policy]\nprofile_runs = 0\n"     # (the slow variants would take seconds)


def make_slow(bdir: Path, variants: list[int], seconds: float) -> None:
    """Raise the FLOP estimates of the given variants' computing kernels so that each
    variant lasts about ``seconds`` alone on the simulated T4 (as bundles_for_tests'
    make_slow_running does for variant 0: the time follows from the work)."""
    from paella.bundle import load_bundle
    from paella.dispatcher.devices.sim.bundle_profile import profile
    for _ in range(2):                   # (the second round absorbs the fixed latencies)
        prof = profile(load_bundle(bdir), "t4")["variants"]
        path = bdir / "manifest.json"
        m = json.loads(path.read_text())
        for k in variants:
            took = {r["kernel"]: r["isolated_us"] * 1e-6 for r in prof[k]["launches"]}
            heavy = [kd for kd in m["variants"][k]["kernels"] if kd["flops"] > 0]
            for kd in heavy:
                kd["flops"] = kd["flops"] * (seconds / len(heavy)) / took[kd["name"]]
        path.write_text(json.dumps(m, indent=1))


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    from paella.compiler_pass.build import compile_bundle
    from paella.models import zoo
    d = tmp_path_factory.mktemp("triton") / "mlp"
    compile_bundle([zoo.get("tiny_mlp", batch=b) for b in SIZES], str(d))
    make_slow(d, [SIZES.index(4), SIZES.index(8)], SLOW_S)
    return d


@pytest.fixture(scope="module")
def served(bundle, tmp_path_factory):
    repo = tmp_path_factory.mktemp("triton_repo")
    for name, text in CONFIGS.items():
        shutil.copytree(bundle, repo / name)
        (repo / name / "config.toml").write_text(text + NO_PROFILING)
    dp = start_daemon("--models", str(repo), "--no-noop")
    yield dp
    cleanup(dp)


def reference(bundle: Path, x: np.ndarray) -> np.ndarray:
    from paella.bundle import load_bundle
    b = load_bundle(bundle)
    k = next(i for i, v in enumerate(b.variants) if v.batch >= len(x))
    pad = np.zeros((b.variants[k].batch, 16), np.float32)
    pad[:len(x)] = x
    return b.run_cpu({"x": pad}, k)["output0"][:len(x)]


class Sender:
    """Shaped requests of one client, with their inputs, submit times and answers."""

    def __init__(self, c, model: str, seed: int):
        self.c, self.model = c, model
        self.rng = np.random.default_rng(seed)
        self.sent: dict[int, tuple] = {}          # req id -> (x, outputs view, t sent)
        self.answers: list[tuple] = []            # (req id, error or None, t answered)

    def send(self, rows: int) -> int:
        x = self.rng.standard_normal((rows, 16)).astype(np.float32)
        ins, outs, _ = self.c.shaped_views(self.model, off := self.c.alloc(4096), rows)
        ins["x"][...] = x
        rid = self.c.predict_shaped(self.model, off, rows)
        self.sent[rid] = (x, outs, time.monotonic())
        return rid

    def read(self, n: int, timeout: float = 20.0) -> list[int]:
        for _ in range(n):
            try:
                rid, err = self.c.read_result(timeout=timeout), None
            except RequestFailed as e:
                rid, err = e.req_id, e.reason
            self.answers.append((rid, err, time.monotonic()))
        return [a[0] for a in self.answers]

    def latency(self, rid: int) -> float:
        return next(t for r, _, t in self.answers if r == rid) - self.sent[rid][2]

    def error(self, rid: int) -> str | None:
        return next(e for r, e, _ in self.answers if r == rid)

    def check_rows(self, bundle: Path, rid: int) -> None:
        x, outs, _ = self.sent[rid]
        np.testing.assert_allclose(outs["output0"], reference(bundle, x), rtol=1e-5, atol=1e-5)


def test_the_largest_preferred_size_leaves_at_once_when_the_batch_in_flight_ends(served, bundle):
    """Triton: "If the dynamic batcher can form a batch of a preferred size(s) it will
    create a batch of the largest possible preferred size and send it for inferencing";
    the max queue delay applies only "When a batch of a maximum or preferred size cannot
    be created from the available requests".

    max_batch_size 8, preferred [4], delay 1.5 s, one batch in flight at a time: a
    4-row request runs (0.4 s) while five one-row requests queue. When it ends, the
    first four leave at once as a batch of 4 (answered in about 0.8 s, not after the
    1.5 s delay, and not five rows padded to 8); the fifth then waits out its delay."""
    with connect(served.socket) as c:
        s = Sender(c, "pref", 1)
        first = s.send(4)
        time.sleep(0.05)                              # (it is in flight)
        ones = [s.send(1) for _ in range(5)]
        s.read(6)
        assert all(err is None for _, err, _ in s.answers), s.answers
        for rid in [first, *ones]:
            s.check_rows(bundle, rid)
        quick = [s.latency(r) for r in ones[:4]]
        assert max(quick) < 1.2, quick                # before the delay could have passed
        assert s.latency(ones[4]) > 1.3, s.latency(ones[4])   # the fifth waited for it
        order = [r for r, _, _ in s.answers]
        assert order.index(ones[4]) == 5 and set(order[1:5]) == set(ones[:4]), order


def test_a_request_past_its_queue_timeout_is_rejected(served, bundle):
    """ModelQueuePolicy: timeout_action REJECT, "Reject the request and return error
    message accordingly", once it has waited default_timeout_microseconds (here 0.1 s)
    in the queue: while a 0.4 s batch is in flight, a queued request is answered with
    the reason after about 0.1 s, before the batch ends."""
    with connect(served.socket) as c:
        s = Sender(c, "reject", 2)
        first = s.send(4)
        time.sleep(0.02)
        late = s.send(1)
        assert s.read(2) == [late, first]
        assert "request timeout expired" in s.error(late) and "REJECT" in s.error(late)
        # (From the client's clock: the daemon stamps a request with its device clock
        # as of its loop's last step, which may be some milliseconds old.)
        assert 0.05 < s.latency(late) < 0.35, s.latency(late)
        assert s.error(first) is None
        s.check_rows(bundle, first)


def test_a_request_past_its_queue_timeout_waits_behind_the_others_with_delay(served, bundle):
    """ModelQueuePolicy: timeout_action DELAY, "Delay the request until all other requests
    at the same (or higher) priority levels that have not reached their timeouts are
    processed." One request per batch: B is queued behind a 0.4 s batch and passes its
    0.2 s timeout (at 0.22 s); C arrives at 0.3 s, still within its own when the batch
    ends, so C is served before B, and B is still served (not rejected).

    The scenario holds only if C arrives within 0.2 s before the batch ends: on a loaded
    machine a late sleep or a late batch start can miss that window, so it is tried up to
    three times; a DELAY that is not applied fails every try."""
    orders = []
    for attempt in range(3):
        with connect(served.socket) as c:
            s = Sender(c, "delayed", 3 + attempt)
            a = s.send(4)                             # (alone: rows >= max_batch_size)
            time.sleep(0.02)
            b = s.send(1)
            time.sleep(0.28)                          # B's timeout has passed
            c_ = s.send(1)
            order = s.read(3)
            assert all(err is None for _, err, _ in s.answers), s.answers   # B not rejected
            for rid in (a, b, c_):
                s.check_rows(bundle, rid)
        orders.append(order)
        if order == [a, c_, b]:
            return
    raise AssertionError(f"C was never served before the delayed B: {orders}")


def test_a_full_queue_refuses_a_request_at_once(served, bundle):
    """ModelQueuePolicy.max_queue_size: "A request will be rejected immediately if it
    can't be enqueued because the queue is full." max_queue_size 1, one batch in flight:
    the second queued request is refused at once with a clear error; the others run."""
    with connect(served.socket) as c:
        s = Sender(c, "full", 4)
        first = s.send(4)
        time.sleep(0.02)
        queued = s.send(1)
        refused = s.send(1)
        assert s.read(3) == [refused, first, queued]
        assert s.error(refused).startswith("queue full: full holds max_queue_size=1 request(s)")
        assert s.latency(refused) < 0.2, s.latency(refused)
        for rid in (first, queued):
            assert s.error(rid) is None
            s.check_rows(bundle, rid)


def test_preserve_ordering_answers_in_arrival_order(served, bundle):
    """ModelDynamicBatching.preserve_ordering: "If true, the responses will be returned in
    the same order as the order of requests sent to the scheduler." A 4-row request runs
    0.4 s on the slow variant; a one-row request sent just after runs alone on the fast
    one and ends first, yet its answer comes second."""
    with connect(served.socket) as c:
        s = Sender(c, "ordered", 5)
        first = s.send(4)
        time.sleep(0.02)
        second = s.send(1)
        assert s.read(2) == [first, second]
        assert s.latency(first) > 0.3                 # (the slow batch ran)
        for rid in (first, second):
            assert s.error(rid) is None
            s.check_rows(bundle, rid)


BAD_CONFIGS = [
    ("preferred-above-max", "max_batch_size = 4\npreferred_batch_size = [4, 8]\n",
     "preferred_batch_size must be integers in 1..4 (max_batch_size), got 8"),
    ("negative-timeout", "[batching.default_queue_policy]\ndefault_timeout_microseconds = -100\n",
     "default_queue_policy.default_timeout_microseconds must be an integer 0..86400000000 "
     "(microseconds in the queue; 0: no timeout), got -100"),
    ("unknown-timeout-action", "[batching.default_queue_policy]\ntimeout_action = \"RETRY\"\n",
     "default_queue_policy.timeout_action must be one of REJECT, DELAY, got 'RETRY'"),
]


@pytest.mark.parametrize("case,text,expected", BAD_CONFIGS, ids=[c[0] for c in BAD_CONFIGS])
def test_a_bad_dynamic_batching_config_is_a_clean_start_up_error(tmp_path, bundle, case, text,
                                                                 expected):
    """Refused at model load with the key and its valid values: a repository with
    nothing else to serve stops ``paella serve`` with ``paella: error:`` and exit 2 (as
    Triton refuses "dynamic batching preferred size must be <= max batch size")."""
    models = tmp_path / "models"
    shutil.copytree(bundle, models / "mlp")
    (models / "mlp" / "config.toml").write_text('[batching]\nbatcher = "dynamic"\n' + text)
    r = subprocess.run([sys.executable, "-c", "import sys; from paella.cli import main; "
                        "sys.exit(main())", "serve", "--socket", str(tmp_path / "p.sock"),
                        "--models", str(models), "--cpu", "none", "--rt-priority", "0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("paella: error: no bundle of the model repository"), r.stderr
    assert expected in last, r.stderr
    assert not (tmp_path / "p.sock").exists()
