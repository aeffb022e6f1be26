"""``paella perf``: a load generator for a running daemon, like Triton's perf_analyzer.

Three transports: the local rings (the client library, ``--socket``), KServe v2 over
HTTP (``--kserve HOST:PORT``, binary tensors, one keep-alive connection per worker) and
KServe v2 over gRPC (``--grpc HOST:PORT``, ``ModelInfer``, one connection per worker).
Two kinds of sweep:

* ``--concurrency 1,2,4``: closed loop, N workers each sending its next request as
  soon as the last one answered;
* ``--rate 100,200``: open loop, requests sent at scheduled arrival times, Poisson
  (exponential gaps) or lognormal gaps of the same mean (``--arrivals``, ``--sigma``);
  latency counts from the scheduled time, so a generator that falls behind shows as
  latency rather than hiding it.

``--stream`` (a generative model, e.g. one served by ``orca``): each request is a
generation of ``--max-tokens`` after ``--prompt-len`` random token ids, streamed token
by token (``Client.generate`` on the rings, ``generate_stream`` server-sent events over
HTTP, ``ModelStreamInfer`` over gRPC, one stream per worker); each point then also has
the time to the first token (TTFT) and between tokens (TBT). Without ``--stream`` a
generative model's requests are the same generations answered whole.

``--server-pid PID`` (the daemon, ``paella kserve``): the CPU time those processes
spent over the measured window (not the warm-up), per request served: the front end's
"CPU per request". Read from ``/proc/PID/stat`` (all the process's threads, not its
children), whose unit is a clock tick (10 ms): over a window of a few seconds and
thousands of requests that is a few microseconds per request at most.

Per point: p50, p90 and p99 latency, mean, throughput, errors, this generator's own CPU
per request (if it nears a core, the generator is the bottleneck); to ``--csv`` (the
columns perf_analyzer writes, in microseconds, then ours), ``--json`` and ``--plot``
(latency percentiles against throughput, needs matplotlib: the ``plots`` extra).
Progress goes to stderr once a second. Inputs are random, of the model's shapes and
dtypes.

Why the network workers speak HTTP/1.1 and HTTP/2 themselves: on a small machine the
generator shares the cores with the server it measures, and http.client spends about
100 us of CPU per request, grpcio's client about 185 us (measured against ``echo`` on
2 cores), where a request encoded once, sent whole and answered with the least parsing
costs 30 to 60 us. ``--grpc-client grpcio`` uses grpcio instead, to cross-check.
"""
from __future__ import annotations

import argparse
import csv
import http.client
import json
import math
import os
import queue
import resource
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import numpy as np

from paella import wire
from paella.client.client import connect, default_socket
from paella.client.errors import PaellaError
from paella.client.kserve_messages import pb_bytes, infer_request, model_metadata, stream_response
from paella.client.perf_http import DATA, END_STREAM, GRPC_SERVICE, H2, Http1, RST, grpc_headers, grpc_message, http_error

KSERVE_DTYPES = {"BOOL": "bool", "UINT8": "uint8", "UINT16": "uint16", "UINT32": "uint32",
                 "UINT64": "uint64", "INT8": "int8", "INT16": "int16", "INT32": "int32",
                 "INT64": "int64", "FP16": "float16", "FP32": "float32", "FP64": "float64"}
#: A generative model's tensors (``paella.stepsched.orca_plugin``; what the front end's
#: ``ModelSpec.generative`` and ``Client.generate`` check).
GENERATIVE_INPUTS, GENERATIVE_OUTPUTS = {"prompt", "lengths"}, {"tokens", "n_tokens"}
#: Prompt token ids are drawn from 1..PROMPT_IDS-1: valid for any vocabulary this size
#: or larger (the tiny GPT's is 64).
PROMPT_IDS = 32

#: What a worker's ``send()`` returns: nothing, or (streaming) each token's arrival time.
Send = Callable[[], "list[float] | None"]


class PerfError(Exception):
    """A setting or a target that cannot be measured: the message says why."""


@dataclass(frozen=True)
class Workload:
    """What every request asks. ``stream``: a generation, token by token (a generative
    model only); a generative model's requests are ``prompt_len`` random token ids and
    ``max_tokens``, streamed or not. ``priority`` as the daemon takes it (0: none)."""
    stream: bool = False
    prompt_len: int = 8
    max_tokens: int = 16
    priority: int = 0


@dataclass
class Point:
    """One measured load point. The stream fields are None without ``--stream``, the
    server CPU ones without ``--server-pid``."""
    concurrency: int | None
    rate: float | None
    seconds: float
    requests: int
    errors: int
    throughput_rps: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    first_error: str = ""
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    tbt_p50_ms: float | None = None
    tbt_p99_ms: float | None = None
    tokens_per_s: float | None = None
    server_cpu_us_per_request: float | None = None
    server_cpu_us_per_request_by_pid: dict[str, float] | None = None
    client_cpu_us_per_request: float | None = None


@dataclass
class Sender:
    """Makes one worker's ``send()``: runs one request, raises on failure. ``close()``
    closes the connections made so far (after each point)."""
    make: Callable[[], Send]
    closers: list[Callable[[], None]] = field(default_factory=list)
    #: What the target keeps over the whole run (closed by :meth:`shutdown`).
    keep: list[Callable[[], None]] = field(default_factory=list)

    def workers(self, n: int) -> list[Send]:
        try:
            return [self.make() for _ in range(n)]
        except (PaellaError, OSError) as e:
            self.close()
            raise PerfError(f"cannot open {n} connections: {e}") from None

    def close(self) -> None:
        while self.closers:
            self.closers.pop()()

    def shutdown(self) -> None:
        self.close()
        while self.keep:
            self.keep.pop()()


