"""Generation served by the real daemon (Orca as the ``orca`` scheduler plug-in, loaded
through its entry point), streamed over the rings to client processes.

The daemon serves a model repository of ``config.toml``-only folders (docs/step-scheduler.md,
"Serving generation from the daemon"): ``gpt-tiny`` (the tiny GPT, 4 requests a
batch), ``gpt-tight`` (a KV cache of 64 slots: one long generation at a time) and
``gpt-bad`` (a plug-in installed for real that raises after its third token). Tokens
are checked against ``generate_reference``: the same seeded weights, recomputed from
scratch in numpy."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from paella import rings, wire
from paella.client import RequestFailed, connect
from paella.models.gpt import GPTConfig, generate_reference, gpt_weights
from service_daemon import cleanup, start_daemon

CFG = GPTConfig.tiny()
W = gpt_weights(CFG)

RAISING = '''
from paella.stepsched.orca_plugin import OrcaScheduler


class RaisingOrca(OrcaScheduler):
    """Raises in its third token's callback: a plug-in bug in the middle of serving."""
    name = "orca-raising"

    def _token(self, req, tok):
        if len(self._streams[id(req)].tokens) == 3:
            raise RuntimeError("plug-in bug at the third token")
        super()._token(req, tok)


class GarbageVariants(OrcaScheduler):
    """Describes its io to clients as something no client can read."""
    name = "orca-garbage"

    def client_variants(self):
        return ["not a variant"]
'''


def model_repository(root: Path) -> Path:
    models = root / "models"
    for name, body in {"gpt-tiny": "max_bs = 4\nn_slots = 256\n",
                       "gpt-tight": "max_bs = 2\nn_slots = 64\n",
                       "gpt-bad": None, "gpt-bad2": None, "gpt-bad3": None}.items():
        (models / name).mkdir(parents=True)
        batcher = "orca-raising" if body is None else "orca"
        (models / name / "config.toml").write_text(
            f'[batching]\nbatcher = "{batcher}"\nconfig = "tiny"\n{body or ""}')
    (root / "plugin").mkdir()
    (root / "plugin" / "paella_test_orca.py").write_text(RAISING)
    info = root / "plugin" / "paella_test_orca-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: paella-test-orca\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[paella.batchers]\norca-raising = paella_test_orca:RaisingOrca\n"
        "orca-garbage = paella_test_orca:GarbageVariants\n")
    return models


def serve(root: Path, *args: str, env: dict[str, str] | None = None, ready: bool = True):
    models = model_repository(root)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(root / "plugin"),
                                                       os.environ.get("PYTHONPATH")])),
           **(env or {})}
    return start_daemon("--backend", "sim", "--models", str(models), *args, env=env,
                        ready=ready)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    dp = serve(tmp_path_factory.mktemp("gen"))
    yield dp
    cleanup(dp)


def stream_raw(c, model: str, prompt: list[int], max_tokens: int) -> tuple[int, int, np.ndarray]:
    """Send one STREAM request by hand: (req id, io offset, the tokens view)."""
    v = c.model(model).variants[0]
    off = c.alloc(v.io_bytes)
    ins, outs = c.io_views(model, off)
    ins["prompt"][:len(prompt)] = prompt
    ins["lengths"][:] = (len(prompt), max_tokens)
    return c.predict(model, v.io_bytes, off, wire.STREAM), off, outs["tokens"]


def entries(c, until_done: set[int], timeout: float = 20.0) -> list[tuple[int, int, object]]:
    """Every completion-ring entry (progress and completions) until each request in
    ``until_done`` has its completion."""
    got, deadline = [], time.monotonic() + timeout
    left = set(until_done)
    while left:
        e = c._completions.pop()
        if e is None:
            assert time.monotonic() < deadline, f"no completion for {left} in {timeout} s"
            continue
        got.append(e)
        if e[1] != rings.PROGRESS:
            left.discard(e[0])
    return got


GENERATE = textwrap.dedent('''
    import json, sys, time
    import paella
    prompt, n, start = json.loads(sys.argv[1])
    c = paella.connect(SOCK)
    while time.time() < start:
        time.sleep(0.001)
    times, tokens = [], []
    for t in c.generate("gpt-tiny", prompt, n, timeout=30):
        tokens.append(t)
        times.append(time.time())
    print(json.dumps({"tokens": tokens, "first": times[0], "end": time.time()}))
