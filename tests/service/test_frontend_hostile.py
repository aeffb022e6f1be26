"""Hostile clients against the network front end (``paella kserve``), over HTTP and gRPC,
with a real daemon (the tiny GPT ``gpt-tiny`` and ``echo``) behind it.

Every test abuses the front end one way, then checks what a well-behaved client sees:
an echo answered correctly over HTTP and over gRPC (``tritonclient``) within
``PROMPT`` seconds, and the ``paella kserve`` process alive. What is measured about
the front end itself comes from ``/proc/PID/status``: its threads (one event loop,
so a small number unrelated to the connections) and its resident memory (``VmRSS``,
and the peak ``VmHWM`` for an instance started for that test alone).

Attacks whose memory could stay in the process (malloc keeps its high-water mark)
run against a front end of their own (``fresh_front``), so the shared one measures
honestly. The module's front end must end with exit status 0 and no traceback.
"""
from __future__ import annotations

import errno
import json
import os
import resource
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

tritonhttp = pytest.importorskip("tritonclient.http")
tritongrpc = pytest.importorskip("tritonclient.grpc")
grpc = pytest.importorskip("grpc")

from paella.client import connect  # noqa: E402
from paella.kserve import grpc_predict_v2_pb2 as pb  # noqa: E402
from paella.parent_death import end_with_parent  # noqa: E402
from service_daemon import cleanup, free_port  # noqa: E402
from test_generation import serve  # noqa: E402

#: Seconds a well-behaved client may wait for an echo while the front end is abused.
PROMPT = 1.0
#: Resident memory the front end must stay under, MiB (it starts at about 80).
RSS_LIMIT_MB = 200
#: Threads the front end may have (grpc's and the loop's; about 14), whatever the load.
THREADS_LIMIT = 40
#: Connections of the many-connections tests.
MANY = 10_000

INFER = "/inference.GRPCInferenceService/ModelInfer"
STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"


# -- the processes -----------------------------------------------------------------------
@dataclass
class Front:
    """One ``paella kserve`` process."""
    proc: subprocess.Popen
    hp: int
    gp: int
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def status(self) -> dict[str, float]:
        """threads, rss_mb, hwm_mb (peak) of the process now."""
        fields = {}
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                fields[k] = v.split()
        return {"threads": int(fields["Threads"][0]), "rss_mb": int(fields["VmRSS"][0]) / 1024,
                "hwm_mb": int(fields["VmHWM"][0]) / 1024}

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def nofile(self) -> int:
        """Its soft limit of open files."""
        with open(f"/proc/{self.pid}/limits") as f:
            for line in f:
                if line.startswith("Max open files"):
                    return int(line.split()[3])
        raise AssertionError("no open-files limit in /proc/PID/limits")

    def text(self) -> str:
        return self.log.read_text()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        return self.proc.wait(20)


def raise_nofile() -> int:
    """This process's soft descriptor limit raised to the hard one (a front end started
    afterwards inherits it); returns the hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def start_front(sock: str, *args: str) -> Front:
    """``paella kserve`` for the daemon at ``sock`` (like ``start_kserve``, with extra
    arguments, this process's raised descriptor limit, and ended with its parent)."""
    hp, gp = free_port(), free_port()
    log = Path(sock).with_name(f"kserve.{hp}.log")
    paella = str(Path(sys.executable).with_name("paella"))
    with open(log, "w") as f:
        proc = subprocess.Popen([paella, "kserve", "--socket", sock, "--http-port", str(hp),
                                 "--grpc-port", str(gp), "--timeout", "10", *args],
                                stdout=f, stderr=subprocess.STDOUT, preexec_fn=end_with_parent())
    deadline = time.monotonic() + 30
    while "HTTP on" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"paella kserve did not start:\n{log.read_text()}")
        time.sleep(0.05)
    return Front(proc, hp, gp, log)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    raise_nofile()
    dp = serve(tmp_path_factory.mktemp("hostile"))
    try:
        with connect(dp.socket) as c:         # (the first generation warms the model up)
            assert len(list(c.generate("gpt-tiny", [1, 2], max_tokens=4))) == 4
        yield dp
    finally:
        cleanup(dp)
        resource.setrlimit(resource.RLIMIT_NOFILE, limits)   # (as the other tests expect)


@pytest.fixture(scope="module")
def front(daemon):
    """The front end most tests share; it must end cleanly, with no traceback logged."""
    f = start_front(daemon.socket)
    yield f
    text = f.text()
    assert f.stop() == 0, text
    assert "Traceback" not in text and " ERROR " not in text, text


@pytest.fixture(scope="module")
def small(daemon):
    """A front end with a 1 MiB body limit and a 1 s idle timeout."""
    f = start_front(daemon.socket, "--max-body-mb", "1", "--idle-timeout", "1")
    yield f
    text = f.text()
    assert f.stop() == 0, text
    assert "Traceback" not in text, text


@pytest.fixture
def fresh_front(daemon):
    """A front end of the test's own (its peak memory is the test's)."""
    made: list[Front] = []

    def make(*args: str) -> Front:
        f = start_front(daemon.socket, *args)
        made.append(f)
        return f
    yield make
    for f in made:
        f.stop()