# --- server CPU ---------------------------------------------------------------------------
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_cpu(pid: int) -> float:
    """CPU seconds process ``pid`` has spent, user and system, all its threads (not its
    children): fields 14 and 15 of ``/proc/PID/stat``. OSError if there is no such
    process."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rpartition(b")")[2].split()     # (the name may hold spaces)
    return (int(fields[11]) + int(fields[12])) / _TICK


class Meter:
    """CPU seconds of the server processes and of this one between two marks: the
    measured window of one point (its warm-up left out)."""

    def __init__(self, pids: Sequence[int]):
        self.pids = list(pids)
        self.marks: list[tuple[list[float], float]] = []

    def mark(self) -> None:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        self.marks.append(([self._cpu(p) for p in self.pids], ru.ru_utime + ru.ru_stime))

    @staticmethod
    def _cpu(pid: int) -> float:
        try:
            return process_cpu(pid)
        except (OSError, ValueError, IndexError):
            return math.nan                      # (it exited meanwhile: no figure)

    def per_request(self, served: int) -> tuple[dict[int, float], float] | None:
        """({pid: server CPU us per request}, client CPU us per request), or None
        before both marks."""
        if len(self.marks) < 2 or not served:
            return None
        (s0, c0), (s1, c1) = self.marks[0], self.marks[-1]
        return ({p: (b - a) * 1e6 / served for p, a, b in zip(self.pids, s0, s1)},
                (c1 - c0) * 1e6 / served)


def _sleep_until(t: float) -> None:
    while (left := t - time.perf_counter()) > 0:
        time.sleep(left)


# --- inputs -------------------------------------------------------------------------------
def _random(rng: np.random.Generator, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    dt = np.dtype(dtype)
    if dt.kind == "f":
        return rng.random(shape).astype(dt)
    if dt.kind == "b":
        return rng.random(shape) < 0.5
    return rng.integers(0, 100, size=shape).astype(dt)


def request_arrays(model: str, inputs: dict[str, tuple[str, tuple[int, ...]]],
                   outputs: set[str], work: Workload) -> dict[str, np.ndarray]:
    """One request's inputs (name: (numpy dtype, shape)): random ones, or for a
    generative model a prompt of ``work.prompt_len`` random token ids, padded, and
    ``lengths`` = [prompt length, max tokens]. PerfError for ``--stream`` with a model
    that does not generate, or a prompt longer than the model takes."""
    rng = np.random.default_rng(0)
    inputs = {n: (dt, tuple(max(d, 1) for d in shape))        # (a variable dimension: 1)
              for n, (dt, shape) in inputs.items()}
    if set(inputs) != GENERATIVE_INPUTS or not GENERATIVE_OUTPUTS <= outputs:
        if work.stream:
            raise PerfError(f"--stream needs a generative model (inputs prompt and lengths, "
                            f"outputs tokens and n_tokens: one served by a streaming "
                            f"scheduler such as orca); {model!r} has the inputs "
                            f"{', '.join(sorted(inputs))}")
        return {n: _random(rng, dt, shape) for n, (dt, shape) in inputs.items()}
    dtype, shape = inputs["prompt"]
    cap = int(np.prod(shape))
    if work.prompt_len > cap:
        raise PerfError(f"--prompt-len {work.prompt_len}: model {model!r} takes prompts of "
                        f"{cap} tokens at most")
    prompt = np.zeros(shape, dtype)
    prompt.reshape(-1)[:work.prompt_len] = prompt_ids(work.prompt_len)
    lengths = np.zeros(inputs["lengths"][1], inputs["lengths"][0])
    lengths.reshape(-1)[:2] = (work.prompt_len, work.max_tokens)
    return {"prompt": prompt, "lengths": lengths}


def prompt_ids(n: int) -> list[int]:
    """The prompt every generation of a run starts from (seeded: runs compare)."""
    return np.random.default_rng(0).integers(1, PROMPT_IDS, n).tolist()


def _address(option: str, address: str) -> tuple[str, int]:
    """HOST:PORT (HOST may be empty: 127.0.0.1; or [IPv6]) checked, or PerfError."""
    host, _, port = address.rpartition(":")
    if not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        raise PerfError(f"{option} wants HOST:PORT with a TCP port 1..65535, got {address!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


# --- the local rings ----------------------------------------------------------------------
def local_target(socket: str, model: str, timeout: float, mode: str = "socket",
                 priority: int = 0, work: Workload | None = None) -> Sender:
    """Requests over the rings, one connection per worker, in wait ``mode``. The default
    is ``socket``: the workers are threads of one process, and a hybrid or polling waiter
    spins on its ring holding the GIL, so the other workers wait for the interpreter's
    switch interval (5 ms) and the generator, not the daemon, sets the latency."""
    work = work or Workload(priority=priority)
    try:
        probe = connect(socket)
    except PaellaError as e:
        raise PerfError(str(e)) from None
    with probe:
        m = probe.models.get(model)
        if m is None:
            raise PerfError(f"the daemon serves no model {model!r}; it serves "
                            f"{', '.join(sorted(probe.models)) or 'none'}")
    v = m.variants[0]
    inputs = request_arrays(model, {t.name: (t.dtype, tuple(t.shape)) for t in v.inputs},
                            {t.name for t in v.outputs}, work)
    prompt = prompt_ids(work.prompt_len)
    sender = Sender(lambda: None)                     # type: ignore[arg-type,return-value]

    def make() -> Send:
        c = connect(socket, mode=mode)
        sender.closers.append(c.close)
        if not work.stream:
            return lambda: c.infer(model, inputs, timeout=timeout,
                                   priority=work.priority) and None
        clock = time.perf_counter

        def send() -> list[float]:
            return [clock() for _ in c.generate(model, prompt, work.max_tokens,
                                                timeout=timeout, priority=work.priority)]
        return send
    sender.make = make
    return sender


def _kserve_metadata(host: str, port: int, address: str, model: str, timeout: float) -> dict:
    conn = http.client.HTTPConnection(host, port, timeout=min(timeout, 10.0))
    try:
        conn.request("GET", f"/v2/models/{model}")
        r = conn.getresponse()
        body = r.read()
    except OSError as e:
        raise PerfError(f"no KServe endpoint answers on {address}: {e}") from None
    finally:
        conn.close()
    if r.status != 200:
        raise PerfError(f"KServe endpoint {address}: model {model!r}: "
                        f"{json.loads(body or b'{}').get('error', r.status)}")
    return json.loads(body)


def _tensors(md: list[dict]) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {t["name"]: (KSERVE_DTYPES.get(t["datatype"], "float32"), tuple(t["shape"]))
            for t in md}


def kserve_target(address: str, model: str, timeout: float, priority: int = 0,
                  work: Workload | None = None) -> Sender:
    """Requests to a KServe v2 REST endpoint, a connection per worker: ``infer`` with
    binary tensors, or (``--stream``) ``generate_stream``, its events timed as they
    arrive."""
    work = work or Workload(priority=priority)
    host, port = _address("--kserve", address)
    md = _kserve_metadata(host, port, address, model, timeout)
    dtypes = {t["name"]: t["datatype"] for t in md["inputs"]}
    arrays = request_arrays(model, _tensors(md["inputs"]), {t["name"] for t in md["outputs"]},
                            work)
    params: dict = {"binary_data_output": True}
    if work.priority:
        params["priority"] = work.priority          # (Triton's request parameter)
    if work.stream:
        head = b""
        body = json.dumps({"prompt_ids": prompt_ids(work.prompt_len),
                           "max_tokens": work.max_tokens,
                           "parameters": {"priority": work.priority} if work.priority
                           else {}}).encode()
        what, ctype = "generate_stream", b"application/json"
    else:
        header = [{"name": n, "datatype": dtypes[n], "shape": list(a.shape),
                   "parameters": {"binary_data_size": a.nbytes}} for n, a in arrays.items()]
        head = json.dumps({"inputs": header, "parameters": params}).encode()
        body = head + b"".join(a.tobytes() for a in arrays.values())
        what, ctype = "infer", b"application/octet-stream"
    request = [b"POST /v2/models/%s/%s HTTP/1.1\r\nHost: %s\r\nContent-Type: %s\r\n"
               b"%sContent-Length: %d\r\n\r\n"
               % (model.encode(), what.encode(), address.encode(), ctype,
                  b"Inference-Header-Content-Length: %d\r\n" % len(head) if head else b"",
                  len(body)), body]
    sender = Sender(lambda: None)                     # type: ignore[arg-type,return-value]

    def make() -> Send:
        conn = Http1(host, port, timeout)
        sender.closers.append(conn.close)
        run = _sse_request if work.stream else _http_request

        def send() -> list[float] | None:
            try:
                return run(conn, request)
            except BaseException:
                conn.close()        # (in no known state: the next request opens another)
                raise
        return send
    sender.make = make
    return sender


def _http_request(conn: Http1, request: list[bytes]) -> None:
    conn.send(request)
    status, body = conn.answer()
    if status != 200:
        raise http_error(status, body)


def _sse_request(conn: Http1, request: list[bytes]) -> list[float]:
    """One ``generate_stream``: each token event's arrival time. The stream must end
    with its ``done`` event; an ``error`` event fails the request."""
    conn.send(request)
    status, head = conn.head()
    if status != 200:
        raise http_error(status, conn.body(head))
    times: list[float] = []
    pending, done, error = b"", False, b""
    for piece, t in conn.pieces(head):
        pending += piece
        while (i := pending.find(b"\n\n")) >= 0:
            event, pending = pending[:i], pending[i + 2:]
            if b'"token_id"' in event:
                times.append(t)
            elif b'"done"' in event:
                done = True
            elif b'"error"' in event:
                error = event
    if error or not done:
        raise RuntimeError(f"generate_stream: {error[6:300].decode(errors='replace')}"
                           if error else "generate_stream ended without its done event")
    return times


class GrpcTarget:
    """What a gRPC worker needs: the address, the encoded request, and grpcio for what
    is not the hot path (metadata, and an error's explanation)."""

    def __init__(self, address: str, model: str, timeout: float, work: Workload):
        try:
            import grpc
        except ImportError:
            raise PerfError("--grpc needs grpcio: pip install grpcio (or the kserve extra: "
                            "pip install 'paella-py[kserve]')") from None
        self.grpc = grpc
        self.host, self.port = _address("--grpc", address)
        self.address, self.model, self.timeout, self.work = address, model, timeout, work
        self.target = f"{self.host}:{self.port}" if ":" not in self.host else \
            f"[{self.host}]:{self.port}"
        self.channel = grpc.insecure_channel(self.target, options=[
            ("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)])
        inputs, outputs = model_metadata(self._metadata())
        tensors = {n: (KSERVE_DTYPES.get(dt, "float32"), shape) for n, (dt, shape) in
                   inputs.items()}
        arrays = request_arrays(model, tensors, outputs, work)
        self.request = self._request(arrays, {n: dt for n, (dt, _) in inputs.items()})
        self.explained = ""

    def _metadata(self) -> bytes:
        call = self.channel.unary_unary(GRPC_SERVICE + "ModelMetadata")
        try:
            return call(pb_bytes(1, self.model.encode()), timeout=min(self.timeout, 10))
        except self.grpc.RpcError as e:
            self.channel.close()
            if e.code() in (self.grpc.StatusCode.UNAVAILABLE,
                            self.grpc.StatusCode.DEADLINE_EXCEEDED):
                raise PerfError(f"no KServe gRPC endpoint answers on {self.address}: "
                                f"{e.details()}") from None
            raise PerfError(f"KServe gRPC endpoint {self.address}: model {self.model!r}: "
                            f"{e.details()}") from None

    def _request(self, arrays: dict[str, np.ndarray], datatypes: dict[str, str]) -> bytes:
        """The ModelInferRequest every call sends: the model's inputs as raw contents, or
        (``--stream``) ``prompt_ids`` and the ``max_tokens`` parameter."""
        params = {"priority": self.work.priority} if self.work.priority else {}
        if self.work.stream:
            ids = np.array(prompt_ids(self.work.prompt_len), "<i4")
            return infer_request(self.model, [("prompt_ids", "INT32", [ids.size], ids.tobytes())],
                                 {"max_tokens": self.work.max_tokens, **params})
        le = {n: np.ascontiguousarray(a, a.dtype.newbyteorder("<")) for n, a in arrays.items()}
        return infer_request(self.model, [(n, datatypes[n], a.shape, a.tobytes())
                                          for n, a in le.items()], params)

    def why(self) -> str:
        """Why calls fail, once (asked through grpcio: the raw client reads no
        trailers); later failures repeat the first answer."""
        if not self.explained:
            call = self.channel.unary_unary(GRPC_SERVICE + "ModelInfer")
            try:
                call(self.request, timeout=self.timeout)
                self.explained = "a call failed (the same call through grpcio then succeeded)"
            except self.grpc.RpcError as e:
                self.explained = f"gRPC {e.code().name}: {e.details()}"
        return self.explained

    def close(self) -> None:
        self.channel.close()


def grpc_target(address: str, model: str, timeout: float, work: Workload,
                client: str = "h2") -> Sender:
    """Requests to a KServe v2 gRPC endpoint, a connection per worker: ``ModelInfer``, or
    (``--stream``) ``ModelStreamInfer``, one stream per worker and one request at a time
    on it. ``client``: ``h2`` (:class:`H2`) or ``grpcio``."""
    g = GrpcTarget(address, model, timeout, work)
    sender = Sender(lambda: None, keep=[g.close])     # type: ignore[arg-type,return-value]
    if client == "grpcio":
        sender.make = lambda: _grpcio_worker(g, sender)
    else:
        sender.make = lambda: _h2_worker(g, sender)
    return sender


def _h2_worker(g: GrpcTarget, sender: Sender) -> Send:
    """A worker over its own :class:`H2` connection (made again after a failure)."""
    conn: list[H2] = []
    method = "ModelStreamInfer" if g.work.stream else "ModelInfer"
    block = grpc_headers(f"{g.host}:{g.port}", method)
    message = grpc_message(g.request)
    stream: list[int] = []                          # the open ModelStreamInfer's id

    def connection() -> H2:
        if not conn or conn[0].closed:
            if conn:
                conn.pop().close()
            stream.clear()
            conn.append(H2(g.host, g.port, g.timeout))
        return conn[0]

    def close() -> None:
        if conn:
            conn.pop().close()
    sender.closers.append(close)

    def unary() -> None:
        c = connection()
        sid = c.open(block, message, end=True)
        got = bytearray()
        try:
            while True:
                kind, flags, fsid, payload = c.frame()
                if fsid != sid:
                    continue
                if kind == RST:
                    raise RuntimeError(f"the server reset the call (HTTP/2 error "
                                       f"{int.from_bytes(payload[:4], 'big')})")
                if kind == DATA:
                    got += payload
                if flags & END_STREAM:
                    break
        except BaseException:
            close()
            raise
        c.done(sid)
        if len(got) < 5:
            raise RuntimeError(g.why())

    def streamed() -> list[float]:
        c = connection()
        try:
            if not stream:
                stream.append(c.open(block))
            sid = stream[0]
            c.send(sid, message, end=False)
            return _stream_tokens(g, c, sid)
        except BaseException:
            close()
            raise
    return streamed if g.work.stream else unary


def _stream_tokens(g: GrpcTarget, c: H2, sid: int) -> list[float]:
    """The responses to one request on ``ModelStreamInfer`` stream ``sid``: each token's
    arrival time, until the final response."""
    times: list[float] = []
    acc = bytearray()
    while True:
        kind, flags, fsid, payload = c.frame()
        if fsid != sid:
            continue
        if kind == RST or flags & END_STREAM:
            raise RuntimeError("the server ended the stream")
        if kind != DATA:
            continue
        acc += payload
        while len(acc) >= 5 and len(acc) >= 5 + (n := int.from_bytes(acc[1:5], "big")):
            error, final = stream_response(bytes(acc[5:5 + n]))
            del acc[:5 + n]
            if error:
                raise RuntimeError(f"ModelStreamInfer: {error}")
            if final:
                if acc:
                    raise RuntimeError("ModelStreamInfer answered past the final response")
                return times
            times.append(c.t_recv)


def _grpcio_worker(g: GrpcTarget, sender: Sender) -> Send:
    """A worker through grpcio (``--grpc-client grpcio``), a channel of its own."""
    grpc = g.grpc
    ch = grpc.insecure_channel(g.target, options=[("grpc.max_receive_message_length", -1),
                                                  ("grpc.max_send_message_length", -1),
                                                  ("grpc.use_local_subchannel_pool", 1)])
    sender.closers.append(ch.close)
    if not g.work.stream:
        call = ch.unary_unary(GRPC_SERVICE + "ModelInfer")

        def unary() -> None:
            try:
                call(g.request, timeout=g.timeout)
            except grpc.RpcError as e:
                raise RuntimeError(f"gRPC {e.code().name}: {e.details()}") from None
        return unary
    requests: queue.Queue[bytes | None] = queue.Queue()
    responses = ch.stream_stream(GRPC_SERVICE + "ModelStreamInfer")(iter(requests.get, None))
    sender.closers.append(lambda: requests.put(None))
    clock = time.perf_counter

    def streamed() -> list[float]:
        requests.put(g.request)
        times = []
        try:
            for body in responses:
                error, final = stream_response(body)
                if error:
                    raise RuntimeError(f"ModelStreamInfer: {error}")
                if final:
                    return times
                times.append(clock())
        except grpc.RpcError as e:
            raise RuntimeError(f"gRPC {e.code().name}: {e.details()}") from None
        raise RuntimeError("the server ended the stream")
    return streamed


# --- load -----------------------------------------------------------------------------------
class Recorder:
    """Latencies, token times and errors of one point, shared by its workers."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.latencies: list[float] = []
        self.ttft: list[float] = []
        self.gaps: list[float] = []
        self.tokens = 0
        self.errors = 0
        self.first_error = ""

    def record(self, send: Send, t0: float, measuring: bool) -> None:
        try:
            times = send()
        except Exception as e:  # noqa: BLE001 - every failure counts, the run goes on
            with self.lock:
                self.errors += measuring
                self.first_error = self.first_error or f"{type(e).__name__}: {e}"
            return
        if not measuring:
            return
        lat = time.perf_counter() - t0
        with self.lock:
            self.latencies.append(lat)
            if times:
                self.ttft.append(times[0] - t0)
                self.gaps += [b - a for a, b in zip(times, times[1:])]
                self.tokens += len(times)


def run_concurrency(sender: Sender, n: int, seconds: float, warmup: float,
                    progress: Callable[[Recorder, float], None],
                    meter: Meter | None = None) -> tuple[Recorder, float]:
    rec = Recorder()
    sends = sender.workers(n)
    t_start = time.perf_counter() + warmup
    t_end = t_start + seconds

    def worker(send: Send) -> None:
        while True:
            t0 = time.perf_counter()
            if t0 >= t_end:
                return
            rec.record(send, t0, t0 >= t_start)
    threads = [threading.Thread(target=worker, args=(s,)) for s in sends]
    return rec, _run_threads(threads, rec, t_start, t_end, progress, meter)


def arrival_gaps(rate: float, arrivals: str, sigma: float, n: int, seed: int = 1) -> np.ndarray:
    """``n`` gaps (seconds) of mean 1/rate: exponential (Poisson arrivals), lognormal of
    that mean with shape ``sigma``, or constant."""
    rng = np.random.default_rng(seed)
    mean = 1.0 / rate
    if arrivals == "poisson":
        return rng.exponential(mean, n)
    if arrivals == "lognormal":
        return rng.lognormal(math.log(mean) - sigma ** 2 / 2, sigma, n)
    return np.full(n, mean)


def run_rate(sender: Sender, rate: float, arrivals: str, sigma: float, seconds: float,
             warmup: float, workers: int, progress: Callable[[Recorder, float], None],
             meter: Meter | None = None) -> tuple[Recorder, float]:
    rec = Recorder()
    sends = sender.workers(workers)
    todo: queue.Queue[float | None] = queue.Queue()
    t_start = time.perf_counter() + warmup
    t_end = t_start + seconds
    gaps = arrival_gaps(rate, arrivals, sigma, int(rate * (seconds + warmup) * 1.5) + 16)

    def worker(send: Send) -> None:
        while (t0 := todo.get()) is not None:
            rec.record(send, t0, t_start <= t0 < t_end)

    def schedule() -> None:
        t = time.perf_counter()
        for gap in gaps:
            t += gap
            if t >= t_end:
                break
            delay = t - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            todo.put(t)                       # latency counts from the scheduled time
        for _ in sends:
            todo.put(None)
    threads = [threading.Thread(target=worker, args=(s,)) for s in sends]
    threads.append(threading.Thread(target=schedule))
    return rec, _run_threads(threads, rec, t_start, t_end, progress, meter)


def _run_threads(threads: list[threading.Thread], rec: Recorder, t_start: float, t_end: float,
                 progress: Callable[[Recorder, float], None], meter: Meter | None = None
                 ) -> float:
    """Run the point's threads, and ``meter``'s marks at the measured window's ends."""
    if meter is not None:
        def marks() -> None:
            for t in (t_start, t_end):
                _sleep_until(t)
                meter.mark()
        threads = [*threads, threading.Thread(target=marks)]
    for t in threads:
        t.daemon = True
        t.start()
    while (alive := [t for t in threads if t.is_alive()]):
        alive[0].join(1.0)
        progress(rec, min(time.perf_counter(), t_end) - t_start)
    return t_end - t_start


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1e3 if values else math.nan


def summarize(rec: Recorder, seconds: float, concurrency: int | None, rate: float | None,
              stream: bool = False, meter: Meter | None = None) -> Point:
    lat = np.array(rec.latencies) * 1e3
    pct = (lambda q: float(np.percentile(lat, q))) if lat.size else (lambda q: math.nan)
    p = Point(concurrency, rate, seconds, int(lat.size), rec.errors, lat.size / seconds,
              pct(50), pct(90), pct(99), float(lat.mean()) if lat.size else math.nan,
              rec.first_error)
    if stream:
        p.ttft_p50_ms, p.ttft_p99_ms = _pct(rec.ttft, 50), _pct(rec.ttft, 99)
        p.tbt_p50_ms, p.tbt_p99_ms = _pct(rec.gaps, 50), _pct(rec.gaps, 99)
        p.tokens_per_s = rec.tokens / seconds
    cpu = meter.per_request(p.requests + p.errors) if meter is not None else None
    if cpu is not None:
        by_pid, p.client_cpu_us_per_request = cpu
        if by_pid:
            p.server_cpu_us_per_request = sum(by_pid.values())
            p.server_cpu_us_per_request_by_pid = {str(k): v for k, v in by_pid.items()}
    return p


# --- output ---------------------------------------------------------------------------------
@dataclass
class RoundTrip:
    """Closed-loop round trips of one model in one wait mode (:func:`time_round_trips`)."""
    model: str
    mode: str
    n: int
    p50_us: float
    p99_us: float
    mean_us: float
    client_cpu: float      # client CPU seconds / wall seconds over the run


def time_round_trips(sock: str, model: str, mode: str, n: int, warmup: int = 300) -> RoundTrip:
    """``n`` requests back to back from one client, predict to read_result on one
    buffer (no input written, no output copied): the service path's own cost, which the
    demo and ``bench_roundtrip`` both report, so they time it the same way."""
    with connect(sock, mode=mode) as c:
        v = c.models[model].variants[0]
        off = c.alloc(v.io_bytes)
        predict, read = c.predict, c.read_result
        times = np.empty(n)
        perf = time.perf_counter
        for _ in range(warmup):
            predict(model, v.io_bytes, off)
            read()
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        w0 = perf()
        for i in range(n):
            t = perf()
            predict(model, v.io_bytes, off)
            read()
            times[i] = perf() - t
        wall = perf() - w0
        r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime) / wall
    us = times * 1e6
    return RoundTrip(model, mode, n, float(np.percentile(us, 50)), float(np.percentile(us, 99)),
                     float(us.mean()), cpu)


def _us(ms: float | None) -> str:
    return "" if ms is None or math.isnan(ms) else str(round(ms * 1e3))


def write_csv(path: str, points: list[Point], pids: Sequence[int] = ()) -> None:
    """perf_analyzer's columns (latencies in microseconds), then ours: the stream's (if
    any point has them), the servers' CPU per request, the generator's."""
    stream = any(p.ttft_p50_ms is not None for p in points)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Concurrency", "Request Rate", "Inferences/Second", "p50 latency",
                    "p90 latency", "p99 latency", "Avg latency", "Requests", "Errors"]
                   + (["TTFT p50", "TTFT p99", "TBT p50", "TBT p99", "Tokens/Second"]
                      if stream else [])
                   + (["Server CPU us/request"] if pids else [])
                   + [f"Server CPU us/request {pid}" for pid in pids if len(pids) > 1]
                   + ["Client CPU us/request"])
        for p in points:
            row = [p.concurrency or "", p.rate or "", f"{p.throughput_rps:.2f}",
                   _us(p.p50_ms), _us(p.p90_ms), _us(p.p99_ms), _us(p.mean_ms), p.requests,
                   p.errors]
            if stream:
                row += [_us(p.ttft_p50_ms), _us(p.ttft_p99_ms), _us(p.tbt_p50_ms),
                        _us(p.tbt_p99_ms), "" if p.tokens_per_s is None
                        else f"{p.tokens_per_s:.2f}"]
            by_pid = p.server_cpu_us_per_request_by_pid or {}
            if pids:
                row.append(_fmt(p.server_cpu_us_per_request, ".1f"))
            row += [_fmt(by_pid.get(str(pid)), ".1f") for pid in pids if len(pids) > 1]
            row.append(_fmt(p.client_cpu_us_per_request, ".1f"))
            w.writerow(row)


def _fmt(x: float | None, spec: str) -> str:
    return "" if x is None or math.isnan(x) else format(x, spec)


def table(points: list[Point], open_loop: bool, pids: Sequence[int]) -> str:
    """The points as the terminal shows them (ms; CPU in us per request)."""
    stream = any(p.ttft_p50_ms is not None for p in points)
    cols = [("concurrency" if not open_loop else "rate/s", 11)] + [
        (c, w) for c, w in (("req/s", 9), ("p50 ms", 8), ("p90 ms", 8), ("p99 ms", 8),
                            ("errors", 6))]
    if stream:
        cols += [("TTFT p50", 9), ("TTFT p99", 9), ("TBT p50", 8), ("TBT p99", 8),
                 ("tok/s", 8)]
    if pids:
        cols += [("srv us/req", 10)] + [(f"us/req {pid}", 13) for pid in pids if len(pids) > 1]
    cols += [("cli us/req", 10)]
    lines = [" ".join(f"{c:>{w}}" for c, w in cols)]
    for p in points:
        vals = [f"{p.concurrency or p.rate:>11g}", f"{p.throughput_rps:>9.1f}",
                f"{p.p50_ms:>8.3f}", f"{p.p90_ms:>8.3f}", f"{p.p99_ms:>8.3f}", f"{p.errors:>6}"]
        if stream:
            vals += [f"{_fmt(p.ttft_p50_ms, '.3f'):>9}", f"{_fmt(p.ttft_p99_ms, '.3f'):>9}",
                     f"{_fmt(p.tbt_p50_ms, '.3f'):>8}", f"{_fmt(p.tbt_p99_ms, '.3f'):>8}",
                     f"{_fmt(p.tokens_per_s, '.1f'):>8}"]
        if pids:
            by_pid = p.server_cpu_us_per_request_by_pid or {}
            vals.append(f"{_fmt(p.server_cpu_us_per_request, '.1f'):>10}")
            vals += [f"{_fmt(by_pid.get(str(pid)), '.1f'):>13}" for pid in pids if len(pids) > 1]
        vals.append(f"{_fmt(p.client_cpu_us_per_request, '.1f'):>10}")
        lines.append(" ".join(vals))
    return "\n".join(lines)


def _check_plot_format(path: str) -> None:
    """``--plot``'s file type, checked before the run (not after it, in matplotlib)."""
    from paella.cli import CLIError
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
    except ImportError:
        raise CLIError("--plot needs matplotlib: pip install 'paella-py[plots]'") from None
    kinds = FigureCanvasAgg.get_supported_filetypes()
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    if ext not in kinds:
        raise CLIError(f"--plot {path}: the file name must end in one of "
                       f"{', '.join('.' + k for k in sorted(kinds))} (the image's format)")


def plot(path: str, points: list[Point], title: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PerfError("--plot needs matplotlib: pip install 'paella-py[plots]'") from None
    fig, ax = plt.subplots(figsize=(6, 4))
    x = [p.throughput_rps for p in points]
    for key, style in (("p50_ms", "o-"), ("p90_ms", "s--"), ("p99_ms", "^-")):
        ax.plot(x, [getattr(p, key) for p in points], style, label=key[:3])
    for p in points:
        ax.annotate(f"c{p.concurrency}" if p.concurrency else f"{p.rate:g}/s",
                    (p.throughput_rps, p.p99_ms), fontsize=7, textcoords="offset points",
                    xytext=(3, 3))
    ax.set_xlabel("throughput (requests/s)")
    ax.set_ylabel("latency (ms)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- command --------------------------------------------------------------------------------
def _numbers(text: str, kind: type) -> list:
    try:
        vals = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}")
    if not vals or any(not 0 < v < 1e9 for v in vals):     # (also refuses nan and inf)
        raise argparse.ArgumentTypeError(f"expected positive numbers (below 1e9), got {text!r}")
    return vals


def server_pids(values: list[str] | None) -> list[int]:
    """``--server-pid`` values (each a pid or a comma list), each a live process."""
    pids: list[int] = []
    for text in values or ():
        for part in text.split(","):
            part = part.strip()
            if not (part.isascii() and part.isdigit() and 0 < int(part) < 2 ** 31):
                raise PerfError(f"--server-pid wants process ids, got {text!r}")
            if int(part) not in pids:
                pids.append(int(part))
    for pid in pids:
        try:
            process_cpu(pid)
        except (OSError, ValueError, IndexError):
            raise PerfError(f"--server-pid {pid}: no such process") from None
    return pids


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("perf", help="load generator for a running daemon (like perf_analyzer)",
                       description=__doc__.splitlines()[0])
    p.add_argument("model", help="model name (e.g. echo, noop, resnet18, gpt-tiny)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--socket", help="the daemon's control socket (local rings; default "
                                        "$PAELLA_SOCKET or /run/paella/paella.sock)")
    where.add_argument("--kserve", metavar="HOST:PORT", help="a KServe v2 REST endpoint instead")
    where.add_argument("--grpc", metavar="HOST:PORT", help="a KServe v2 gRPC endpoint instead")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=lambda t: _numbers(t, int),
                      help="closed-loop sweep, e.g. 1,2,4,8 (default 1)")
    load.add_argument("--rate", type=lambda t: _numbers(t, float),
                      help="open-loop sweep in requests/s, e.g. 100,200,400")
    p.add_argument("--arrivals", choices=("poisson", "lognormal", "constant"), default="poisson",
                   help="open-loop arrival process (default poisson)")
    p.add_argument("--sigma", type=float, default=1.5, help="lognormal shape (default 1.5)")
    p.add_argument("--seconds", type=float, default=5.0, help="measured seconds per point")
    p.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds first")
    p.add_argument("--workers", type=int, default=16,
                   help="open loop: requests in flight at most (default 16)")
    p.add_argument("--timeout", type=float, default=30.0, help="per request, seconds")
    p.add_argument("--priority", type=int, default=0,
                   help=f"every request's priority, 1 (most urgent) .. {wire.MAX_PRIORITY}; "
                        "default none (the batchers' and the priority policy's middle level)")
    p.add_argument("--stream", action="store_true",
                   help="a generative model's generations, streamed token by token: adds "
                        "time to first token and between tokens")
    p.add_argument("--prompt-len", type=int, default=8,
                   help="generative models: prompt tokens per request (default 8)")
    p.add_argument("--max-tokens", type=int, default=16,
                   help="generative models: tokens generated per request (default 16)")
    p.add_argument("--server-pid", action="append", metavar="PID",
                   help="report this process's CPU time per request over each point "
                        "(repeatable, or a comma list: the daemon, paella kserve)")
    p.add_argument("--wait-mode", choices=("socket", "hybrid", "polling"), default="socket",
                   help="local rings: how workers wait (default socket: they are threads of "
                        "one process, and a spinning waiter holds the GIL)")
    p.add_argument("--grpc-client", choices=("h2", "grpcio"), default="h2",
                   help="--grpc: this generator's own HTTP/2 client (default; about a third "
                        "of grpcio's CPU per call) or grpcio")
    p.add_argument("--csv", help="write the points as CSV (perf_analyzer's columns)")
    p.add_argument("--json", help="write the points as JSON")
    p.add_argument("--plot", help="write latency against throughput as an image")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=_perf)


