"""Batching through the real daemon: a model repository whose tiny MLP was compiled with
--batch-sizes 1,2,4 and a config.toml choosing the dynamic batcher. Many concurrent
clients with distinct inputs and shapes each get exactly their own rows, equal to the
CPU build's; bad shapes get clear errors and lose nothing; versions and config.toml
errors behave as docs/batching.md says."""
from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time

import numpy as np
import pytest

from paella.client import connect
from paella.client.errors import RequestFailed
from service_daemon import cleanup, start_daemon

SIZES = (1, 2, 4)
CONFIG = """
[batching]
batcher = "dynamic"
max_queue_delay_us = 3000
preferred_batch_sizes = [4]
"""


def compile_variants(dest: str, sizes=SIZES) -> str:
    from paella.compiler_pass.build import compile_bundle
    from paella.models import zoo
    compile_bundle([zoo.get("tiny_mlp", batch=b) for b in sizes], dest)
    return dest


@pytest.fixture(scope="module")
def repo():
    d = tempfile.mkdtemp(prefix="plbatch")
    compile_variants(os.path.join(d, "mlp"))
    with open(os.path.join(d, "mlp", "config.toml"), "w") as f:
        f.write(CONFIG)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def served(repo):
    dp = start_daemon("--models", repo, "--no-noop")
    yield dp
    cleanup(dp)


def reference(repo: str, x: np.ndarray) -> np.ndarray:
    """The CPU build's answer for ``x``'s rows: its own variant, or the next one padded."""
    from paella.bundle import load_bundle
    b = load_bundle(os.path.join(repo, "mlp"))
    k = next(i for i, v in enumerate(b.variants) if v.batch >= len(x))
    pad = np.zeros((b.variants[k].batch, 16), np.float32)
    pad[:len(x)] = x
    return b.run_cpu({"x": pad}, k)["output0"][:len(x)]


def test_the_model_is_named_after_its_folder_and_lists_its_variants(served):
    with connect(served.socket) as c:
        m = c.models["mlp"]
        assert [(v.batch, v.inputs[0].shape) for v in m.variants] == [(1, (1, 16)), (2, (2, 16)),
                                                                      (4, (4, 16))]
    assert "registered mlp (3 variant(s): b1, b2, b4; batcher dynamic)" in served.log()


def test_concurrent_clients_each_get_exactly_their_own_rows(served, repo):
    """8 clients x 6 requests of 1..4 rows with distinct inputs, in flight together (so
    the dynamic batcher groups requests of different clients, and pads 3 rows to 4)."""
    results: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
    errors = []

    def client(k: int) -> None:
        rng = np.random.default_rng(100 + k)
        try:
            with connect(served.socket) as c:
                pending = []
                for i in range(6):
                    rows = int(rng.integers(1, 5))
                    x = rng.standard_normal((rows, 16)).astype(np.float32) + k * 10 + i
                    ins, outs, n = c.shaped_views("mlp", off := c.alloc(4096), rows)
                    ins["x"][...] = x
                    pending.append((c.predict_shaped("mlp", off, rows), x, outs))
                for req_id, x, outs in pending:
                    c.wait(req_id)
                    results[(k, req_id)] = (x, outs["output0"].copy())
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(results) == 48
    for x, got in results.values():
        assert got.shape == x.shape[:1] + (8,)
        np.testing.assert_allclose(got, reference(repo, x), rtol=1e-5, atol=1e-5)


