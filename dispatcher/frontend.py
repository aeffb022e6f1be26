"""The daemon's front end: control socket, per-client segments, request-ring polling.

Everything a client can reach goes through here, and nothing a client writes is
trusted. A connection is identified by SO_PEERCRED (the kernel's word, not the
client's) and checked against the allowed users and groups. Its shared-memory segment
(``paella.rings``) is created with mode 0600 by the daemon; the file descriptor is
passed over the socket with SCM_RIGHTS, so a client of another uid maps it without
the segment ever being opened to others.

The loop calls :meth:`Frontend.poll_rings` (round-robin over clients, each entry
validated, bad ones completed with an error status) and :meth:`Frontend.poll_io`
(accept, control messages, client loss). The execution path is an :class:`Executor`:
it calls back :meth:`almost_finished` and :meth:`complete`.
"""
from __future__ import annotations

import fcntl
import grp
import logging
import mmap
import os
import pwd
import selectors
import socket
import struct
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np
import posix_ipc

from paella import rings, wire

log = logging.getLogger("paella.frontend")

UCRED = struct.Struct("3i")   # struct ucred {pid_t pid; uid_t uid; gid_t gid;}


class FrontendError(RuntimeError):
    """The front end cannot start (socket in use, bad configuration)."""


class Executor(Protocol):
    """The execution path behind the front end (built-in host models, Dispatcher)."""

    def submit(self, client_id: int, req_id: int, model_id: int, variant: int,
               io: np.ndarray) -> None: ...

    def step(self) -> bool: ...

    def cancel_client(self, client_id: int) -> None: ...

    @property
    def in_flight(self) -> int: ...


@dataclass
class FrontendConfig:
    socket_path: str
    allowed_users: tuple[str | int, ...] = ()
    allowed_groups: tuple[str | int, ...] = ()
    socket_mode: int = 0o666
    layout: rings.Layout = field(default_factory=rings.Layout)
    max_arena_bytes: int = 256 << 20
    max_clients: int = 256
    max_inflight_per_client: int = 256
    quantum: int = 8                   # entries taken from one ring per round-robin turn
    outbox_limit: int = 1 << 20        # bytes queued for a client that does not read


@dataclass(eq=False)
class ClientConn:
    """One connected client: its socket, identity, segment and requests in flight."""
    cid: int
    sock: socket.socket
    pid: int
    uid: int
    gid: int
    reader: wire.FrameReader = field(default_factory=wire.FrameReader)
    outbox: bytearray = field(default_factory=bytearray)
    mode: str = ""
    shm: posix_ipc.SharedMemory | None = None
    seg: rings.Segment | None = None
    reqs: rings.RequestConsumer | None = None
    cmps: rings.CompletionProducer | None = None
    #: req_id -> True once the wake-up was sent (hybrid mode)
    inflight: dict[int, bool] = field(default_factory=dict)
    alive: bool = True

    @property
    def ready(self) -> bool:
        return self.seg is not None and self.alive


class ModelTable:
    """Served models by id, as the clients see them. Ids stay stable across reloads."""

    def __init__(self) -> None:
        self.by_id: dict[int, wire.ModelInfo] = {}
        self._ids: dict[str, int] = {}

    def id_for(self, name: str) -> int:
        """The id ``name`` has (or gets): a reloaded model keeps its id."""
        if name not in self._ids:
            self._ids[name] = len(self._ids) + 1
        return self._ids[name]

    def replace(self, models: list[wire.ModelInfo]) -> None:
        self.by_id = {m.model_id: m for m in models}

    def describe(self) -> list[dict]:
        return [m.to_dict() for m in sorted(self.by_id.values(), key=lambda m: m.model_id)]


def _resolve_id(name: str | int, lookup, field: str, what: str) -> int:
    """A user or group name (or number) as its numeric id; unknown names are errors."""
    if isinstance(name, int) or str(name).isdigit():
        return int(name)
    try:
        return getattr(lookup(name), field)
    except KeyError:
        raise FrontendError(f"allowed {what} {name!r} does not exist") from None


def peer_groups(pid: int, gid: int) -> set[int]:
    """The peer's primary and supplementary groups (from /proc, keyed by the kernel's pid)."""
    groups = {gid}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    groups.update(int(x) for x in line.split()[1:])
                    break
    except OSError:
        pass  # the process already exited: its primary group is all we know
    return groups