def _check(args: argparse.Namespace) -> None:
    """Every setting, before anything is measured (CLIError: exit 2)."""
    from paella.cli import CLIError
    if not (0 < args.seconds <= 1e6 and 0 <= args.warmup <= 1e6 and 1 <= args.workers <= 4096
            and 0 < args.sigma <= 100 and 0 < args.timeout <= 1e6):    # (nan and inf too)
        raise CLIError("--seconds, --workers, --sigma and --timeout must be positive, "
                       "--warmup >= 0 (all finite; at most 4096 workers)")
    if not (1 <= args.prompt_len <= 1 << 20 and 1 <= args.max_tokens <= 1 << 20):
        raise CLIError("--prompt-len and --max-tokens must be 1 .. 1048576")
    for opt in ("csv", "json", "plot"):         # (checked now, not after the whole run)
        out = getattr(args, opt)
        if out and (os.path.isdir(out) or not os.path.isdir(os.path.dirname(os.path.abspath(out)))):
            raise CLIError(f"--{opt} {out}: not a file in an existing directory")
    if args.plot:
        _check_plot_format(args.plot)
    if args.rate is not None and min(args.rate) * args.seconds < 1:
        raise CLIError(f"--rate {min(args.rate):g} for --seconds {args.seconds:g} sends no "
                       f"request: raise one of them (rate x seconds must be at least 1)")
    if not 0 <= args.priority <= wire.MAX_PRIORITY:
        raise CLIError(f"--priority must be 1 (most urgent) .. {wire.MAX_PRIORITY}, or 0 for "
                       f"none; got {args.priority}")


