"""``paella perf`` against a real daemon: local rings and KServe (HTTP and gRPC), both
sweeps, streamed generations (time to first token, between tokens), the servers' CPU per
request, the outputs (JSON, CSV, plot), and the arrival processes' statistics."""
from __future__ import annotations

import csv
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from paella.client.perf import arrival_gaps
from paella.client.perf_http import H2, grpc_headers
from service_daemon import cleanup, start_kserve

PAELLA = str(Path(sys.executable).with_name("paella"))


def perf(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PAELLA, "perf", *args], capture_output=True, text=True, timeout=120)


def test_concurrency_sweep_over_the_rings_writes_json_csv_and_plot(daemon, tmp_path):
    r = perf("echo", "--socket", daemon.socket, "--concurrency", "1,2", "--seconds", "1",
             "--warmup", "0.2", "--json", str(tmp_path / "p.json"), "--csv",
             str(tmp_path / "p.csv"), "--plot", str(tmp_path / "p.png"))
    assert r.returncode == 0, r.stderr
    assert "[concurrency 2]" in r.stderr                     # progress while it runs
    res = json.loads((tmp_path / "p.json").read_text())
    assert res["transport"] == "local-rings" and [p["concurrency"] for p in res["points"]] == [1, 2]
    for p in res["points"]:
        assert p["requests"] > 0 and p["errors"] == 0
        assert 0 < p["p50_ms"] <= p["p90_ms"] <= p["p99_ms"]
        assert p["throughput_rps"] == pytest.approx(p["requests"] / p["seconds"])
    rows = list(csv.DictReader(open(tmp_path / "p.csv")))
    assert [r["Concurrency"] for r in rows] == ["1", "2"]
    assert int(rows[0]["p99 latency"]) == round(res["points"][0]["p99_ms"] * 1e3)
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("arrivals", ["poisson", "lognormal"])
def test_rate_sweep(daemon, arrivals, tmp_path):
    # 3 points x 30 workers: more connections than a uid may hold at once (64), unless
    # each point's are closed before the next
    r = perf("noop", "--socket", daemon.socket, "--rate", "40,40,40", "--arrivals", arrivals,
             "--sigma", "0.5", "--seconds", "1", "--warmup", "0.1", "--workers", "30",
             "--json", str(tmp_path / "r.json"), "-q")
    assert r.returncode == 0, r.stderr
    points = json.loads((tmp_path / "r.json").read_text())["points"]
    assert len(points) == 3
    for p in points:
        assert p["rate"] == 40 and p["errors"] == 0
        assert 8 <= p["throughput_rps"] <= 120        # 40/s on average, random arrivals


def test_over_kserve(daemon, tmp_path):
    proc, hp, _gp, log = start_kserve(daemon.socket)
    try:
        r = perf("echo", "--kserve", f"127.0.0.1:{hp}", "--concurrency", "2", "--seconds", "1",
                 "--warmup", "0.2", "--json", str(tmp_path / "k.json"), "-q")
        assert r.returncode == 0, r.stderr
        [p] = json.loads((tmp_path / "k.json").read_text())["points"]
        assert p["requests"] > 0 and p["errors"] == 0
        r = perf("nope", "--kserve", f"127.0.0.1:{hp}", "-q")
        assert r.returncode == 2 and "unknown model 'nope'" in r.stderr
        # Triton's priority request parameter, accepted by the front end and the daemon
        r = perf("echo", "--kserve", f"127.0.0.1:{hp}", "--concurrency", "1", "--seconds",
                 "0.5", "--warmup", "0", "--priority", "2", "--json", str(tmp_path / "q.json"),
                 "-q")
        assert r.returncode == 0, r.stderr
        res = json.loads((tmp_path / "q.json").read_text())
        assert res["priority"] == 2 and res["points"][0]["errors"] == 0
    finally:
        proc.terminate()
        proc.wait(15)


