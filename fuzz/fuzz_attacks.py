"""The hostile client of the daemon fuzzer: what one attack episode sends, and how.

Each *family* below is one way a tenant can misbehave: random and boundary control
frames, HELLO variants, hostile request-ring entries, ring indices written with
garbage or torn, a segment truncated or remapped under the daemon, attempts to open
other clients' segments, connections that never say HELLO, clients that vanish in the
middle of a request, clients that never read their socket, clients that rewrite their
inputs after submitting them. An episode is short (well
under a second) and returns how many inputs it tried; the engine
(``paella.fuzz.fuzz_daemon``) runs episodes in attacker processes, as another
uid when it can, while legitimate clients check every answer.

Attackers talk to the daemon with their own raw code (:class:`RawClient`), not the
client library: a hostile tenant keeps the segment's file descriptor, writes any word
anywhere in its segment, and never has to follow the protocol. They target every model
the WELCOME lists; a request to a step model (a generation, a cell sequence or tree)
often gets a plausible io first (:func:`plausible_io`), so that it is admitted and its
work runs while its client scribbles on its rings, vanishes or stops reading.

Everything an attacker needs is imported here, at module import: an attacker drops
its privileges after the fork, and the interpreter's files may then be out of reach.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import mmap
import os
import random
import select
import signal
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Callable

from paella import rings, wire

HEADER = struct.Struct("<HHI")
_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
#: memfd seals a client might try to add to its own segment (F_SEAL_FUTURE_WRITE = 0x10)
SEALS = (fcntl.F_SEAL_SEAL, fcntl.F_SEAL_SHRINK, fcntl.F_SEAL_GROW, fcntl.F_SEAL_WRITE, 0x10)


@dataclass
class Context:
    """What an attacker knows: the daemon's socket and pid, and whose segments it may
    try to open (the legitimate clients' pids)."""
    socket: str
    daemon_pid: Callable[[], int]
    victims: tuple[int, ...] = ()
    cross_uid: bool = True           # attackers run as another uid than daemon/victims
    stop: Callable[[], bool] = lambda: False
    breach: Callable[[str], None] = lambda what: None   # called for each forbidden open that worked
    hog_limit: int = 300             # most connections one hog episode holds
    rng: random.Random = field(default_factory=random.Random)


def frame(kind: int, body: bytes, flags: int = 0, length: int | None = None) -> bytes:
    """A frame with any header, true or not."""
    return HEADER.pack(kind & 0xFFFF, flags & 0xFFFF,
                       (len(body) if length is None else length) & 0xFFFFFFFF) + body


def dial(path: str, timeout: float = 2.0) -> socket.socket | None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(path)
    except OSError:
        s.close()
        return None
    return s


def read_some(s: socket.socket, seconds: float) -> bytes:
    """What the daemon says within ``seconds`` (until it closes or goes quiet)."""
    got = b""
    end = time.monotonic() + seconds
    try:
        while True:
            left = end - time.monotonic()
            if left <= 0:
                break
            s.settimeout(left)
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
    except (socket.timeout, OSError):
        pass  # quiet or reset: either is an acceptable answer to garbage
    return got


def send_quietly(s: socket.socket, data: bytes, fds: list[int] = ()) -> None:
    try:
        if fds:
            socket.send_fds(s, [data], list(fds))
        else:
            s.sendall(data)
    except OSError:
        pass  # the daemon may close on the first bad byte


# --- hostile JSON ------------------------------------------------------------------------
def hostile_json(rng: random.Random, depth: int = 0) -> str:
    """JSON text of a value a schema would not expect: wrong types, boundary numbers,
    huge or deep structures, text json.dumps would never write (NaN, lone surrogates,
    5000-digit integers)."""
    r = rng.random()
    if r < 0.08 and depth < 3:
        return "[" + ",".join(hostile_json(rng, depth + 1) for _ in range(rng.randint(0, 3))) + "]"
    if r < 0.14 and depth < 3:
        return "{" + ",".join(f'"{rng.choice(KEYS)}":{hostile_json(rng, depth + 1)}'
                              for _ in range(rng.randint(0, 3))) + "}"
    if r < 0.18:
        n = rng.choice([100, 900, 1000, 3000, 20000, 100000])
        o, c = rng.choice([("[", "]"), ('{"a":', "}")])
        return o * n + "1" + c * n                              # deep nesting
    if r < 0.22:
        return rng.choice(["1", "9", "-1"]) * rng.choice([4301, 5000, 50000])   # digit limit
    return rng.choice(SCALARS)


KEYS = ["version", "mode", "arena_bytes", "client_id", "segment", "layout", "models", "",
        "x" * 300, "\\u0000", "__proto__"]
SCALARS = ["null", "true", "false", "0", "1", "-1", "2", "1.0", "1e400", "-1e400", "NaN",
           "Infinity", "-Infinity", "-0", "0.5", str(2 ** 31), str(2 ** 32), str(2 ** 63),
           str(2 ** 64), str(2 ** 64 + 1), str(-2 ** 63), str(10 ** 30), "1E5", '""', '"1"',
           '"hybrid"', '"polling"', '"socket"', '"turbo"', '"\\ud800"', '"\\u0000"',
           '"' + "x" * 70000 + '"', "[]", "{}", "[1]", '{"version":1}', "[[[]]]"]


def hello_text(rng: random.Random) -> bytes:
    """A HELLO payload: usually version 1 (so the later checks are reached), each other
    field missing, right, or hostile."""
    parts = []
    r = rng.random()
    if r < 0.7:
        parts.append('"version":1')
    elif r < 0.85:
        parts.append(f'"version":{hostile_json(rng)}')
    if rng.random() < 0.6:
        parts.append('"mode":' + (rng.choice(['"hybrid"', '"polling"', '"socket"'])
                                  if rng.random() < 0.5 else hostile_json(rng)))
    if rng.random() < 0.7:
        good = str(rng.choice([1, 4096, 1 << 16, 1 << 20, 256 << 20, (256 << 20) + 1]))
        parts.append('"arena_bytes":' + (good if rng.random() < 0.4 else hostile_json(rng)))
    if rng.random() < 0.2:
        parts.append(f'"{rng.choice(KEYS)}":{hostile_json(rng)}')
    if rng.random() < 0.05:
        parts.append('"version":2')                          # a duplicate key, last wins
    rng.shuffle(parts)
    return ("{" + ",".join(parts) + "}").encode("utf-8", "surrogatepass")


# --- a raw client ------------------------------------------------------------------------
class RawClient:
    """A client that keeps the segment's descriptor and maps the segment itself.

    ``touchable`` is False while the attacker has shrunk the segment: touching it then
    would fault the attacker, not the daemon.
    """

    def __init__(self, path: str, hello: dict | None = None, timeout: float = 2.0):
        self.sock = dial(path, timeout)
        if self.sock is None:
            raise ConnectionError("no daemon")
        self.fd = -1
        self.mm = None
        self.seg: rings.Segment | None = None
        self.touchable = False
        try:
            self.sock.sendall(wire.encode(wire.HELLO, hello or {"version": 1, "arena_bytes": 1 << 16}))
            reader = wire.FrameReader()
            end = time.monotonic() + timeout
            while True:
                self.sock.settimeout(max(0.01, end - time.monotonic()))
                data, fds, _, _ = socket.recv_fds(self.sock, 1 << 16, 4)
                for extra in fds[1:]:
                    os.close(extra)
                if fds and self.fd < 0:
                    self.fd = fds[0]
                if not data:
                    raise ConnectionError("closed during the handshake")
                for kind, msg in reader.feed(data):
                    if kind == wire.ERROR:
                        raise ConnectionError(f"refused: {msg}")
                    if kind == wire.WELCOME:
                        self.welcome = msg
                        self._map()
                        return
        except BaseException:
            self.close()
            raise

    def _map(self) -> None:
        self.layout = rings.Layout.from_dict(self.welcome["layout"])
        if self.fd < 0:
            raise ConnectionError("WELCOME without a descriptor")
        self.mm = mmap.mmap(self.fd, self.layout.total_bytes)
        self.seg = rings.Segment(self.mm, self.layout)
        self.touchable = True
        self.models = {m["name"]: (m["id"], m["variants"][0]["io_bytes"])
                       for m in self.welcome["models"]}
        #: the inputs of the models whose requests say their own lengths (the step
        #: models: orca's generations, cellular's sequences and trees), by model id
        self.step_inputs = {m["id"]: m["variants"][0]["inputs"] for m in self.welcome["models"]
                            if any(t["name"] == "lengths" for t in m["variants"][0]["inputs"])}

    # -- ring words, written with single aligned stores (numpy uint64) --------------------
    def hdr(self, index: int, value: int) -> None:
        if self.touchable:
            self.seg.hdr[index] = value & rings.U64

    def word(self, index: int) -> int:
        return int(self.seg.hdr[index]) if self.touchable else 0

    def push(self, req_id: int, model_id: int, offset: int, length: int, options: int = 0,
             publish: bool = True) -> None:
        """Write an entry at the tail and (unless told not to) publish the tail, without
        looking at whether the ring has room: a hostile client does not care."""
        if not self.touchable:
            return
        tail = int(self.seg.hdr[rings.REQ_TAIL])
        self.seg.req[tail & (self.layout.req_slots - 1)] = (
            req_id & rings.U64, (model_id & rings.U32) | ((options & rings.U32) << 32),
            offset & rings.U64, length & rings.U64)
        if publish:
            self.seg.hdr[rings.REQ_TAIL] = (tail + 1) & rings.U64

    def room(self) -> int:
        if not self.touchable:
            return 0
        return self.layout.req_slots - ((self.word(rings.REQ_TAIL) - self.word(rings.REQ_HEAD))
                                        & rings.U64)

    def consume_completions(self) -> int:
        """Mark every completion read (by moving cmp_head to cmp_tail); returns how many."""
        if not self.touchable:
            return 0
        tail, head = self.word(rings.CMP_TAIL), self.word(rings.CMP_HEAD)
        self.hdr(rings.CMP_HEAD, tail)
        return (tail - head) & rings.U64

    def kick(self) -> None:
        send_quietly(self.sock, wire.KICK_FRAME)

    def close(self) -> None:
        self.seg = None
        self.touchable = False
        if self.mm is not None:
            try:
                self.mm.close()
            except (BufferError, ValueError):
                pass  # a numpy view still points into it: let it go with the object
            self.mm = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def plausible_io(rng: random.Random, c: RawClient, model_id: int, offset: int) -> None:
    """Fill a step model's io at ``offset`` of the arena with a request it may well take
    (so the work is admitted, runs, and its client can vanish or scribble meanwhile):
    lengths from 1 to a few steps, small token ids, normal floats, a tree as a heap
    (node i under (i - 1) // 2); now and then one field hostile. Other models' io is
    left as it is (their bytes are only data)."""
    ins = c.step_inputs.get(model_id)
    if not ins or not c.touchable:
        return
    first = ins[0]["shape"][0]                 # the context / max_len
    generation = any(t["name"] == "prompt" for t in ins)
    # (a generation's prompt and tokens fit in few KV slots; a sequence runs up to 8 cells)
    n = rng.randint(1, max(1, min(first, 2 if generation else 8)))
    base = c.layout.arena_offset + offset
    for t in ins:
        count = 1
        for d in t["shape"]:
            count *= d
        if t["name"] == "lengths":   # orca: [prompt, max_tokens]; cellular: [n, tgt, per_step]
            vals = [n, rng.randint(1, 2 if generation else 4), rng.randint(0, 1)][:count]
            if rng.random() < 0.1:
                vals[rng.randrange(count)] = rng.choice([0, -1, first, first + 1, 2 ** 31 - 1])
            data = struct.pack(f"<{count}i", *vals)
        elif t["name"] == "parents":
            data = struct.pack(f"<{count}i", *[(i - 1) // 2 for i in range(count)])
        elif t["dtype"] == "float32":
            data = struct.pack(f"<{count}f", *[rng.gauss(0.0, 1.0) for _ in range(count)])
        elif t["dtype"] == "int32":
            data = struct.pack(f"<{count}i", *[rng.randrange(32) for _ in range(count)])
        else:
            continue
        at = base + t["offset"]
        if at + len(data) <= len(c.mm) and c.touchable:
            c.mm[at:at + len(data)] = data


def raw_connect(ctx: Context, hello: dict | None = None) -> RawClient | None:
    try:
        return RawClient(ctx.socket, hello)
    except (ConnectionError, OSError, ValueError, KeyError, TypeError, wire.WireError):
        time.sleep(0.02)    # the daemon is down or refusing: do not spin on it
        return None


# --- the families ------------------------------------------------------------------------
def attack_frames(ctx: Context) -> int:
    """Random and boundary control frames, with or without HELLO first, some with file
    descriptors attached, some dribbled a byte at a time."""
    rng = ctx.rng
    s = dial(ctx.socket)
    if s is None:
        time.sleep(0.02)
        return 0
    tried = 0
    try:
        if rng.random() < 0.3:
            send_quietly(s, wire.encode(wire.HELLO, {"version": 1, "arena_bytes": 4096}))
            read_some(s, 0.05)
        for _ in range(rng.randint(1, 4)):
            data = _hostile_frame(rng)
            fds = _fds_to_pass(rng) if rng.random() < 0.15 else []
            try:
                if rng.random() < 0.05 and len(data) < 4096:
                    for i in range(len(data)):
                        send_quietly(s, data[i:i + 1])
                else:
                    send_quietly(s, data, fds)
            finally:
                for fd in fds:
                    os.close(fd)
            tried += 1
        if rng.random() < 0.7:
            read_some(s, rng.choice([0.0, 0.01, 0.05]))
    finally:
        s.close()
    return tried


def _hostile_frame(rng: random.Random) -> bytes:
    r = rng.random()
    kinds = list(wire.NAMES) + [0, max(wire.NAMES) + 1, 255, 0x8001, 0xFFFF]   # + unknown ones
    if r < 0.2:
        return rng.randbytes(rng.randint(1, 300))
    if r < 0.35:                                # a header with a boundary length
        n = rng.choice([0, 1, 7, 8, wire.MAX_PAYLOAD - 1, wire.MAX_PAYLOAD,
                        wire.MAX_PAYLOAD + 1, 2 ** 31, 2 ** 32 - 1])
        body = rng.randbytes(rng.randint(0, 64))
        return frame(rng.choice(kinds), body, rng.choice([0, 0, 1, 0x8000]), length=n)
    if r < 0.45:                                # a complete frame of junk, any kind
        return frame(rng.choice(kinds), rng.randbytes(rng.randint(0, 200)))
    if r < 0.5:                                 # a huge frame (1 MiB, the limit)
        body = rng.choice([b" " * (wire.MAX_PAYLOAD - 2) + b"{}",
                           b'{"version":1,"x":"' + b"a" * (wire.MAX_PAYLOAD - 22) + b'"}',
                           b"[" * wire.MAX_PAYLOAD])
        return frame(wire.HELLO, body[:wire.MAX_PAYLOAD])
    if r < 0.6:                                 # hostile JSON in any JSON-typed frame
        kind = rng.choice([wire.HELLO, wire.LIST_MODELS, wire.KICK, wire.WELCOME, wire.ERROR,
                           wire.STATUS, wire.TRACE, wire.REPOSITORY_INDEX, wire.LOAD,
                           wire.UNLOAD])
        return frame(kind, hostile_json(rng).encode("utf-8", "surrogatepass"))
    if r < 0.65:                                # id frames a client may not send
        return frame(rng.choice([wire.WAKE, wire.DONE]),
                     rng.choice([b"", b"abc", struct.pack("<Q", rng.getrandbits(64)), b"x" * 9]))
    if r < 0.75:                                # floods of valid small frames
        one = rng.choice([wire.KICK_FRAME, wire.encode(wire.LIST_MODELS)])
        return one * rng.randint(10, 3000)
    return frame(wire.HELLO, hello_text(rng))


def _fds_to_pass(rng: random.Random) -> list[int]:
    """Descriptors to attach with SCM_RIGHTS (the daemon must not keep them)."""
    n = rng.choice([1, 2, 16, 250])
    out = []
    for _ in range(n):
        try:
            out.append(os.open("/dev/null", os.O_RDONLY) if rng.random() < 0.5 else
                       os.memfd_create("fuzz"))
        except OSError:
            break
    return out


def attack_hello(ctx: Context) -> int:
    """HELLO variants, up to eight connections at a time; when the daemon welcomes one,
    the segment's descriptor is dropped at once or kept a moment."""
    rng = ctx.rng
    socks = []
    for _ in range(min(8, max(1, ctx.hog_limit // 2))):
        s = dial(ctx.socket)
        if s is None:
            time.sleep(0.02)
            break
        send_quietly(s, frame(wire.HELLO, hello_text(rng)))
        if rng.random() < 0.1:                              # HELLO twice
            send_quietly(s, frame(wire.HELLO, hello_text(rng)))
        socks.append(s)
    for s in socks:
        s.settimeout(0.2)
        try:
            _, fds, _, _ = socket.recv_fds(s, 1 << 16, 4)
        except OSError:
            fds = []
        for fd in fds:
            os.close(fd)
        if rng.random() < 0.3:
            read_some(s, 0.01)
        s.close()
    return len(socks)


HOSTILE_OFFSETS = [0, 1, 2 ** 63, 2 ** 64 - 1, 2 ** 64 - 2048, 2 ** 32]
HOSTILE_LENGTHS = [0, 1, 2047, 2049, 2 ** 63, 2 ** 64 - 1, 2 ** 32 + 2048]


def _entry(rng: random.Random, c: RawClient, req_id: int) -> tuple[int, int, int, int, int]:
    """A request entry: valid, boundary or garbage; every field a client controls."""
    arena = c.layout.arena_bytes
    mid, ln = rng.choice(list(c.models.values()))
    off = rng.randrange(0, max(1, arena - ln)) if ln < arena else 0
    opts = 0
    r = rng.random()
    if r < 0.15:
        return (rng.getrandbits(64), rng.getrandbits(32), rng.getrandbits(64),
                rng.getrandbits(64), rng.getrandbits(32))
    if r < 0.3:
        off = rng.choice(HOSTILE_OFFSETS + [arena - 1, arena, arena - ln + 1])
    elif r < 0.4:
        ln = rng.choice(HOSTILE_LENGTHS)
    elif r < 0.5:
        mid = rng.choice([0, 77, 2 ** 32 - 1, mid + 1000])
    elif r < 0.6:
        opts = rng.choice([1, 2, 0xFFFF, 1 << 16, 1 << 31, 2 ** 32 - 1])
    elif r < 0.65:
        req_id = rng.choice([0, 2 ** 64 - 1, 1])            # ids that collide
    elif rng.random() < 0.5:
        plausible_io(rng, c, mid, off)
    return req_id, mid, off, ln, opts


def attack_ring_entries(ctx: Context) -> int:
    """Random and boundary request entries, read back or not."""
    rng = ctx.rng
    c = raw_connect(ctx, {"version": 1, "mode": rng.choice(wire.MODES),
                          "arena_bytes": rng.choice([4096, 1 << 16, 1 << 20])})
    if c is None:
        return 0
    tried = 0
    try:
        for _ in range(rng.randint(1, 4)):
            n = min(c.room(), rng.randint(1, 200))
            for _ in range(n):
                c.push(*_entry(rng, c, rng.getrandbits(63)))
                tried += 1
            c.kick()
            time.sleep(rng.choice([0, 0.001, 0.01]))
            if rng.random() < 0.8:
                c.consume_completions()
        read_some(c.sock, rng.choice([0.0, 0.02]))
    finally:
        c.close()
    return tried


def attack_ring_indices(ctx: Context) -> int:
    """Ring indices and header words written with garbage, moved past each other or
    stored torn (a byte or a half at a time), before and while requests are in flight."""
    rng = ctx.rng
    c = raw_connect(ctx, {"version": 1, "mode": rng.choice(wire.MODES), "arena_bytes": 1 << 16})
    if c is None:
        return 0
    tried = 0
    try:
        slow = [v for k, v in c.models.items() if k != "echo"] or list(c.models.values())
        # some traffic first, so the indices are not all zero and jobs are in flight
        for i in range(rng.choice([0, 5, 40, 300])):
            if c.room() <= 1:
                c.consume_completions()
                c.kick()
                time.sleep(0.001)
                continue
            mid, ln = rng.choice(slow)
            off = (i * ln) % (c.layout.arena_bytes - ln)
            plausible_io(rng, c, mid, off)
            c.push(i + 1, mid, off, ln)
        c.kick()
        if rng.random() < 0.5:        # wait until the daemon took them: they are in flight
            end = time.monotonic() + 0.05
            while c.word(rings.REQ_HEAD) != c.word(rings.REQ_TAIL) and time.monotonic() < end:
                pass
        for _ in range(rng.randint(1, 6)):
            tried += _scribble(rng, c)
            if rng.random() < 0.5:
                c.kick()
            time.sleep(rng.choice([0, 0.0005, 0.005]))
        read_some(c.sock, rng.choice([0.01, 0.05]))
    finally:
        c.close()
    return tried


def _scribble(rng: random.Random, c: RawClient) -> int:
    """One hostile write into the header or the rings."""
    head_t, tail_t = c.word(rings.CMP_HEAD), c.word(rings.CMP_TAIL)
    rhead, rtail = c.word(rings.REQ_HEAD), c.word(rings.REQ_TAIL)
    slots = c.layout.req_slots
    r = rng.random()
    targets = [rings.REQ_TAIL, rings.CMP_HEAD, rings.REQ_HEAD, rings.CMP_TAIL, rings.SLEEPING,
               0, 1, 2, 3]
    if r < 0.25:
        value = rng.choice([0, 1, slots, slots + 1, 2 ** 63, 2 ** 64 - 1, rng.getrandbits(64),
                            rhead - 1, rtail + slots + 1, tail_t + 1, tail_t + 2 ** 32,
                            head_t - 1, rhead + slots])
        c.hdr(rng.choice(targets), value)
    elif r < 0.4:                                   # cmp_head past cmp_tail
        c.hdr(rings.CMP_HEAD, tail_t + rng.choice([1, 2, c.layout.cmp_slots + 1, 2 ** 40]))
    elif r < 0.5:                                   # req_tail behind req_head
        c.hdr(rings.REQ_TAIL, rhead - rng.choice([1, 2, slots]))
    elif r < 0.7:                                   # a torn store of an index
        index = rng.choice([rings.CMP_HEAD, rings.REQ_TAIL])
        new = (c.word(index) + rng.choice([1, 255, 256, 2 ** 32])) & rings.U64
        if index == rings.CMP_HEAD:
            new = rng.choice([new, tail_t, (tail_t + 2 ** 32) & rings.U64])
        _torn_store(rng, c, index, new)
    elif r < 0.85 and c.touchable:                  # completion ring and reason text
        c.seg.cmp[rng.randrange(c.layout.cmp_slots)] = (rng.getrandbits(64), rng.getrandbits(64))
        c.seg.msg[rng.randrange(c.layout.cmp_slots), :] = 0xFF
    elif c.touchable:                               # an entry rewritten after publishing
        c.seg.req[(rtail - 1) & (slots - 1)] = [rng.getrandbits(64) for _ in range(4)]
    return 1


def _torn_store(rng: random.Random, c: RawClient, index: int, value: int) -> None:
    """Store an 8-byte index in smaller pieces, in a random order (what struct.pack_into
    or a 32-bit client may do), with a pause between pieces."""
    if not c.touchable:
        return
    piece = rng.choice([1, 2, 4])
    raw = value.to_bytes(8, "little")
    order = list(range(0, 8, piece))
    rng.shuffle(order)
    base = index * 8
    for at in order:
        c.mm[base + at:base + at + piece] = raw[at:at + piece]
        if rng.random() < 0.5:
            time.sleep(0.0002)


def attack_segment(ctx: Context) -> int:
    """The segment changed under the daemon: truncated (to 0, a page, the rings without
    the arena), grown, shrunk and regrown (zeroed), holes punched, remapped, sealed."""
    rng = ctx.rng
    c = raw_connect(ctx, {"version": 1, "mode": rng.choice(wire.MODES),
                          "arena_bytes": rng.choice([1 << 16, 1 << 20])})
    if c is None:
        return 0
    tried = 0
    lay = c.layout
    try:
        for _ in range(rng.randint(1, 3)):
            op = rng.choice(["shrink", "shrink", "regrow", "grow", "punch", "remap", "seal"])
            size = rng.choice([0, 1, 4096, lay.cmp_offset, lay.arena_offset,
                               lay.arena_offset + lay.arena_bytes // 2])
            tried += 1
            try:
                if op == "shrink":
                    os.ftruncate(c.fd, size)
                    c.touchable = size >= lay.total_bytes
                elif op == "regrow":
                    os.ftruncate(c.fd, size)
                    os.ftruncate(c.fd, lay.total_bytes)
                elif op == "grow":
                    os.ftruncate(c.fd, lay.total_bytes + rng.choice([1, 4096, 1 << 20]))
                elif op == "punch":
                    start = rng.choice([0, 4096, lay.arena_offset])
                    _punch_hole(c.fd, start, rng.choice([4096, lay.total_bytes - start]))
                elif op == "remap" and c.touchable:
                    flags = rng.choice([mmap.MAP_SHARED, mmap.MAP_PRIVATE])
                    other = mmap.mmap(c.fd, lay.total_bytes, flags=flags)
                    other[rings.REQ_TAIL * 8:rings.REQ_TAIL * 8 + 8] = os.urandom(8)
                    other.close()
                elif op == "seal":
                    fcntl.fcntl(c.fd, fcntl.F_ADD_SEALS, rng.choice(SEALS))
            except OSError:
                pass  # refused (e.g. sealed): the attempt still counts
            # make the daemon look: valid requests (they touch the arena) and a kick
            if c.touchable:
                for i in range(rng.choice([0, 1, 8, 64])):
                    mid, ln = rng.choice(list(c.models.values()))
                    if c.room() > 0:
                        off = (i * ln) % (lay.arena_bytes - ln)
                        plausible_io(rng, c, mid, off)
                        c.push(i + 1, mid, off, ln)
            c.kick()
            time.sleep(rng.choice([0.001, 0.01, 0.03]))
        read_some(c.sock, 0.02)
    finally:
        c.close()
    return tried


def _punch_hole(fd: int, offset: int, length: int) -> None:
    if _LIBC.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                       ctypes.c_long(offset), ctypes.c_long(length)) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def attack_open_others(ctx: Context) -> int:
    """Try to reach memory that is not ours: other clients' segments by name in
    /dev/shm, through the daemon's or the legitimate clients' /proc/PID/fd and
    map_files, and the daemon's /proc/PID/mem. Every success is a breach."""
    tried = 0
    paths = []
    try:
        paths += [os.path.join("/dev/shm", n) for n in os.listdir("/dev/shm") if "paella" in n]
    except OSError:
        pass  # no /dev/shm to list
    for pid in (ctx.daemon_pid(), *ctx.victims):
        for sub in ("fd", "map_files"):
            d = f"/proc/{pid}/{sub}"
            try:
                paths += [os.path.join(d, n) for n in os.listdir(d)]
            except OSError:
                tried += 1      # listing refused counts as one (failed) attempt
        paths.append(f"/proc/{pid}/mem")
    ctx.rng.shuffle(paths)
    for p in paths[:400]:
        for flags in (os.O_RDWR, os.O_RDONLY):
            tried += 1
            try:
                fd = os.open(p, flags | os.O_NOFOLLOW if p.startswith("/dev/shm") else flags)
            except OSError:
                continue
            try:
                target = os.readlink(p) if p.startswith("/proc") else p
            except OSError:
                target = p
            os.close(fd)
            if _forbidden(p, target):
                ctx.breach(f"{p} -> {target} opened {'rw' if flags == os.O_RDWR else 'ro'}")
    time.sleep(0.05)          # one sweep is enough for a while: the others need the time
    return tried


def _forbidden(path: str, target: str) -> bool:
    """Opening this is a breach: a client segment, or the daemon's memory."""
    return (path.endswith("/mem") or "paella" in target or "memfd:" in target
            or target.startswith("/dev/shm/"))


def attack_no_hello(ctx: Context) -> int:
    """Hold many connections that never say HELLO (some with half a frame sent), then
    let them go: the daemon must not let them lock everyone else out."""
    rng = ctx.rng
    n = rng.choice([1, 16, 128, ctx.hog_limit])
    hold = rng.choice([0.2, 1.0, 3.0])
    socks = []
    for _ in range(n):
        s = dial(ctx.socket, timeout=0.5)
        if s is None:
            break
        if rng.random() < 0.3:
            send_quietly(s, HEADER.pack(wire.HELLO, 0, 100)[:rng.randint(1, 8)])
        socks.append(s)
    end = time.monotonic() + hold
    while time.monotonic() < end and not ctx.stop():
        time.sleep(0.05)
    for s in socks:
        s.close()
    return len(socks)


def attack_vanish(ctx: Context) -> int:
    """A client that dies in the middle of its requests: a child process pushes valid
    (and some bad) requests and is killed, or exits, or shuts its socket, at once or
    a little later."""
    rng = ctx.rng
    n = rng.choice([1, 8, 64, 300])
    delay = rng.choice([0, 0.0005, 0.003, 0.02])
    how = rng.choice(["kill", "exit", "shutdown", "close_keep_map"])
    seed = rng.getrandbits(32)
    pid = os.fork()
    if pid == 0:                                   # the vanishing client
        code = 0
        try:
            crng = random.Random(seed)
            c = RawClient(ctx.socket, {"version": 1, "mode": crng.choice(wire.MODES),
                                       "arena_bytes": 1 << 20})
            for i in range(min(n, c.room())):
                c.push(*(_entry(crng, c, i + 1) if crng.random() < 0.2 else
                         _valid_entry(crng, c, i + 1)))
            c.kick()
            if how == "shutdown":
                c.sock.shutdown(socket.SHUT_RDWR)
            elif how == "close_keep_map":
                c.sock.close()
                c.sock = None
            time.sleep(60 if how == "kill" else delay)
        except BaseException:  # noqa: BLE001 - a child never returns into the attacker
            code = 1
        os._exit(code)
    time.sleep(delay)
    if how == "kill":
        os.kill(pid, signal.SIGKILL)
    return n if _reap(pid, 5.0) in (0, -signal.SIGKILL) else 0


def _valid_entry(rng: random.Random, c: RawClient, req_id: int) -> tuple[int, int, int, int, int]:
    mid, ln = rng.choice(list(c.models.values()))
    off = rng.randrange(0, c.layout.arena_bytes - ln)
    plausible_io(rng, c, mid, off)
    return req_id, mid, off, ln, 0


def _reap(pid: int, timeout: float) -> int:
    """Wait for a child (killing it after ``timeout``); its exit code, -N for signal N."""
    end = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > end:
            os.kill(pid, signal.SIGKILL)
            return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        time.sleep(0.005)


def attack_no_read(ctx: Context) -> int:
    """A client that never reads its socket while every request it makes queues a
    notification (hybrid WAKE, socket DONE, or MODELS replies to LIST_MODELS), and
    that keeps its completion ring drained itself so the daemon keeps taking entries."""
    rng = ctx.rng
    c = raw_connect(ctx, {"version": 1, "mode": rng.choice(["hybrid", "hybrid", "socket"]),
                          "arena_bytes": 1 << 16})
    if c is None:
        return 0
    tried = 0
    try:
        c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rng.choice([1024, 65536]))
        end = time.monotonic() + rng.choice([0.3, 1.0, 3.0])
        req_id = 1
        while time.monotonic() < end and not ctx.stop() and c.touchable:
            for _ in range(c.room()):
                # mostly rejected at once (each still costs a notification), some
                # reaching the range check, some valid
                e = _entry(rng, c, req_id)
                if rng.random() < 0.5:
                    mid, ln = rng.choice(list(c.models.values()))
                    e = (req_id, mid, c.layout.arena_bytes, ln, 0)
                c.push(*e)
                req_id += 1
                tried += 1
            if rng.random() < 0.05:
                send_quietly(c.sock, wire.encode(wire.LIST_MODELS) * 50)
            c.kick()
            c.consume_completions()
            if _peer_closed(c.sock):
                break
    finally:
        c.close()
    return tried


def attack_rewrite(ctx: Context) -> int:
    """A client that keeps rewriting its inputs after submitting them: the daemon looks
    a compiled model's answer up (or has it computed) from the bytes it read at arrival,
    and the device then finds other bytes at the kernel, whose answer is computed there
    (issue 37): that job must wait for it alone, and its failure or refusal must be its
    own. Valid requests to the models without a step scheduler, then rewrites of their
    io with random bytes for a while (each rewrite a new never-seen input)."""
    rng = ctx.rng
    c = raw_connect(ctx, {"version": 1, "mode": rng.choice(wire.MODES), "arena_bytes": 1 << 20})
    if c is None:
        return 0
    tried = 0
    try:
        plain = [(mid, ln) for mid, ln in c.models.values() if mid not in c.step_inputs and ln > 0]
        if not plain:
            return 0
        n = min(rng.choice([1, 4, 16, 64]), c.room())
        slots = []
        for i in range(n):
            mid, ln = rng.choice(plain)
            off = i * (c.layout.arena_bytes // max(1, n))
            if off + ln > c.layout.arena_bytes:
                break
            slots.append((c.layout.arena_offset + off, ln))
            if c.touchable:
                c.mm[slots[-1][0]:slots[-1][0] + ln] = rng.randbytes(ln)
            c.push(i + 1, mid, off, ln)
            tried += 1
        if not slots:
            return tried
        c.kick()
        end = time.monotonic() + rng.choice([0.002, 0.02, 0.2, 1.0])
        while time.monotonic() < end and not ctx.stop() and c.touchable:
            at, ln = rng.choice(slots)
            c.mm[at:at + ln] = rng.randbytes(ln)
            c.consume_completions()
    finally:
        c.close()
    return tried


def _peer_closed(s: socket.socket) -> bool:
    """True once the daemon dropped us, without reading what it queued (a Unix socket
    whose peer closed polls POLLHUP)."""
    p = select.poll()
    p.register(s, select.POLLHUP)
    return bool(p.poll(0.5))


#: Family name -> episode. The engine weights them equally unless told otherwise.
FAMILIES: dict[str, Callable[[Context], int]] = {
    "frames": attack_frames,
    "hello": attack_hello,
    "ring_entries": attack_ring_entries,
    "ring_indices": attack_ring_indices,
    "segment": attack_segment,
    "open_others": attack_open_others,
    "no_hello": attack_no_hello,
    "vanish": attack_vanish,
    "no_read": attack_no_read,
    "rewrite": attack_rewrite,
}