''')


def test_two_client_processes_stream_the_reference_tokens(daemon):
    start = time.time() + 2.0       # both start generating at once, after their imports
    jobs = {tuple(p): subprocess.Popen(
        [sys.executable, "-c", f"SOCK = {daemon.socket!r}\n" + GENERATE,
         json.dumps([p, 40, start])], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for p in ([3, 7, 1, 9], [60, 2, 2, 5, 11, 40])}
    for prompt, proc in jobs.items():
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        r = json.loads(out)
        assert r["tokens"] == generate_reference(CFG, W, list(prompt), 40)
        assert r["first"] < r["end"]


def test_progress_entries_come_in_order_before_the_one_completion(daemon):
    with connect(daemon.socket, mode="polling") as c:
        rid, off, tokens = stream_raw(c, "gpt-tiny", [5, 4, 3], 20)
        got = entries(c, {rid})
    assert [e[0] for e in got] == [rid] * 21
    assert [e[1:] for e in got] == [(rings.PROGRESS, n) for n in range(1, 21)] + [(rings.OK, "")]
    assert tokens.tolist()[:20] == generate_reference(CFG, W, [5, 4, 3], 20)


def test_read_result_skips_progress_entries_and_keeps_no_count(daemon):
    """A STREAM request read the plain way: read_result returns its completion only."""
    with connect(daemon.socket) as c:
        rid, off, tokens = stream_raw(c, "gpt-tiny", [6, 1], 15)
        assert c.read_result(timeout=20) == rid
        assert c.in_flight == 0 and not c._progress
        assert tokens.tolist()[:15] == generate_reference(CFG, W, [6, 1], 15)


@pytest.mark.parametrize("mode", ["hybrid", "socket", "polling"])
def test_generate_in_every_wait_mode(daemon, mode):
    with connect(daemon.socket, mode=mode) as c:
        assert list(c.generate("gpt-tiny", [2, 9], 12, timeout=20)) == \
            generate_reference(CFG, W, [2, 9], 12)
        assert c.in_flight == 0 and not c._progress


def test_plain_infer_of_a_generative_model_gets_the_tokens_without_progress(daemon):
    """No STREAM bit: no progress entry, one completion, all the tokens in the io."""
    with connect(daemon.socket, mode="polling") as c:
        out = c.infer("gpt-tiny", {"prompt": np.r_[[9, 8], np.zeros(62)],
                                   "lengths": np.array([2, 5])}, timeout=20)
    assert out["n_tokens"][0] == 5
    assert out["tokens"][:5].tolist() == generate_reference(CFG, W, [9, 8], 5)


@pytest.mark.parametrize("prompt,max_tokens,reason", [
    ([1, 64, 2], 4, "token id 64 is outside the vocabulary [0, 64)"),
    ([1, -3], 4, "token id -3 is outside the vocabulary"),
    ([1] * 60, 5, "prompt (60) + max_tokens (5) = 65 exceeds the model's context of 64"),
    ([1, 2], 0, "max_tokens must be >= 1, got 0"),
    ([1, 2], 10 ** 6, "exceeds the model's context of 64 tokens"),
    ([], 4, "the prompt length must be 1..64 tokens, got 0"),
])
def test_bad_generation_requests_get_a_clean_error(daemon, prompt, max_tokens, reason):
    with connect(daemon.socket) as c:
        with pytest.raises(RequestFailed) as e:
            list(c.generate("gpt-tiny", prompt, max_tokens, timeout=20))
        assert e.value.status == rings.E_OPTIONS and reason in str(e.value)
        assert list(c.generate("gpt-tiny", [1, 2], 3, timeout=20)) == \
            generate_reference(CFG, W, [1, 2], 3)


def test_a_prompt_beyond_the_io_is_refused_by_the_client(daemon):
    with connect(daemon.socket) as c:
        with pytest.raises(ValueError, match="takes at most 64"):
            next(c.generate("gpt-tiny", [1] * 65, 1))
        with pytest.raises(ValueError, match="not a generative model"):
            next(c.generate("echo", [1], 1))


VANISH = textwrap.dedent('''
    import os, time
    from paella import connect, rings, wire
    c = connect(SOCK, mode="polling")
    v = c.model("gpt-tight").variants[0]
    off = c.alloc(v.io_bytes)
    ins, outs = c.io_views("gpt-tight", off)
    ins["prompt"][:4] = [1, 2, 3, 4]
    ins["lengths"][:] = (4, 56)
    rid = c.predict("gpt-tight", v.io_bytes, off, wire.STREAM)
    seen = []
    while not seen:
        e = c._completions.pop()
        if e is not None:
            seen.append(e[1])
    while (e := c._completions.pop()) is not None:    # a last look: still running?
        seen.append(e[1])
    print(seen[0], "running" if rings.OK not in seen else "finished", flush=True)
    os._exit(0)                  # gone mid-generation, socket and all