def test_bad_targets_are_clear_errors(daemon, tmp_path):
    r = perf("nope", "--socket", daemon.socket, "-q")
    assert r.returncode == 2 and "serves no model 'nope'" in r.stderr
    r = perf("echo", "--socket", str(tmp_path / "none.sock"), "-q")
    assert r.returncode == 2 and "no paella daemon listens" in r.stderr
    r = perf("echo", "--socket", daemon.socket, "--rate", "0")
    assert r.returncode == 2 and "positive numbers" in r.stderr
    assert "Traceback" not in r.stderr
    for bad in ("256", "-1"):
        r = perf("echo", "--socket", daemon.socket, "--priority", bad, "-q")
        assert r.returncode == 2 and "--priority must be 1 (most urgent) .. 255" in r.stderr
        assert "Traceback" not in r.stderr
    # found by review: tracebacks after (or instead of) the whole run
    for args, text in ((["--rate", "nan"], "expected positive numbers"),
                       (["--rate", "inf"], "expected positive numbers"),
                       (["--seconds", "nan"], "must be positive"),
                       (["--csv", str(tmp_path / "no" / "x.csv")], "not a file in an existing"),
                       (["--json", str(tmp_path)], "not a file in an existing directory"),
                       (["--plot", str(tmp_path / "x.xyz")], "the file name must end in one of"),
                       (["--rate", "0.5", "--seconds", "0.5"], "sends no request: raise one")):
        r = perf("echo", "--socket", daemon.socket, *args, "-q")
        assert r.returncode == 2 and text in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = perf("echo", "--kserve", "127.0.0.1:\u00b2", "-q")      # str.isdigit takes "²"
    assert r.returncode == 2 and "--kserve wants HOST:PORT" in r.stderr, r.stderr
    for t in ("nan", "-1"):
        r = subprocess.run([PAELLA, "status", "--socket", daemon.socket, "--timeout", t],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "--timeout must be a number of seconds" in r.stderr
    for args in (["hol", "--jobs", "-1"], ["hol", "--sigma", "nan"], ["mix", "--requests", "0"]):
        r = subprocess.run([PAELLA, "experiment", *args], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 2 and "must be a finite number" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr


def test_a_priority_over_the_rings(daemon, tmp_path):
    r = perf("echo", "--socket", daemon.socket, "--concurrency", "2", "--seconds", "0.5",
             "--warmup", "0", "--priority", "1", "--json", str(tmp_path / "p.json"), "-q")
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "p.json").read_text())
    assert res["priority"] == 1 and res["points"][0]["requests"] > 0
    assert res["points"][0]["errors"] == 0


@pytest.mark.parametrize("arrivals,cv", [("poisson", 1.0), ("lognormal", np.sqrt(np.e - 1)),
                                         ("constant", 0.0)])
def test_arrival_processes_have_the_asked_mean_and_spread(arrivals, cv):
    gaps = arrival_gaps(250.0, arrivals, 1.0, 200_000)
    assert gaps.mean() == pytest.approx(1 / 250, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, abs=0.06)


# --- gRPC, streaming, server CPU ---------------------------------------------------------
@pytest.fixture(scope="module")
def front(daemon):
    """``paella kserve`` in front of the echo daemon: (process, HTTP port, gRPC port)."""
    pytest.importorskip("grpc")
    proc, hp, gp, log = start_kserve(daemon.socket)
    yield proc, hp, gp
    proc.terminate()
    proc.wait(15)
    assert "Traceback" not in log.read_text(), log.read_text()


@pytest.mark.parametrize("client", ["h2", "grpcio"])
def test_over_grpc_with_the_servers_cpu_per_request(daemon, front, client, tmp_path):
    proc, _hp, gp = front
    r = perf("echo", "--grpc", f"127.0.0.1:{gp}", "--grpc-client", client, "--concurrency",
             "1,4", "--seconds", "1", "--warmup", "0.2", "--server-pid", str(proc.pid),
             "--server-pid", str(daemon.pid), "--json", str(tmp_path / "g.json"), "--csv",
             str(tmp_path / "g.csv"), "-q")
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "g.json").read_text())
    assert res["transport"] == "kserve-grpc" and res["grpc_client"] == client
    assert res["server_pids"] == [proc.pid, daemon.pid]
    for p in res["points"]:
        assert p["requests"] > 0 and p["errors"] == 0, p["first_error"]
        by_pid = p["server_cpu_us_per_request_by_pid"]
        # both processes work for every request: the front end decodes and answers it,
        # the daemon runs it (10 ms ticks over a 1 s window of hundreds of requests)
        assert by_pid[str(proc.pid)] > 0 and by_pid[str(daemon.pid)] > 0
        assert p["server_cpu_us_per_request"] == pytest.approx(sum(by_pid.values()))
        assert p["client_cpu_us_per_request"] > 0
    assert "srv us/req" in r.stdout and f"us/req {proc.pid}" in r.stdout
    rows = list(csv.DictReader(open(tmp_path / "g.csv")))
    assert float(rows[0]["Server CPU us/request"]) == pytest.approx(
        res["points"][0]["server_cpu_us_per_request"], abs=0.1)