def _target(args: argparse.Namespace, work: Workload) -> tuple[Sender, str]:
    if args.grpc:
        return grpc_target(args.grpc, args.model, args.timeout, work, args.grpc_client), \
            "kserve-grpc"
    if args.kserve:
        return kserve_target(args.kserve, args.model, args.timeout, work=work), "kserve-http"
    sock = args.socket or default_socket()
    return local_target(sock, args.model, args.timeout, args.wait_mode, work=work), \
        "local-rings"


def _perf(args: argparse.Namespace) -> int:
    from paella.cli import CLIError
    _check(args)
    work = Workload(args.stream, args.prompt_len, args.max_tokens, args.priority)
    try:
        pids = server_pids(args.server_pid)
        sender, transport = _target(args, work)
        try:
            points = _sweep(args, sender, pids)
        finally:
            sender.shutdown()
    except PerfError as e:
        raise CLIError(str(e)) from None
    print(table(points, args.rate is not None, pids))
    failed = [p for p in points if p.errors]
    if failed:
        print(f"first error: {failed[0].first_error}", file=sys.stderr)
    result = {"model": args.model, "transport": transport,
              "grpc_client": args.grpc_client if args.grpc else None,
              "arrivals": None if args.rate is None else args.arrivals,
              "sigma": args.sigma if args.arrivals == "lognormal" and args.rate else None,
              "seconds": args.seconds, "priority": args.priority or None,
              "stream": args.stream,
              "prompt_len": args.prompt_len if args.stream else None,
              "max_tokens": args.max_tokens if args.stream else None,
              "server_pids": pids, "points": [asdict(p) for p in points]}
    try:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        if args.csv:
            write_csv(args.csv, points, pids)
    except OSError as e:
        raise CLIError(f"cannot write {e.filename}: {e.strerror}") from None
    if args.plot:
        try:
            plot(args.plot, points, f"paella perf {args.model} ({transport}"
                 f"{', ' + args.arrivals + ' arrivals' if args.rate else ''})")
        except PerfError as e:
            raise CLIError(str(e)) from None
    return 1 if any(p.requests == 0 for p in points) else 0


def _sweep(args: argparse.Namespace, sender: Sender, pids: Sequence[int] = ()) -> list[Point]:
    points = []
    loads = args.rate if args.rate is not None else (args.concurrency or [1])
    for load in loads:
        label = f"rate {load:g}/s" if args.rate is not None else f"concurrency {load}"

        def progress(rec: Recorder, t: float, label: str = label) -> None:
            if args.quiet:
                return
            with rec.lock:
                n, errors = len(rec.latencies), rec.errors
            phase = "warm-up" if t < 0 else f"{t:4.1f}/{args.seconds:g} s"
            print(f"[{label}] {phase}: {n} requests, {errors} errors", file=sys.stderr,
                  flush=True)
        meter = Meter(pids)
        if args.rate is not None:
            rec, secs = run_rate(sender, load, args.arrivals, args.sigma, args.seconds,
                                 args.warmup, args.workers, progress, meter)
            points.append(summarize(rec, secs, None, load, args.stream, meter))
        else:
            rec, secs = run_concurrency(sender, load, args.seconds, args.warmup, progress,
                                        meter)
            points.append(summarize(rec, secs, load, None, args.stream, meter))
        sender.close()
    return points