def test_bad_shapes_get_clear_errors_and_lose_nothing(served, repo):
    from paella import shapes
    with connect(served.socket) as c:
        m = c.models["mlp"]
        off = c.alloc(4096)
        too_many = c.predict(m.model_id, 5 * 64 + 5 * 32, off, shapes.RequestShape(5).options())
        with_length = c.predict(m.model_id, 128, off, shapes.RequestShape(1, 7).options())
        wrong_size = c.predict(m.model_id, 100, off, shapes.RequestShape(2).options())
        x = np.ones((3, 16), np.float32)
        ins, outs, _ = c.shaped_views("mlp", off2 := c.alloc(4096), 3)
        ins["x"][...] = x
        good = c.predict_shaped("mlp", off2, 3)
        reasons = {}
        for _ in range(4):
            try:
                reasons[c.read_result()] = None
            except RequestFailed as e:
                reasons[e.req_id] = str(e)
        assert reasons[good] is None
        np.testing.assert_allclose(outs["output0"], reference(repo, x), rtol=1e-5, atol=1e-5)
        assert "mlp: 5 rows: a request has 1..4 rows, the largest compiled variant taking 4 " \
               "(compiled batch sizes: 1, 2, 4)" in reasons[too_many]
        assert "sequence length 7: the model has no length axis" in reasons[with_length]
        assert "mlp needs 192 io bytes for 2 row(s), request has 100" in reasons[wrong_size]
        assert c.in_flight == 0
        with pytest.raises(ValueError, match="a request has 1..4 rows"):
            c.infer("mlp", {"x": np.ones((5, 16), np.float32)}, rows=5)


def test_a_client_that_dies_mid_batch_costs_the_others_nothing(served, repo):
    """A client submits rows into batches and vanishes; clients whose rows share those
    batches still get their own answers, and the daemon keeps serving."""
    from service_daemon import run_client
    code = """
import os, sys
import numpy as np
from paella.client import connect
c = connect(SOCK)
for i in range(4):
    ins, outs, n = c.shaped_views("mlp", off := c.alloc(4096), 1)
    ins["x"][...] = 7.0 + i
    c.predict_shaped("mlp", off, 1)
os._exit(0)      # no close, no reads: the daemon finds the socket gone
"""
    rng = np.random.default_rng(5)
    with connect(served.socket) as c:
        pending = []
        for i in range(6):
            x = rng.standard_normal((1, 16)).astype(np.float32)
            ins, outs, _ = c.shaped_views("mlp", off := c.alloc(4096), 1)
            ins["x"][...] = x
            pending.append((c.predict_shaped("mlp", off, 1), x, outs))
            if i == 2:
                assert run_client(code, served.socket).returncode == 0
        for req_id, x, outs in pending:
            c.wait(req_id)
            np.testing.assert_allclose(outs["output0"], reference(repo, x), rtol=1e-5, atol=1e-5)
        assert c.infer("mlp", {"x": np.ones((2, 16), np.float32)}, rows=2)["output0"].shape == (2, 8)
    assert "dropped: disconnected" in served.log()


def test_versions_latest_or_pinned(tmp_path, fresh_daemon):
    repo = tmp_path / "models"
    (repo / "mlp").mkdir(parents=True)
    compile_variants(str(repo / "mlp" / "1"), (1, 2))
    compile_variants(str(repo / "mlp" / "2"), SIZES)
    dp = fresh_daemon("--models", str(repo), "--no-noop")
    with connect(dp.socket) as c:
        assert [v.batch for v in c.models["mlp"].variants] == [1, 2, 4]      # the latest
    (repo / "mlp" / "config.toml").write_text("version = 1\n")
    dp.proc.send_signal(1)                                                 # SIGHUP: reload
    deadline = time.monotonic() + 30
    while "registered mlp version 1" not in dp.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "registered mlp version 1" in dp.log()
    with connect(dp.socket) as c:
        assert [v.batch for v in c.models["mlp"].variants] == [1, 2]         # the pinned one
    assert dp.stop() == 0


def test_version_folders_are_read_by_number_and_two_names_of_one_version_refused(tmp_path):
    """A folder named "01" is version 1 (it was looked for as "1" and not found); "1" and
    "01" together are ambiguous; a non-ASCII digit ("²") is not a version."""
    from paella.dispatcher.daemon.repository import bundle_folder
    model = tmp_path / "m"
    for name in ("01", "²", "10"):
        (model / name).mkdir(parents=True)
        (model / name / "manifest.json").write_text("{}")
    assert bundle_folder(str(model), None) == (str(model / "10"), "10")
    assert bundle_folder(str(model), 1) == (str(model / "01"), "1")
    (model / "1").mkdir()
    (model / "1" / "manifest.json").write_text("{}")
    with pytest.raises(ValueError, match="subfolders 01 and 1 are both version 1; rename or "
                                         "remove one"):
        bundle_folder(str(model), None)