def test_grpc_errors_and_a_message_larger_than_the_flow_control_windows(front):
    _proc, _hp, gp = front
    r = perf("nope", "--grpc", f"127.0.0.1:{gp}", "-q")
    assert r.returncode == 2 and "unknown model 'nope'" in r.stderr, r.stderr
    r = perf("echo", "--grpc", f"127.0.0.1:{gp}", "--stream", "-q")
    assert r.returncode == 2 and "--stream needs a generative model" in r.stderr, r.stderr
    assert "'echo' has the inputs x" in r.stderr
    # the load generator's own HTTP/2 client waits for the server's WINDOW_UPDATEs: a
    # 12 MB request (the server's windows are 4 MB) arrives whole, and is refused by shape
    from paella.kserve import grpc_predict_v2_pb2 as pb
    c = H2("127.0.0.1", gp, 20)
    block = grpc_headers(f"127.0.0.1:{gp}", "ModelInfer")
    for n, ok in ((3_000_000, False), (256, True), (3_000_000, False), (256, True)):
        req = pb.ModelInferRequest(model_name="echo")
        req.inputs.add(name="x", datatype="FP32", shape=[n])
        req.raw_input_contents.append(np.ones(n, np.float32).tobytes())
        body = req.SerializeToString()
        sid = c.open(block, b"\x00" + len(body).to_bytes(4, "big") + body, end=True)
        got = b""
        while True:
            kind, flags, fsid, payload = c.frame()
            if fsid == sid:
                got += payload if kind == 0 else b""
                if flags & 1:
                    break
        c.done(sid)
        assert (len(got) > 5) == ok
        if ok:
            y = pb.ModelInferResponse.FromString(got[5:]).raw_output_contents[0]
            assert np.frombuffer(y, np.float32).tolist() == [1.0] * 256
    c.close()


def perf_here(capsys, *args: str) -> tuple[int, str]:
    """``paella perf`` in this process (for settings refused before any request: no
    interpreter to start): (exit status, stderr)."""
    from paella.cli import main
    capsys.readouterr()
    code = main(["perf", *args])
    return code, capsys.readouterr().err


def test_bad_ports_and_pids_are_clear_errors(daemon, capsys):
    for opt in ("--grpc", "--kserve"):
        for bad in ("127.0.0.1:99999", "127.0.0.1:x", "127.0.0.1:0", "nohost", ":\u00b2"):
            code, err = perf_here(capsys, "echo", opt, bad, "-q")
            assert code == 2, err
            assert f"paella: error: {opt} wants HOST:PORT with a TCP port 1..65535" in err
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    for bad, text in ((str(gone.pid), f"--server-pid {gone.pid}: no such process"),
                      ("1,abc", "--server-pid wants process ids, got '1,abc'"),
                      ("-5", "--server-pid wants process ids")):
        code, err = perf_here(capsys, "echo", "--socket", daemon.socket, "--server-pid", bad)
        assert code == 2 and f"paella: error: {text}" in err, err
    code, err = perf_here(capsys, "echo", "--socket", daemon.socket, "--stream")
    assert code == 2 and "--stream needs a generative model" in err
    for args in (["--prompt-len", "0"], ["--max-tokens", "-1"]):
        code, err = perf_here(capsys, "echo", "--socket", daemon.socket, *args)
        assert code == 2 and "--prompt-len and --max-tokens must be" in err
    # and as a command: the message, status 2, no traceback
    r = perf("echo", "--grpc", "127.0.0.1:65536", "--server-pid", str(gone.pid), "-q")
    assert r.returncode == 2 and "paella: error: --server-pid" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


@pytest.fixture(scope="module")
def generative(tmp_path_factory):
    """A daemon serving the tiny GPT (``orca``) and ``paella kserve`` in front of it:
    (daemon, HTTP port, gRPC port)."""
    pytest.importorskip("grpc")
    from test_generation import serve
    from paella.client import connect
    dp = serve(tmp_path_factory.mktemp("perfgen"))
    with connect(dp.socket) as c:           # the first generation is slow (its set-up),
        assert len(list(c.generate("gpt-tiny", [1, 2], 2, timeout=60))) == 2  # not timed
    proc, hp, gp, _log = start_kserve(dp.socket)
    yield dp, hp, gp
    proc.terminate()
    proc.wait(15)
    cleanup(dp)


