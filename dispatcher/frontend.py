"""The daemon's front end: control socket, per-client segments, request-ring polling.

Everything a client can reach goes through here, and nothing a client writes is
trusted. A connection is identified by SO_PEERCRED (the kernel's word, not the
client's) and checked against the allowed users and groups, a per-uid connection limit
and a handshake deadline. Its shared-memory segment (``paella.rings``) is a memfd the
daemon creates, sizes and seals (``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``) before
passing its descriptor over the socket with SCM_RIGHTS: the client maps it, of any uid,
but no one can change its size, so the daemon's mapping can never fault (SIGBUS) on a
page past a truncated end. The segment has no name anywhere; it goes with the last
descriptor and mapping.

The loop calls :meth:`Frontend.poll_rings` (round-robin over clients, each entry
validated, bad ones completed with an error status) and :meth:`Frontend.poll_io`
(accept, control messages, handshake deadlines, client loss). The execution path is an
:class:`Executor`: it calls back :meth:`almost_finished` and :meth:`complete`.

A client may be dropped by almost any call that touches it (a corrupt ring, a socket
that stopped reading); every loop over clients or over one client's entries checks
``alive`` after each step that could drop it.
"""
from __future__ import annotations

import errno
import fcntl
import grp
import logging
import mmap
import os
import pwd
import re
import resource
import selectors
import socket
import stat
import struct
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np

from paella import rings, shapes, wire
from paella.dispatcher.core import Request
from paella.log_throttle import LogThrottle

log = logging.getLogger("paella.frontend")

UCRED = struct.Struct("3i")   # struct ucred {pid_t pid; uid_t uid; gid_t gid;}

#: Seals of every client segment: its size is fixed for good (and the seals too).
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL

#: errnos meaning "the daemon is out of descriptors or memory", answered with ERROR
#: "resources" rather than a crash or a silent close.
RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS,
                             errno.ENOSPC})


#: Connections the kernel holds for the loop to accept (capped by net.core.somaxconn):
#: a client dialling while it is full is refused at once (EAGAIN) on a Unix socket.
LISTEN_BACKLOG = min(socket.SOMAXCONN, 4096)
#: The control frames a client may send; any other kind is refused "unexpected".
CLIENT_SENDS = frozenset({wire.KICK, wire.HELLO, wire.LIST_MODELS, wire.STATUS, wire.TRACE,
                          wire.REPOSITORY_INDEX, wire.LOAD, wire.UNLOAD})
#: Model control frames (``paella model``): the daemon answers them, maybe much later.
MODEL_CONTROL = frozenset({wire.REPOSITORY_INDEX, wire.LOAD, wire.UNLOAD})
#: The longest trace a client may ask for (TRACE "milliseconds").
MAX_TRACE_MS = 600_000
#: What a lock file may hold: nothing (new) or a daemon's pid.
_LOCK_CONTENT = re.compile(rb"(?:[0-9]{1,10}\n?)?")
#: The request ring's tail word in a segment's header (read per client per loop pass).
_REQ_TAIL = rings.REQ_TAIL


class FrontendError(RuntimeError):
    """The front end cannot start (socket in use, bad configuration)."""


class Executor(Protocol):
    """The execution path behind the front end (built-in host models, Dispatcher). A
    request reaches it as the one record the front end makes of it when it accepts it
    (:class:`paella.dispatcher.core.Request`: ids, model, io view, variant in
    ``options``, and the front end's wake-up and completion callbacks), and goes on
    unchanged to the dispatcher; statuses are the wire's (``paella.rings``) throughout."""

    def submit(self, req: Request) -> None: ...

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
    handshake_seconds: float = 5.0     # a connection must send HELLO within this
    max_clients_per_uid: int = 64      # connections (handshaking or ready) of one uid
    trace_users: tuple[str | int, ...] = ()   # uids besides the owner (and root) that
                                              # may take a trace (TRACE)
    control_users: tuple[str | int, ...] = ()  # users, uids or "@group"s besides the owner
                                              # (and root) that may LOAD and UNLOAD models
    class_default: dict[str, int] = field(default_factory=dict)   # tenant -> class of a
                                              # request naming none (see TenantClasses)
    class_highest: dict[str, int] = field(default_factory=dict)   # tenant -> the most
                                              # urgent class it may ask for
    log_interval: float = 10.0         # one log line per client per interval for its
                                       # rejected entries and bad messages (then a count)


#: Client arrivals/departures logged per ``log_interval`` before they are only counted.
SESSION_LOG_BURST = 50

#: Descriptors a ready client holds in the daemon: its socket and its segment's mapping
#: (Python's mmap keeps a duplicate of the descriptor).
FDS_PER_CLIENT = 2