def test_model_folders_that_cannot_be_read_are_reported_not_skipped(tmp_path):
    """A manifest.json that is a directory, a version number too long to be one, a
    config.toml that is a fifo (it blocked the load, or its settings were ignored) and a
    folder name with a newline (which split the log's lines): each is a model not
    served, with its reason."""
    from paella.dispatcher.daemon.repository import scan
    repo = tmp_path / "models"
    (repo / "dir_manifest" / "manifest.json").mkdir(parents=True)
    (repo / "long_version" / ("9" * 26)).mkdir(parents=True)
    (repo / "long_version" / ("9" * 26) / "manifest.json").write_text("{}")
    (repo / "fifo_config").mkdir()
    os.mkfifo(repo / "fifo_config" / "config.toml")
    (repo / "new\nline").mkdir()
    (repo / "dangling_config").mkdir()                # (these two were served with defaults)
    os.symlink(repo / "nowhere.toml", repo / "dangling_config" / "config.toml")
    (repo / "loop_config").mkdir()
    os.symlink("x", repo / "loop_config" / "config.toml")
    os.symlink("config.toml", repo / "loop_config" / "x")
    (repo / "deep_config").mkdir()                    # (a RecursionError, naming no file)
    (repo / "deep_config" / "config.toml").write_text("a = " + "[" * 5000 + "]" * 5000 + "\n")
    out = scan(str(repo), {}, lambda *a: None)
    failed = {os.path.basename(k): v for k, v in out.failed.items()}
    assert "manifest.json is not a regular file" in failed["dir_manifest"]
    assert "is not a version number of at most 18 digits" in failed["long_version"]
    assert "config.toml is not a regular file" in failed["fifo_config"]
    assert "control characters or surrounding spaces" in failed["new\nline"]
    for name in ("dangling_config", "loop_config"):
        assert "config.toml is a symlink that leads to no file (dangling, or a loop)" in \
            failed[name], failed
    assert "config.toml is not valid TOML: nested too deeply to read" in failed["deep_config"]
    assert not out.prepared


CONFIG_ERRORS = [
    ("unknown-top-key", "batcher = 'dynamic'\n",
     "config.toml: unknown key 'batcher'; valid keys: version, tokenizer, batching, policy, "
     "memory"),
    ("tokenizer-missing", "tokenizer = 'tok.json'\n",
     "config.toml: tokenizer 'tok.json' is not a file"),
    ("tokenizer-not-a-name", "tokenizer = 5\n",
     "config.toml: tokenizer must be the file name of a tokenizer.json"),
    ("unknown-batching-key", "[batching]\nbatcher = 'dynamic'\nmax_delay_us = 5\n",
     "[batching] batcher 'dynamic' has no option 'max_delay_us'; valid options: "
     "default_priority_level, default_queue_policy, max_batch_size, max_inflight_batches, "
     "max_queue_delay_microseconds, max_queue_delay_us, preferred_batch_size, "
     "preferred_batch_sizes, preserve_ordering, priority_levels, priority_queue_policy"),
    ("unknown-batcher", "[batching]\nbatcher = 'triton'\n", "unknown batcher 'triton'"),
    ("bad-value", "[batching]\nbatcher = 'dynamic'\nmax_batch_size = 64\n",
     "max_batch_size must be 1..4 (the largest compiled variant of mlp), got 64"),
    ("pinned-missing", "version = 3\n",
     "config.toml pins version 3, but the folder has no version subfolders"),
    ("policy-key", "[policy]\nname = 'fifo'\n", "unknown key 'name' in [policy]; valid keys: "
                                                "profile_runs"),
    ("allocator", "[memory]\nallocator = 'arena'\n",
     "[memory] allocator must be one of 'sets', 'chunked', got 'arena'"),
    ("turbo-unprofiled", "[batching]\nbatcher = 'turbo-dp'\n[policy]\nprofile_runs = 0\n",
     "[policy] profile_runs in config.toml must be at least 1"),
    # Checked before any variant is registered and profiled (once, each reload did it again).
    ("turbo-bad-option", "[batching]\nbatcher = 'turbo-dp'\ntrigger = 'bogus'\n",
     "trigger must be one of hungry, lazy"),
    ("profile-runs-huge", "[policy]\nprofile_runs = 1000000\n",
     "[policy] profile_runs must be an integer 0..20, got 1000000"),
    ("orca-beside-a-bundle", "[batching]\nbatcher = 'orca'\nconfig = 'tiny'\n",
     "batcher 'orca' serves a model of its own (its io, no bundle), but this folder holds a "
     "bundle"),
]


