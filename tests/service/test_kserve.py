"""The KServe v2 front end (``paella kserve``) against a real daemon, with the unmodified
``tritonclient`` (http and grpc) as the client, and hostile HTTP bodies."""
from __future__ import annotations

import http.client
import json
import os
import socket

import numpy as np
import pytest

tritonhttp = pytest.importorskip("tritonclient.http")
tritongrpc = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

from service_daemon import start_kserve  # noqa: E402


@pytest.fixture(scope="module")
def kserve(daemon):
    proc, hp, gp, log = start_kserve(daemon.socket)
    yield hp, gp, log
    proc.terminate()
    assert proc.wait(15) == 0, log.read_text()


def raw(port: int, method: str, path: str, body: bytes = b"",
        headers: dict | None = None) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=15)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        data = r.read()
        return r.status, dict(r.getheaders()), data
    finally:
        conn.close()


X = np.arange(256, dtype=np.float32) / 7


@pytest.mark.parametrize("binary", [True, False])
def test_tritonclient_http(kserve, binary):
    c = tritonhttp.InferenceServerClient(f"127.0.0.1:{kserve[0]}")
    assert c.is_server_live() and c.is_server_ready()
    assert "binary_tensor_data" in c.get_server_metadata()["extensions"]
    assert c.is_model_ready("echo") and c.is_model_ready("echo", "1")
    assert not c.is_model_ready("nope")
    md = c.get_model_metadata("echo")
    assert md["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [256]}]
    assert md["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [256]}]
    inp = tritonhttp.InferInput("x", [256], "FP32")
    inp.set_data_from_numpy(X, binary_data=binary)
    out = c.infer("echo", [inp], outputs=[tritonhttp.InferRequestedOutput("y", binary_data=binary)],
                  request_id="r1", priority=1)           # (Triton's parameter, passed on)
    assert np.array_equal(out.as_numpy("y"), X) and out.get_response()["id"] == "r1"
    noop = tritonhttp.InferInput("x", [64], "UINT8")
    noop.set_data_from_numpy(np.zeros(64, np.uint8), binary_data=binary)
    assert c.infer("noop", [noop]).get_response()["outputs"] == []


def test_tritonclient_grpc(kserve):
    c = tritongrpc.InferenceServerClient(f"127.0.0.1:{kserve[1]}")
    assert c.is_server_live() and c.is_server_ready()
    assert c.is_model_ready("echo") and not c.is_model_ready("nope")
    md = c.get_model_metadata("echo", as_json=True)
    assert md["inputs"] == [{"name": "x", "datatype": "FP32", "shape": ["256"]}]
    inp = tritongrpc.InferInput("x", [256], "FP32")
    inp.set_data_from_numpy(X)
    out = c.infer("echo", [inp], outputs=[tritongrpc.InferRequestedOutput("y")], priority=2)
    assert np.array_equal(out.as_numpy("y"), X)
    bad = tritongrpc.InferInput("x", [255], "FP32")
    bad.set_data_from_numpy(X[:255])
    with pytest.raises(InferenceServerException, match=r"has shape \[256\], got \[255\]"):
        c.infer("echo", [bad])
    with pytest.raises(InferenceServerException, match="unknown model 'nope'"):
        c.infer("nope", [inp])
    wrong = tritongrpc.InferInput("x", [256], "FP64")
    wrong.set_data_from_numpy(X.astype(np.float64))
    with pytest.raises(InferenceServerException, match="has datatype FP32, got FP64"):
        c.infer("echo", [wrong])


@pytest.mark.parametrize("body", [b"\xff\xff\xff\xff", b"\x0a\x05ab", b"\x0a\x02\xc3\x28"],
                         ids=["garbage", "truncated", "bad-utf8-name"])
def test_grpc_bytes_that_are_not_the_message_are_invalid_argument(kserve, body):
    """The client's bytes are the client's fault: INVALID_ARGUMENT naming the message
    expected (grpcio's own deserializer said INTERNAL), and the server serves on."""
    import grpc
    with grpc.insecure_channel(f"127.0.0.1:{kserve[1]}") as ch:
        infer = ch.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        with pytest.raises(grpc.RpcError) as e:
            infer(body, timeout=15)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid inference.ModelInferRequest message" in e.value.details()
    assert tritongrpc.InferenceServerClient(f"127.0.0.1:{kserve[1]}").is_server_live()


def _infer_body(**over) -> bytes:
    req = {"inputs": [{"name": "x", "shape": [256], "datatype": "FP32", "data": X.tolist()}]}
    req["inputs"][0].update(over)
    return json.dumps(req).encode()


HOSTILE = [
    ("wrong-shape", _infer_body(shape=[2, 128]), {}, 400, "has shape [256], got [2, 128]"),
    ("wrong-dtype", _infer_body(datatype="INT8"), {}, 400, "has datatype FP32, got INT8"),
    ("bytes-dtype", _infer_body(datatype="BYTES"), {}, 400, "has datatype FP32"),
    ("too-few-elements", _infer_body(data=[1.0, 2.0]), {}, 400, "needs 256 elements, data has 2"),
    ("strings-as-data", _infer_body(data=["a"] * 256), {}, 400, "data must be numbers"),
    ("ragged-data", _infer_body(data=[[1.0], [1.0, 2.0]]), {}, 400, "not a regular array"),
    ("malformed-json", b'{"inputs": [', {}, 400, "not valid JSON"),
    ("not-an-object", b"[1, 2]", {}, 400, "must be a JSON object"),
    ("deep-nesting", b"[" * 30000 + b"]" * 30000, {}, 400, "nests deeper than"),
    # larger than echo's inputs can need: refused unread
    ("deeper-than-the-model-needs", b"[" * 100000 + b"]" * 100000, {}, 413,
     "exceeds the limit of 74752 (what model 'echo''s inputs can take)"),
    ("no-inputs", b"{}", {}, 400, "needs \"inputs\""),
    ("unknown-input", _infer_body(name="z"), {}, 400, "has no input 'z'"),
    ("binary-size-past-the-end", _infer_body(parameters={"binary_data_size": 1024}),
     {"Inference-Header-Content-Length": "-1"}, 400, "Inference-Header-Content-Length"),
    ("binary-size-too-large", b"", {"binary": 1}, 400, "exceeds the"),
    ("unknown-output", json.dumps({"inputs": json.loads(_infer_body())["inputs"],
                                   "outputs": [{"name": "q"}]}).encode(), {}, 400, "asked for q"),
    ("output-name-not-a-string", json.dumps({"inputs": json.loads(_infer_body())["inputs"],
                                             "outputs": [{"name": [1]}]}).encode(), {}, 400,
     "asked for [1]"),
    ("header-length-not-ascii-digits", _infer_body(), {"Inference-Header-Content-Length": "\u00b2"},
     400, "Inference-Header-Content-Length"),
    ("priority-out-of-range", json.dumps({"inputs": json.loads(_infer_body())["inputs"],
                                          "parameters": {"priority": 300}}).encode(), {}, 400,
     "parameter priority must be an integer 0..255"),
    ("priority-not-an-integer", json.dumps({"inputs": json.loads(_infer_body())["inputs"],
                                            "parameters": {"priority": "high"}}).encode(), {}, 400,
     "parameter priority must be an integer 0..255"),
]


@pytest.mark.parametrize("case", HOSTILE, ids=[c[0] for c in HOSTILE])
def test_hostile_bodies_fail_cleanly_and_it_keeps_serving(kserve, case):
    _, body, headers, status, text = case
    if headers.pop("binary", None):
        head = json.dumps({"inputs": [{"name": "x", "shape": [256], "datatype": "FP32",
                                       "parameters": {"binary_data_size": 10**9}}]}).encode()
        body, headers = head + b"\0" * 16, {"Inference-Header-Content-Length": str(len(head))}
    got, hdrs, data = raw(kserve[0], "POST", "/v2/models/echo/infer", body, headers)
    assert got == status, data
    assert text in json.loads(data)["error"]
    # and it keeps serving
    ok, _, data = raw(kserve[0], "POST", "/v2/models/echo/infer", _infer_body())
    assert ok == 200 and json.loads(data)["outputs"][0]["data"] == X.tolist()


@pytest.mark.parametrize("length", ["\u00b2", "9" * 5000])
def test_a_content_length_that_is_not_a_length_is_a_client_error(kserve, length):
    """str.isdigit() takes "²" and int() takes 5000 digits: both used to be a 500 with a
    traceback in the log."""
    s = socket.create_connection(("127.0.0.1", kserve[0]), timeout=15)
    try:
        s.sendall(b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: x\r\nContent-Length: "
                  + length.encode("latin-1") + b"\r\n\r\n")
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    finally:
        s.close()
    # (httptools refuses it as malformed HTTP: 400; a server that parses it: 411)
    assert reply[:12] in (b"HTTP/1.1 400", b"HTTP/1.1 411"), reply[:200]
    ok, _, data = raw(kserve[0], "POST", "/v2/models/ech%6F/infer", _infer_body())  # (percent-
    assert ok == 200 and json.loads(data)["model_name"] == "echo"               # encoded name)


def test_huge_body_is_refused_without_reading_it(kserve):
    s = socket.create_connection(("127.0.0.1", kserve[0]), timeout=15)
    try:
        s.sendall(b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: x\r\n"
                  b"Content-Length: 100000000000\r\n\r\n" + b"x" * 65536)
        reply = b""
        while chunk := s.recv(65536):         # the server closes after its answer
            reply += chunk
    finally:
        s.close()
    assert reply.startswith(b"HTTP/1.1 413") and b"exceeds the limit" in reply
    assert raw(kserve[0], "GET", "/v2/health/live")[0] == 200


def test_unknown_endpoints_model_and_version(kserve):
    assert raw(kserve[0], "GET", "/v2/models/nope")[0] == 404
    st, _, data = raw(kserve[0], "GET", "/v2/models/echo/versions/7")
    assert st == 404 and "no version '7'" in json.loads(data)["error"]
    assert raw(kserve[0], "GET", "/v3/anything")[0] == 404
    st, _, data = raw(kserve[0], "POST", "/v2/models/echo/infer", b"{}",
                      {"Transfer-Encoding": "chunked"})
    assert st in (400, 411)
    s = socket.create_connection(("127.0.0.1", kserve[0]), timeout=15)
    s.sendall(b"\x16\x03\x01 garbage that is not HTTP\r\n\r\n")
    s.recv(4096)
    s.close()
    assert raw(kserve[0], "GET", "/v2/health/ready")[0] == 200


def test_without_a_daemon_it_is_live_but_not_ready(tmp_path):
    proc, hp, gp, log = start_kserve(str(tmp_path / "none.sock"))
    try:
        assert raw(hp, "GET", "/v2/health/live")[0] == 200
        assert raw(hp, "GET", "/v2/health/ready")[0] == 503
        st, _, data = raw(hp, "POST", "/v2/models/echo/infer", _infer_body())
        assert st == 503 and "daemon is unavailable" in json.loads(data)["error"]
        c = tritongrpc.InferenceServerClient(f"127.0.0.1:{gp}")
        assert c.is_server_live() and not c.is_server_ready()
    finally:
        proc.terminate()
        assert proc.wait(15) == 0, log.read_text()
    assert "Traceback" not in log.read_text()
    os.unlink(log)


def test_a_grpc_port_in_use_is_a_clear_error_not_a_shared_port(tmp_path):
    """grpc binds with SO_REUSEPORT by default, which would let a second server on the
    port take half of the first one's connections in silence; ours refuses the port."""
    import subprocess
    import sys
    from pathlib import Path

    from service_daemon import free_port
    first, hp, gp, log = start_kserve(str(tmp_path / "none.sock"))
    try:
        paella = str(Path(sys.executable).with_name("paella"))
        second = subprocess.run([paella, "kserve", "--socket", str(tmp_path / "none.sock"),
                                 "--http-port", str(free_port()), "--grpc-port", str(gp)],
                                capture_output=True, text=True, timeout=60)
        assert second.returncode == 2, second.stderr
        assert f"cannot listen on 127.0.0.1:{gp}" in second.stderr, second.stderr
        assert "Traceback" not in second.stderr
        c = tritongrpc.InferenceServerClient(f"127.0.0.1:{gp}")   # (the first one serves on)
        assert c.is_server_live()
    finally:
        first.terminate()
        assert first.wait(15) == 0, log.read_text()
    os.unlink(log)


def test_our_proto_is_the_protocols_field_for_field():
    # Our grpc_predict_v2.proto against tritonclient's copy of the protocol: same message
    # names, field numbers, types and cardinality (a wrong number would garble the wire).
    import tritonclient.grpc.service_pb2 as theirs

    from paella.kserve import grpc_predict_v2_pb2 as ours

    def repeated(f) -> bool:          # (protobuf 7 dropped .label for .is_repeated)
        r = getattr(f, "is_repeated", None)
        return f.label == f.LABEL_REPEATED if r is None else r

    def same(a, b):
        for f in a.fields:
            g = b.fields_by_name[f.name]
            assert (f.number, f.type, repeated(f)) == (g.number, g.type, repeated(g)), \
                (a.full_name, f.name)
        for n in a.nested_types:
            same(n, b.nested_types_by_name[n.name])
    assert ours.DESCRIPTOR.package == theirs.DESCRIPTOR.package == "inference"
    for name, d in ours.DESCRIPTOR.message_types_by_name.items():
        same(d, theirs.DESCRIPTOR.message_types_by_name[name])
    [svc] = ours.DESCRIPTOR.services_by_name.values()
    assert svc.full_name == "inference.GRPCInferenceService"
    theirs_svc = theirs.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    for m in svc.methods:
        t = theirs_svc.methods_by_name[m.name]
        assert (m.input_type.name, m.output_type.name) == (t.input_type.name, t.output_type.name)


def test_a_restarted_daemon_is_served_again(fresh_daemon):
    """The daemon dies and comes back on the same socket: the front end answers 503
    meanwhile, then serves again on new connections (the dead ones are dialled again)."""
    import signal
    dp = fresh_daemon()
    proc, hp, gp, log = start_kserve(dp.socket)
    try:
        c = tritonhttp.InferenceServerClient(f"127.0.0.1:{hp}")
        inp = tritonhttp.InferInput("x", [256], "FP32")
        inp.set_data_from_numpy(X)
        assert np.array_equal(c.infer("echo", [inp]).as_numpy("y"), X)
        dp.proc.send_signal(signal.SIGKILL)
        dp.proc.wait(10)
        with pytest.raises(InferenceServerException) as e:
            c.infer("echo", [inp])
        assert "[503]" in str(e.value) and "daemon" in str(e.value)
        os.unlink(dp.socket)
        again = fresh_daemon(sock_dir=dp.dir)
        assert again.socket == dp.socket
        import time
        deadline = time.monotonic() + 10
        while True:                           # (the model list is refreshed within 1 s)
            try:
                out = c.infer("echo", [inp])
                break
            except InferenceServerException:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        assert np.array_equal(out.as_numpy("y"), X)
        g = tritongrpc.InferenceServerClient(f"127.0.0.1:{gp}")
        gi = tritongrpc.InferInput("x", [256], "FP32")
        gi.set_data_from_numpy(X)
        assert np.array_equal(g.infer("echo", [gi]).as_numpy("y"), X)
    finally:
        proc.terminate()
        assert proc.wait(15) == 0, log.read_text()
    assert "Traceback" not in log.read_text(), log.read_text()