# -- what a well-behaved client sees -----------------------------------------------------
def echo_http(f: Front, timeout: float = 5.0) -> float:
    """One echo over HTTP (tritonclient, binary tensors): its seconds, the answer checked."""
    x = np.random.default_rng().standard_normal(256).astype(np.float32)
    t = time.monotonic()
    c = tritonhttp.InferenceServerClient(f"127.0.0.1:{f.hp}", connection_timeout=timeout,
                                         network_timeout=timeout)
    try:
        inp = tritonhttp.InferInput("x", [256], "FP32")
        inp.set_data_from_numpy(x)
        y = c.infer("echo", [inp]).as_numpy("y")
    finally:
        c.close()
    took = time.monotonic() - t
    np.testing.assert_array_equal(y, x)
    return took


def echo_grpc(f: Front, timeout: float = 5.0) -> float:
    x = np.random.default_rng().standard_normal(256).astype(np.float32)
    t = time.monotonic()
    c = tritongrpc.InferenceServerClient(f"127.0.0.1:{f.gp}")
    try:
        inp = tritongrpc.InferInput("x", [256], "FP32")
        inp.set_data_from_numpy(x)
        y = c.infer("echo", [inp], client_timeout=timeout).as_numpy("y")
    finally:
        c.close()
    took = time.monotonic() - t
    np.testing.assert_array_equal(y, x)
    return took


def served(f: Front, limit: float = PROMPT) -> tuple[float, float]:
    """The front end is alive and answers an echo correctly over both protocols, each
    within ``limit`` seconds."""
    assert f.proc.poll() is None, f"paella kserve exited with {f.proc.returncode}:\n{f.text()}"
    h, g = echo_http(f), echo_grpc(f)
    assert h < limit and g < limit, f"echo took {h:.3f} s over HTTP, {g:.3f} s over gRPC"
    return h, g


class Monitor:
    """Well-behaved echoes (both protocols) in a thread, every ``every`` seconds, while
    the main thread attacks: the slowest, and any failure."""

    def __init__(self, f: Front, every: float = 0.05):
        self.f, self.every = f, every
        self.worst, self.n, self.errors = 0.0, 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                took = max(echo_http(self.f), echo_grpc(self.f))
                self.worst = max(self.worst, took)
                self.n += 1
            except Exception as e:  # noqa: BLE001 - reported by check()
                self.errors.append(f"{type(e).__name__}: {e}")
            self._stop.wait(self.every)

    def stop(self) -> "Monitor":
        self._stop.set()
        self._thread.join(30)
        return self

    def check(self, limit: float = PROMPT, at_least: int = 1) -> None:
        self.stop()
        assert not self.errors, self.errors[:3]
        assert self.n >= at_least, f"only {self.n} echoes answered meanwhile"
        assert self.worst < limit, f"an echo took {self.worst:.3f} s meanwhile"


def daemon_in_flight(sock: str) -> int:
    with connect(sock) as c:
        return c.status()["in_flight"]