def _close_gently(sock: socket.socket) -> None:
    """Close after reading what the peer already sent: closing a Unix socket with
    unread input makes the peer's recv fail with ECONNRESET *before* it can read the
    ERROR frame we just sent it."""
    for _ in range(16):
        try:
            if not sock.recv(65536, socket.MSG_DONTWAIT):
                break
        except OSError:
            break   # nothing more (EAGAIN) or the peer is gone: either way, close
    sock.close()


class Frontend:
    """Control socket + rings. Single-threaded: only the daemon loop calls it."""

    def __init__(self, cfg: FrontendConfig, models: ModelTable):
        self.cfg = cfg
        self.models = models
        self.executor: Executor | None = None
        #: Hooks of the device path: ``(client_id, arena)`` once a client's arena is
        #: mapped (HELLO done), and again just before the mapping is dropped (no job of
        #: the client is left). The daemon page-locks arenas with them (register_host).
        self.on_arena_mapped: Callable[[int, np.ndarray], None] | None = None
        self.on_arena_released: Callable[[int, np.ndarray], None] | None = None
        self.clients: dict[int, ClientConn] = {}
        self.ready: list[ClientConn] = []      # round-robin order
        self._rr = 0
        self._next_cid = 1
        self.sel = selectors.DefaultSelector()
        self.listener: socket.socket | None = None
        self.accepting = True
        self._lock_fd: int | None = None
        self._sleeping = False
        self.allowed_uids = {_resolve_id(u, pwd.getpwnam, 'pw_uid', 'user')
                             for u in cfg.allowed_users} | {os.geteuid(), 0}
        self.allowed_gids = {_resolve_id(g, grp.getgrnam, 'gr_gid', 'group')
                             for g in cfg.allowed_groups}
        self.stats = {"accepted": 0, "refused": 0, "lost": 0, "requests": 0, "rejected": 0,
                      "bad_messages": 0}

    # -- socket setup --------------------------------------------------------------
    def listen(self) -> None:
        """Take the socket path: refuse clearly if another daemon holds it."""
        path = self.cfg.socket_path
        lock_path = path + ".lock"
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise FrontendError(f"another paella daemon (pid {other}) is already serving "
                                f"{path}; stop it first or choose another --socket") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd
        if os.path.exists(path):
            os.unlink(path)   # we hold the lock, so this is a dead daemon's socket
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(path)
        os.chmod(path, self.cfg.socket_mode)
        s.listen(128)
        s.setblocking(False)
        self.listener = s
        self.sel.register(s, selectors.EVENT_READ, None)

    def watch(self, fd: int, callback) -> None:
        """Also wake :meth:`poll_io` when ``fd`` is readable, and call ``callback()``."""
        self.sel.register(fd, selectors.EVENT_READ, callback)

    def stop_accepting(self) -> None:
        """Close the listening socket: new clients get "no daemon", not a hang."""
        if self.listener is not None:
            self.sel.unregister(self.listener)
            self.listener.close()
            self.listener = None
            try:
                os.unlink(self.cfg.socket_path)
            except FileNotFoundError:
                pass  # someone removed it for us
        self.accepting = False

    # -- the socket side -----------------------------------------------------------
    def poll_io(self, timeout: float | None = 0) -> int:
        """Handle ready sockets; block up to ``timeout`` seconds (None: forever)."""
        events = self.sel.select(timeout)
        for key, mask in events:
            c = key.data
            if c is None:
                self._accept()
                continue
            if not isinstance(c, ClientConn):
                c()          # an extra source the daemon registered (signal pipe)
                continue
            if not c.alive:
                continue
            if mask & selectors.EVENT_WRITE:
                self._flush(c)
            if mask & selectors.EVENT_READ and c.alive:
                self._read(c)
        return len(events)

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()   # type: ignore[union-attr]
        except (BlockingIOError, InterruptedError):
            return
        sock.setblocking(False)
        pid, uid, gid = UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                     UCRED.size))
        if uid not in self.allowed_uids and not (self.allowed_gids & peer_groups(pid, gid)):
            self._refuse(sock, "forbidden", f"uid {uid} (pid {pid}) is not in the daemon's "
                                            f"allowed users or groups")
            return
        if len(self.clients) >= self.cfg.max_clients:
            self._refuse(sock, "too_many_clients",
                         f"the daemon already serves {self.cfg.max_clients} clients (limit)")
            return
        c = ClientConn(self._next_cid, sock, pid, uid, gid)
        self._next_cid += 1
        self.clients[c.cid] = c
        self.sel.register(sock, selectors.EVENT_READ, c)
        self.stats["accepted"] += 1
        log.debug("client %d connected: pid %d uid %d", c.cid, pid, uid)

    def _refuse(self, sock: socket.socket, code: str, message: str) -> None:
        log.warning("refused a connection: %s", message)
        self.stats["refused"] += 1
        try:
            sock.send(wire.error(code, message))
        except OSError:
            pass  # the peer is gone already; nothing to tell
        _close_gently(sock)

    def _read(self, c: ClientConn) -> None:
        try:
            data = c.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self.drop_client(c, f"socket error: {e}")
            return
        if not data:
            self.drop_client(c, "disconnected")
            return
        c.reader.buf += data
        while c.alive:
            try:
                raw = c.reader.next_raw()
            except wire.WireError as e:
                self._bad_message(c, e, fatal=True)
                return
            if raw is None:
                return
            try:
                self._handle(c, raw[0], wire.decode_payload(raw[0], raw[1]))
            except wire.WireError as e:
                self._bad_message(c, e, fatal=False)

    def _bad_message(self, c: ClientConn, e: wire.WireError, fatal: bool) -> None:
        self.stats["bad_messages"] += 1
        log.warning("client %d (pid %d) sent a bad message: %s", c.cid, c.pid, e)
        self.send(c, wire.error(e.code, str(e)))
        if fatal:
            self._flush(c)
            self.drop_client(c, f"unrecoverable framing error: {e}")

    def _handle(self, c: ClientConn, kind: int, msg) -> None:
        """One control message; raises WireError for anything malformed."""
        if kind == wire.KICK:
            return   # waking the loop was the point
        if kind == wire.HELLO:
            self._hello(c, msg)
        elif kind == wire.LIST_MODELS:
            self.send(c, wire.encode(wire.MODELS, {"models": self.models.describe()}))
        else:
            raise wire.WireError("unexpected", f"a client may not send {wire.NAMES[kind]}")

    def _hello(self, c: ClientConn, msg: dict) -> None:
        if c.seg is not None:
            raise wire.WireError("unexpected", "HELLO sent twice on one connection")
        if msg.get("version") != wire.PROTOCOL_VERSION:
            raise wire.WireError("version", f"protocol version {msg.get('version')!r} is not "
                                            f"supported (daemon speaks {wire.PROTOCOL_VERSION})")
        mode = msg.get("mode", "hybrid")
        if mode not in wire.MODES:
            raise wire.WireError("bad_mode", f"mode {mode!r} is not one of {wire.MODES}")
        arena = msg.get("arena_bytes", self.cfg.layout.arena_bytes)
        if not isinstance(arena, int) or not 0 < arena <= self.cfg.max_arena_bytes:
            raise wire.WireError("bad_arena", f"arena_bytes {arena!r} must be an integer in "
                                              f"1..{self.cfg.max_arena_bytes}")
        layout = rings.Layout(self.cfg.layout.req_slots, self.cfg.layout.cmp_slots, arena)
        name = f"/paella.{os.getpid()}.{c.cid}.{os.urandom(4).hex()}"
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=layout.total_bytes)
        try:
            mm = mmap.mmap(shm.fd, layout.total_bytes)
            c.shm, c.mode = shm, mode
            c.seg = rings.Segment(mm, layout)
            c.seg.init_header()
            c.reqs = rings.RequestConsumer(c.seg)
            c.cmps = rings.CompletionProducer(c.seg)
            c.cmps.set_sleeping(self._sleeping)
            welcome = wire.encode(wire.WELCOME, {"client_id": c.cid, "segment": name,
                                                 "layout": layout.to_dict(),
                                                 "models": self.models.describe()})
            socket.send_fds(c.sock, [welcome], [shm.fd])
        except OSError as e:
            self.drop_client(c, f"could not hand over the segment: {e}")
            return
        finally:
            shm.close_fd()
        self.ready.append(c)
        if self.on_arena_mapped is not None:
            self.on_arena_mapped(c.cid, c.seg.arena)
        log.info("client %d (pid %d uid %d) ready: mode %s, segment %s, arena %d bytes",
                 c.cid, c.pid, c.uid, mode, name, arena)

    def send(self, c: ClientConn, frame: bytes) -> None:
        """Queue-or-send without blocking; a client that lets too much pile up is dropped."""
        if not c.alive:
            return
        if not c.outbox:
            try:
                n = c.sock.send(frame)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError as e:
                self.drop_client(c, f"send failed: {e}")
                return
            if n == len(frame):
                return
            frame = frame[n:]
            self.sel.modify(c.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, c)
        c.outbox += frame
        if len(c.outbox) > self.cfg.outbox_limit:
            self.drop_client(c, f"does not read its socket ({len(c.outbox)} bytes queued)")

    def _flush(self, c: ClientConn) -> None:
        if not c.outbox or not c.alive:
            return
        try:
            n = c.sock.send(c.outbox)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self.drop_client(c, f"send failed: {e}")
            return
        del c.outbox[:n]
        if not c.outbox:
            self.sel.modify(c.sock, selectors.EVENT_READ, c)

    # -- the ring side ---------------------------------------------------------------
    def poll_rings(self, admit: bool = True) -> int:
        """One round-robin pass over the request rings; returns entries taken.

        Each client gets up to ``quantum`` entries per pass, starting one client later
        each pass, so a busy client cannot starve the others. A client's entries stay
        in its ring (back-pressure) while its completion ring could not take their
        completions or it has ``max_inflight_per_client`` requests running.
        """
        ready = self.ready
        n = len(ready)
        if n == 0:
            return 0
        taken = 0
        start = self._rr = (self._rr + 1) % n
        for i in range(n):
            c = ready[(start + i) % n]
            if c.alive:
                taken += self._poll_client(c, admit)
        return taken

    def _poll_client(self, c: ClientConn, admit: bool) -> int:
        reqs, cmps = c.reqs, c.cmps
        try:
            pending = reqs.pending()     # type: ignore[union-attr]
            if not pending:
                return 0
            room = min(self.cfg.layout.cmp_slots - cmps.unread() - len(c.inflight),  # type: ignore[union-attr]
                       self.cfg.max_inflight_per_client - len(c.inflight))
        except rings.RingCorrupt as e:
            self.send(c, wire.error("ring_corrupt", str(e)))
            self._flush(c)
            self.drop_client(c, f"corrupt ring: {e}")
            return 0
        k = min(pending, room, self.cfg.quantum)
        for _ in range(k):
            req_id, mo, off, ln = reqs.pop()   # type: ignore[union-attr]
            if admit:
                self._admit(c, req_id, mo & rings.U32, mo >> 32, off, ln)
            else:
                self._reject(c, req_id, rings.E_CANCELLED, "the daemon is shutting down")
        return k

    def _admit(self, c: ClientConn, req_id: int, model_id: int, options: int, off: int,
               ln: int) -> None:
        """Validate every field of one entry; start the job or complete it with an error."""
        self.stats["requests"] += 1
        if options & ~wire.KNOWN_OPTIONS:
            return self._reject(c, req_id, rings.E_OPTIONS,
                                f"unknown option bits {options & ~wire.KNOWN_OPTIONS:#x}")
        model = self.models.by_id.get(model_id)
        if model is None:
            return self._reject(c, req_id, rings.E_MODEL, f"no model with id {model_id}")
        variant = options & wire.VARIANT_MASK
        if variant >= len(model.variants):
            return self._reject(c, req_id, rings.E_OPTIONS,
                                f"{model.name} has no variant {variant}")
        arena = c.seg.layout.arena_bytes   # type: ignore[union-attr]
        if off + ln > arena:
            return self._reject(c, req_id, rings.E_RANGE,
                                f"[{off}, {off + ln}) is outside the {arena}-byte arena")
        need = model.variants[variant].io_bytes
        if ln != need:
            return self._reject(c, req_id, rings.E_LENGTH,
                                f"{model.name} needs {need} io bytes, request has {ln}")
        if req_id in c.inflight:
            return self._reject(c, req_id, rings.E_DUPLICATE,
                                f"request id {req_id} is already in flight")
        c.inflight[req_id] = False
        self.executor.submit(c.cid, req_id, model_id, variant,   # type: ignore[union-attr]
                             c.seg.arena[off:off + ln])          # type: ignore[union-attr]

    def _reject(self, c: ClientConn, req_id: int, status: int, reason: str) -> None:
        self.stats["rejected"] += 1
        log.info("client %d request %d rejected: %s", c.cid, req_id, reason)
        self._finish(c, req_id, False, status, reason)

    # -- executor callbacks -------------------------------------------------------------
    def almost_finished(self, client_id: int, req_id: int) -> None:
        """The job's last operation is about to run: wake a hybrid client."""
        c = self.clients.get(client_id)
        if c is None or not c.alive or c.mode != "hybrid":
            return
        if c.inflight.get(req_id) is False:
            c.inflight[req_id] = True
            self.send(c, wire.encode_id(wire.WAKE, req_id))

    def complete(self, client_id: int, req_id: int, status: int, reason: str | None) -> None:
        """The job ended: put its completion on the client's ring."""
        c = self.clients.get(client_id)
        if c is None:
            return
        woken = c.inflight.pop(req_id, None)
        if woken is None:
            log.error("completion for unknown request %d of client %d", req_id, client_id)
            return
        if not c.alive:
            if not c.inflight:
                self._release(c)   # the last cancelled job of a lost client
            return
        self._finish(c, req_id, woken, status, reason or "")

    def _finish(self, c: ClientConn, req_id: int, woken: bool, status: int, reason: str) -> None:
        # Hybrid clients count one WAKE per completion, so every completion gets one.
        if c.mode == "hybrid" and not woken:
            self.send(c, wire.encode_id(wire.WAKE, req_id))
        if not c.alive:
            return
        c.cmps.push(req_id, status, reason)   # type: ignore[union-attr]
        if c.mode == "socket":
            self.send(c, wire.encode_id(wire.DONE, req_id))

    # -- idle support -----------------------------------------------------------------
    def set_sleeping(self, flag: bool) -> None:
        """Tell every client whether pushing onto its ring must be followed by a KICK."""
        self._sleeping = flag
        for c in self.ready:
            if c.alive:
                c.cmps.set_sleeping(flag)   # type: ignore[union-attr]

    def any_pending(self) -> bool:
        """True when some ring holds an entry (checked after raising the sleep flag)."""
        for c in self.ready:
            if not c.alive:
                continue
            try:
                if c.reqs.pending():   # type: ignore[union-attr]
                    return True
            except rings.RingCorrupt:
                return True   # poll_rings will deal with it
        return False

    # -- client loss and shutdown -------------------------------------------------------
    def drop_client(self, c: ClientConn, why: str) -> None:
        """Forget a client: cancel its jobs, unlink its segment, close its socket."""
        if not c.alive:
            return
        c.alive = False
        self.stats["lost"] += 1
        log.info("client %d (pid %d) dropped: %s (%d in flight)", c.cid, c.pid, why,
                 len(c.inflight))
        try:
            self.sel.unregister(c.sock)
        except (KeyError, ValueError):
            pass  # never registered or already gone
        _close_gently(c.sock)
        if c in self.ready:
            self.ready.remove(c)
        if c.shm is not None:
            try:
                c.shm.unlink()   # the name goes now; the mapping lives while jobs do
            except posix_ipc.ExistentialError:
                pass  # already unlinked
        if c.inflight and self.executor is not None:
            self.executor.cancel_client(c.cid)
        if not c.inflight:
            self._release(c)

    def _release(self, c: ClientConn) -> None:
        """Drop the mapping and the client record.

        The mmap is never closed explicitly: numpy views made with ``buffer=`` do not
        pin it, so closing it under a live view (an executor finishing a cancelled
        job) would crash the daemon. Dropping our references lets the last view's
        death unmap it.
        """
        if c.seg is not None:
            if self.on_arena_released is not None:
                self.on_arena_released(c.cid, c.seg.arena)
            c.seg.release()
            c.seg = c.reqs = c.cmps = None
        self.clients.pop(c.cid, None)

    def close(self) -> None:
        """Drop every client and give the socket path back."""
        for c in list(self.clients.values()):
            self.drop_client(c, "daemon stopping")
            c.inflight.clear()
            self._release(c)
        self.stop_accepting()
        if self._lock_fd is not None:
            try:
                os.unlink(self.cfg.socket_path + ".lock")
            except FileNotFoundError:
                pass  # same
            os.close(self._lock_fd)
            self._lock_fd = None
        self.sel.close()

    @property
    def inflight(self) -> int:
        return sum(len(c.inflight) for c in self.clients.values())