def _fd_share() -> int:
    """The descriptors one uid may hold: half of the process's soft limit, read at each
    accept (an operator may lower it while the daemon runs). Why: ``max_clients_per_uid``
    counts connections, and under a low limit (64, say) one tenant's silent connections
    filled the descriptor table under that count and every other tenant was refused
    "resources" (the fuzzer, ``--nofile 64``: 814 refused legitimate connections)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return (1 << 30) if soft == resource.RLIM_INFINITY else soft // 2


@dataclass(eq=False)
class ClientConn:
    """One connected client: its socket, identity, segment and requests in flight."""
    cid: int
    sock: socket.socket
    pid: int
    uid: int
    gid: int
    reader: wire.FrameReader = field(
        default_factory=lambda: wire.FrameReader(wire.MAX_CLIENT_PAYLOAD))
    outbox: bytearray = field(default_factory=bytearray)
    mode: str = ""
    #: It asked for a trace (TRACE): no handshake deadline; closed once it is sent.
    tracing: bool = False
    #: Model control messages of it still unanswered (a LOAD may take minutes): no
    #: handshake deadline meanwhile; without HELLO, closed once the last is answered.
    controls: int = 0
    #: Answered, no session: closed once the rest of its outbox is sent (:meth:`_flush`).
    close_when_sent: bool = False
    #: Its tenant's priority classes (TenantClasses): a request naming none gets
    #: ``class_default``; one more urgent than ``class_highest`` is clamped to it.
    class_default: int = 0
    class_highest: int = 1
    clamp_log: Any = None
    segment: str = ""                   # the memfd's name, for logs (it is in no file system)
    deadline: float = 0.0               # monotonic time by which HELLO must have come
    seg: rings.Segment | None = None
    reqs: rings.RequestConsumer | None = None
    cmps: rings.CompletionProducer | None = None
    #: req_id -> True once the wake-up was sent (hybrid mode)
    inflight: dict[int, bool] = field(default_factory=dict)
    alive: bool = True
    #: A request of it was answered since its last STATUS: its next STATUS is built anew
    #: (a reused reply could predate the answers it already holds).
    answered: bool = False
    reject_log: LogThrottle = field(default_factory=lambda: LogThrottle(10.0))
    message_log: LogThrottle = field(default_factory=lambda: LogThrottle(10.0))

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


#: The largest uid or gid (uid_t is 32 bits; (uid_t)-1 means "none").
MAX_ID = 2 ** 32 - 2


def _resolve_id(name: str | int, lookup, field: str, what: str,
                setting: str | None = None) -> int:
    """A user or group name (or number) as its numeric id; unknown names are errors
    (naming ``setting``, the [access] setting that lists it, when given)."""
    if isinstance(name, int) or (str(name).isascii() and str(name).isdigit()):
        if not 0 <= int(name) <= MAX_ID:
            where = f"[access] {setting}" if setting else f"allowed {what}"
            raise FrontendError(f"{where}: {str(name)[:40]} is not a {what} id (0..{MAX_ID})")
        return int(name)
    try:
        return getattr(lookup(name), field)
    except (KeyError, ValueError, TypeError):
        if setting is None:
            raise FrontendError(f"allowed {what} {name!r} does not exist") from None
        raise FrontendError(f"[access] {setting}: there is no {what} {name!r} on this "
                            f"system; correct the name or remove it") from None


def resolve_users(entries: tuple[str | int, ...], setting: str) -> tuple[set[int], set[int]]:
    """The uids and gids of an [access] list of users, uids and ``"@group"`` names."""
    uids: set[int] = set()
    gids: set[int] = set()
    for who in entries:
        if isinstance(who, str) and who.startswith("@"):
            gids.add(_resolve_id(who[1:], grp.getgrnam, 'gr_gid', 'group', setting))
        else:
            uids.add(_resolve_id(who, pwd.getpwnam, 'pw_uid', 'user', setting))
    return uids, gids


class TenantClasses:
    """Each tenant's priority classes, from ``[access] class_default`` and
    ``class_highest`` (tenant -> class: a user name or uid, ``@group``, or ``*``).

    A connection's are resolved once, at accept: its uid's entry first; else, among its
    groups' entries, the most urgent (the lowest number: a member of a privileged group
    gets that group's rights); else ``*``'s; else no default (0) and no bound (1)."""

    def __init__(self, defaults: dict[str, int], highest: dict[str, int]):
        self.tables = [self._resolve(defaults, "class_default"),
                       self._resolve(highest, "class_highest")]
        self.groups = any(t[1] for t in self.tables)

    @staticmethod
    def _resolve(table: dict[str, int], setting: str
                 ) -> tuple[dict[int, int], dict[int, int], int | None]:
        users, groups, anyone = {}, {}, None
        for who, n in table.items():
            if who == "*":
                anyone = n
            elif who.startswith("@"):
                groups[_resolve_id(who[1:], grp.getgrnam, 'gr_gid', 'group', setting)] = n
            else:
                users[_resolve_id(who, pwd.getpwnam, 'pw_uid', 'user', setting)] = n
        return users, groups, anyone

    def of(self, uid: int, pid: int, gid: int) -> tuple[int, int]:
        """(default class, highest class) of a connection."""
        peer = peer_groups(pid, gid) if self.groups else set()
        out = []
        for (users, groups, anyone), fallback in zip(self.tables, (0, 1)):
            n = users.get(uid)
            if n is None:
                mine = [groups[g] for g in peer if g in groups]
                n = min(mine) if mine else anyone
            out.append(fallback if n is None else n)
        return out[0], out[1]


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


def make_segment(name: str, size: int) -> tuple[int, mmap.mmap]:
    """A sealed memfd of ``size`` bytes and the daemon's mapping of it.

    Sealed against shrinking and growing (and against removing the seals), so the
    client that gets the descriptor can change the bytes but never the size: the
    daemon's mapping can never fault. On failure nothing is left open."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        return fd, mmap.mmap(fd, size)      # (mmap keeps a duplicate fd until unmapped)
    except BaseException:
        os.close(fd)
        raise