def wait_for(cond, timeout: float = 10.0, every: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(every)
    return True


def assert_nothing_in_flight(sock: str, timeout: float = 10.0) -> None:
    assert wait_for(lambda: daemon_in_flight(sock) == 0, timeout, 0.1), \
        f"the daemon still has {daemon_in_flight(sock)} requests in flight after {timeout} s"


def assert_bounded(f: Front, peak: bool = False) -> dict:
    st = f.status()
    assert st["threads"] < THREADS_LIMIT, st
    assert st["rss_mb"] < RSS_LIMIT_MB, st
    if peak:
        assert st["hwm_mb"] < RSS_LIMIT_MB, st
    return st


# -- raw HTTP --------------------------------------------------------------------------
def exchange(port: int, data: bytes, timeout: float = 10.0,
             until_closed: bool = True) -> tuple[bytes, bool]:
    """Send ``data`` on a fresh connection; what came back, and whether the server
    closed the connection (True) or left it open for ``timeout`` seconds (False).
    ``until_closed`` False: only until one whole answer is in."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        try:
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass                               # it answered and closed before we finished
        got = b""
        if not until_closed:
            try:
                return read_reply(s), False
            except ConnectionResetError:
                return got, True
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                return got, True
            except socket.timeout:
                return got, False
            if not chunk:
                return got, True
            got += chunk
    finally:
        s.close()


def read_reply(s: socket.socket) -> bytes:
    """One whole answer with a Content-Length (or what came before the server closed)."""
    reply = b""
    while True:
        head, sep, body = reply.partition(b"\r\n\r\n")
        if sep:
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if len(body) >= length:
                return reply
        chunk = s.recv(65536)
        if not chunk:
            return reply
        reply += chunk


def status_of(reply: bytes) -> int:
    assert reply.startswith(b"HTTP/1.1 "), reply[:200]
    return int(reply[9:12])


def echo_body(**over) -> bytes:
    req = {"inputs": [{"name": "x", "shape": [256], "datatype": "FP32", "data": [0.5] * 256}]}
    req["inputs"][0].update(over)
    return json.dumps(req).encode()


def post(path: str, body: bytes, headers: bytes = b"") -> bytes:
    return (b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n" + headers + b"\r\n" + body)


#: The start of an echo request, to which a test adds its own framing.
_ECHO = b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: x\r\n"


def open_many(port: int, n: int, first: bytes = b"") -> list[socket.socket]:
    """``n`` connections (non-blocking connects, then a poll until each is made), each
    having sent ``first``."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket()
            socks.append(s)
            s.setblocking(False)
            err = s.connect_ex(("127.0.0.1", port))
            assert err in (0, errno.EINPROGRESS), os.strerror(err)
        poller = select.poll()
        left = {s.fileno(): s for s in socks}
        for fd in left:
            poller.register(fd, select.POLLOUT)
        deadline = time.monotonic() + 60
        while left:
            assert time.monotonic() < deadline, f"{len(left)} of {n} connections not made"
            for fd, _ in poller.poll(1000):
                if fd in left:
                    s = left.pop(fd)
                    poller.unregister(fd)
                    err = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                    assert err == 0, os.strerror(err)
                    if first:
                        assert s.send(first) == len(first)
    except BaseException:
        for s in socks:
            s.close()
        raise
    return socks


def closed_by_peer(socks: list[socket.socket]) -> int:
    """How many of these (non-blocking) connections the server closed or answered."""
    n = 0
    for s in socks:
        try:
            s.recv(1, socket.MSG_PEEK)
            n += 1                              # data or EOF
        except BlockingIOError:
            pass
        except OSError:
            n += 1
    return n


# == 1. many connections ===============================================================
@pytest.mark.parametrize("first", [b"", b"GET /v2/health/li",
                                   b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: x\r\n"
                                   b"Content-Type: application/json\r\nContent-Le"],
                         ids=["silent", "partial-request-line", "partial-headers"])
def test_ten_thousand_idle_connections_cost_no_thread_and_little_memory(daemon, front, first):
    """10,000 connections that send nothing (or half a request) are accepted and held
    (they are below the descriptor limit, and well within the 60 s idle timeout, after
    which they are closed: see the test below); meanwhile others are served promptly,
    the front end keeps its handful of threads and stays under 200 MB. Closing them
    frees every descriptor."""
    hard = raise_nofile()
    if hard < MANY + 500 or front.nofile() < MANY + 500:
        pytest.skip(f"descriptor limit too low for {MANY} connections "
                    f"(hard {hard}, the front end's {front.nofile()})")
    base_fds = front.fds()
    t = time.monotonic()
    socks = open_many(front.hp, MANY, first)
    try:
        opened = time.monotonic() - t
        # (within a few: a keep-alive connection of an earlier check may close meanwhile)
        assert wait_for(lambda: front.fds() >= base_fds + MANY - 5, 20), \
            f"the front end holds {front.fds() - base_fds} of {MANY} connections"
        worst = 0.0
        for _ in range(3):                      # held a while, others served meanwhile
            worst = max(worst, *served(front))
            time.sleep(0.3)
        st = assert_bounded(front)
        assert closed_by_peer(socks) == 0       # held, not dropped (nor answered)
        print(f"\n{MANY} connections ({first[:24]!r}) "
              f"opened in {opened:.2f} s: threads {st['threads']}, RSS {st['rss_mb']:.0f} MB, "
              f"peak {st['hwm_mb']:.0f} MB, slowest echo meanwhile {worst * 1000:.0f} ms")
    finally:
        for s in socks:
            s.close()
    assert wait_for(lambda: front.fds() <= base_fds + 5, 20), \
        f"{front.fds() - base_fds} descriptors still held after the clients closed"
    served(front)


def test_keepalive_connections_are_closed_after_the_idle_timeout(small):
    """``--idle-timeout 1``: a keep-alive connection idle after its answer is closed."""
    s = socket.create_connection(("127.0.0.1", small.hp), timeout=10)
    try:
        s.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        reply = s.recv(65536)
        assert status_of(reply) == 200
        t = time.monotonic()
        assert s.recv(1) == b""                 # closed by the server...
        assert 0.5 < time.monotonic() - t < 5   # ...after about a second
    finally:
        s.close()
    served(small)


def test_connections_that_never_finish_a_request_are_closed_in_time(small):
    """A connection that sends nothing, or half a request line, is not kept past the
    idle timeout (1 s here) plus a margin."""
    socks = [socket.create_connection(("127.0.0.1", small.hp), timeout=10) for _ in range(2)]
    try:
        socks[1].sendall(b"GET /v2/health/li")
        for s in socks:
            s.setblocking(False)
        time.sleep(4)
        assert closed_by_peer(socks) == 2
    finally:
        for s in socks:
            s.close()
        served(small)


# == 2. slow clients ===================================================================
def _trickle(port: int, head: bytes, body: bytes, every: float, per: int,
             out: dict) -> None:
    """Send ``head`` then ``body``, the slow part (``body``, or ``head`` if there is
    no body) ``per`` bytes every ``every`` seconds; the answer in ``out["reply"]``."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            slow = body or head
            if body:
                s.sendall(head)
            for i in range(0, len(slow), per):
                s.sendall(slow[i:i + per])
                time.sleep(every)
            out["reply"] = read_reply(s)
    except Exception as e:  # noqa: BLE001 - reported by the test
        out["error"] = repr(e)


def test_slowloris_headers_one_byte_every_50ms(front):
    """Headers trickling in (one byte every 50 ms, 3.5 s in all) hold one connection,
    nobody else: echoes meanwhile are prompt, and the slow request is answered in the
    end."""
    head = (b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nUser-Agent: slow\r\n"
            b"X-Pad: abc\r\n\r\n")
    out: dict = {}
    t = threading.Thread(target=_trickle, args=(front.hp, head, b"", 0.05, 1, out))
    t.start()
    mon = Monitor(front)
    t.join(60)
    mon.check(at_least=5)
    assert "error" not in out, out
    assert status_of(out["reply"]) == 200
    assert_bounded(front)


def test_slow_body(front):
    """A body sent in 64-byte pieces every 50 ms: others are served meanwhile, and the
    request is answered correctly once its body is whole."""
    x = np.arange(256, dtype=np.float32) / 3
    body = json.dumps({"inputs": [{"name": "x", "shape": [256], "datatype": "FP32",
                                   "data": x.tolist()}]}).encode()
    head = _ECHO + f"Content-Length: {len(body)}\r\n\r\n".encode()
    out: dict = {}
    every = 2.0 / (len(body) / 64)              # about 2 s in all
    t = threading.Thread(target=_trickle, args=(front.hp, head, body, every, 64, out))
    t.start()
    mon = Monitor(front)
    t.join(60)
    mon.check(at_least=5)
    assert "error" not in out, out
    reply = out["reply"]
    assert status_of(reply) == 200, reply[:300]
    got = json.loads(reply.split(b"\r\n\r\n", 1)[1])
    assert np.array_equal(np.array(got["outputs"][0]["data"], np.float32), x)
    assert_bounded(front)


def test_a_client_that_pipelines_and_never_reads_costs_bounded_memory(fresh_front):
    """Echo requests pipelined on one connection without ever reading an answer: the
    front end stops reading once its answers back up (the client can push no more than
    the kernel's socket buffers hold, and a few requests); memory stays bounded; others
    are served meanwhile."""
    def most(path: str) -> int:
        with open(path) as fh:
            return int(fh.read().split()[-1])
    buffers = most("/proc/sys/net/ipv4/tcp_rmem") + most("/proc/sys/net/ipv4/tcp_wmem")
    bound = buffers + (8 << 20)
    f = fresh_front()
    one = post("/v2/models/echo/infer", echo_body(data=[1.2345678] * 256))
    block = one * 100
    s = socket.create_connection(("127.0.0.1", f.hp))
    s.setblocking(False)
    mon = Monitor(f, every=0.2)
    sent, pending, peak = 0, b"", 0.0
    t0 = last_progress = looked = time.monotonic()
    try:
        while sent < bound + (16 << 20) and time.monotonic() - last_progress < 2.0 \
                and time.monotonic() - t0 < 10:
            pending = pending or block
            try:
                n = s.send(pending)
                sent, pending = sent + n, pending[n:]
                last_progress = time.monotonic()
            except BlockingIOError:
                time.sleep(0.01)
            if time.monotonic() - looked > 0.1:
                looked = time.monotonic()
                peak = max(peak, f.status()["rss_mb"])
                if peak > RSS_LIMIT_MB:
                    break                       # (unbounded: no need to go on)
        mon.check()
        st = f.status()
        print(f"\npipelined {sent >> 20} MB unread in {time.monotonic() - t0:.1f} s: "
              f"RSS {st['rss_mb']:.0f} MB, peak {st['hwm_mb']:.0f} MB")
    finally:
        s.close()
    served(f)
    assert_bounded(f, peak=True)
    assert sent < bound, (f"the front end read {sent >> 20} MB of requests it cannot answer "
                          f"(the sockets buffer {buffers >> 20} MB at most)")


# == 3. header abuse ====================================================================
@pytest.mark.parametrize("request_bytes", [
    b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Bad: a\x00b\x7f\r\n\r\n",
    b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX B\xff: ab\r\n\r\n",
    b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Bad: a\rb\r\n\r\n",
    b"GET /v2/health/live\x00 HTTP/1.1\r\nHost: x\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(256)),
], ids=["nul-in-value", "space-in-name", "bare-cr", "nul-in-target", "tls-hello"])
def test_a_header_or_request_line_with_invalid_bytes_is_a_400(front, request_bytes):
    reply, closed = exchange(front.hp, request_bytes)
    assert status_of(reply) == 400 and closed, reply[:300]
    served(front)


def test_a_request_line_of_one_megabyte_is_refused(front):
    line = b"GET /v2/health/live?" + b"a" * (1 << 20) + b" HTTP/1.1\r\nHost: x\r\n\r\n"
    reply, closed = exchange(front.hp, line)
    assert (not reply or 400 <= status_of(reply) < 500) and closed, reply[:300]
    served(front)
    assert_bounded(front)


@pytest.mark.parametrize("head", [
    b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n",
    b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n"
    + b"".join(b"X-Header-%05d: value\r\n" % i for i in range(10_000)) + b"\r\n",
], ids=["one-megabyte-header", "ten-thousand-headers"])
def test_a_huge_request_head_is_refused(front, head):
    """A 1 MB header, or 10,000 headers (270 KB): a 4xx (431) or the connection
    closed, not an answer."""
    reply, _ = exchange(front.hp, head, until_closed=False)    # (b"": closed unanswered)
    served(front)
    assert_bounded(front)
    assert not reply or 400 <= status_of(reply) < 500, reply[:300]


def test_a_hundred_megabyte_header_streamed_in_is_cut_off(fresh_front):
    """A header streamed in 64 KiB pieces up to 100 MB: the front end answers 4xx or
    closes long before the end, its memory stays bounded, others are served promptly."""
    f = fresh_front()
    s = socket.create_connection(("127.0.0.1", f.hp), timeout=10)
    mon = Monitor(f, every=0.1)
    piece, sent, cut, peak = b"a" * 65536, 0, False, 0.0
    try:
        s.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Big: ")
        t0 = time.monotonic()
        while sent < 100 << 20 and time.monotonic() - t0 < 5:
            try:
                s.sendall(piece)
            except (BrokenPipeError, ConnectionResetError):
                cut = True
                break
            sent += len(piece)
            if sent % (1 << 20) == 0:
                peak = max(peak, f.status()["rss_mb"])
                if peak > RSS_LIMIT_MB:
                    break                       # (unbounded: no need to go on)
        reply = b""
        if not cut:
            try:
                s.sendall(b"\r\n\r\n")
                s.settimeout(10)
                reply = s.recv(65536)
            except OSError:
                cut = True
        mon.stop()
        print(f"\nheader of {sent >> 20} MB streamed in {time.monotonic() - t0:.1f} s: peak "
              f"RSS {f.status()['hwm_mb']:.0f} MB, answer {reply[:12]!r}, slowest echo "
              f"meanwhile {mon.worst:.2f} s, errors {mon.errors[:1]}")
        mon.check()
    finally:
        s.close()
    served(f)
    assert_bounded(f, peak=True)
    assert cut or not reply or 400 <= status_of(reply) < 500, reply[:200]


# == 4. bodies ==========================================================================

@pytest.mark.parametrize("request_bytes, statuses", [
    (_ECHO + b"Content-Length: -1\r\n\r\n" + echo_body(), (400,)),
    (_ECHO + b"Content-Length: 99999999999999999999999\r\n\r\n" + echo_body(), (400, 413)),
    (_ECHO + b"Content-Length: 999999999999999999\r\n\r\n" + echo_body(), (413,)),
    (_ECHO + b"Content-Length: 12, 12\r\n\r\n" + echo_body(), (400, 411)),
    (_ECHO + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"
     b"0\r\n\r\nGET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n", (400,)),
    (_ECHO + b"Transfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n"
     b"0\r\n\r\nGET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n", (400,)),
    (_ECHO + b"Transfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n", (400,)),
    (_ECHO + b"Transfer-Encoding: chunked\r\n\r\n-5\r\nabc\r\n0\r\n\r\n", (400,)),
    (_ECHO + b"Transfer-Encoding: chunked\r\n\r\n1ffffffffffffffff\r\nabc\r\n0\r\n\r\n", (400,)),
    (_ECHO + b"Transfer-Encoding: chunked\r\n\r\n3\r\nabcdef\r\n0\r\n\r\n", (400,)),
    (_ECHO + b"Transfer-Encoding: gzip\r\n\r\n" + echo_body(), (400, 411, 501)),
], ids=["negative-length", "overflowing-length", "length-over-the-limit", "list-length",
        "length-and-chunked", "chunked-and-length", "chunk-size-not-hex",
        "negative-chunk-size", "chunk-size-over-64-bits", "chunk-longer-than-its-size",
        "unknown-transfer-coding"])
def test_malformed_body_framing_is_refused_and_the_connection_closed(front, request_bytes,
                                                                     statuses):
    """No framing trick gets a body (or a smuggled request) through: one error answer,
    then the connection is closed."""
    reply, closed = exchange(front.hp, request_bytes)
    assert status_of(reply) in statuses, reply[:300]
    assert closed
    assert reply.count(b"HTTP/1.1 ") == 1, reply   # nothing smuggled was answered
    served(front)


def test_a_chunked_body_over_the_limit_is_cut_off(small):
    """A chunked body past ``--max-body-mb 1`` (64 KiB chunks, 64 MB offered): the 413
    arrives while the client is still sending (the body is counted as it comes, not
    read whole first); the connection closes (after the answer's short linger)."""
    s = socket.create_connection(("127.0.0.1", small.hp), timeout=10)
    sent, reply = 0, b""
    try:
        s.sendall(_ECHO + b"Transfer-Encoding: chunked\r\n\r\n")
        piece = b"10000\r\n" + b"7" * 0x10000 + b"\r\n"
        try:
            while sent < 64 << 20 and not select.select([s], [], [], 0)[0]:
                s.sendall(piece)
                sent += 0x10000
        except (BrokenPipeError, ConnectionResetError):
            pass
        answered_after = sent
        t = time.monotonic()
        try:
            while chunk := s.recv(65536):
                reply += chunk
        except ConnectionResetError:
            pass
        closed_in = time.monotonic() - t
    finally:
        s.close()
    # (the limit is the model's: echo's inputs need far less than --max-body-mb)
    assert status_of(reply) == 413 and b"exceeds the limit of" in reply, reply[:300]
    assert answered_after < 16 << 20, f"no answer before {answered_after >> 20} MB were sent"
    assert closed_in < 5
    served(small)
    assert_bounded(small)


def test_json_nested_100000_deep_is_a_400(front):
    """Deep nesting is refused before the parser runs (echo's infer route takes 74 KB at
    most: 30,000 deep there; a larger body is a 413 before it is read)."""
    for path, deep in (("/v2/models/echo/infer", 30_000), ("/v1/completions", 100_000)):
        reply, _ = exchange(front.hp, post(path, b"[" * deep + b"]" * deep),
                            until_closed=False)
        assert status_of(reply) == 400 and b"nests deeper than" in reply, reply[:300]
        reply, _ = exchange(front.hp, post(path, b'{"a":' * (deep // 3) + b"1"
                                           + b"}" * (deep // 3)), until_closed=False)
        assert status_of(reply) == 400 and b"nests deeper than" in reply, reply[:300]
    reply, _ = exchange(front.hp, post("/v2/models/echo/infer",
                                       b"[" * 100_000 + b"]" * 100_000), until_closed=False)
    assert status_of(reply) == 413 and b"exceeds the limit" in reply, reply[:300]
    served(front)


@pytest.mark.parametrize("path", ["/v2/models/echo/infer", "/v1/completions"],
                         ids=["v2-infer-data", "v1-prompt"])
def test_a_json_array_as_large_as_the_body_limit(fresh_front, path):
    """A 61 MB JSON array (32 million zeros: the data of echo's [256] input, or an
    OpenAI prompt) within the default 64 MiB body limit: a prompt 4xx; meanwhile others
    are served promptly, and the front end's peak memory stays within the body twice
    over (the body as read, and joined) above its start."""
    f = fresh_front()
    start = f.status()["rss_mb"]
    zeros = b"[" + b"0," * 31_999_999 + b"0]"
    if path.startswith("/v1"):
        body = b'{"model": "gpt-tiny", "max_tokens": 2, "prompt": ' + zeros + b"}"
    else:
        body = b'{"inputs": [{"name": "x", "shape": [256], "datatype": "FP32", "data": ' \
               + zeros + b"}]}"
    mon = Monitor(f, every=0.1)
    t = time.monotonic()
    reply, _ = exchange(f.hp, post(path, body), timeout=60, until_closed=False)
    took = time.monotonic() - t
    del body, zeros
    st = f.status()
    mon.stop()
    print(f"\n61 MB JSON array to {path}: answered in {took:.1f} s, {reply[9:12]!r}; "
          f"slowest echo meanwhile {mon.worst:.2f} s; peak RSS {st['hwm_mb']:.0f} MB")
    mon.check()
    assert 400 <= status_of(reply) < 500, reply[:300]
    assert st["hwm_mb"] < start + 2 * 64 + 20, st
    served(f)


def _binary(sizes: list[int], raw: bytes, header_len: int | None = None) -> bytes:
    head = json.dumps({"inputs": [{"name": "x", "shape": [256], "datatype": "FP32",
                                   "parameters": {"binary_data_size": n}} for n in sizes]
                       }).encode()
    hl = len(head) if header_len is None else header_len
    return post("/v2/models/echo/infer", head + raw,
                f"Inference-Header-Content-Length: {hl}\r\n".encode())


@pytest.mark.parametrize("request_bytes, text", [
    (_binary([4096], bytes(1024)), b"exceeds the"),
    (_binary([512], bytes(1024)), b"512"),
    (_binary([1024], bytes(2048)), b"binary bytes after"),
    (_binary([-1], bytes(1024)), b"binary_data_size"),
    (_binary([1024], bytes(1024), header_len=10 ** 6), b"Inference-Header-Content-Length"),
    (_binary([1024], bytes(1024), header_len=5), b"not valid JSON"),
    (_binary([1024, 1024], bytes(2048)), b"given twice"),
], ids=["size-past-the-end", "size-short-of-the-shape", "bytes-left-over", "negative-size",
        "header-length-past-the-body", "header-length-cuts-the-json", "input-twice"])
def test_binary_data_size_mismatches_are_400s(front, request_bytes, text):
    reply, _ = exchange(front.hp, request_bytes, until_closed=False)
    assert status_of(reply) == 400 and text in reply, reply[:400]
    served(front)


@pytest.mark.parametrize("how", ["close", "reset", "half-close"])
def test_a_body_that_ends_early_then_the_client_vanishes(front, daemon, how):
    """Content-Length 100,000, 1,000 bytes sent, then the client goes (20 times): the
    front end forgets them (no descriptor kept, nothing in the daemon, no traceback)."""
    base = front.fds()
    for _ in range(20):
        s = socket.create_connection(("127.0.0.1", front.hp), timeout=5)
        s.sendall(_ECHO + b"Content-Length: 100000\r\n\r\n" + echo_body()[:1000])
        if how == "reset":
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        elif how == "half-close":
            s.shutdown(socket.SHUT_WR)
            s.settimeout(5)
            reply = s.recv(65536)               # (an answer, if any, is an error)
            assert not reply or status_of(reply) in (400, 413), reply[:300]
        s.close()
    assert wait_for(lambda: front.fds() <= base + 2, 10), (base, front.fds())
    assert_nothing_in_flight(daemon.socket)
    served(front)


# == 5. gRPC =============================================================================
def _echo_request(i: int, model: str = "echo") -> bytes:
    r = pb.ModelInferRequest(model_name=model, id=f"r{i}")
    r.inputs.add(name="x", datatype="FP32", shape=[256])
    r.raw_input_contents.append((np.arange(256, dtype=np.float32) + i).tobytes())
    return r.SerializeToString()


def _generate_request(i: int, max_tokens: int = 40) -> bytes:
    r = pb.ModelInferRequest(model_name="gpt-tiny", id=f"g{i}")
    r.inputs.add(name="prompt_ids", datatype="INT32", shape=[2])
    r.raw_input_contents.append(np.array([1, 2], np.int32).tobytes())
    r.parameters["max_tokens"].int64_param = max_tokens
    return r.SerializeToString()


@pytest.mark.parametrize("body", [b"\xff" * 100, b"\x0a\xff\xff\xff\xff\x0f", bytes(range(256)),
                                  b"\x12\x03abc" * 1000],
                         ids=["0xff", "overlong-length", "all-bytes", "wrong-fields"])
def test_grpc_bytes_that_are_not_a_request(front, body):
    with grpc.insecure_channel(f"127.0.0.1:{front.gp}") as ch:
        with pytest.raises(grpc.RpcError) as e:
            ch.unary_unary(INFER)(body, timeout=10)
    assert e.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), \
        (e.value.code(), e.value.details())
    assert "internal" not in e.value.details().lower()
    served(front)


def test_grpc_stream_errors_are_responses_and_the_stream_goes_on(front):
    """On one ModelStreamInfer stream: bytes that are not a request, a request for an
    unknown model, then an echo: two error_message responses, then the echo's answer."""
    with grpc.insecure_channel(f"127.0.0.1:{front.gp}") as ch:
        call = ch.stream_stream(STREAM)(iter([b"\xff" * 64, _echo_request(1, "nope"),
                                              _echo_request(2)]), timeout=20)
        got = [pb.ModelStreamInferResponse.FromString(b) for b in call]
    assert len(got) == 3, got
    assert "not a valid inference.ModelInferRequest" in got[0].error_message
    assert "unknown model 'nope'" in got[1].error_message and got[1].infer_response.id == "r1"
    ok = got[2]
    assert not ok.error_message and ok.infer_response.id == "r2"
    y = np.frombuffer(ok.infer_response.raw_output_contents[0], "<f4")
    assert np.array_equal(y, np.arange(256, dtype=np.float32) + 2)
    served(front)


def test_grpc_message_over_the_limit(small):
    """``--max-body-mb 1``: a 2 MB message, unary or on a stream, is RESOURCE_EXHAUSTED."""
    big = pb.ModelInferRequest(model_name="echo", id="big")
    big.inputs.add(name="x", datatype="FP32", shape=[256])
    big.raw_input_contents.append(bytes(2 << 20))
    body = big.SerializeToString()
    with grpc.insecure_channel(f"127.0.0.1:{small.gp}") as ch:
        with pytest.raises(grpc.RpcError) as e:
            ch.unary_unary(INFER)(body, timeout=10)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            list(ch.stream_stream(STREAM)(iter([_echo_request(0), body]), timeout=10))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
    served(small)
    assert_bounded(small)


def _blocked_stream(f: Front, n: int) -> tuple[grpc.Channel, object, list[int]]:
    """A ModelStreamInfer stream of ``n`` echo requests whose responses are never read
    (the channel's receive window stays at 64 KiB: no BDP probing), so the server's
    writes back up. Returns the channel, the call and [requests consumed so far]."""
    ch = grpc.insecure_channel(f"127.0.0.1:{f.gp}", options=[("grpc.http2.bdp_probe", 0)])
    taken = [0]

    def requests():
        for i in range(n):
            taken[0] += 1
            yield _echo_request(i)
    call = ch.stream_stream(STREAM)(requests(), timeout=60)
    return ch, call, taken


def test_grpc_stream_that_never_reads_its_responses(fresh_front, daemon):
    """1,000 requests on a stream whose responses are never read: the stream stalls
    (flow control), nobody else does; memory stays bounded; cancelling it leaves
    nothing in flight."""
    f = fresh_front()
    with connect(daemon.socket) as c:
        before = c.status()["stats"]["requests"]
    ch, call, taken = _blocked_stream(f, 1000)
    try:
        mon = Monitor(f)
        last = -1
        time.sleep(0.5)
        while taken[0] != last:                 # until the client could send no more
            last = taken[0]
            time.sleep(0.5)
        mon.check(at_least=3)
        with connect(daemon.socket) as c:
            run = c.status()["stats"]["requests"] - before - 2 * (mon.n + 1)
        st = assert_bounded(f, peak=True)
        print(f"\nunread stream: the client sent {taken[0]} of 1000 requests, the front end "
              f"ran {run}: {st}")
        assert run < 500, f"{run} requests of a stream nobody reads were run"
    finally:
        call.cancel()
        ch.close()
    assert_nothing_in_flight(daemon.socket)
    served(f)
    assert_bounded(f, peak=True)


def test_grpc_cancelling_blocked_streams_logs_no_error(fresh_front):
    f = fresh_front()
    for _ in range(5):                          # (the first is racy; five make it sure)
        ch, call, taken = _blocked_stream(f, 1000)
        last = -1
        while taken[0] != last:
            last = taken[0]
            time.sleep(0.3)
        call.cancel()
        ch.close()
        time.sleep(0.2)
    for _ in range(300):                        # (allocations: the cyclic GC runs)
        echo_http(f)
    text = f.text()
    assert "Traceback" not in text and " ERROR " not in text, text


def test_grpc_many_streams_opened_and_abandoned(fresh_front, daemon):
    """200 streams, each with an echo (and every fifth a generation first), cancelled at
    once or after their first response, and 50 channels closed under open streams:
    the front end serves on, nothing stays in flight (the daemon finishes what was
    started), the descriptors come back, and nothing is logged."""
    f = fresh_front()
    base = f.fds()
    hold = threading.Event()

    def requests(i: int):
        if i % 5 == 0:
            yield _generate_request(i, max_tokens=20)
        yield _echo_request(i)
        hold.wait(30)                           # (the client keeps its half open)

    chans, calls = [], []
    for i in range(200):
        if i % 4 == 0:
            chans.append(grpc.insecure_channel(f"127.0.0.1:{f.gp}"))
        calls.append(chans[-1].stream_stream(STREAM)(requests(i), timeout=60))
    for i, call in enumerate(calls):
        if i % 2:
            next(call)                          # its first response, then cancelled
        call.cancel()
    for ch in chans:
        ch.close()
    hold.set()
    for i in range(50):                         # channels dropped under open streams
        ch = grpc.insecure_channel(f"127.0.0.1:{f.gp}")
        call = ch.stream_stream(STREAM)(iter([_generate_request(i, 20)] * (i % 5 == 0)
                                             + [_echo_request(i)]))
        next(call)
        ch.close()
    served(f)
    assert_nothing_in_flight(daemon.socket, 20)
    assert wait_for(lambda: f.fds() <= base + 5, 10), (base, f.fds())
    assert_bounded(f, peak=True)
    text = f.text()
    assert "Traceback" not in text and " ERROR " not in text, text


# == 6. OpenAI endpoint =================================================================
def _completion(front: Front, body: bytes) -> tuple[int, dict]:
    reply, _ = exchange(front.hp, post("/v1/completions", body,
                                       b"Content-Type: application/json\r\n"), timeout=30,
                        until_closed=False)
    head, _, data = reply.partition(b"\r\n\r\n")
    return status_of(reply), json.loads(data)


@pytest.mark.parametrize("body, text", [
    (b"not json", "not valid JSON"),
    (b"", "not valid JSON"),
    (b'"a string"', "must be a JSON object"),
    (b"\xff\xfe{}", "not valid JSON"),
    (b'{"model": "gpt-tiny", "prompt": [1], "max_tokens": 1e400}', "max_tokens"),
    (b'{"model": "gpt-tiny", "prompt": [1], "stream": "yes"}', "stream must be"),
    (b'{"model": ["gpt-tiny"], "prompt": [1]}', "\"model\" must be"),
], ids=["text", "empty", "not-an-object", "bad-utf8", "max-tokens-infinite", "stream-string",
        "model-list"])
def test_openai_bodies_that_are_not_a_request(front, body, text):
    status, err = _completion(front, body)
    assert status == 400, err
    assert text in err["error"]["message"] and err["error"]["type"] == "invalid_request_error"
    served(front)


def test_openai_prompt_of_two_million_token_ids(fresh_front):
    """2 million token ids (a 10 MB body): a 413 (past a completion request's 2 MiB),
    promptly, without reading it (a front end of its own: its peak is this)."""
    front = fresh_front()
    rng = np.random.default_rng(1)
    body = json.dumps({"model": "gpt-tiny", "max_tokens": 2,
                       "prompt": rng.integers(300, 1000, 2_000_000).tolist()}).encode()
    t = time.monotonic()
    status, err = _completion(front, body)
    took = time.monotonic() - t
    assert status == 413 and "exceeds the limit" in err["error"]["message"], err
    assert took < 5, took
    st = assert_bounded(front, peak=True)
    print(f"\n2M-id prompt refused in {took:.2f} s; front end peak RSS {st['hwm_mb']:.0f} MB")
    served(front)


@pytest.mark.parametrize("max_tokens", [
    2 ** 31 - 1,
    2 ** 31, 10 ** 30, -1], ids=["2**31-1", "2**31", "10**30", "-1"])
def test_openai_max_tokens_huge(front, daemon, max_tokens):
    """A budget beyond the context (or beyond the protocol) is a 400 naming max_tokens,
    answered at once; nothing is left running."""
    for stream in (False, True):
        t = time.monotonic()
        status, err = _completion(front, json.dumps({"model": "gpt-tiny", "prompt": [1, 2],
                                                     "max_tokens": max_tokens,
                                                     "stream": stream}).encode())
        assert time.monotonic() - t < PROMPT
        assert status == 400, err
        assert err["error"]["type"] == "invalid_request_error", err
    assert_nothing_in_flight(daemon.socket)
    served(front)


def test_openai_streams_dropped_after_the_first_chunk(front, daemon):
    """30 streamed completions (60 tokens each) whose clients leave after the first
    chunk (half of them with a reset): the generations finish or are dropped, nothing
    stays in flight, the front end keeps no descriptor, and serves on."""
    base = front.fds()
    body = json.dumps({"model": "gpt-tiny", "prompt": [1, 2], "max_tokens": 60,
                       "stream": True}).encode()
    request = post("/v1/completions", body, b"Content-Type: application/json\r\n")
    for i in range(30):
        s = socket.create_connection(("127.0.0.1", front.hp), timeout=10)
        s.sendall(request)
        got = b""
        while b"data: {" not in got:
            chunk = s.recv(65536)
            assert chunk, got
            got += chunk
        assert status_of(got) == 200
        if i % 2:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()
    served(front)
    assert_nothing_in_flight(daemon.socket)
    assert wait_for(lambda: front.fds() <= base + 2, 10), (base, front.fds())
    assert_bounded(front)


# == 7. clients that vanish mid-request ====================================================
def test_two_hundred_clients_vanish_before_their_answers(front, daemon):
    """200 echo requests (and 20 generations) whose clients close (half with a reset)
    before their answers: the front end serves on, the daemon's in-flight count comes
    back to 0, no descriptor is kept."""
    base = front.fds()
    with connect(daemon.socket) as c:
        before = c.status()["stats"]["requests"]
    echo = post("/v2/models/echo/infer", echo_body())
    gen = post("/v2/models/gpt-tiny/generate",
               json.dumps({"prompt_ids": [1, 2], "max_tokens": 60}).encode())
    socks = [socket.create_connection(("127.0.0.1", front.hp), timeout=10) for _ in range(220)]
    for i, s in enumerate(socks):
        s.sendall(gen if i < 20 else echo)
    for i, s in enumerate(socks):
        if i % 2:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()
    served(front)
    assert_nothing_in_flight(daemon.socket)
    with connect(daemon.socket) as c:
        reached = c.status()["stats"]["requests"] - before
    assert reached >= 20, reached              # (they reached the daemon, at least some)
    assert wait_for(lambda: front.fds() <= base + 2, 10), (base, front.fds())
    assert_bounded(front)