@pytest.mark.parametrize("case,text,expected", CONFIG_ERRORS, ids=[c[0] for c in CONFIG_ERRORS])
def test_config_toml_errors_are_clean(tmp_path, repo, case, text, expected):
    """A model whose config.toml is wrong is not served, with the reason; a repository
    with nothing else to serve is a ``paella: error:`` at start-up (exit 2)."""
    import subprocess
    import sys
    models = tmp_path / "models"
    shutil.copytree(os.path.join(repo, "mlp"), models / "mlp")
    (models / "mlp" / "config.toml").write_text(text)
    r = subprocess.run([sys.executable, "-c", "import sys; from paella.cli import main; "
                        "sys.exit(main())", "serve", "--socket", str(tmp_path / "p.sock"),
                        "--models", str(models), "--cpu", "none", "--rt-priority", "0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "paella: error: no bundle of the model repository" in r.stderr
    assert expected in r.stderr
    assert not (tmp_path / "p.sock").exists()
    if case == "turbo-bad-option":       # refused by the scan, not after registering
        assert "cannot be served" not in r.stderr


def test_a_folder_named_like_a_built_in_model_is_refused(tmp_path, repo, fresh_daemon):
    models = tmp_path / "models"
    shutil.copytree(os.path.join(repo, "mlp"), models / "mlp")
    shutil.copytree(os.path.join(repo, "mlp"), models / "Echo")
    dp = fresh_daemon("--models", str(models), "--no-noop")
    with connect(dp.socket) as c:
        assert set(c.models) == {"echo", "mlp"}
    assert "model name 'Echo' is already taken by the daemon's built-in models" in dp.log()


TURBO = """
[batching]
batcher = "turbo-dp"
trigger = "lazy"
timeout_us = 3000

[memory]
allocator = "chunked"
"""


@pytest.mark.parametrize("config", [CONFIG.replace("[4]", "[2]"), TURBO], ids=["dynamic", "turbo-dp"])
def test_length_buckets_batch_requests_of_different_lengths(tmp_path, fresh_daemon, config):
    """The tiny encoder at batch 1,2 x length 4,8: requests of 1..2 rows and lengths 2..8
    from several clients, batched across lengths (padded to the bucket, masked), each
    get their own rows and length back, equal to the CPU build at their bucket. Also
    with TurboTransformers' DP batcher (its cost table the daemon's profiles) and the
    chunked allocator placing every variant's buffers in one chunk list."""
    from paella.bundle import load_bundle
    from paella.compiler_pass.build import compile_bundle
    from paella.models import zoo
    repo = tmp_path / "models"
    repo.mkdir()
    compile_bundle([zoo.get("tiny_encoder", batch=b, seq_len=s) for s in (4, 8) for b in (1, 2)],
                   repo / "enc")
    (repo / "enc" / "config.toml").write_text(config)
    b = load_bundle(repo / "enc")
    dp = fresh_daemon("--models", str(repo), "--no-noop")
    rng = np.random.default_rng(9)
    shapes_ = [(1, 3), (2, 4), (1, 8), (1, 2), (2, 6), (1, 5)]
    with connect(dp.socket) as c:
        assert [(v.batch, v.seq_len) for v in c.models["enc"].variants] == \
            [(1, 4), (2, 4), (1, 8), (2, 8)]
        pending = []
        for rows, ln in shapes_:
            x = rng.standard_normal((rows, ln, 16)).astype(np.float32)
            ins, outs, _ = c.shaped_views("enc", off := c.alloc(8192), rows, ln)
            ins["x"][...] = x
            ins["mask"][...] = 1.0
            pending.append((c.predict_shaped("enc", off, rows, ln), x, outs))
        for req_id, x, outs in pending:
            c.wait(req_id)
            rows, ln = x.shape[:2]
            k = next(i for i, v in enumerate(b.variants) if v.batch >= rows and v.seq_len >= ln)
            v = b.variants[k]
            xp = np.zeros((v.batch, v.seq_len, 16), np.float32)
            mp = np.zeros((v.batch, v.seq_len), np.float32)
            xp[:rows, :ln], mp[:rows, :ln] = x, 1.0
            ref = b.run_cpu({"x": xp, "mask": mp}, k)["output0"][:rows, :ln]
            assert outs["output0"].shape == (rows, ln, 16)
            np.testing.assert_allclose(outs["output0"], ref, rtol=1e-4, atol=1e-4)
        with pytest.raises(ValueError, match="sequence length 9: the model takes 1..8"):
            c.shaped_views("enc", 0, 1, 9)


PRIORITY_CONFIG = """
[batching]
batcher = "dynamic"
max_queue_delay_us = 300000
priority_levels = 2
"""


@pytest.mark.parametrize("high", [True, False])
def test_a_request_priority_travels_the_wire_to_the_batcher(tmp_path, repo, fresh_daemon, high):
    """3 rows wait for a fuller batch (300 ms of delay); then 2 rows arrive. At the same
    level the 3 rows go first (the 2 do not fit beside them) and the 2 then wait out the
    delay; with priority 1 (the highest), the 2 rows go at once and the 3 wait instead."""
    models = tmp_path / "models"
    shutil.copytree(os.path.join(repo, "mlp"), models / "mlp")
    (models / "mlp" / "config.toml").write_text(PRIORITY_CONFIG)
    dp = fresh_daemon("--models", str(models), "--no-noop")
    with connect(dp.socket) as c:
        rng = np.random.default_rng(5)
        regions, order = {}, []
        for rows, prio in ((3, 2), (2, 1 if high else 2)):
            ins, _, nbytes = c.shaped_views("mlp", 0, rows)    # (the layout only)
            off = c.alloc(nbytes)
            ins, outs, _ = c.shaped_views("mlp", off, rows)
            x = rng.standard_normal((rows, 16)).astype(np.float32)
            ins["x"][...] = x
            rid = c.predict_shaped("mlp", off, rows, priority=prio)
            regions[rid] = (x, outs, rows)
            time.sleep(0.05)                 # the 3 rows are queued before the 2 arrive
        for _ in regions:
            order.append(c.read_result(timeout=10))
        for rid, (x, outs, rows) in regions.items():
            np.testing.assert_allclose(outs["output0"], reference(repo, x), rtol=1e-5, atol=1e-6)
        first_rows = regions[order[0]][2]
        assert first_rows == (2 if high else 3), order
    assert dp.stop() == 0


def test_a_bad_priority_is_refused_by_the_client(served):
    with connect(served.socket) as c:
        for bad in (-1, 256, 1.0):
            with pytest.raises(ValueError, match=r"priority must be an int 0..255"):
                c.infer("mlp", {"x": np.zeros((1, 16), np.float32)}, rows=1, priority=bad)


@pytest.mark.parametrize("line, reason", [
    ("seed = -1", "seed must be 0 .. 2**32 - 1 (the built-in weights' seed), got -1"),
    ("fairness_threshold = nan", "fairness_threshold >= 0"),
    ('folder = "/etc"', "[batching] folder is the model's own folder, which the daemon "
                        "passes; remove it from config.toml"),
])
def test_orca_options_a_user_cannot_mean_are_refused(tmp_path, line, reason):
    """Found by review: a negative seed was refused by numpy's words, a NaN fairness
    threshold was accepted, and ``folder`` (the daemon's own argument, the base of a
    relative checkpoint path) could be set from config.toml."""
    from paella.dispatcher.daemon.repository import scan
    repo = tmp_path / "models"
    (repo / "g").mkdir(parents=True)
    (repo / "g" / "config.toml").write_text(f'[batching]\nbatcher = "orca"\nconfig = "tiny"\n{line}\n')
    out = scan(str(repo), {}, lambda *a: None)
    failed = {os.path.basename(k): v for k, v in out.failed.items()}
    assert reason in failed["g"], failed
    assert not out.prepared
