"""Hostile clients against a real daemon (issue 12, the client-facing half).

Each test attacks one root cause of a daemon crash or leak and checks three things:
the attacker gets a clear error (or is dropped with one), the daemon stays up, and an
honest client is still served. Where the attack needs a second uid (the daemon admits
it with ``--allow-user nobody``), it runs as uid 65534 when the tests run as root.
"""
from __future__ import annotations

import json
import os
import resource
import socket
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

from paella import rings, wire
from paella.client import DaemonGone, DaemonUnavailable, RequestFailed, connect

from service_daemon import held_segments

NOBODY = 65534


def echo_works(sock: str) -> None:
    with connect(sock) as c:
        x = np.random.default_rng().standard_normal(256).astype(np.float32)
        np.testing.assert_array_equal(c.infer("echo", {"x": x})["y"], x)


def wait_for(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def read_until_closed(sock: socket.socket, timeout: float = 5.0) -> list[tuple[int, object]]:
    """The frames the daemon sent before it closed the connection."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (ConnectionResetError, socket.timeout):
        pass  # closed hard, or still open: the frames so far are what we check
    return wire.FrameReader().feed(data)


def exchange(path: str, payload: bytes, quiet: float = 0.3) -> list[tuple[int, object]]:
    """Send ``payload`` on a fresh connection; the frames answered until the daemon
    closed it or went quiet."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    got = b""
    try:
        s.sendall(payload)
        s.settimeout(quiet)
        while chunk := s.recv(65536):
            got += chunk
    except (socket.timeout, BrokenPipeError, ConnectionResetError):
        pass  # open (a recoverable error) or closed before we finished sending
    finally:
        s.close()
    return wire.FrameReader().feed(got)


def frame(kind: int, body: bytes) -> bytes:
    return wire.HEADER.pack(kind, 0, len(body)) + body


@pytest.fixture(scope="module")
def daemon():
    """One daemon for the tests that leave it healthy; uid 65534 may connect."""
    from service_daemon import cleanup, start_daemon
    dp = start_daemon("--allow-user", "nobody")
    os.chmod(dp.dir, 0o755)
    yield dp
    cleanup(dp)


# --- 1. a client truncates, grows, punches and remaps its segment ---------------------
HOSTILE_SEGMENT = """
import ctypes, errno, fcntl, json, mmap, os, socket, time
from paella import rings, wire
if UID:                              # (after the imports: /root is not readable by UID)
    os.setgid(UID); os.setuid(UID)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(SOCK)                      # SO_PEERCRED: this uid
s.sendall(wire.encode(wire.HELLO, {"version": 1, "mode": "polling", "arena_bytes": 65536}))
reader, fds, frames = wire.FrameReader(), [], []
while not frames:
    data, got, _, _ = socket.recv_fds(s, 65536, 4)
    fds += got
    frames += reader.feed(data)
welcome, fd = frames[0][1], fds[0]
layout = rings.Layout.from_dict(welcome["layout"])
out = {}
for size in (0, 4096, 2 * layout.total_bytes):
    try:
        os.ftruncate(fd, size)
        out[f"truncate {size}"] = "done"
    except OSError as e:
        out[f"truncate {size}"] = errno.errorcode[e.errno]
    try:                             # wake the daemon: it reads the ring at once
        s.sendall(wire.KICK_FRAME)
    except OSError:
        pass  # (a daemon that faulted is gone: the test sees it)
    time.sleep(0.3)
try:
    os.pwrite(fd, b"x", layout.total_bytes + 100)          # growing by a write
    out["write past the end"] = "done"
except OSError as e:
    out["write past the end"] = errno.errorcode[e.errno]
try:                                 # a write seal would stop the daemon writing too
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | 0x0010)   # | F_SEAL_FUTURE_WRITE
    out["add a seal"] = "done"
except OSError as e:
    out["add a seal"] = errno.errorcode[e.errno]
libc = ctypes.CDLL(None, use_errno=True)
libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
# FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE over the header and rings: reads as zeros
out["punch"] = libc.fallocate(fd, 3, 0, layout.arena_offset)
out["size"] = os.fstat(fd).st_size
out["served"] = False
if out["size"] >= layout.total_bytes:                     # remap and use it as usual
    mm = mmap.mmap(fd, layout.total_bytes)
    seg = rings.Segment(mm, layout)
    prod, cons = rings.RequestProducer(seg), rings.CompletionConsumer(seg)
    seg.arena[:1024] = 7
    prod.push(1, welcome["models"][0]["id"], 0, 2048, 0)
    s.sendall(wire.KICK_FRAME)
    deadline = time.monotonic() + 5
    while (got := cons.pop()) is None and time.monotonic() < deadline:
        time.sleep(0.001)
    out["served"] = got == (1, 0, "") and bool((seg.arena[1024:2048] == 7).all())
else:
    s.sendall(wire.KICK_FRAME)
    time.sleep(0.5)
print(json.dumps(out))
"""


@pytest.mark.parametrize("uid", [0, NOBODY], ids=["same-uid", "other-uid"])
def test_segment_cannot_be_truncated_or_grown(daemon, uid):
    """Item 1: the segment is a sealed memfd. ftruncate, growing writes and new seals
    fail with EPERM, for the daemon's own uid and another; a punched hole reads back as zeros
    (a fault needs pages beyond the end of the file, which sealing rules out); the
    daemon keeps serving this client and everyone else."""
    if uid and os.geteuid() != 0:
        pytest.skip("needs root to run the attacker as another user")
    from service_daemon import run_client
    r = run_client(f"UID = {uid}\n" + HOSTILE_SEGMENT, daemon.socket, timeout=30)
    assert daemon.proc.poll() is None, daemon.log()[-3000:]
    echo_works(daemon.socket)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["truncate 0"] == out["truncate 4096"] == "EPERM", out
    assert out[f"truncate {2 * rings.Layout(1024, 1024, 65536).total_bytes}"] == "EPERM", out
    assert out["write past the end"] == out["add a seal"] == "EPERM", out
    assert out["punch"] == 0 and out["served"], out


# --- 2. a client dropped in the middle of a round-robin pass ------------------------
def test_client_dropped_mid_pass_does_not_break_the_pass(daemon):
    """Item 2: a client dropped by poll_rings (corrupt ring) while clients after it
    in the ready list are still to be visited. Each round puts the corrupt client
    before a fresh honest one, so the pass visits the shrunken list."""
    honest = []
    try:
        for _ in range(8):
            bad = connect(daemon.socket, arena_bytes=1 << 16)
            honest.append(connect(daemon.socket, arena_bytes=1 << 16))
            bad._seg.hdr[rings.REQ_TAIL] = 10 ** 6            # impossibly far ahead
            bad._send(wire.KICK_FRAME)
            frames = read_until_closed(bad._sock)
            assert [m["error"] for k, m in frames if k == wire.ERROR] == ["ring_corrupt"]
            bad.close()
            assert daemon.proc.poll() is None, daemon.log()[-3000:]
        for c in honest:                  # everyone who was in the pass is still served
            x = np.full(256, float(c.client_id), np.float32)
            np.testing.assert_array_equal(c.infer("echo", {"x": x})["y"], x)
    finally:
        for c in honest:
            c.close()


# --- 3. completion head moved past the tail while completions are due -----------------
def test_completion_head_past_tail_drops_only_that_client(fresh_daemon):
    """Item 3: the client moves cmp_head past cmp_tail (as a torn store of the head
    can) after the daemon took its requests and before it completes them, so the
    daemon meets the head in complete(), not while polling (its ring is empty then).
    That client is dropped with ERROR ring_corrupt; another client's requests, in
    flight meanwhile, all get their answer.

    The window is exact: the simulated GPU runs in its own process (--sim-mode
    process), stopped (SIGSTOP) while the daemon takes the entries and the head
    moves, then let go (SIGCONT)."""
    import signal
    daemon = fresh_daemon("--sim-mode", "process")
    with open(f"/proc/{daemon.pid}/task/{daemon.pid}/children") as f:
        (gpu,) = [int(p) for p in f.read().split()]
    honest = connect(daemon.socket, mode="polling")
    hoff = honest.alloc(64)
    c = connect(daemon.socket, mode="polling", arena_bytes=1 << 16)
    off, model, hdr, n = c.alloc(64), c.models["noop"].model_id, c._seg.hdr, 8
    os.kill(gpu, signal.SIGSTOP)
    try:
        ids = [honest.predict("noop", 64, hoff) for _ in range(20)]
        for i in range(n):
            c.predict(model, 64, off)
        assert wait_for(lambda: int(hdr[rings.REQ_HEAD]) == n)     # all taken, none done
        assert int(hdr[rings.CMP_TAIL]) == 0
        hdr[rings.CMP_HEAD] = 5
    finally:
        os.kill(gpu, signal.SIGCONT)
    frames = read_until_closed(c._sock)
    c.close()
    assert daemon.proc.poll() is None, daemon.log()[-3000:]
    errors = [m for k, m in frames if k == wire.ERROR]
    assert errors and errors[0]["error"] == "ring_corrupt", frames
    assert "completion ring head 5 is outside [0, 0]" in errors[0]["message"], errors
    assert sorted(honest.read_result() for _ in ids) == ids    # every answer, once
    honest.close()
    echo_works(daemon.socket)


def test_client_library_stores_indices_with_one_aligned_8_byte_store():
    """Item 3: the library writes cmp_head and req_tail through an aligned,
    native-endian uint64 view (numpy then stores through a uint64 pointer: one
    8-byte store), never byte-wise."""
    import mmap
    layout = rings.Layout(4, 4, 4096)
    seg = rings.Segment(mmap.mmap(-1, layout.total_bytes), layout)
    for end in (rings.RequestProducer(seg), rings.CompletionConsumer(seg)):
        assert end.hdr.dtype == np.dtype("<u8") and end.hdr.flags.aligned
        assert end.hdr.ctypes.data % 64 == 0
    for word in (rings.REQ_TAIL, rings.CMP_HEAD):
        assert (word * 8) % 64 == 0               # each index on its own cache line


# --- 4. a hybrid client that never reads its socket, mid-batch ------------------------
def test_outbox_overflow_in_the_middle_of_a_batch(daemon):
    """Item 4: every rejected entry of a hybrid client queues a WAKE; a client that
    consumes its completion ring but never reads its socket overflows its outbox and
    is dropped inside a batch of entries. The rest of the batch is skipped (before,
    the next entry's validation read the released segment: ``c.seg is None``)."""
    for _ in range(3):                    # (one overflow may fall on a batch's last entry)
        c = connect(daemon.socket, mode="hybrid", arena_bytes=1 << 16)
        dropped = f"client {c.client_id} (pid {os.getpid()}) dropped: does not read its socket"
        prod, cons = c._requests, c._completions
        echo = c.models["echo"].model_id        # a real model, so validation goes as far
        pushed, look_at = 0, 0.0                # as the arena check (wrong length: rejected)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            while prod.push(pushed, echo, 0, 1, 0):
                pushed += 1
            if prod.daemon_sleeping():
                try:
                    c._send(wire.KICK_FRAME)
                except DaemonGone:        # dropped already: its socket is closed (checked
                    break                 # in the log below)
            while cons.pop() is not None:
                pass
            if time.monotonic() > look_at:
                if dropped in daemon.log():
                    break
                look_at = time.monotonic() + 0.05
        assert daemon.proc.poll() is None, daemon.log()[-3000:]
        assert wait_for(lambda: dropped in daemon.log(), 5)
        assert pushed > 60000             # 1 MiB of 16-byte WAKEs (beyond the socket's buffer)
        c.close()
    echo_works(daemon.socket)


# --- 5, 6. control frames: nesting and strict field types ------------------------------
#: name -> (frame, the ERROR code it must get)
HOSTILE_FRAMES = {
    "nested array": (frame(wire.HELLO, b"[" * 1024 + b"]" * 1024), "too_deep"),
    "nested object": (frame(wire.HELLO, b'{"a":' * 700 + b"1" + b"}" * 700), "too_deep"),
    "nested in a field": (frame(wire.HELLO, b'{"version":1,"mode":' + b"[" * 1500
                                + b"]" * 1500 + b"}"), "too_deep"),
    "nested LIST_MODELS": (frame(wire.LIST_MODELS, b"[" * 2000 + b"]" * 2000), "too_deep"),
    "nested KICK": (frame(wire.KICK, b"[" * 2000), "too_deep"),
    "bool arena": (wire.encode(wire.HELLO, {"version": 1, "arena_bytes": True}), "bad_field"),
    "bool version": (wire.encode(wire.HELLO, {"version": True}), "bad_field"),
    "float version": (wire.encode(wire.HELLO, {"version": 1.0}), "bad_field"),
    "float arena": (wire.encode(wire.HELLO, {"version": 1, "arena_bytes": 65536.0}), "bad_field"),
    "string arena": (wire.encode(wire.HELLO, {"version": 1, "arena_bytes": "65536"}), "bad_field"),
    "null mode": (wire.encode(wire.HELLO, {"version": 1, "mode": None}), "bad_field"),
    "list mode": (wire.encode(wire.HELLO, {"version": 1, "mode": ["hybrid"]}), "bad_field"),
    "unknown field": (wire.encode(wire.HELLO, {"version": 1, "segment": "/dev/shm/x"}),
                      "bad_field"),
    "no version": (wire.encode(wire.HELLO, {"mode": "polling"}), "bad_field"),
    "huge integer": (frame(wire.HELLO, b'{"version":1,"arena_bytes":' + b"9" * 5000 + b"}"),
                     "bad_json"),
    "NaN": (frame(wire.HELLO, b'{"version":1,"arena_bytes":NaN}'), "bad_field"),
    "field in LIST_MODELS": (wire.encode(wire.LIST_MODELS, {"all": True}), "bad_field"),
    "too large": (frame(wire.HELLO, b" " * (wire.MAX_CLIENT_PAYLOAD + 1)), "too_large"),
    "ERROR from a client": (frame(wire.ERROR, b"\xff not JSON"), "unexpected"),
    "MODELS from a client": (wire.encode(wire.MODELS, {"models": []}), "unexpected"),
}


@pytest.mark.parametrize("name", list(HOSTILE_FRAMES))
def test_hostile_control_frame_gets_an_error(daemon, name):
    """Items 5 and 6: deep nesting is refused before the JSON parser recurses, and
    every field must have its exact JSON type (a boolean is not an integer, 1.0 is
    not 1). Each frame gets one ERROR naming the problem; the daemon stays up."""
    payload, code = HOSTILE_FRAMES[name]
    frames = exchange(daemon.socket, payload)
    assert daemon.proc.poll() is None, daemon.log()[-3000:]
    assert frames and frames[0][0] == wire.ERROR, frames
    assert frames[0][1]["error"] == code, frames[0][1]
    assert frames[0][1]["message"]
    echo_works(daemon.socket)


# --- 8. a departed client leaves no mapping and no descriptor ---------------------------
def quiet_fds(dp) -> list[str]:
    """The daemon's descriptors once one client has come and gone (whatever first use
    opens for good is open then) and the daemon has let go of it."""
    echo_works(dp.socket)
    assert wait_for(lambda: not held_segments(dp.pid))
    return dp.fds()


KILLED_MID_REQUEST = """
from paella.client import connect
c = connect(SOCK)
off = c.alloc(64)
for _ in range(100):
    c.predict("noop", 64, off)
print("submitted", flush=True)
import time; time.sleep(60)
"""


def test_departed_clients_leave_no_mapping_and_no_fd(fresh_daemon):
    """Item 8: after clients come and go (served, closed with requests in flight,
    SIGKILLed, dropped for a corrupt ring), /proc/<daemon>/maps and /proc/<daemon>/fd
    hold nothing of theirs, and the daemon holds as many descriptors as before."""
    dp = fresh_daemon()
    before = quiet_fds(dp)
    for k in range(4):                    # served: echo on the host, noop on the device
        with connect(dp.socket) as c:
            off = c.alloc(64)
            ids = [c.predict("noop", 64, off) for _ in range(20)]
            assert sorted(c.read_result() for _ in ids) == ids
            c.infer("echo", {"x": np.ones(256)})
    for k in range(3):                    # closed with jobs on the simulated GPU
        c = connect(dp.socket)
        off = c.alloc(64)
        for _ in range(50):
            c.predict("noop", 64, off)
        c.close()
    p = subprocess.Popen([sys.executable, "-c", f"SOCK = {dp.socket!r}\n" + KILLED_MID_REQUEST],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "submitted"
    p.kill()
    p.wait()
    p.stdout.close()
    c = connect(dp.socket)                # dropped by the daemon with jobs in flight
    off = c.alloc(64)
    for _ in range(50):
        c.predict("noop", 64, off)
    c._seg.hdr[rings.REQ_TAIL] = 10 ** 9
    c._send(wire.KICK_FRAME)
    read_until_closed(c._sock)
    c.close()
    assert wait_for(lambda: not held_segments(dp.pid), 10), (held_segments(dp.pid),
                                                             dp.log()[-2000:])
    assert dp.fds() == before
    assert dp.proc.poll() is None


# --- 9. EMFILE while a client connects -------------------------------------------------
def _fd_limit_allowing(pid: int, n: int) -> int:
    """The RLIMIT_NOFILE under which process ``pid`` can open exactly ``n`` more fds
    (descriptors take the lowest free numbers, and the limit bounds the number)."""
    used = {int(f) for f in os.listdir(f"/proc/{pid}/fd")}
    free = [i for i in range(max(used) + n + 2) if i not in used]
    return free[n]


@pytest.mark.parametrize("spare", [0, 1, 2], ids=["at-accept", "at-segment", "at-mapping"])
def test_fd_exhaustion_during_hello(fresh_daemon, spare):
    """Item 9: with the daemon out of descriptors at accept (0 spare), at segment
    creation (1) or at mapping (2), the client gets ERROR "resources" (a clear
    DaemonUnavailable), and the daemon leaks nothing and serves once fds are back."""
    dp = fresh_daemon()
    before = quiet_fds(dp)
    soft, hard = resource.prlimit(dp.pid, resource.RLIMIT_NOFILE)
    resource.prlimit(dp.pid, resource.RLIMIT_NOFILE, (_fd_limit_allowing(dp.pid, spare), hard))
    try:
        for _ in range(3):
            with pytest.raises(DaemonUnavailable, match="resources.*(open files|descriptors)"):
                connect(dp.socket, timeout=5)
            assert dp.proc.poll() is None, dp.log()[-3000:]
    finally:
        resource.prlimit(dp.pid, resource.RLIMIT_NOFILE, (soft, hard))
    assert wait_for(lambda: dp.fds() == before, 5), (dp.fds(), before)
    assert not held_segments(dp.pid)
    echo_works(dp.socket)


def test_a_new_input_while_out_of_descriptors_is_answered(fresh_daemon, tmp_path):
    """The fuzzer's finding (seed 11, --nofile 64): a compiled model's request with an
    input the simulator had not seen, while the daemon's descriptor table was full (silent
    connections of another tenant), killed the daemon: the simulator's CPU reference
    re-read a file of the bundle on the loop, and the OSError unwound it, losing every
    client's requests. The file is now read once, and a reference computation that fails
    fails its own request only (tests/dispatcher/test_kernel_fault.py)."""
    from bundles_for_tests import tiny_mlp
    from paella.bundle import load_bundle
    repo = tmp_path / "models"
    repo.mkdir()
    bundle = load_bundle(tiny_mlp(repo / "tiny_mlp"))
    dp = fresh_daemon("--models", str(repo))
    rng = np.random.default_rng(0)
    with connect(dp.socket, timeout=5) as c:
        x = {"x": rng.standard_normal((2, 16)).astype(np.float32)}
        np.testing.assert_allclose(c.infer("tiny_mlp", x)["output0"],
                                   bundle.run_cpu(x)["output0"], rtol=1e-5)
        soft, hard = resource.prlimit(dp.pid, resource.RLIMIT_NOFILE)
        resource.prlimit(dp.pid, resource.RLIMIT_NOFILE, (_fd_limit_allowing(dp.pid, 0), hard))
        try:
            for _ in range(3):                         # new inputs: computed on the CPU
                x = {"x": rng.standard_normal((2, 16)).astype(np.float32)}
                np.testing.assert_allclose(c.infer("tiny_mlp", x, timeout=30)["output0"],
                                           bundle.run_cpu(x)["output0"], rtol=1e-5)
            assert dp.proc.poll() is None, dp.log()[-3000:]
        finally:
            resource.prlimit(dp.pid, resource.RLIMIT_NOFILE, (soft, hard))
    echo_works(dp.socket)
    assert dp.stop() == 0, dp.log()[-3000:]


# --- 13. silent connections, per-uid limit, log flooding ---------------------------------
def silent_connections(path: str, n: int, uid: int | None) -> list[socket.socket]:
    """``n`` connections that never say HELLO, made as ``uid`` (None: this process's):
    SO_PEERCRED reports the effective uid at connect, so root switches it for the loop."""
    if uid is not None:
        os.setresuid(-1, uid, -1)
    silent = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(path)
            silent.append(s)
    finally:
        if uid is not None:
            os.setresuid(-1, 0, -1)
    return silent


def test_silent_connections_cannot_lock_others_out(fresh_daemon):
    """Item 13: 256 connections that never send HELLO. The per-uid limit refuses
    all but 32 of them at once (so another uid gets in meanwhile), and the handshake
    deadline closes those 32 with ERROR handshake_timeout (so their own uid gets in
    again after it). Before: every later client got too_many_clients, forever."""
    dp = fresh_daemon("--handshake-seconds", "1", "--max-clients-per-uid", "32",
                      "--allow-user", "nobody")
    os.chmod(dp.dir, 0o755)
    as_other = os.geteuid() == 0          # the silent ones as uid 65534, the honest as root
    silent = silent_connections(dp.socket, 256, NOBODY if as_other else None)
    if as_other:
        echo_works(dp.socket)             # not locked out, while the 32 still wait
    outcomes: dict[str | None, int] = {}
    for s in silent:
        errors = [m["error"] for k, m in read_until_closed(s, timeout=10) if k == wire.ERROR]
        outcomes[errors[0] if errors else None] = outcomes.get(errors[0] if errors else None, 0) + 1
        s.close()
    assert outcomes == {"too_many_connections": 224, "handshake_timeout": 32}, outcomes
    echo_works(dp.socket)
    assert dp.stop() == 0
    stats = daemon_stats(dp.log())
    assert stats["handshake_timeouts"] == 32 and stats["refused"] == 224, stats
    assert stats["refusals_not_logged"] >= 220, stats     # refusals are rate-limited too


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another uid (nobody)")
def test_one_uid_cannot_take_the_descriptors_others_need(fresh_daemon):
    """The fuzzer's finding (seed 11, --nofile 64): under a low descriptor limit one
    tenant's silent connections, within max_clients_per_uid, filled the table, and every
    other tenant was refused "resources". A uid may now hold at most half the limit's
    descriptors (two per client); past that its connections are refused, and another uid
    still gets in."""
    dp = fresh_daemon("--handshake-seconds", "30", "--allow-user", "nobody")
    os.chmod(dp.dir, 0o755)
    soft, hard = resource.prlimit(dp.pid, resource.RLIMIT_NOFILE)
    assert soft == hard, "the daemon raises its soft limit to the hard one at start"
    resource.prlimit(dp.pid, resource.RLIMIT_NOFILE, (64, hard))
    silent, refused = silent_connections(dp.socket, 40, NOBODY), []
    try:
        for s in silent:
            s.settimeout(0.05)
            try:
                data = s.recv(65536)
            except socket.timeout:
                continue
            refused.append(data)
        assert len(silent) - len(refused) == 16, (len(refused), dp.log()[-2000:])
        assert all(b"too_many_connections" in r and b"file-descriptor limit" in r
                   for r in refused), refused[:2]
        echo_works(dp.socket)             # the other uid is served meanwhile
    finally:
        for s in silent:
            s.close()
        resource.prlimit(dp.pid, resource.RLIMIT_NOFILE, (soft, hard))
    assert dp.stop() == 0


def daemon_stats(log: str) -> dict:
    """The counters the daemon logs when it stops."""
    import ast
    return ast.literal_eval(log.split("stopped cleanly; stats ")[1].splitlines()[0])


def test_rejected_entries_are_counted_and_their_logs_rate_limited(fresh_daemon):
    """Item 13: 3000 rejected entries write a handful of log lines (one per
    interval, then a summary), and the stats the daemon logs at exit count them all."""
    dp = fresh_daemon()
    with connect(dp.socket, arena_bytes=1 << 16) as c:
        prod = c._requests
        n, rejected = 3000, 0
        pending = list(range(1, n + 1))
        while rejected < n:
            while pending and prod.push(pending[0], 99, 0, 2048, 0):   # no model 99
                c._submitted += 1
                pending.pop(0)
                if prod.daemon_sleeping():
                    c._send(wire.KICK_FRAME)
            try:
                c.read_result()
            except RequestFailed as e:
                assert e.status == rings.E_MODEL
                rejected += 1
    assert dp.stop() == 0
    log = dp.log()
    lines = [ln for ln in log.splitlines() if "rejected" in ln and "stats" not in ln]
    assert 1 <= len(lines) <= 5, lines
    assert "no model with id 99" in lines[0]
    stats = daemon_stats(log)
    assert stats["rejected"] == n, stats
    assert stats["rejections_not_logged"] >= n - 5, stats


# --- clients that connect and leave in a loop cannot fill the disk with log lines ----------
def test_a_connect_loop_writes_a_bounded_log(daemon):
    """300 clients connecting and leaving at once: at most SESSION_LOG_BURST arrival and
    departure lines per log interval; the rest are counted, and the daemon serves on."""
    from paella.dispatcher.frontend import SESSION_LOG_BURST
    before = daemon.log().count(" ready: mode ") + daemon.log().count(") dropped: ")
    for _ in range(300):
        with connect(daemon.socket):
            pass
    echo_works(daemon.socket)
    log = daemon.log()
    lines = log.count(" ready: mode ") + log.count(") dropped: ") - before
    assert lines <= SESSION_LOG_BURST + 4, lines       # (+ this test's echo client, a window edge)
    assert lines >= 10                                 # ... but sessions are still logged


def test_one_bad_frame_per_connection_in_a_loop_writes_a_bounded_log(daemon):
    """Each connection's bad message is its first (a per-client throttle starts fresh):
    the daemon-wide throttle bounds them all (before: 55,119 lines in 10 s)."""
    from paella.dispatcher.frontend import SESSION_LOG_BURST
    before = daemon.log().count("sent a bad message")
    for _ in range(400):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(daemon.socket)
        s.sendall(wire.HEADER.pack(99, 0, 0))           # an unknown message type
        s.close()
    echo_works(daemon.socket)
    lines = daemon.log().count("sent a bad message") - before
    assert 1 <= lines <= SESSION_LOG_BURST + 2, lines


def test_log_throttle_allows_a_burst_then_counts():
    from paella.log_throttle import LogThrottle
    t = LogThrottle(interval=3600.0, burst=3)
    assert [t.admit() for _ in range(3)] == [0, 0, 0]
    assert [t.admit() for _ in range(5)] == [None] * 5
    t.next_at = 0.0                                    # the window ends
    assert t.admit() == 5 and t.flush() == 0
    one = LogThrottle(interval=3600.0)
    assert one.admit() == 0 and one.admit() is None and one.flush() == 1