@pytest.mark.parametrize("where", ["rings", "kserve", "grpc", "grpcio"])
def test_streamed_generations_report_time_to_first_token_and_between_tokens(
        generative, where, tmp_path):
    dp, hp, gp = generative
    target = {"rings": ["--socket", dp.socket], "kserve": ["--kserve", f"127.0.0.1:{hp}"],
              "grpc": ["--grpc", f"127.0.0.1:{gp}"],
              "grpcio": ["--grpc", f"127.0.0.1:{gp}", "--grpc-client", "grpcio"]}[where]
    r = perf("gpt-tiny", *target, "--stream", "--prompt-len", "5", "--max-tokens", "6",
             "--concurrency", "2", "--seconds", "1", "--warmup", "0.2", "--json",
             str(tmp_path / "s.json"), "--csv", str(tmp_path / "s.csv"), "-q")
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "s.json").read_text())
    assert res["stream"] and (res["prompt_len"], res["max_tokens"]) == (5, 6)
    [p] = res["points"]
    assert p["requests"] > 0 and p["errors"] == 0, p["first_error"]
    assert 0 < p["ttft_p50_ms"] <= p["ttft_p99_ms"] and 0 < p["tbt_p50_ms"] <= p["tbt_p99_ms"]
    # each request's first token comes before its end, so every percentile does too
    assert p["ttft_p50_ms"] <= p["p50_ms"] and p["ttft_p99_ms"] <= p["p99_ms"]
    assert p["tokens_per_s"] == pytest.approx(p["requests"] * 6 / p["seconds"])
    assert "TTFT p50" in r.stdout and "TBT p99" in r.stdout
    [row] = csv.DictReader(open(tmp_path / "s.csv"))
    assert int(row["TTFT p50"]) == round(p["ttft_p50_ms"] * 1e3)


def test_generative_models_without_stream_and_bad_lengths(generative, tmp_path):
    dp, hp, _gp = generative
    # unstreamed: whole generations of the asked length (valid inputs, not random ones)
    r = perf("gpt-tiny", "--kserve", f"127.0.0.1:{hp}", "--concurrency", "1", "--seconds",
             "0.5", "--warmup", "0", "--json", str(tmp_path / "w.json"), "-q")
    assert r.returncode == 0, r.stderr
    [p] = json.loads((tmp_path / "w.json").read_text())["points"]
    assert p["requests"] > 0 and p["errors"] == 0 and p["ttft_p50_ms"] is None
    r = perf("gpt-tiny", "--socket", dp.socket, "--stream", "--prompt-len", "65", "-q")
    assert r.returncode == 2 and "--prompt-len 65: model 'gpt-tiny' takes prompts of 64 " \
        "tokens at most" in r.stderr, r.stderr
    # refused by the daemon (the context is 64 tokens): errors, with the daemon's reason
    t0 = time.monotonic()
    r = perf("gpt-tiny", "--socket", dp.socket, "--stream", "--prompt-len", "60",
             "--max-tokens", "30", "--seconds", "0.3", "--warmup", "0", "-q")
    assert r.returncode == 1 and "exceeds the model's context of 64 tokens" in r.stderr
    assert time.monotonic() - t0 < 30


def test_hand_encoded_kserve_messages_match_the_generated_ones():
    """paella perf encodes the few KServe messages it needs by hand (the client does not
    import the front end): what it writes parses as the protocol's message, and what it
    reads of the protocol's messages is what they hold."""
    from paella.client.kserve_messages import infer_request, model_metadata, stream_response
    from paella.kserve import grpc_predict_v2_pb2 as pb
    raw = np.arange(6, dtype=np.float32).tobytes()
    req = pb.ModelInferRequest.FromString(
        infer_request("echo", [("x", "FP32", [2, 3], raw)], {"priority": 3, "timeout": -1}))
    assert req.model_name == "echo" and req.raw_input_contents == [raw]
    assert [(t.name, t.datatype, list(t.shape)) for t in req.inputs] == [("x", "FP32", [2, 3])]
    assert req.parameters["priority"].int64_param == 3
    assert req.parameters["timeout"].int64_param == -1
    md = pb.ModelMetadataResponse(name="m", inputs=[
        pb.ModelMetadataResponse.TensorMetadata(name="a", datatype="INT32", shape=[64]),
        pb.ModelMetadataResponse.TensorMetadata(name="b", datatype="FP16", shape=[1, 2])],
        outputs=[pb.ModelMetadataResponse.TensorMetadata(name="y", datatype="FP32", shape=[4])])
    assert model_metadata(md.SerializeToString()) == (
        {"a": ("INT32", (64,)), "b": ("FP16", (1, 2))}, {"y"})
    for final in (True, False):
        r = pb.ModelStreamInferResponse()
        r.infer_response.parameters["triton_final_response"].bool_param = final
        r.infer_response.parameters["index"].int64_param = 5
        assert stream_response(r.SerializeToString()) == ("", final)
    assert stream_response(pb.ModelStreamInferResponse(error_message="no").SerializeToString()) \
        == ("no", False)