''')


def test_a_client_vanishing_mid_generation_gives_its_kv_slots_back(daemon):
    """gpt-tight's cache (64 slots) holds one 60-token generation: the next one is only
    admitted once the vanished client's slots are back. Its generation takes ~150 ms,
    so it is nearly always still running when the client dies (it looks last thing);
    a rare run where it had finished is repeated."""
    for attempt in range(3):
        r = subprocess.run([sys.executable, "-c", f"SOCK = {daemon.socket!r}\n" + VANISH],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and r.stdout.split()[0] == str(rings.PROGRESS), r.stderr
        with connect(daemon.socket) as c:     # needs all but 4 of the 64 slots
            assert list(c.generate("gpt-tight", [4, 3, 2, 1], 56, timeout=20)) == \
                generate_reference(CFG, W, [4, 3, 2, 1], 56)
        if r.stdout.split()[1] == "running":
            return
    pytest.fail("the client never vanished mid-generation in 3 attempts")


def test_a_client_that_never_reads_its_ring_cannot_stall_anyone(tmp_path):
    """Ring of 8 slots: progress entries fill the free ones, the rest are skipped; the
    completion still comes, and another client is served meanwhile."""
    dp = serve(tmp_path, "--ring-slots", "8")
    try:
        with connect(dp.socket, mode="polling") as lazy, connect(dp.socket) as other:
            rid, off, tokens = stream_raw(lazy, "gpt-tiny", [7, 7], 50)
            for _ in range(3):                  # served while the lazy ring is full
                assert list(other.generate("gpt-tiny", [3], 30, timeout=20)) == \
                    generate_reference(CFG, W, [3], 30)
            got = entries(lazy, {rid})
            status = other.status()
        progress = [e[2] for e in got if e[1] == rings.PROGRESS]
        assert got[-1] == (rid, rings.OK, "") and len(got) <= 8
        assert progress == sorted(set(progress)) and len(progress) == 7   # 8 - 1 reserved
        assert tokens.tolist()[:50] == generate_reference(CFG, W, [7, 7], 50)
        assert status["stats"]["progress_skipped"] >= 50 - 7 - 1        # the rest
        assert dp.stop() == 0
    finally:
        cleanup(dp)


def test_a_raising_scheduler_answers_its_requests_and_the_rest_is_served(daemon):
    with connect(daemon.socket) as c:
        got = []
        with pytest.raises(RequestFailed) as e:
            for t in c.generate("gpt-bad", [1, 2, 3], 10, timeout=20):
                got.append(t)
        assert e.value.status == rings.E_INTERNAL
        assert e.value.reason.startswith(
            "gpt-bad out of service: scheduler 'orca-raising' raised in on_done(): "
            "RuntimeError: plug-in bug at the third token")
        assert got == generate_reference(CFG, W, [1, 2, 3], 2)      # streamed before it broke
        with pytest.raises(RequestFailed, match="out of service"):  # and later ones at once
            list(c.generate("gpt-bad", [1], 2, timeout=20))
        assert list(c.generate("gpt-tiny", [1, 2, 3], 4, timeout=20)) == \
            generate_reference(CFG, W, [1, 2, 3], 4)
    log = daemon.log()
    assert "Traceback" in log and "plug-in bug at the third token" in log


def test_tokens_announced_before_a_failure_read_in_one_drain_are_still_yielded(daemon):
    """The reader is held off (another thread holds the receive lock) until the progress
    entries and the failure are all on the ring: generate() then reads them in one drain,
    and still yields the two tokens announced before the scheduler broke."""
    import threading
    with connect(daemon.socket) as c:
        held, release = threading.Event(), threading.Event()

        def hold():
            with c._recv_lock:
                held.set()
                release.wait(20)
        t = threading.Thread(target=hold)
        t.start()
        held.wait(5)
        got = []
        it = c.generate("gpt-bad2", [1, 2, 3], 10, timeout=20)
        threading.Timer(1.0, release.set).start()    # the iterations take ~20 ms each
        with pytest.raises(RequestFailed, match="plug-in bug at the third token"):
            for tok in it:
                got.append(tok)
        t.join()
        assert got == generate_reference(CFG, W, [1, 2, 3], 2)
        assert not c._progress and not c._streaming     # nothing kept for it


@pytest.mark.parametrize("drain", ["10", "0"])
def test_sigterm_with_generations_in_flight_answers_each_exactly_once(tmp_path, drain):
    """drain 10 s: the generations finish (the reference tokens); drain 0: each is
    answered cancelled. Either way one completion per request, then exit 0."""
    dp = serve(tmp_path, "--drain-seconds", drain)
    try:
        with connect(dp.socket, mode="polling") as c:
            sent = {}
            for i, prompt in enumerate(([1, 2], [3, 4, 5], [6])):
                rid, off, tokens = stream_raw(c, "gpt-tiny", prompt, 50)
                sent[rid] = (prompt, tokens)
            while c._completions.ready() is False:
                pass                             # the first token: they are running
            dp.proc.send_signal(signal.SIGTERM)
            got = entries(c, set(sent))
            assert dp.proc.wait(20) == 0
            finals = [e for e in got if e[1] != rings.PROGRESS]
            assert sorted(e[0] for e in finals) == sorted(sent)          # once each
            for rid, status, reason in finals:
                if drain == "10":
                    assert status == rings.OK
                    prompt, tokens = sent[rid]
                    assert tokens.tolist()[:50] == generate_reference(CFG, W, prompt, 50)
                else:
                    assert status == rings.E_CANCELLED and "drain deadline" in reason
    finally:
        cleanup(dp)


def test_the_readme_generation_snippet_runs_as_written(daemon):
    from test_readme_steps import README, _python_blocks
    [snippet] = _python_blocks(README, "Generation, streamed token by token")
    assert 'paella.generate("gpt-tiny", [3, 7, 1, 9], max_tokens=6)' in snippet
    r = subprocess.run([sys.executable, "-c", snippet.replace('"/tmp/paella.sock"',
                                                              repr(daemon.socket))],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(generate_reference(CFG, W, [3, 7, 1, 9], 6))


def test_sighup_with_a_changed_config_serves_the_new_and_loses_nothing(tmp_path):
    """A generation in flight across a reload of its model gets all its tokens, and the
    reloaded model serves. (Whether the reload's swap lands before the generation ends
    depends on timing; the old scheduler finishing its requests after a swap is
    tests/stepsched/test_orca_plugin.py's reload test, deterministic in virtual time.)"""
    dp = serve(tmp_path)
    try:
        with connect(dp.socket, mode="polling") as c:
            models = c.status()["dispatcher"]["models"]
            rid, off, tokens = stream_raw(c, "gpt-tiny", [4, 4], 50)
            while not c._completions.ready():
                pass                                      # it runs
            cfg = tmp_path / "models" / "gpt-tiny" / "config.toml"
            cfg.write_text(cfg.read_text().replace("max_bs = 4", "max_bs = 2"))
            os.utime(cfg, (time.time() + 5, time.time() + 5))    # a newer mtime for sure
            dp.proc.send_signal(signal.SIGHUP)
            got = entries(c, {rid})
            assert got[-1] == (rid, rings.OK, "")
            assert tokens.tolist()[:50] == generate_reference(CFG, W, [4, 4], 50)
            deadline = time.monotonic() + 20
            while "SIGHUP: repository read" not in dp.log():
                assert time.monotonic() < deadline, dp.log()
                time.sleep(0.05)
            assert list(c.generate("gpt-tiny", [4, 4], 5, timeout=20)) == \
                generate_reference(CFG, W, [4, 4], 5)
            # The old scheduler's internal models went with it (retired, then freed).
            while c.status()["dispatcher"]["models"] != models:
                assert time.monotonic() < deadline, c.status()["dispatcher"]
                time.sleep(0.05)
        log = dp.log()
        assert "1 new or changed" in log and "registered gpt-tiny" in log
        assert dp.stop() == 0
    finally:
        cleanup(dp)


def test_a_device_lost_mid_generation_fails_it_once_and_the_daemon_exits(tmp_path):
    """The simulated GPU is lost at its 40th launch (the noop model's profiling took 2;
    an iteration of the tiny GPT is a dozen): the generation has streamed some tokens,
    then fails with the reason, once; the daemon exits for systemd to restart it."""
    from paella.dispatcher.daemon import EXIT_DEVICE_LOST
    dp = serve(tmp_path, env={"PAELLA_SIM_LOSE_DEVICE_AFTER": "40"})
    try:
        with connect(dp.socket, mode="polling") as c:
            rid, off, tokens = stream_raw(c, "gpt-tiny", [2, 2, 2], 40)
            got = entries(c, {rid})
        assert dp.proc.wait(15) == EXIT_DEVICE_LOST
        finals = [e for e in got if e[1] != rings.PROGRESS]
        assert len(finals) == 1 and finals[0][1] == rings.E_FAILED
        assert "GPU failed" in finals[0][2]
        n = max((e[2] for e in got if e[1] == rings.PROGRESS), default=0)
        assert 0 < n < 40
        assert tokens.tolist()[:n] == generate_reference(CFG, W, [2, 2, 2], n)
    finally:
        cleanup(dp)


def test_a_client_corrupting_its_ring_mid_stream_is_dropped_and_its_slots_come_back(daemon):
    """Its completion head moved past the tail between two progress entries: the next
    progress push finds it (inside the scheduler's callback) and drops the client; its
    generation is cancelled, and gpt-tight's 64 slots serve the next long one."""
    from paella.client import DaemonError, DaemonGone
    c = connect(daemon.socket, mode="polling")
    rid, off, tokens = stream_raw(c, "gpt-tight", [1, 1, 1, 1], 56)
    while c._completions.pop() is None:
        pass                                              # its first token
    c._seg.hdr[rings.CMP_HEAD] = int(c._seg.hdr[rings.CMP_TAIL]) + 5
    deadline = time.monotonic() + 20
    with pytest.raises(DaemonError) as e:
        while time.monotonic() < deadline:
            c._pump(block=True, timeout=1.0)              # the ERROR frame
    assert e.value.code == "ring_corrupt"
    with pytest.raises(DaemonGone):                       # then the connection's end
        while time.monotonic() < deadline:
            c._pump(block=True, timeout=1.0)
    c.close()
    with connect(daemon.socket) as other:
        assert list(other.generate("gpt-tight", [4, 3, 2, 1], 56, timeout=20)) == \
            generate_reference(CFG, W, [4, 3, 2, 1], 56)


def _post(port: int, path: str, body: object) -> tuple[int, str, bytes]:
    import http.client
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.getheader("Content-Type", ""), r.read()
    finally:
        conn.close()


def _events(data: bytes) -> list[dict]:
    """Server-sent events: one ``data: JSON`` line and a blank line each."""
    chunks = data.decode().split("\n\n")
    assert chunks[-1] == ""
    assert all(c.startswith("data: ") for c in chunks[:-1]), chunks
    return [json.loads(c[len("data: "):]) for c in chunks[:-1]]


def test_kserve_generate_and_generate_stream(daemon):
    """Triton's generate extension over the KServe front end: the reference tokens, all
    at once and as one event each; refusals as error statuses; a failure after the
    first token as the stream's last event; the front end serves on."""
    from service_daemon import start_kserve
    proc, hp, _gp, log = start_kserve(daemon.socket)
    try:
        want = generate_reference(CFG, W, [3, 1, 4], 12)
        st, ctype, body = _post(hp, "/v2/models/gpt-tiny/generate",
                                {"prompt_ids": [3, 1, 4], "max_tokens": 12})
        assert st == 200 and json.loads(body) == {"model_name": "gpt-tiny", "model_version": "1",
                                                  "token_ids": want}
        st, ctype, body = _post(hp, "/v2/models/gpt-tiny/generate_stream",
                                {"prompt_ids": [3, 1, 4], "parameters": {"max_tokens": 12,
                                                                         "priority": 1}})
        assert st == 200 and ctype == "text/event-stream"
        ev = _events(body)
        assert [e["token_id"] for e in ev[:-1]] == want
        assert [e["index"] for e in ev[:-1]] == list(range(12))
        assert ev[-1] == {"model_name": "gpt-tiny", "model_version": "1", "done": True,
                          "n_tokens": 12}
        # refused before any token: a status, no stream
        for req, status, text in (
                ({"prompt_ids": "1 2", "max_tokens": 3}, 400, "prompt_ids"),
                ({"prompt_ids": [1, True], "max_tokens": 3}, 400, "prompt_ids"),
                ({"prompt_ids": [1], "max_tokens": -1}, 400, "max_tokens"),
                ({"prompt_ids": [1]}, 400, "max_tokens"),
                ({"prompt_ids": [1] * 65, "max_tokens": 1}, 400, "at most 64"),
                ({"prompt_ids": [1], "max_tokens": 2, "parameters": {"priority": 300}}, 400,
                 "priority"),
                ({"prompt_ids": [CFG.vocab + 5], "max_tokens": 2}, 400, "outside the vocabulary")):
            st, ctype, body = _post(hp, "/v2/models/gpt-tiny/generate_stream", req)
            assert st == status and ctype == "application/json", (req, st, body)
            assert text in json.loads(body)["error"], (req, body)
        st, _, body = _post(hp, "/v2/models/echo/generate", {"prompt_ids": [1], "max_tokens": 1})
        assert st == 400 and "not a generative model" in json.loads(body)["error"]
        # a scheduler that raises at its third token: two events, then the error
        st, ctype, body = _post(hp, "/v2/models/gpt-bad3/generate_stream",
                                {"prompt_ids": [1, 2, 3], "max_tokens": 10})
        ev = _events(body)
        assert st == 200 and [e.get("token_id") for e in ev[:-1]] == \
            generate_reference(CFG, W, [1, 2, 3], 2)
        assert "plug-in bug at the third token" in ev[-1]["error"], ev[-1]
        st, _, body = _post(hp, "/v2/models/gpt-tiny/generate",
                            {"prompt_ids": [2], "max_tokens": 4})
        assert st == 200 and json.loads(body)["token_ids"] == generate_reference(CFG, W, [2], 4)
    finally:
        proc.terminate()
        proc.wait(15)


def test_generations_are_counted_in_the_metrics(tmp_path):
    """A scheduler plug-in answers its requests itself (no job of theirs: its iterations
    are jobs of internal requests): they are counted under the model's name all the
    same, successes and refusals."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families
    from service_daemon import free_port
    port = free_port()
    dp = serve(tmp_path, "--metrics-port", str(port))
    try:
        with connect(dp.socket) as c:
            for n in (3, 5):
                assert list(c.generate("gpt-tiny", [1, 2], n, timeout=20)) == \
                    generate_reference(CFG, W, [1, 2], n)
            with pytest.raises(RequestFailed):
                list(c.generate("gpt-tiny", [1, 64], 2, timeout=20))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        got = {(s.name, s.labels.get("model")): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
        assert got[("nv_inference_request_success", "gpt-tiny")] == 2
        assert got[("nv_inference_request_failure", "gpt-tiny")] == 1
        assert got[("nv_inference_count", "gpt-tiny")] == 3
    finally:
        cleanup(dp)


def test_status_counts_the_kv_cache_under_the_model_clients_name(daemon):
    per_slot = CFG.kv_bytes_per_slot()
    with connect(daemon.socket) as c:
        list(c.generate("gpt-tiny", [1, 2, 3], 4, timeout=30))
        st = c.status()
    mem = {m["name"]: m["device_memory_bytes"] for m in st["models"]}
    assert mem["gpt-tiny"] >= 256 * per_slot and mem["gpt-tight"] >= 64 * per_slot
    assert sum(mem.values()) <= st["dispatcher"]["device_memory_bytes"]


def test_orca_on_the_simulator_in_its_own_process_is_refused_with_the_reason(tmp_path):
    """The child process applies a kernel's effect when its completion arrives, after the
    notifQ showed it: a step's tokens were read before they existed (KeyError, and the
    daemon died at the first generation). Now the model is not served, with the fix."""
    dp = serve(tmp_path, "--sim-mode", "process", ready=False)
    try:
        assert dp.proc.wait(timeout=120) == 2    # its every model is orca: nothing to serve
        log = dp.log()
    finally:
        cleanup(dp)
    assert "reads its kernels' functional effects as they complete" in log
    assert "--sim-mode stepped, the default" in log and "Traceback" not in log


def test_a_scheduler_describing_its_io_wrongly_is_not_served_and_the_rest_is(tmp_path):
    """Its client_variants() went into every client's HELLO reply: every connection
    failed, for every model. Now that model is refused at load, with the reason."""
    models = model_repository(tmp_path)
    (models / "gpt-garbage").mkdir()
    (models / "gpt-garbage" / "config.toml").write_text(
        '[batching]\nbatcher = "orca-garbage"\nconfig = "tiny"\n')
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path / "plugin"),
                                                       os.environ.get("PYTHONPATH")]))}
    dp = start_daemon("--backend", "sim", "--models", str(models), env=env)
    try:
        with connect(dp.socket) as c:
            assert "gpt-garbage" not in c.models and "gpt-tiny" in c.models
            assert list(c.generate("gpt-tiny", [3, 7, 1], 5, timeout=30)) == \
                generate_reference(CFG, W, [3, 7, 1], 5)
        assert "client_variants() must return a list of wire.VariantInfo" in dp.log()
    finally:
        cleanup(dp)