def _out_of_resources(e: OSError) -> str:
    if e.errno in (errno.EMFILE, errno.ENFILE):
        return (f"the daemon is out of file descriptors ({e.strerror}); try again later, "
                f"or raise its limit (LimitNOFILE= in the unit)")
    return f"the daemon could not make a shared-memory segment ({e.strerror}); try again later"


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
        #: Builds a STATUS reply (the daemon adds the device's side); default :meth:`status`.
        self.on_status: Callable[[], dict] | None = None
        #: Starts a trace of ``seconds`` for a client allowed to take one (TRACE); the
        #: daemon answers with :meth:`send_trace`. None: this front end takes no traces.
        self.on_trace: Callable[["ClientConn", float], None] | None = None
        #: Takes a model control message (REPOSITORY_INDEX, or a LOAD or UNLOAD from a
        #: client allowed to send one) as ``(client, kind, message)``; the daemon answers
        #: each with one :meth:`control_reply`. None: no model control here.
        self.on_model_control: Callable[["ClientConn", int, dict], None] | None = None
        self.clients: dict[int, ClientConn] = {}
        self.ready: list[ClientConn] = []      # round-robin order
        self._probe: np.ndarray | None = None  # ring_probe()'s, until ``ready`` changes
        self._rr = 0
        self._next_cid = 1
        self.sel = selectors.DefaultSelector()
        self.listener: socket.socket | None = None
        self.accepting = True
        self._lock_fd: int | None = None
        #: Held open so that at EMFILE one descriptor can be freed to accept the waiting
        #: connection and tell it why it is refused (else it would wait in the backlog).
        self._spare_fd: int | None = None
        self._sleeping = False
        #: Connections that have not sent HELLO yet, oldest (earliest deadline) first.
        self._handshaking: deque[ClientConn] = deque()
        #: Clients dropped whose jobs are still to be cancelled (see _cancel_dropped).
        self._cancels: list[int] = []
        self._per_uid: dict[int, int] = {}
        self._refusal_log = LogThrottle(cfg.log_interval)
        #: Client arrivals and departures: logged, but a loop of them is only counted.
        self._session_log = LogThrottle(cfg.log_interval, burst=SESSION_LOG_BURST)
        # Bad messages and rejections are throttled per client and, for clients that
        # each send one and leave (a new throttle per connection), daemon-wide too.
        self._message_log = LogThrottle(cfg.log_interval, burst=SESSION_LOG_BURST)
        self._reject_log = LogThrottle(cfg.log_interval, burst=SESSION_LOG_BURST)
        self.allowed_uids = {_resolve_id(u, pwd.getpwnam, 'pw_uid', 'user')
                             for u in cfg.allowed_users} | {os.geteuid(), 0}
        self.allowed_gids = {_resolve_id(g, grp.getgrnam, 'gr_gid', 'group')
                             for g in cfg.allowed_groups}
        self.classes = TenantClasses(cfg.class_default, cfg.class_highest)
        #: Requests accepted per priority class (0: none), and those clamped to their
        #: tenant's highest class.
        self.class_counts: dict[int, int] = {}
        #: Requests in flight per priority class (accepted, not yet answered).
        self.class_inflight: dict[int, int] = {}
        self._clamp_log = LogThrottle(cfg.log_interval, burst=SESSION_LOG_BURST)
        #: Who may take a trace: it shows every tenant's kernels and timing.
        self.trace_uids = {_resolve_id(u, pwd.getpwnam, 'pw_uid', 'user', 'trace_users')
                           for u in cfg.trace_users} | {os.geteuid(), 0}
        #: Who may load and unload models: that changes what every tenant is served.
        self.control_uids, self.control_gids = resolve_users(cfg.control_users,
                                                             "control_users")
        self.control_uids |= {os.geteuid(), 0}
        #: Counters the daemon logs at exit ("stopped cleanly; stats {...}").
        self.stats = {"accepted": 0, "refused": 0, "lost": 0, "requests": 0, "rejected": 0,
                      "priority_clamped": 0,
                      "bad_messages": 0, "handshake_timeouts": 0, "rejections_not_logged": 0,
                      "messages_not_logged": 0, "refusals_not_logged": 0,
                      "sessions_not_logged": 0, "progress": 0, "progress_skipped": 0}

    # -- socket setup --------------------------------------------------------------
    def listen(self) -> None:
        """Take the socket path: refuse clearly if another daemon holds it."""
        path = self.cfg.socket_path
        lock_path = path + ".lock"
        # The daemon often runs as root: it replaces or deletes only what is its own (a
        # socket, a lock file holding a pid), never follows a symlink, and refuses
        # anything else at those paths rather than clobber it.
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK   # (a fifo: no wait)
        created = False
        try:
            try:
                fd = os.open(lock_path, flags | os.O_CREAT | os.O_EXCL, 0o644)
                created = True
            except FileExistsError:
                fd = os.open(lock_path, flags)
        except OSError as e:
            raise FrontendError(f"cannot open the lock file {lock_path}: {e.strerror}"
                                f"{' (a symlink: refused)' if e.errno == errno.ELOOP else ''}; "
                                f"remove it or choose another --socket") from None
        try:
            st = os.fstat(fd)
            held = os.pread(fd, 64, 0) if stat.S_ISREG(st.st_mode) else b""   # (a fifo: ESPIPE)
            if not stat.S_ISREG(st.st_mode) or not _LOCK_CONTENT.fullmatch(held):
                raise FrontendError(f"{lock_path} exists and is not a paella daemon's lock "
                                    f"file (a pid); refusing to overwrite it: remove it or "
                                    f"choose another --socket")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                other = held.decode(errors="replace").strip() or "?"
                raise FrontendError(f"another paella daemon (pid {other}) is already serving "
                                    f"{path}; stop it first or choose another --socket") from None
            try:
                old = os.lstat(path)
            except FileNotFoundError:
                old = None
            if old is not None and not stat.S_ISSOCK(old.st_mode):
                raise FrontendError(f"{path} exists and is not a socket; refusing to replace "
                                    f"it: remove it or choose another --socket")
        except BaseException:
            if created:                      # (the lock file is ours: made just now)
                os.unlink(lock_path)
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd
        if old is not None:
            os.unlink(path)   # we hold the lock, so this is a dead daemon's socket
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(path)
        os.chmod(path, self.cfg.socket_mode)
        s.listen(LISTEN_BACKLOG)
        s.setblocking(False)
        self.listener = s
        self.sel.register(s, selectors.EVENT_READ, None)
        self._spare_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)

    def watch(self, fd: int, callback) -> None:
        """Also wake :meth:`poll_io` when ``fd`` is readable, and call ``callback()``."""
        self.sel.register(fd, selectors.EVENT_READ, callback)

    def stop_accepting(self) -> None:
        """Close the listening socket: new clients get "no daemon", not a hang."""
        if self.listener is not None:
            self.sel.unregister(self.listener)
            self.listener.close()
            self.listener = None
            self._unlink_socket()
        self.accepting = False

    def _unlink_socket(self) -> None:
        try:                                 # (only a socket: never someone's file)
            if stat.S_ISSOCK(os.lstat(self.cfg.socket_path).st_mode):
                os.unlink(self.cfg.socket_path)
        except FileNotFoundError:
            pass  # someone removed it for us

    def _unlink_lock(self) -> None:
        lock_path = self.cfg.socket_path + ".lock"
        try:                                 # only if the path still names our lock file
            if os.path.samestat(os.lstat(lock_path), os.fstat(self._lock_fd)):
                os.unlink(lock_path)
        except FileNotFoundError:
            pass  # same

    def unlink_paths(self) -> None:
        """Remove the socket file and the lock file, and nothing else: what a process that
        must exit at once (the watchdog's last resort, from its own thread) leaves tidy."""
        if self.listener is not None:
            self._unlink_socket()
        if self._lock_fd is not None:
            self._unlink_lock()

    # -- the socket side -----------------------------------------------------------
    def poll_io(self, timeout: float | None = 0) -> int:
        """Handle ready sockets; block up to ``timeout`` seconds (None: forever), but
        no later than the next handshake deadline."""
        if self._cancels:
            self._cancel_dropped()
        if self._handshaking:
            timeout = self._expire_handshakes(timeout)
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
        except OSError as e:
            if e.errno in RESOURCE_ERRNOS:
                self._accept_with_spare_fd(e)
            else:   # ECONNABORTED and kin: that one connection is gone, nothing else
                log.warning("accept failed: %s", e)
            return
        sock.setblocking(False)
        pid, uid, gid = UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                     UCRED.size))
        if uid not in self.allowed_uids and not (self.allowed_gids & peer_groups(pid, gid)):
            self._refuse(sock, "forbidden", f"uid {uid} (pid {pid}) is not in the daemon's "
                                            f"allowed users or groups")
            return
        held = self._per_uid.get(uid, 0)
        if held >= self.cfg.max_clients_per_uid:
            self._refuse(sock, "too_many_connections",
                         f"uid {uid} already has {self.cfg.max_clients_per_uid} connections "
                         f"(max_clients_per_uid)")
            return
        share = _fd_share()
        if FDS_PER_CLIENT * (held + 1) > share:
            self._refuse(sock, "too_many_connections",
                         f"uid {uid} already has {held} connections, half of what the "
                         f"daemon's file-descriptor limit allows ({share} descriptors of "
                         f"{2 * share}; raise LimitNOFILE, or lower max_clients_per_uid)")
            return
        if len(self.clients) >= self.cfg.max_clients:
            self._refuse(sock, "too_many_clients",
                         f"the daemon already serves {self.cfg.max_clients} clients (limit)")
            return
        c = ClientConn(self._next_cid, sock, pid, uid, gid,
                       deadline=time.monotonic() + self.cfg.handshake_seconds,
                       reject_log=LogThrottle(self.cfg.log_interval),
                       message_log=LogThrottle(self.cfg.log_interval))
        c.class_default, c.class_highest = self.classes.of(uid, pid, gid)
        self._next_cid += 1
        self.clients[c.cid] = c
        self._per_uid[uid] = self._per_uid.get(uid, 0) + 1
        self._handshaking.append(c)
        self.sel.register(sock, selectors.EVENT_READ, c)
        self.stats["accepted"] += 1
        log.debug("client %d connected: pid %d uid %d", c.cid, pid, uid)

    def _accept_with_spare_fd(self, exc: OSError) -> None:
        """Out of descriptors: free the spare one, accept the waiting connection into
        it, tell the peer why, close it, take the spare back. Without this the
        connection would sit in the backlog (the listener stays readable: a busy loop)
        and its client would wait for its timeout without a word."""
        if self._spare_fd is None:
            log.error("accept failed (%s) and no spare descriptor is left", exc)
            return
        os.close(self._spare_fd)
        self._spare_fd = None
        try:
            sock, _ = self.listener.accept()   # type: ignore[union-attr]
        except OSError:
            sock = None      # someone else took the freed descriptor, or it is gone
        if sock is not None:
            self._refuse(sock, "resources", _out_of_resources(exc))
        try:
            self._spare_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            pass  # retried at the next EMFILE

    def _refuse(self, sock: socket.socket, code: str, message: str) -> None:
        self.stats["refused"] += 1
        held = self._refusal_log.admit()
        if held is None:
            self.stats["refusals_not_logged"] += 1
        else:
            log.warning("refused a connection: %s%s", message,
                        f" ({held} more refused since the last line)" if held else "")
        try:
            sock.send(wire.error(code, message))
        except OSError:
            pass  # the peer is gone already; nothing to tell
        _close_gently(sock)

    def _expire_handshakes(self, timeout: float | None) -> float | None:
        """Drop the connections whose HELLO is overdue; return ``timeout`` shortened
        to the next deadline. Deadlines grow in accept order, so only the front of
        the queue is ever looked at."""
        q = self._handshaking
        now = time.monotonic()
        while q:
            c = q[0]
            if not c.alive or c.seg is not None or c.tracing or c.controls:
                q.popleft()           # gone, its HELLO came in time, tracing or controlling
            elif c.deadline <= now:
                q.popleft()
                self.stats["handshake_timeouts"] += 1
                self.send(c, wire.error("handshake_timeout",
                                        f"no HELLO within {self.cfg.handshake_seconds} s of "
                                        f"connecting"))
                self._flush(c)
                self.drop_client(c, "no HELLO before the handshake deadline")
            else:
                wait = c.deadline - now
                return wait if timeout is None else min(timeout, wait)
        return timeout

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
                if raw[0] not in CLIENT_SENDS:   # before its body is read: a frame of a
                    raise wire.WireError(        # kind only the daemon sends is refused
                        "unexpected", f"a client may not send {wire.NAMES[raw[0]]}")
                self._handle(c, raw[0], wire.decode_payload(raw[0], raw[1]))
            except wire.WireError as e:
                self._bad_message(c, e, fatal=False)
            except Exception as e:  # noqa: BLE001 - a daemon bug costs this client only
                log.exception("client %d: handling %s failed", c.cid, wire.NAMES[raw[0]])
                self._fatal(c, "internal", f"the daemon failed on your {wire.NAMES[raw[0]]} "
                                           f"({type(e).__name__}: {e}); this is a bug")

    def _bad_message(self, c: ClientConn, e: wire.WireError, fatal: bool) -> None:
        self.stats["bad_messages"] += 1
        held = c.message_log.admit()
        if held is not None and self._message_log.admit() is None:
            held = None
        if held is None:
            self.stats["messages_not_logged"] += 1
        else:
            log.warning("client %d (pid %d) sent a bad message: %s%s", c.cid, c.pid, e,
                        f" ({held} more since the last line)" if held else "")
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
        elif kind == wire.STATUS:
            self.send(c, self._status_frame(fresh=c.answered))
            c.answered = False
        elif kind == wire.TRACE:
            self._trace(c, msg["milliseconds"])
        elif kind in MODEL_CONTROL:
            self._model_control(c, kind, msg)

    def may_control(self, c: ClientConn) -> bool:
        """Whether ``c`` may LOAD and UNLOAD models: the daemon's owner, root, a user of
        ``[access] control_users`` or a member (primary or supplementary group, as the
        kernel's pid names it) of one of its ``"@group"``s."""
        if c.uid in self.control_uids:
            return True
        return bool(self.control_gids) and bool(self.control_gids & peer_groups(c.pid, c.gid))

    def _model_control(self, c: ClientConn, kind: int, msg: dict) -> None:
        """REPOSITORY_INDEX (any admitted client: it only reads), LOAD and UNLOAD (they
        change what every tenant is served: :meth:`may_control` only), for the daemon."""
        if kind != wire.REPOSITORY_INDEX and not self.may_control(c):
            self.send(c, wire.error(
                "permission", f"loading and unloading models changes what every tenant is "
                              f"served: only the daemon's owner (uid {os.geteuid()}), root, or "
                              f"a user or \"@group\" listed in its [access] control_users "
                              f"(--control-user) may, and you are uid {c.uid}; ask its "
                              f"operator to add you there"))
            return
        if self.on_model_control is None:
            self.send(c, wire.error("unsupported", "this daemon does not control models"))
            return
        c.controls += 1
        self.on_model_control(c, kind, msg)

    def control_reply(self, c: ClientConn, frame: bytes) -> None:
        """The one answer to a model control message of ``c``. A connection that asked
        without a session (no HELLO, as ``paella model`` does) is closed once its last
        answer is sent: at once, or when the peer has read what did not fit its socket
        (one that never reads holds its connection as a session client that never reads
        does, within its uid's connection limit)."""
        c.controls -= 1
        if not c.alive:
            return
        self.send(c, frame)
        if c.seg is not None or c.controls or c.tracing or not c.alive:
            return
        if c.outbox:
            c.close_when_sent = True
        else:
            self.drop_client(c, "its answer was sent")

    def _trace(self, c: ClientConn, ms: int) -> None:
        if not 1 <= ms <= MAX_TRACE_MS:
            raise wire.WireError("bad_field", f"TRACE milliseconds must be 1..{MAX_TRACE_MS}, "
                                              f"got {ms}")
        if c.uid not in self.trace_uids:
            self.send(c, wire.error(
                "forbidden", f"a trace shows every tenant's kernels and timing: only the "
                             f"daemon's owner (uid {os.geteuid()}) or a user listed in its "
                             f"[access] trace_users may take one, and you are uid {c.uid}"))
            return
        if self.on_trace is None:
            self.send(c, wire.error("unsupported", "this daemon takes no traces"))
            return
        if c.seg is None:
            c.tracing = True
        self.on_trace(c, ms / 1000.0)

    def send_trace(self, c: ClientConn, info: dict, fd: int) -> None:
        """The TRACE_REPLY with the trace's descriptor (SCM_RIGHTS). A client with bytes
        still queued (it sent more than TRACE and does not read) gets an error instead:
        a descriptor cannot join a partly sent stream."""
        if not c.alive:
            return
        if c.outbox:
            self.send(c, wire.error("busy", "the trace is ready but your connection has "
                                            "unread replies queued; read them and ask again"))
            return
        try:
            socket.send_fds(c.sock, [wire.encode(wire.TRACE_REPLY, {"trace": info})], [fd])
        except (BlockingIOError, InterruptedError):
            self.drop_client(c, "its socket is full: the trace reply could not be sent")
            return
        except OSError as e:
            self.drop_client(c, f"send failed: {e}")
            return
        if c.tracing:                # a connection made for the trace (no HELLO): done
            self.drop_client(c, "its trace was sent")

    #: Seconds a built STATUS reply is reused: a client sending STATUS in a loop costs
    #: the dispatcher loop one build per interval, not one per frame. A client that had
    #: a request answered since its last STATUS gets a new one (``fresh``): it sees its
    #: own answers counted (a flood of STATUS alone still gets the reused reply).
    STATUS_REUSE = 0.05

    def _status_frame(self, fresh: bool = False) -> bytes:
        now = time.monotonic()
        cached = getattr(self, "_status_cache", None)
        if not fresh and cached is not None and now - cached[0] < self.STATUS_REUSE:
            return cached[1]
        st = self.on_status() if self.on_status is not None else self.status()
        frame = wire.encode(wire.STATUS_REPLY, {"status": st})
        self._status_cache = (now, frame)
        return frame

    def status(self) -> dict:
        """What the front end knows: served models, connected clients and their requests
        in flight, its counters. Safe from another thread (snapshots are taken with one
        C-level copy each, which the GIL keeps whole)."""
        clients = [{"id": c.cid, "pid": c.pid, "uid": c.uid, "mode": c.mode,
                    "in_flight": len(c.inflight)} for c in list(self.ready)]
        return {"pid": os.getpid(), "socket": self.cfg.socket_path,
                "models": [{"id": m.model_id, "name": m.name, "variants": len(m.variants)}
                           for m in sorted(list(self.models.by_id.values()),
                                           key=lambda m: m.model_id)],
                "clients": clients,
                "in_flight": sum(c["in_flight"] for c in clients),
                "classes": {"accepted": {str(k): v for k, v in sorted(self.class_counts.items())},
                            "in_flight": {str(k): v
                                          for k, v in sorted(self.class_inflight.items())},
                            "clamped": self.stats["priority_clamped"]},
                "stats": dict(self.stats)}

    def _hello(self, c: ClientConn, msg: dict) -> None:
        """``msg`` passed ``wire.check_fields``: each present field has its exact type."""
        if c.seg is not None:
            raise wire.WireError("unexpected", "HELLO sent twice on one connection")
        if msg["version"] != wire.PROTOCOL_VERSION:
            raise wire.WireError("version", f"protocol version {msg['version']} is not "
                                            f"supported (daemon speaks {wire.PROTOCOL_VERSION})")
        mode = msg.get("mode", "hybrid")
        if mode not in wire.MODES:
            raise wire.WireError("bad_mode", f"mode {mode[:40]!r} is not one of {wire.MODES}")
        arena = msg.get("arena_bytes", self.cfg.layout.arena_bytes)
        if not 0 < arena <= self.cfg.max_arena_bytes:
            raise wire.WireError("bad_arena", f"arena_bytes {arena} must be in "
                                              f"1..{self.cfg.max_arena_bytes}")
        layout = rings.Layout(self.cfg.layout.req_slots, self.cfg.layout.cmp_slots, arena)
        name = f"paella.{os.getpid()}.{c.cid}"
        try:
            fd, mm = make_segment(name, layout.total_bytes)
        except OSError as e:
            self._fatal(c, "resources", _out_of_resources(e))
            return
        try:
            c.segment, c.mode = "memfd:" + name, mode
            c.seg = rings.Segment(mm, layout)
            c.seg.init_header()
            c.reqs = rings.RequestConsumer(c.seg)
            c.cmps = rings.CompletionProducer(c.seg)
            c.cmps.set_sleeping(self._sleeping)
            welcome = wire.encode(wire.WELCOME, {"client_id": c.cid, "segment": c.segment,
                                                 "layout": layout.to_dict(),
                                                 "models": self.models.describe()})
            sent = socket.send_fds(c.sock, [welcome], [fd])
        except OSError as e:
            # (BlockingIOError too: a client that filled its socket before HELLO. The
            # descriptor can only travel with the first byte, so it cannot be queued.)
            self.drop_client(c, f"could not hand over the segment: {e}")
            return
        finally:
            os.close(fd)          # the client has its copy; our mapping needs none
        if sent < len(welcome):
            self.send(c, welcome[sent:])    # the rest follows like any queued frame
            if not c.alive:
                return
        self.ready.append(c)
        self._probe = None
        if self.on_arena_mapped is not None:
            self.on_arena_mapped(c.cid, c.seg.arena)
        self._session_line("client %d (pid %d uid %d) ready: mode %s, segment %s, arena %d bytes",
                           c.cid, c.pid, c.uid, mode, c.segment, arena)

    def _session_line(self, fmt: str, *args: Any) -> None:
        """A client's arrival or departure, through the session throttle."""
        held = self._session_log.admit()
        if held is None:
            self.stats["sessions_not_logged"] += 1
            return
        if held:
            fmt += f" ({held} more client arrivals/departures since the last line)"
        log.info(fmt, *args)

    def _fatal(self, c: ClientConn, code: str, message: str) -> None:
        """Tell the client why, then drop it."""
        self.send(c, wire.error(code, message))
        self._flush(c)
        self.drop_client(c, f"{code}: {message}")

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
            if c.close_when_sent and c.seg is None:
                self.drop_client(c, "its answer was sent")

    # -- the ring side ---------------------------------------------------------------
    def poll_rings(self, admit: bool = True) -> int:
        """One round-robin pass over the request rings; returns entries taken.

        Each client gets up to ``quantum`` entries per pass, starting one client later
        each pass, so a busy client cannot starve the others. A client's entries stay
        in its ring (back-pressure) while its completion ring could not take their
        completions or it has ``max_inflight_per_client`` requests running.
        """
        if self._cancels:
            self._cancel_dropped()
        ready = self.ready
        n = len(ready)
        if n == 0:
            return 0
        taken = 0
        start = self._rr = (self._rr + 1) % n
        # A snapshot: a client dropped during the pass leaves ``ready`` at once.
        for c in ready[start:] + ready[:start]:
            # Speed (a trick, labelled): the common case, an empty ring (the client's
            # tail word equals our head), is tested here, without a call per client per
            # loop pass; _poll_client checks a non-empty ring's tail for corruption.
            r = c.reqs
            if c.alive and r.hdr[_REQ_TAIL] != r.head:
                taken += self._poll_client(c, admit)
        return taken

    def ring_probe(self) -> np.ndarray:
        """The addresses of the live clients' request-ring tail words (uint64), for a
        loop that waits in C (``Core.spin``) to notice a push without a pass in Python.
        Valid until ``ready`` changes: rebuilt then, before any mapping goes (a client is
        dropped here first, its segment released later)."""
        probe = self._probe
        if probe is None:
            probe = self._probe = np.array(
                [c.reqs.hdr.ctypes.data + 8 * _REQ_TAIL for c in self.ready if c.alive],
                dtype=np.uint64)
        return probe

    def _poll_client(self, c: ClientConn, admit: bool) -> int:
        reqs, cmps = c.reqs, c.cmps
        try:
            pending = reqs.pending()     # type: ignore[union-attr]
            if not pending:
                return 0
            room = min(self.cfg.layout.cmp_slots - cmps.unread() - len(c.inflight),  # type: ignore[union-attr]
                       self.cfg.max_inflight_per_client - len(c.inflight))
        except rings.RingCorrupt as e:
            self._ring_corrupt(c, e)
            return 0
        k = min(pending, room, self.cfg.quantum)
        for i in range(k):
            if not c.alive:      # dropped by the previous entry (its outbox overflowed):
                return i         # the rest of the batch stays in the ring, unread
            req_id, mo, off, ln = reqs.pop()   # type: ignore[union-attr]
            if admit:
                self._admit(c, req_id, mo & rings.U32, mo >> 32, off, ln & wire.LENGTH_MASK,
                            ln >> wire.PRIORITY_SHIFT)
            else:
                self._reject(c, req_id, rings.E_CANCELLED, "the daemon is shutting down")
        return k

    def _ring_corrupt(self, c: ClientConn, e: rings.RingCorrupt) -> None:
        self._fatal(c, "ring_corrupt", str(e))

    def _admit(self, c: ClientConn, req_id: int, model_id: int, options: int, off: int,
               ln: int, priority: int = 0) -> None:
        """Validate every field of one entry; start the job or complete it with an error."""
        self.stats["requests"] += 1
        shape = shapes.RequestShape.from_options(options)
        if shape is None and options & ~wire.KNOWN_OPTIONS:
            return self._reject(c, req_id, rings.E_OPTIONS,
                                f"unknown option bits {options & ~wire.KNOWN_OPTIONS:#x}")
        model = self.models.by_id.get(model_id)
        if model is None:
            return self._reject(c, req_id, rings.E_MODEL, f"no model with id {model_id}")
        variant, rows, seq_len, slots = 0, 1, 0, None
        if shape is not None:              # rows x length: the daemon's batcher chooses
            try:
                slots, need = shapes.request_layout(model.variants, shape.rows, shape.seq_len)
            except shapes.ShapeError as e:
                return self._reject(c, req_id, rings.E_OPTIONS, f"{model.name}: {e}")
            rows, seq_len, slots = shape.rows, shape.seq_len, tuple(slots)
            what = f"{rows} row(s)" + (f" of length {seq_len}" if seq_len else "")
        else:
            variant = options & wire.VARIANT_MASK
            if variant >= len(model.variants):
                return self._reject(c, req_id, rings.E_OPTIONS,
                                    f"{model.name} has no variant {variant}")
            v = model.variants[variant]
            # The whole variant: its batch size (or its first input's axis 0, for bundles
            # compiled without --batch-sizes), so it is no padding anywhere.
            rows = v.batch or (v.inputs[0].shape[0] if v.inputs and v.inputs[0].shape else 1)
            need, seq_len, what = v.io_bytes, v.seq_len, ""
        arena = c.seg.layout.arena_bytes   # type: ignore[union-attr]
        if off + ln > arena:
            return self._reject(c, req_id, rings.E_RANGE,
                                f"[{off}, {off + ln}) is outside the {arena}-byte arena")
        if ln != need:
            return self._reject(c, req_id, rings.E_LENGTH,
                                f"{model.name} needs {need} io bytes{' for ' + what if what else ''}"
                                f", request has {ln}")
        if req_id in c.inflight:
            return self._reject(c, req_id, rings.E_DUPLICATE,
                                f"request id {req_id} is already in flight")
        c.inflight[req_id] = False
        if not priority:
            priority = c.class_default
        if priority and priority < c.class_highest:
            priority = self._clamp(c, req_id, priority)
        self.class_counts[priority] = self.class_counts.get(priority, 0) + 1
        self.class_inflight[priority] = self.class_inflight.get(priority, 0) + 1
        req = Request(req_id, c.cid, model_id, c.seg.arena[off:off + ln],  # type: ignore[union-attr]
                      variant, self._woken, self._completed, rows=rows, seq_len=seq_len,
                      layout=slots, priority=priority, tenant=c.uid)
        if options & wire.STREAM and shape is None:
            req.on_progress = self._progressed
        self.executor.submit(req)   # type: ignore[union-attr]

    def _clamp(self, c: ClientConn, req_id: int, asked: int) -> int:
        """A request more urgent than its tenant may ask: it runs at the tenant's highest
        class; counted, and logged at most a few lines per interval."""
        self.stats["priority_clamped"] += 1
        if c.clamp_log is None:
            c.clamp_log = LogThrottle(self.cfg.log_interval)
        held = c.clamp_log.admit()
        if held is not None and self._clamp_log.admit() is None:
            held = None
        if held is not None:
            log.warning("client %d (uid %d) request %d asked for priority class %d, above the "
                        "highest its tenant may use (%d, [access] class_highest): clamped%s",
                        c.cid, c.uid, req_id, asked, c.class_highest,
                        f" ({held} more since the last line)" if held else "")
        return c.class_highest

    def _reject(self, c: ClientConn, req_id: int, status: int, reason: str) -> None:
        self.stats["rejected"] += 1
        held = c.reject_log.admit()
        if held is not None and self._reject_log.admit() is None:
            held = None
        if held is None:
            self.stats["rejections_not_logged"] += 1
        else:
            log.info("client %d request %d rejected: %s%s", c.cid, req_id, reason,
                     f" ({held} more rejected since the last line)" if held else "")
        self._finish(c, req_id, False, status, reason)

    # -- executor callbacks -------------------------------------------------------------
    def _woken(self, req: Request) -> None:
        self.almost_finished(req.client_id, req.req_id)

    def _completed(self, req: Request, status: int, error: str | None) -> None:
        req.io = None        # its job may outlive it in a policy's state; the client's memory may not
        n = self.class_inflight.get(req.priority, 0) - 1
        if n > 0:
            self.class_inflight[req.priority] = n
        else:
            self.class_inflight.pop(req.priority, None)
        self.complete(req.client_id, req.req_id, status, error)

    def _progressed(self, req: Request, n: int) -> None:
        """A streaming request has ``n`` outputs valid so far: a progress entry on its
        client's completion ring, only into a slot beyond the ones reserved for the
        completions of the requests in flight. None free (the client does not read its
        ring): skipped and counted; the next progress or the completion covers it."""
        c = self.clients.get(req.client_id)
        if c is None or not c.alive or req.req_id not in c.inflight:
            return
        cmps = c.cmps
        try:
            free = self.cfg.layout.cmp_slots - cmps.unread() - len(c.inflight)  # type: ignore[union-attr]
            if free <= 0:
                self.stats["progress_skipped"] += 1
                return
            cmps.push_progress(req.req_id, n)   # type: ignore[union-attr]
        except rings.RingCorrupt as e:
            self._ring_corrupt(c, e)
            return
        self.stats["progress"] += 1
        if c.mode != "polling":
            self.send(c, wire.encode_id(wire.PROGRESS, req.req_id))

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
        c.answered = True
        # Hybrid clients count one WAKE per completion, so every completion gets one.
        if c.mode == "hybrid" and not woken:
            self.send(c, wire.encode_id(wire.WAKE, req_id))
        if not c.alive:
            return
        try:
            c.cmps.push(req_id, status, reason)   # type: ignore[union-attr]
        except rings.RingCorrupt as e:
            self._ring_corrupt(c, e)
            return
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
        """Forget a client: cancel its jobs, close its socket; its segment goes with
        the mapping, once no job of it is left (:meth:`_release`)."""
        if not c.alive:
            return
        c.alive = False
        self._probe = None
        self.stats["lost"] += 1
        self._session_line("client %d (pid %d) dropped: %s (%d in flight)", c.cid, c.pid, why,
                           len(c.inflight))
        for what, throttle in (("rejected entries", c.reject_log),
                               ("bad messages", c.message_log)):
            if held := throttle.flush():
                log.info("client %d: %d more %s since the last line", c.cid, held, what)
        n = self._per_uid.get(c.uid, 0) - 1
        if n > 0:
            self._per_uid[c.uid] = n
        else:
            self._per_uid.pop(c.uid, None)
        try:
            self.sel.unregister(c.sock)
        except (KeyError, ValueError):
            pass  # never registered or already gone
        _close_gently(c.sock)
        if c in self.ready:
            self.ready.remove(c)
        if c.inflight and self.executor is not None:
            self._cancels.append(c.cid)
        if not c.inflight:
            self._release(c)

    def _cancel_dropped(self) -> None:
        """Cancel the jobs of the clients dropped since the last call.

        Deferred to the loop's own calls (poll_rings, poll_io): a client can be dropped
        inside an executor callback (the WAKE that almost_finished sends fails while the
        dispatcher launches a copy), and cancelling its jobs right there would re-enter
        the executor in the middle of that operation."""
        cids, self._cancels = self._cancels, []
        for cid in cids:
            self.executor.cancel_client(cid)   # type: ignore[union-attr]

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
        self._handshaking.clear()
        self._cancels.clear()
        if self._spare_fd is not None:
            os.close(self._spare_fd)
            self._spare_fd = None
        if self._lock_fd is not None:
            self._unlink_lock()
            os.close(self._lock_fd)
            self._lock_fd = None
        self.sel.close()

    @property
    def inflight(self) -> int:
        return sum(len(c.inflight) for c in self.clients.values())
