"""The daemon fuzzer: hostile tenants against a real daemon, while honest ones check
every answer.

It starts a real daemon (``paella serve`` on the simulated GPU, serving the built-in
``echo`` and ``noop`` models and, unless ``--no-bundle``, a model repository of: the
compiled tiny MLP; ``gpt_tiny``, a tiny GPT the ``orca`` scheduler plug-in generates
from built-in seeded weights; ``lstm`` and ``tree``, a tiny LSTM and TreeLSTM served
by the ``cellular`` plug-in (BatchMaker); and ``gpt_ckpt``, the ``orca`` plug-in serving
a user's GPT-2 safetensors checkpoint on its compiled iteration. The cells and the
compiled iteration are built into the compile cache (``PAELLA_CACHE_DIR``) before the
daemon starts, as the daemon never compiles: up to a minute the first time on a 2-core
machine, then cached) and forks two kinds of processes:

* **attackers** run the episodes of ``paella.fuzz.fuzz_attacks`` (control
  frames, HELLO variants, ring entries and indices, truncated and remapped segments,
  opening other clients' segments, connections that never say HELLO, clients that
  vanish mid-request or never read their socket), against every model the daemon
  welcomes them with; a request to a step model (orca's, cellular's) often carries a
  plausible io (lengths of a few steps), so it is admitted and runs while its client
  scribbles, vanishes or stops reading. Run as root, they drop to another
  uid (``nobody``, 65534) that the daemon is configured to admit (``--allow-user``),
  which is the case the daemon must defend: a tenant that is not the daemon's user.
  Otherwise they run as the same uid as everything else.
* **legitimate clients** (the runner's uid, through the client library, in every
  wait mode) issue requests in small batches and check every answer: echo returns
  its input, the tiny MLP equals its CPU reference, both GPTs' tokens equal
  ``generate_reference``'s (the checkpoint's on the weights read back from its file),
  the LSTM's and TreeLSTM's hidden states (the last, and every step's when asked for;
  sequences and trees of 1 to 16 steps, tree nodes in any order) equal ``run_alone``'s,
  each request computed alone, cell by cell; every request is answered exactly once.
  An answer later than the deadline counts *late* (reported, with each model's slowest
  answer: a CPU-starved daemon on a loaded machine is slow, not wrong); one not come
  after three deadlines counts *lost*. The report counts the answers checked per model
  (``legit_by_model``).

The parent watches the daemon. A crash is the process dying, or no legitimate client
making progress for twice the deadline (the daemon is then aborted, and
``-X faulthandler`` prints where it was stuck). Each crash is classified from the
daemon's log (exception and innermost frame; the root causes already known from
issue 12 are named), the daemon's leftover segments are counted and removed, and a
new daemon takes the same socket. At the end, after every client left, it counts
what the daemon kept: file descriptors (``/proc/PID/fd``), client mappings
(``/proc/PID/maps``) and named segments (``/dev/shm``), against the daemon at READY, and
(``--reload-every S``: SIGHUP with every repository model changed, every S seconds,
throughout) the dispatcher models ``paella status`` reports (and its device memory,
beside READY's).

Run: ``python -m paella.fuzz.fuzz_daemon --seconds 600 [--json F]`` (the long
mode); the test suite runs :func:`run_fuzz` for a few seconds
(``tests/service/test_service_fuzz.py``). The exit status is 1 if any of crashes,
lost or wrong answers, refused legitimate connections, breaches or leaks is non-zero.
"""
from __future__ import annotations

import argparse
import errno
import json
import mmap
import os
import random
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

from paella.client import (NONBLOCK, DaemonGone, DaemonUnavailable, PaellaError, RequestFailed,
                           ResultTimeout, connect)
from paella.fuzz import fuzz_attacks
from paella.child_daemon import await_ready, terminate
from paella.parent_death import end_with_parent

#: The daemon alone (not every ``paella`` sub-command), with a stack dump on fatal
#: signals: a SIGBUS or our SIGABRT of a stuck daemon then says where it was.
DAEMON = (sys.executable, "-X", "faulthandler", "-c",
          "import sys; from paella.dispatcher.daemon import main; sys.exit(main())")
NOBODY = 65534
PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(fuzz_attacks.__file__)))


@dataclass
class FuzzConfig:
    seconds: float = 20.0
    seed: int = 1
    attackers: int = 2
    legit: int = 2
    families: tuple[str, ...] = tuple(fuzz_attacks.FAMILIES)
    #: uid of the attackers: None = 65534 when run as root, else our own uid
    attacker_uid: int | None = None
    #: a legitimate batch must be answered within this many seconds
    deadline: float = 10.0
    bundle: bool = True
    log_level: str = "warning"
    daemon_args: tuple[str, ...] = ()
    settle_seconds: float = 8.0
    #: an attacker runs episodes of one family for this long, then takes the next
    turn_seconds: float = 0.5
    #: the daemon's descriptor limit (None: as inherited), to attack it near EMFILE
    nofile: int | None = None
    #: SIGHUP the daemon this often (seconds; 0: never), each time with every model of
    #: the repository changed (newer mtimes), so every reload replaces them while the attacks
    #: and the honest clients go on; at the end the daemon must hold the dispatcher
    #: models it held at READY (a reload frees what it replaced). Its device memory is
    #: reported beside READY's; the reloaded models' return to it exactly
    #: (tests/service/test_service_bundles.py), the built-in noop's pool keeps the sets
    #: a flood of it made (its per-model budget bounds them)
    reload_seconds: float = 0.0
    #: most connections one "no_hello" episode holds (kept small when attackers share
    #: the legitimate clients' uid: then they are the same tenant, see docs/service.md)
    hog_limit: int | None = None


# --- shared state between the parent and its workers ---------------------------------------
class Board:
    """Counters in an anonymous shared mapping, written by forked workers (which may
    be killed at any time, so nothing is sent at the end: it is already here)."""

    CTL = ("stop_attack", "stop_legit", "daemon_pid", "generation")
    LEGIT = ("requests", "ok", "wrong", "lost_alive", "lost_dead", "refused",
             "refused_own_uid", "connects", "batches", "late")
    LEGIT_T = ("busy_since", "progress")
    #: per legitimate client and model (a :class:`Reference`'s ``slot``)
    BY_MODEL = ("ok", "wrong", "lost", "late")

    def __init__(self, attackers: int, legit: int, families: int, models: int = 0):
        self.nf = families
        n_legit = legit * len(self.LEGIT)
        n_by = legit * models * len(self.BY_MODEL)
        n_int = len(self.CTL) + attackers * (families + 3) + n_legit + n_by
        n_f = legit * len(self.LEGIT_T) + legit * models
        self._mm = mmap.mmap(-1, 8 * (n_int + n_f))
        ints = np.ndarray((n_int,), np.int64, self._mm, 0)
        self.ctl = ints[:len(self.CTL)]
        a0 = len(self.CTL)
        l0 = a0 + attackers * (families + 3)
        self.attack = ints[a0:l0].reshape(attackers, families + 3)
        self.legit = ints[l0:l0 + n_legit].reshape(legit, len(self.LEGIT))
        self.by_model = ints[l0 + n_legit:].reshape(legit, models, len(self.BY_MODEL))
        self.legit_t = np.ndarray((legit, len(self.LEGIT_T)), np.float64, self._mm, 8 * n_int)
        #: per legitimate client and model: its slowest answer (seconds from predict)
        self.slowest = np.ndarray((legit, models), np.float64, self._mm,
                                  8 * (n_int + legit * len(self.LEGIT_T)))

    def get(self, name: str) -> int:
        return int(self.ctl[self.CTL.index(name)])

    def set(self, name: str, value: int) -> None:
        self.ctl[self.CTL.index(name)] = value

    def bump(self, i: int, name: str, n: int = 1) -> None:
        self.legit[i, self.LEGIT.index(name)] += n

    def bump_model(self, i: int, slot: int, name: str, n: int = 1) -> None:
        self.by_model[i, slot, self.BY_MODEL.index(name)] += n

    def legit_total(self, name: str) -> int:
        return int(self.legit[:, self.LEGIT.index(name)].sum())

    def model_total(self, slot: int, name: str) -> int:
        return int(self.by_model[:, slot, self.BY_MODEL.index(name)].sum())


class Events:
    """One append-only JSON-lines file per worker, opened before the fork (an attacker
    that dropped its privileges can still write it)."""

    def __init__(self, path: str):
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def write(self, kind: str, **data) -> None:
        line = json.dumps({"kind": kind, "t": time.time(), **data}, default=str)[:4000]
        try:
            os.write(self.fd, line.encode() + b"\n")
        except OSError:
            pass  # a full disk must not kill a worker

    def read(self) -> list[dict]:
        with open(self.path) as f:
            return [json.loads(x) for x in f if x.strip()]


# --- the daemon under test -------------------------------------------------------------------
class DaemonUnderTest:
    """A real daemon on a fixed socket; restarted on the same path after a crash."""

    def __init__(self, workdir: str, args: tuple[str, ...], nofile: int | None = None):
        self.dir = os.path.join(workdir, "sock")
        os.mkdir(self.dir)
        os.chmod(self.dir, 0o755)              # reachable by an attacker of another uid
        self.socket = os.path.join(self.dir, "p.sock")
        self.log_path = os.path.join(workdir, "daemon.log")
        self.args = args
        self.nofile = nofile
        self.proc = None
        self.log_from = 0
        self.log_bytes = 0                     # written by every incarnation
        self.starts = 0

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _notify_path(self, start: int) -> str:
        """The NOTIFY_SOCKET of the ``start``-th incarnation (sd_notify's READY=1)."""
        return os.path.join(self.dir, f"notify.{start}")

    def _ready(self, notify_path: str, timeout: float, act: Callable[[], None]) -> bool:
        """Listen on ``notify_path``, ``act()``, then wait for READY=1 while the daemon
        lives; False if it exited or ``timeout`` passed first."""
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(notify_path)
        notify.settimeout(0.2)
        try:
            act()
            return await_ready(notify, self.alive, timeout)
        finally:
            notify.close()
            os.unlink(notify_path)

    def start(self, timeout: float = 60.0) -> None:
        notify_path = self._notify_path(self.starts)
        if not self._ready(notify_path, timeout, lambda: self._spawn(notify_path)):
            if self.proc.poll() is not None:
                raise RuntimeError(f"the daemon exited with {self.proc.returncode} at "
                                   f"start:\n{self.log_text()[-3000:]}")
            self.proc.kill()
            raise RuntimeError(f"the daemon was not ready after {timeout} s")
        if self.nofile:                      # after start-up, which may open many files
            resource.prlimit(self.pid, resource.RLIMIT_NOFILE, (self.nofile, self.nofile))

    def _spawn(self, notify_path: str) -> None:
        self.rotate_log(force=True)
        self.log_from = os.path.getsize(self.log_path) if os.path.exists(self.log_path) else 0
        logf = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            self.proc = subprocess.Popen(
                [*DAEMON, "--socket", self.socket, *self.args], stdout=logf, stderr=logf,
                stdin=subprocess.DEVNULL, close_fds=True,
                env=dict(os.environ, NOTIFY_SOCKET=notify_path), preexec_fn=end_with_parent())
        finally:
            os.close(logf)
        self.starts += 1

    def reload(self, timeout: float = 60.0) -> bool:
        """SIGHUP, and wait for the READY=1 that follows the swap (on this incarnation's
        notify path, listened on again); False if none came within ``timeout``."""
        return self._ready(self._notify_path(self.starts - 1), timeout,
                           lambda: os.kill(self.pid, signal.SIGHUP))

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_text(self) -> str:
        """What this incarnation wrote (since its start or the last rotation)."""
        with open(self.log_path, "rb") as f:
            f.seek(self.log_from)
            return f.read().decode("utf-8", "replace")

    def rotate_log(self, force: bool = False, limit: int = 64 << 20) -> None:
        """Keep the log small in long runs (a flood of rejected entries writes a lot):
        count what was written, then empty the file (the daemon appends, O_APPEND)."""
        try:
            size = os.path.getsize(self.log_path)
        except FileNotFoundError:
            return
        if force or size > limit:
            self.log_bytes += size - min(self.log_from, size)
            if size > limit:
                os.truncate(self.log_path, 0)
                size = 0
            self.log_from = size

    def stop(self, timeout: float = 30.0) -> int | None:
        return None if self.proc is None else terminate(self.proc, timeout)


# --- what the daemon holds -------------------------------------------------------------------
@dataclass
class Holdings:
    fds: int
    client_maps: int
    segments: int
    fd_targets: list[str] = field(default_factory=list)
    map_lines: list[str] = field(default_factory=list)
    segment_names: list[str] = field(default_factory=list)


def _is_client_map(line: str) -> bool:
    return ("/dev/shm/" in line or "/memfd:" in line) and not _is_own_state(line)


def _is_own_state(name: str) -> bool:
    """A segment of the daemon's own functional state, not a client's: a generative
    model's KV cache, which its effect workers map (``.kv.``; one per served orca model,
    replaced by each reload)."""
    return ".kv." in name


def segment_names(pid: int) -> list[str]:
    """/dev/shm names that belong to daemon ``pid``: its pid is one of the dot-, dash-
    or underscore-separated parts of a name that mentions paella."""
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return []
    return sorted(n for n in names if "paella" in n and str(pid) in re.split(r"[._-]", n)
                  and not _is_own_state(n))


def holdings(pid: int) -> Holdings:
    fd_dir = f"/proc/{pid}/fd"
    targets = []
    for n in os.listdir(fd_dir):
        try:
            targets.append(os.readlink(os.path.join(fd_dir, n)))
        except OSError:
            pass  # closed meanwhile
    with open(f"/proc/{pid}/maps") as f:
        maps = [ln.strip() for ln in f if _is_client_map(ln)]
    names = segment_names(pid)
    return Holdings(len(targets), len(maps), len(names), sorted(targets), maps, names)


# --- crashes -------------------------------------------------------------------------------------
#: Root causes already known from issue 12, recognised by the exception and the
#: daemon's frames (hints for the reader; anything else is reported as new).
KNOWN_CAUSES = [
    ("issue 12 item 1: SIGBUS on a truncated client segment",
     lambda exc, funcs: "Bus error" in exc),
    ("issue 12 item 2: poll_rings indexes a client list that shrank",
     lambda exc, funcs: exc.startswith("IndexError") and "poll_rings" in funcs),
    ("issue 12 item 3: completion-ring check raised inside complete()",
     lambda exc, funcs: "RingCorrupt" in exc and "complete" in funcs),
    ("issue 12 item 4: client dropped mid-batch, next entry uses its released segment",
     lambda exc, funcs: "NoneType" in exc and bool({"_admit", "_finish"} & set(funcs))),
    ("issue 12 item 5: deeply nested JSON (RecursionError)",
     lambda exc, funcs: exc.startswith("RecursionError")),
    ("issue 12 item 6: HELLO field of the wrong type (arena_bytes: true)",
     lambda exc, funcs: "_hello" in funcs and exc.startswith("TypeError")),
]

_PY_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+),? in (\S+)')


@dataclass
class Crash:
    signature: str
    cause: str              # a known root cause, or "new"
    how: str                # "died (status N)" or "unresponsive"
    at: float               # seconds into the run
    families: list[str]     # what the attackers were doing
    leftover_segments: int  # named segments the dead daemon left in /dev/shm
    log_tail: str


def classify(log: str, how: str) -> tuple[str, str, str]:
    """(signature, cause, tail) of a dead daemon from what it last wrote.

    A Python traceback gives its exception line; a fatal signal, faulthandler's
    "Fatal Python error: ...". The innermost frame of the project names the place."""
    lines = log.splitlines()
    start = max((i for i, ln in enumerate(lines) if ln.startswith("Traceback (most recent call")
                 or ln.startswith("Fatal Python error")), default=None)
    if start is None:
        tail = "\n".join(lines[-15:])
        return f"{how}, nothing in the log", "new", tail
    block = lines[start:start + 400]
    frames = [m.groups() for m in (_PY_FRAME.match(ln) for ln in block) if m]
    if block[0].startswith("Fatal Python error"):
        exc = block[0].split(":", 1)[1].strip()
        frames = frames[::-1]                        # faulthandler: most recent first
        stack_end = next((i for i, ln in enumerate(block[1:], 1) if not ln.strip()), len(block))
        tail_lines = block[:max(stack_end, 12)][:40]
    else:
        exc = next((ln for ln in reversed(block) if ln and not ln[0].isspace()
                    and not ln.startswith(("Traceback", "During handling", "The above"))),
                   "?")
        tail_lines = block[-40:]
    ours = [f for f in frames if f[0].startswith(PROJECT)] or frames
    funcs = [f[2] for f in frames]
    where = ours[-1] if ours else ("?", "?", "?")
    if how == "unresponsive":
        exc = "unresponsive"
    signature = f"{exc.split(':')[0] if how != 'unresponsive' else exc} in {where[2]} " \
                f"({os.path.basename(where[0])}:{where[1]})"
    if how != "unresponsive" and ":" in exc:     # numbers vary between inputs: not the cause
        signature += ": " + re.sub(r"\d+", "N", exc.split(":", 1)[1].strip())[:80]
    cause = next((name for name, match in KNOWN_CAUSES if match(exc, funcs)), "new")
    return signature, cause, "\n".join(tail_lines)


# --- legitimate clients ----------------------------------------------------------------------
#: An answer not come after this many deadlines is lost (one after the deadline is late).
LOST_AFTER = 3


class _Timeout(Exception):
    """The legitimate client's deadline passed (raised from SIGALRM)."""


def _alarm(signum, frame):
    raise _Timeout()


@dataclass
class Reference:
    """One model a legitimate client uses, and how to check its answer."""
    name: str
    pairs: list[tuple[np.ndarray, np.ndarray]]   # (input, expected output); empty: status only
    rtol: float = 0.0
    #: A generative model (orca): pairs are ((prompt, max_tokens), tokens).
    generative: bool = False
    #: A cell model (cellular): pairs are (``cell_request``'s arguments, the answer
    #: ``run_alone`` computed: ``h``, and ``steps`` when ``per_step`` was asked).
    cells: bool = False
    #: Inputs taken in turn, not at random: each is new to the daemon until the list
    #: wraps, so its answer is computed (by the effect workers) while others are served.
    fresh: bool = False
    cursor: int = 0
    #: its index in the run's references (the board counts its answers there)
    slot: int = 0

    @property
    def label(self) -> str:
        return self.name + (" (fresh)" if self.fresh else "")


def legit_worker(board: Board, idx: int, sock: str, cfg: FuzzConfig, refs: list[Reference],
                 ev: Events) -> None:
    """Batches of 1-8 requests on one connection, reconnecting now and then. Every
    answer is checked; every outcome is counted on the board."""
    signal.signal(signal.SIGALRM, _alarm)
    rng = random.Random(f"legit-{cfg.seed}-{idx}")
    for ref in refs:                 # (each client starts its fresh inputs elsewhere)
        ref.cursor = idx * len(ref.pairs) // max(1, cfg.legit)
    mode = ("hybrid", "polling", "socket")[idx % 3]
    t = board.legit_t[idx]
    t[1] = time.time()
    while not board.get("stop_legit"):
        c = _legit_connect(board, idx, sock, mode, cfg, ev)
        if c is None:
            continue
        try:
            for _ in range(rng.randint(3, 30)):
                if board.get("stop_legit"):
                    break
                _legit_batch(board, idx, c, rng, refs, cfg, ev)
        except _Abandoned:
            pass  # counted; reconnect
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            t[0] = 0.0
            try:
                c.close()
            except Exception:  # noqa: BLE001 - a half-torn client after a timeout
                pass


def refusal_kind(message: str, shared_uid: bool) -> str:
    """How a legitimate client's refused connection counts: ``"refused_own_uid"`` when
    the attackers share its uid and the daemon refused it for that uid's connection or
    descriptor budget (one tenant's budget, which its own hostile processes spent: the
    documented same-uid limit, docs/service.md, not a failure); ``"refused"`` (a denial of
    service, a failure) otherwise."""
    if shared_uid and f"uid {os.geteuid()} already has" in message:
        return "refused_own_uid"
    return "refused"


def _legit_connect(board, idx, sock, mode, cfg, ev):
    """Connect, retrying while the daemon restarts. A refusal (an ERROR such as
    too_many_clients from a live daemon) counts at once, and so does a daemon that
    stays up but does not take us within the deadline: both deny service."""
    t = board.legit_t[idx]
    first = time.monotonic()
    gen = board.get("generation")
    last = ""
    t[0] = time.time()
    while not board.get("stop_legit"):
        try:
            c = connect(sock, mode=mode, arena_bytes=1 << 20, timeout=min(5.0, cfg.deadline))
            board.bump(idx, "connects")
            t[1] = time.time()
            return c
        except DaemonUnavailable as e:
            last = str(e)
            if "refused the connection" in last and not _daemon_died(board, gen, wait=0):
                kind = refusal_kind(last, cfg.attacker_uid == os.geteuid())
                board.bump(idx, kind)
                ev.write(kind, client=idx, message=last)
                first = time.monotonic()
        if board.get("generation") != gen:            # the daemon crashed meanwhile
            first, gen = time.monotonic(), board.get("generation")
        if time.monotonic() - first > cfg.deadline:
            kind = refusal_kind(last, cfg.attacker_uid == os.geteuid())
            board.bump(idx, kind)
            ev.write(kind, client=idx, message=last)
            first = time.monotonic()
        time.sleep(0.05)
    t[0] = 0.0
    return None


def _legit_batch(board, idx, c, rng, refs, cfg, ev) -> None:
    """One batch: every answer checked; one after the deadline counts late, one not come
    after :data:`LOST_AFTER` deadlines counts lost (a late answer is a slow daemon, e.g.
    CPU-starved on a loaded 2-core machine; a lost one breaks exactly-once)."""
    t = board.legit_t[idx]
    gen = board.get("generation")
    pending: dict[int, tuple[Reference, int, np.ndarray | None, float]] = {}
    t[0] = time.time()
    start = time.monotonic()
    on_time, give_up = start + cfg.deadline, start + LOST_AFTER * cfg.deadline
    # (a backstop for a blocked predict; waiting for answers uses read_result's timeout,
    # which an alarm could interrupt half-way through a frame)
    signal.setitimer(signal.ITIMER_REAL, LOST_AFTER * cfg.deadline + 1.0)
    noted = False
    try:
        for _ in range(rng.randint(1, 8)):
            ref = rng.choice(refs)
            pending.update(_legit_submit(c, ref, rng))
            board.bump(idx, "requests")
        while pending:
            now = time.monotonic()
            try:
                rid = c.read_result(timeout=max(0.0, (on_time if now < on_time else give_up) - now))
                status, reason = 0, ""
            except RequestFailed as e:
                rid, status, reason = e.req_id, e.status, e.reason
            except ResultTimeout:
                if time.monotonic() >= give_up:
                    raise
                if not noted:
                    noted = True
                    ev.write("late", client=idx, n=len(pending), mode=c.mode,
                             models=sorted({r.name for r, *_ in pending.values()}))
                continue
            got = pending.pop(rid, None)
            if got is None:
                board.bump(idx, "wrong")
                ev.write("wrong", client=idx, why=f"completion for request {rid}, not in flight")
                continue
            ref, off, expected, t_sent = got
            took = time.monotonic() - t_sent
            board.slowest[idx, ref.slot] = max(board.slowest[idx, ref.slot], took)
            if took > cfg.deadline:
                board.bump(idx, "late")
                board.bump_model(idx, ref.slot, "late")
            why = _check(c, ref, off, expected, status, reason)
            c.free(off)
            if why:
                board.bump(idx, "wrong")
                board.bump_model(idx, ref.slot, "wrong")
                ev.write("wrong", client=idx, model=ref.name, why=why)
            else:
                board.bump(idx, "ok")
                board.bump_model(idx, ref.slot, "ok")
            t[1] = time.time()
        signal.setitimer(signal.ITIMER_REAL, 0)
        try:
            extra = c.read_result(NONBLOCK)
        except RequestFailed as e:
            extra = e.req_id
        if extra != -errno.EAGAIN:                  # an answer nobody asked for
            board.bump(idx, "wrong")
            ev.write("wrong", client=idx, why=f"completion for request {extra} beyond the "
                                              f"batch (answered twice?)")
        board.bump(idx, "batches")
    except (_Timeout, DaemonGone, PaellaError, OSError) as e:
        signal.setitimer(signal.ITIMER_REAL, 0)
        dead = _daemon_died(board, gen)
        if pending:
            board.bump(idx, "lost_dead" if dead else "lost_alive", len(pending))
            for ref, *_ in pending.values():
                board.bump_model(idx, ref.slot, "lost")
            if not dead:
                ev.write("lost", client=idx, n=len(pending), mode=c.mode,
                         why=f"{type(e).__name__}: {e}")
        raise _Abandoned() from None
    finally:
        t[0] = 0.0


def _legit_submit(c, ref: Reference, rng) -> dict:
    m = c.models[ref.name]
    v = m.variants[0]
    off = c.alloc(v.io_bytes)
    ins, outs = c.io_views(ref.name, off)
    if ref.name == "echo":
        x = np.asarray([rng.uniform(-1e6, 1e6) for _ in range(8)] * 32, np.float32)
        expected = x
    elif ref.fresh:
        x, expected = ref.pairs[ref.cursor % len(ref.pairs)]
        ref.cursor += 1
    elif ref.pairs:
        x, expected = rng.choice(ref.pairs)
    else:
        x, expected = np.frombuffer(rng.randbytes(v.inputs[0].nbytes), np.uint8), None
    if ref.generative:                                # prompt + lengths in, tokens out
        prompt, max_tokens = x
        ins["prompt"][...] = 0
        ins["prompt"][:len(prompt)] = prompt
        ins["lengths"][...] = (len(prompt), max_tokens)
    elif ref.cells:                                   # a sequence or a tree, padded
        from paella.stepsched.cellular_plugin import cell_request
        for k, a in cell_request(v, **x).items():
            ins[k][...] = a
    else:
        (name,) = ins
        ins[name][...] = x.reshape(ins[name].shape)
    for o in outs.values():
        o.view(np.uint8)[...] = 0xA5                  # a stale answer cannot pass
    return {c.predict(ref.name, v.io_bytes, off): (ref, off, expected, time.monotonic())}


def _check(c, ref: Reference, off: int, expected, status: int, reason: str) -> str:
    if status:
        return f"status {status} ({reason}) for a valid request"
    if expected is None:
        return ""
    _, outs = c.io_views(ref.name, off)
    if ref.generative:
        n = int(outs["n_tokens"][0])
        got = outs["tokens"][:n].tolist()
        return "" if got == list(expected) else f"tokens {got} differ from the reference {list(expected)}"
    if ref.cells:
        return _check_cells(outs, expected)
    (out,) = outs.values()
    if ref.rtol:
        ok = np.allclose(out, expected.reshape(out.shape), rtol=ref.rtol, atol=ref.rtol)
    else:
        ok = np.array_equal(out, expected.reshape(out.shape))
    return "" if ok else f"output differs from the reference (first {out.ravel()[:4]})"


def _check_cells(outs: dict, want: dict) -> str:
    """A cell model's answer against ``run_alone``'s (the tolerance of
    tests/service/test_cellular_service.py): the last (root's) hidden state, and every
    step's row when they were asked for (``n_steps`` rows; none otherwise)."""
    n_steps = int(outs["n_steps"][0])
    if not np.allclose(outs["h"], want["h"], rtol=1e-5, atol=1e-6):
        return f"h differs from the reference (first {outs['h'][:4]}, want {want['h'][:4]})"
    n = len(want["steps"]) if want["per_step"] else 0
    if n_steps != n:
        return f"n_steps {n_steps}, want {n}"
    if n and not np.allclose(outs["steps"][:n], want["steps"], rtol=1e-5, atol=1e-6):
        return f"steps differ from the reference over the {n} rows"
    return ""


class _Abandoned(Exception):
    """The batch cannot finish on this connection (counted); reconnect."""


def _daemon_died(board: Board, gen: int, wait: float = 2.0) -> bool:
    """Did the daemon of generation ``gen`` die? A dead daemon stays a zombie until the
    parent notices, so look at its state, and give the parent a moment."""
    end = time.monotonic() + wait
    while True:
        if board.get("generation") != gen:
            return True
        try:
            with open(f"/proc/{board.get('daemon_pid')}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return True
        except OSError:
            return True
        if time.monotonic() > end:
            return False
        time.sleep(0.05)


# --- attackers -------------------------------------------------------------------------------
def attacker_worker(board: Board, idx: int, sock: str, cfg: FuzzConfig, uid: int,
                    victims: tuple[int, ...], ev: Events) -> None:
    """Episodes of every family in turn, as ``uid``, until told to stop. It keeps no
    descriptor of ours (only its events file): what it can reach, it reached itself."""
    cross = uid != os.geteuid()          # the daemon runs as our uid
    os.closerange(3, ev.fd)
    os.closerange(ev.fd + 1, 1 << 16)
    if cross:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    names = list(cfg.families)           # one order for all, each attacker at its own
    random.Random(cfg.seed).shuffle(names)    # place in it: a short run covers them all
    all_names = list(fuzz_attacks.FAMILIES)
    rng = random.Random(f"attack-{cfg.seed}-{idx}")
    row = board.attack[idx]
    ctx = fuzz_attacks.Context(
        socket=sock, daemon_pid=lambda: board.get("daemon_pid"), victims=victims,
        cross_uid=cross, stop=lambda: bool(board.get("stop_attack")),
        breach=lambda what: ev.write("breach", attacker=idx, what=what),
        hog_limit=cfg.hog_limit or 300, rng=rng)
    k = idx * len(names) // max(1, cfg.attackers)
    while not board.get("stop_attack"):
        name = names[k % len(names)]
        k += 1
        f = all_names.index(name)
        row[board.nf] = f + 1
        turn_end = time.monotonic() + cfg.turn_seconds
        while time.monotonic() < turn_end and not board.get("stop_attack"):
            try:
                row[f] += fuzz_attacks.FAMILIES[name](ctx)
            except Exception as e:  # noqa: BLE001 - a fuzzer bug must not stop the others
                row[board.nf + 2] += 1
                ev.write("attacker_error", family=name, error=f"{type(e).__name__}: {e}",
                         where=traceback.format_exc()[-1500:])
            row[board.nf + 1] += 1
        row[board.nf] = 0


def _fork(target, *args) -> int:
    """Run ``target(*args)`` in a child that never returns into the caller."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            target(*args)
        except BaseException:  # noqa: BLE001 - report, then leave without unwinding
            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    return pid


def _stop_children(pids: list[int], timeout: float) -> int:
    """Wait for children, killing those that do not end within ``timeout``; returns how
    many had to be killed."""
    end = time.monotonic() + timeout
    killed = 0
    for pid in pids:
        while True:
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                break
            if done:
                break
            if time.monotonic() > end:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                killed += 1
                break
            time.sleep(0.02)
    return killed


# --- the run ---------------------------------------------------------------------------------
#: The cell models the legitimate clients use (served by the ``cellular`` plug-in, tiny:
#: hidden 16): folder name -> cell model. At the plug-in's default batch sizes and seed,
#: so the compile cache holds their cells once any of the cellular tests built them.
CELL_MODELS = {"lstm": "lstm", "tree": "treelstm"}
#: Their longest sequence and largest tree (the legitimate ones vary from 1 to this).
CELL_MAX_LEN = 16
#: The user's checkpoint the ``orca`` plug-in loads (a GPT-2-family safetensors file
#: written from seeded weights): its model and options. The model, weights and options
#: of the test suite's compiled-iteration tests (tests/stepsched/test_compiled_orca.py,
#: tests/service/test_generation_checkpoint.py), so the compile cache holds its 14
#: variants ((tokens, slots) up to (16, 16)) once any of them built it (about 4 s a
#: variant on a cold cache, then cached by content). The legitimate generations' prompt
#: and tokens fit in them (a larger one is refused); concurrent ones wait for slots.
CKPT_MODEL = dict(vocab=64, d=32, n_layer=2, n_head=2, n_ctx=16)
CKPT_SEED = 7
CKPT_OPTIONS = {"n_head": 2, "max_bs": 2, "n_slots": 16}


def _references(cfg: FuzzConfig, workdir: str, say: Callable[[str], None] = lambda m: None
                ) -> tuple[list[Reference], tuple[str, ...]]:
    refs = [Reference("echo", []), Reference("noop", [])]
    if not cfg.bundle:
        return refs, ()
    from paella.bundle import load_bundle
    from paella.compiler_pass.build import compile_bundle
    from paella.models.tiny import tiny_mlp
    repo = os.path.join(workdir, "models")
    os.mkdir(repo)
    compile_bundle(tiny_mlp(), os.path.join(repo, "tiny_mlp"))
    b = load_bundle(os.path.join(repo, "tiny_mlp"))
    rng = np.random.default_rng(cfg.seed)
    pairs = []
    for _ in range(16):
        x = rng.standard_normal((2, 16)).astype(np.float32)
        pairs.append((x, b.run_cpu({"x": x})["output0"]))
    refs.append(Reference("tiny_mlp", pairs, rtol=1e-5))
    # Never-seen inputs among the legitimate traffic (issue 37): computed off the loop.
    fresh = []
    for _ in range(256):
        x = rng.standard_normal((2, 16)).astype(np.float32)
        fresh.append((x, b.run_cpu({"x": x})["output0"]))
    refs.append(Reference("tiny_mlp", fresh, rtol=1e-5, fresh=True))
    # A generative model served by the orca scheduler plug-in (a config.toml-only folder):
    # attackers reach it like any model id, and the honest clients check its tokens.
    from paella.models.gpt import GPTConfig, generate_reference, gpt_weights
    os.mkdir(os.path.join(repo, "gpt_tiny"))
    with open(os.path.join(repo, "gpt_tiny", "config.toml"), "w") as f:
        f.write('[batching]\nbatcher = "orca"\nconfig = "tiny"\n')
    gcfg = GPTConfig.tiny()
    w = gpt_weights(gcfg)
    gen = []
    for _ in range(6):
        prompt = [int(t) for t in rng.integers(0, gcfg.vocab, int(rng.integers(1, 9)))]
        n = int(rng.integers(1, 9))
        gen.append(((prompt, n), generate_reference(gcfg, w, prompt, n)))
    refs.append(Reference("gpt_tiny", gen, generative=True))
    ckpt = _checkpoint_start(repo, say)         # (its compiled iteration builds meanwhile)
    try:
        refs += _cell_references(repo, os.path.join(workdir, "cells"), rng, say)
    except BaseException:
        if ckpt is not None and ckpt[1] is not None:
            ckpt[1].kill()
            ckpt[1].wait()
        raise
    refs += _checkpoint_reference(ckpt, rng)
    return refs, ("--models", repo)


def _cell_references(repo: str, bundle_dir: str, rng, say) -> list[Reference]:
    """Cell models served by the ``cellular`` plug-in (docs/step-scheduler.md, "Serving
    cell models from the daemon"): an LSTM and a TreeLSTM, their cells compiled first
    (the daemon never compiles; the compile cache serves it), with sequences and trees
    of 1 to :data:`CELL_MAX_LEN` steps checked against each request computed alone,
    cell by cell (``run_alone``, as tests/service/test_cellular_service.py checks them)."""
    from paella.models import rnn
    from paella.stepsched.cell_engine import run_alone
    from paella.stepsched.cellular_plugin import compile_cells
    from paella.stepsched.graph import random_binary_tree
    ccfg = rnn.RNNConfig.tiny()
    refs = []
    for name, kind in CELL_MODELS.items():
        say(f"compiling the {kind} cells (cached after the first time)")
        compile_cells(kind, ccfg, (1, 2, 4, 8), bundle_dir=bundle_dir)
        os.mkdir(os.path.join(repo, name))
        with open(os.path.join(repo, name, "config.toml"), "w") as f:
            f.write(f'[batching]\nbatcher = "cellular"\nmodel = "{kind}"\nconfig = "tiny"\n'
                    f'max_len = {CELL_MAX_LEN}\nbundle_dir = "{bundle_dir}"\n')
        pairs = []
        for k in range(12):
            n = 1 + k * (CELL_MAX_LEN - 1) // 11                    # 1 .. CELL_MAX_LEN
            xs = rng.standard_normal((n, ccfg.hidden)).astype(np.float32)
            args = {"xs": xs, "per_step": bool(k % 2)}
            if kind == "treelstm":
                args["parents"] = random_binary_tree(rng, n)        # node 0 the root
                if k % 3:                        # nodes in any order (children first too)
                    args["xs"], args["parents"] = _renumber(xs, args["parents"],
                                                            rng.permutation(n))
            want = run_alone(kind, ccfg, xs=args["xs"], parents=args.get("parents"))
            pairs.append((args, {"h": want["h"], "steps": want["steps"],
                                 "per_step": args["per_step"]}))
        refs.append(Reference(name, pairs, cells=True))
    return refs


def _renumber(xs: np.ndarray, parents: list[int],
              order: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """The same tree with its nodes renumbered: node ``order[i]`` becomes node ``i``
    (so children may come before their parents)."""
    new_of = {int(old): i for i, old in enumerate(order)}
    return (xs[order], [-1 if parents[int(old)] < 0 else new_of[parents[int(old)]]
                        for old in order])


def _checkpoint_start(repo: str, say) -> tuple[str, subprocess.Popen | None] | None:
    """The ``orca`` plug-in serving a user's checkpoint on its compiled iteration
    (docs/step-scheduler.md; tests/service/test_generation_checkpoint.py): a GPT-2
    safetensors file written from seeded weights, and its compiled iteration in the
    compile cache before the daemon starts (the daemon never compiles). Not cached yet,
    ``python -m paella.stepsched.compiled_iteration FOLDER`` builds it in the background
    while the cells are compiled; :func:`_checkpoint_reference` waits for it. Returns
    (the folder, that build or None); None without safetensors (an optional dependency)."""
    try:
        from safetensors.numpy import save_file
    except ImportError:
        say("safetensors is not installed: no checkpoint model")
        return None
    from paella.models.gpt import GPTConfig, gpt_weights
    from paella.models.gpt_checkpoint import gpt2_names
    from paella.stepsched.compiled_iteration import CompiledIteration, NotBuilt
    mcfg = GPTConfig(**CKPT_MODEL)
    folder = os.path.join(repo, "gpt_ckpt")
    os.mkdir(folder)
    names = gpt2_names(mcfg)
    w = gpt_weights(mcfg, CKPT_SEED)
    save_file({names[k]: np.array(v) for k, v in w.items()},
              os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.toml"), "w") as f:
        f.write('[batching]\nbatcher = "orca"\ncheckpoint = "model.safetensors"\n'
                + "".join(f"{k} = {v}\n" for k, v in CKPT_OPTIONS.items()))
    try:                                    # what the daemon's plug-in will do
        CompiledIteration(mcfg, w, build=False, max_slots=CKPT_OPTIONS["n_slots"],
                          max_tokens=CKPT_OPTIONS["max_bs"] * mcfg.n_ctx).close()
        return folder, None
    except NotBuilt:
        say("building the checkpoint's compiled iteration in the background (14 variants, "
            "about 4 s each; then cached)")
        return folder, subprocess.Popen(
            [sys.executable, "-m", "paella.stepsched.compiled_iteration", folder],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _checkpoint_reference(started, rng) -> list[Reference]:
    """Generations of the checkpoint's model checked against ``generate_reference`` on
    the weights read back from its file (once its compiled iteration is built)."""
    if started is None:
        return []
    folder, build = started
    if build is not None:
        out, _ = build.communicate()
        if build.returncode:
            raise RuntimeError(f"building the compiled iteration of {folder} failed "
                               f"({build.returncode}):\n{out.decode(errors='replace')[-3000:]}")
    from paella.models.gpt import generate_reference
    from paella.models.gpt_checkpoint import load_checkpoint
    ccfg, w = load_checkpoint(os.path.join(folder, "model.safetensors"), CKPT_OPTIONS["n_head"])
    room = min(ccfg.n_ctx, CKPT_OPTIONS["n_slots"])
    gen = []
    for _ in range(8):
        p = int(rng.integers(1, room))
        prompt = [int(t) for t in rng.integers(0, ccfg.vocab, p)]
        n = int(rng.integers(1, room - p + 1))
        gen.append(((prompt, n), generate_reference(ccfg, w, prompt, n)))
    return [Reference("gpt_ckpt", gen, generative=True)]


def run_fuzz(cfg: FuzzConfig, progress=None) -> dict:
    """Run the fuzzer; returns the report (its "summary" holds the counts; any of
    :data:`FAILURES` non-zero fails the run)."""
    say = progress or (lambda msg: None)
    uid = cfg.attacker_uid
    if uid is None:
        uid = NOBODY if os.geteuid() == 0 else os.geteuid()
    if uid != os.geteuid() and os.geteuid() != 0:
        raise ValueError("attackers can run as another uid only when the fuzzer runs as root")
    cross = uid != os.geteuid()
    cfg.attacker_uid = uid                     # (resolved: the workers read it)
    if cfg.hog_limit is None:
        cfg.hog_limit = 300 if cross else 8
    workdir = tempfile.mkdtemp(prefix="plfuzz")
    os.chmod(workdir, 0o711)                   # the attackers reach the socket below it
    refs, model_args = _references(cfg, workdir, say)
    for i, ref in enumerate(refs):
        ref.slot = i
    args = ("--cpu", "none", "--rt-priority", "0", "--log-level", cfg.log_level, *model_args,
            *(("--allow-user", str(uid)) if cross else ()), *cfg.daemon_args)
    daemon = DaemonUnderTest(workdir, args, cfg.nofile)
    daemon.start()
    base = holdings(daemon.pid)              # (before any client: the leak check's baseline)
    # The honest clients send to the models the daemon serves (in `--sim-mode process`
    # the step plug-ins' models are refused at load, by design): the others are reported.
    with connect(daemon.socket, timeout=5) as c:
        served = set(c.models)
    not_served = sorted({r.name for r in refs} - served)
    if not_served:
        say(f"not served by this daemon (see its log): {', '.join(not_served)}")
    legit_refs = [r for r in refs if r.name in served]
    held_at_ready = _held(daemon.socket)
    reloads = 0
    next_reload = time.monotonic() + cfg.reload_seconds
    board = Board(cfg.attackers, cfg.legit, len(fuzz_attacks.FAMILIES), len(refs))
    board.set("daemon_pid", daemon.pid)
    t0 = time.monotonic()
    crashes: list[Crash] = []
    legit_pids, attack_pids = [], []
    legit_ev = [Events(os.path.join(workdir, f"legit.{i}.jsonl")) for i in range(cfg.legit)]
    attack_ev = [Events(os.path.join(workdir, f"attack.{i}.jsonl")) for i in range(cfg.attackers)]
    respawned = 0

    def spawn_attacker(i: int) -> int:
        return _fork(attacker_worker, board, i, daemon.socket, cfg, uid, tuple(legit_pids),
                     attack_ev[i])

    def crashed(how: str) -> None:
        sig, cause, tail = classify(daemon.log_text(), how)
        families = sorted({list(fuzz_attacks.FAMILIES)[int(f) - 1]
                           for f in board.attack[:, board.nf] if f})
        left = segment_names(daemon.pid)
        for n in left:
            try:
                os.unlink(os.path.join("/dev/shm", n))
            except OSError:
                pass  # gone already
        crashes.append(Crash(sig, cause, how if how == "unresponsive" else
                             f"died (status {daemon.proc.returncode})",
                             round(time.monotonic() - t0, 2), families, len(left), tail))
        say(f"crash {len(crashes)} at {time.monotonic() - t0:.1f} s: {sig} [{cause}]")

    try:
        for i in range(cfg.legit):
            legit_pids.append(_fork(legit_worker, board, i, daemon.socket, cfg, legit_refs,
                                    legit_ev[i]))
        for i in range(cfg.attackers):
            attack_pids.append(spawn_attacker(i))
        end = t0 + cfg.seconds
        while time.monotonic() < end:
            time.sleep(0.05)
            if not daemon.alive():
                crashed("died")
            elif _stalled(board, cfg):
                os.kill(daemon.pid, signal.SIGABRT)   # faulthandler: where it is stuck
                daemon.proc.wait(30)
                crashed("unresponsive")
            else:
                daemon.rotate_log()
                respawned += _respawn(attack_pids, spawn_attacker)
                if cfg.reload_seconds and model_args and time.monotonic() >= next_reload:
                    reloads += 1
                    _change_models(model_args[1], reloads)
                    os.kill(daemon.pid, signal.SIGHUP)
                    next_reload = time.monotonic() + cfg.reload_seconds
                continue
            daemon.start()
            board.set("daemon_pid", daemon.pid)
            board.set("generation", board.get("generation") + 1)
            board.legit_t[:, 1] = time.time()
        board.set("stop_attack", 1)
        attackers_killed = _stop_children(attack_pids, 15.0)
        board.set("stop_legit", 1)
        legit_killed = _stop_children(legit_pids, LOST_AFTER * cfg.deadline + 10.0)
        final = _final_check(daemon, cfg, crashed)
        leaks = _leaks(daemon, base, cfg) if daemon.alive() else {"measured": False}
        # (A restarted daemon holds anew: the models check is for one that never crashed;
        # a crash fails the run already.)
        leaks["models_measured"] = daemon.alive() and daemon.starts == 1
        if leaks["models_measured"]:
            if cfg.reload_seconds and model_args:
                # One more reload with nobody left: the daemon then holds fresh versions,
                # as at READY, plus whatever the replaced ones failed to give back (the
                # versions that served grew their buffer pools, which a fresh one has not).
                reloads += 1
                _change_models(model_args[1], reloads)
                leaks["last_reload_ready"] = daemon.reload()
            leaks.update(_held_leaks(daemon.socket, held_at_ready, cfg))
        leaks["reloads"] = reloads
        stop_status = daemon.stop()
        left_after_stop = segment_names(daemon.pid)
    finally:
        board.set("stop_attack", 1)
        board.set("stop_legit", 1)
        _stop_children(attack_pids + legit_pids, 5.0)
        if daemon.alive():
            daemon.proc.kill()
            daemon.proc.wait()
    daemon.rotate_log(force=True)
    events = [e for ev in legit_ev + attack_ev for e in ev.read()]
    report = _report(cfg, uid, cross, board, crashes, events, leaks, final, base,
                     time.monotonic() - t0, daemon, stop_status, left_after_stop,
                     attackers_killed, legit_killed, respawned, refs, not_served)
    if failures(report):
        report["workdir"] = workdir           # the daemon's log and the workers' events
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return report


def _stalled(board: Board, cfg: FuzzConfig) -> bool:
    """No legitimate client made progress for twice the deadline while one waits."""
    now = time.time()
    busy = board.legit_t[:, 0]
    return bool((busy > 0).any() and (now - board.legit_t[:, 1]).min() > 2 * cfg.deadline)


def _respawn(pids: list[int], spawn) -> int:
    """An attacker process that died (a fuzzer bug or a fault of its own) is replaced."""
    n = 0
    for i, pid in enumerate(pids):
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done = pid
        if done:
            pids[i] = spawn(i)
            n += 1
    return n


def _final_check(daemon: DaemonUnderTest, cfg: FuzzConfig, crashed) -> str:
    """After every attacker left: the daemon is alive and answers within the deadline."""
    if not daemon.alive():
        crashed("died")
        return "dead"
    pid = _fork(_probe, daemon.socket)
    end = time.monotonic() + cfg.deadline
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            if os.waitstatus_to_exitcode(status) == 0:
                return "answers"
            break
        time.sleep(0.02)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    if daemon.alive():
        os.kill(daemon.pid, signal.SIGABRT)
        daemon.proc.wait(30)
        crashed("unresponsive")
    else:
        crashed("died")
    return "no answer"


def _probe(sock: str) -> None:
    with connect(sock, timeout=5) as c:
        x = np.arange(256, dtype=np.float32)
        if not np.array_equal(c.infer("echo", {"x": x})["y"], x):
            os._exit(3)


def _change_models(repo: str, n: int) -> None:
    """Make every model of the repository look changed to a reload (newer mtimes)."""
    t = time.time() + n
    for name in sorted(os.listdir(repo)):          # a bundle's manifest, else its config
        for f in ("manifest.json", "config.toml"):
            path = os.path.join(repo, name, f)
            if os.path.exists(path):
                os.utime(path, (t, t))
                break


def _held(sock: str) -> tuple[int, int, int, int]:
    """The dispatcher's models, the device memory the daemon holds, the jobs that waited
    for device memory and the requests failed for want of it (paella status)."""
    with connect(sock, timeout=5) as c:
        d = c.status()["dispatcher"] or {}
    return (d.get("models", 0), d.get("device_memory_bytes", 0), d.get("memory_waits", 0),
            d.get("memory_failures", 0))


def _held_leaks(sock: str, at_ready: tuple[int, ...], cfg: FuzzConfig) -> dict:
    """Models and device memory beyond the daemon's at READY, once every client left
    and the last reload is done (waiting up to ``settle_seconds`` for the replaced
    versions' cancelled jobs to end)."""
    end = time.monotonic() + cfg.settle_seconds
    while True:
        now = _held(sock)
        if now[0] <= at_ready[0] or time.monotonic() > end:
            break
        time.sleep(0.1)
    return {"models_leaked": max(0, now[0] - at_ready[0]),
            "device_bytes_beyond_ready": now[1] - at_ready[1],
            "models_at_ready": at_ready[0], "models_at_end": now[0],
            "device_bytes_at_ready": at_ready[1], "device_bytes_at_end": now[1],
            "memory_waits": now[2], "memory_failures": now[3]}


def _leaks(daemon: DaemonUnderTest, base: Holdings, cfg: FuzzConfig) -> dict:
    """What the daemon still holds once every client left, against itself at READY
    (waiting up to ``settle_seconds`` for cancelled jobs to let go)."""
    end = time.monotonic() + cfg.settle_seconds
    while True:
        now = holdings(daemon.pid)
        if ((now.fds <= base.fds and now.client_maps <= base.client_maps
             and now.segments <= base.segments) or time.monotonic() > end):
            break
        time.sleep(0.1)
    extra_fds = [re.sub(r"\[\d+\]", "", t) for t in now.fd_targets]   # a restart renumbers
    for t in base.fd_targets:                                            # pipes and sockets
        if re.sub(r"\[\d+\]", "", t) in extra_fds:
            extra_fds.remove(re.sub(r"\[\d+\]", "", t))
    return {"fds_leaked": max(0, now.fds - base.fds),
            "maps_leaked": max(0, now.client_maps - base.client_maps),
            "segments_leaked": max(0, now.segments - base.segments),
            "fds_at_ready": base.fds, "fds_at_end": now.fds, "extra_fds": extra_fds[:50],
            "extra_maps": now.map_lines[:20], "extra_segments": now.segment_names[:20]}


def _report(cfg, uid, cross, board, crashes, events, leaks, final, base, wall, daemon,
            stop_status, left_after_stop, attackers_killed, legit_killed, respawned,
            refs: list[Reference] = (), not_served: list[str] = ()) -> dict:
    fam_names = list(fuzz_attacks.FAMILIES)
    inputs = {n: int(board.attack[:, i].sum()) for i, n in enumerate(fam_names)
              if n in cfg.families}
    causes: dict[str, dict] = {}
    for c in crashes:      # families: in how many of these crashes each one was running
        d = causes.setdefault(c.signature, {"count": 0, "cause": c.cause, "families": {},
                                            "log_tail": c.log_tail})
        d["count"] += 1
        for f in c.families:
            d["families"][f] = d["families"].get(f, 0) + 1
    breaches = [e["what"] for e in events if e["kind"] == "breach"] if cross else []
    lost = board.legit_total("lost_alive") + board.legit_total("lost_dead")
    summary = {
        "inputs": sum(inputs.values()),
        "crashes": len(crashes),
        "lost": lost,
        "wrong": board.legit_total("wrong"),
        "refused": board.legit_total("refused"),
        "refused_own_uid": board.legit_total("refused_own_uid"),
        "breaches": len(breaches),
        "fds_leaked": leaks.get("fds_leaked", 0),
        "maps_leaked": leaks.get("maps_leaked", 0),
        "segments_leaked": leaks.get("segments_leaked", 0)
                           + sum(c.leftover_segments for c in crashes) + len(left_after_stop),
        "models_leaked": leaks.get("models_leaked", 0),
        "device_bytes_beyond_ready": leaks.get("device_bytes_beyond_ready", 0),
        # (with --daemon-arg=--device-memory: a full GPU's waits, and requests failed)
        "memory_waits": leaks.get("memory_waits", 0),
        "memory_failures": leaks.get("memory_failures", 0),
        "reloads": leaks.get("reloads", 0),
        # the reload after the attacks never reached READY (the models check then
        # measured the versions before it)
        "reload_not_ready": int(leaks.get("last_reload_ready") is False),
        "legit_requests": board.legit_total("requests"),
        "legit_ok": board.legit_total("ok"),
        # answered after the deadline (within LOST_AFTER deadlines): slow, not lost
        "legit_late": board.legit_total("late"),
        "seconds": round(wall, 1),
    }
    return {
        "command": "python -m paella.fuzz.fuzz_daemon " + " ".join(_argv_of(cfg)),
        "config": {**asdict(cfg), "families": list(cfg.families)},
        "attacker_uid": uid, "daemon_uid": os.geteuid(), "cross_uid": cross,
        "summary": summary,
        "inputs_by_family": inputs,
        "episodes": int(board.attack[:, board.nf + 1].sum()),
        "attacker_errors": int(board.attack[:, board.nf + 2].sum()),
        "crash_causes": causes,
        "crashes_by_cause": _by_cause(crashes),
        "crashes": [asdict(c) | {"log_tail": c.log_tail[-1500:]} for c in crashes[:30]],
        "legit": {n: board.legit_total(n) for n in Board.LEGIT},
        # the legitimate answers checked (ok), wrong and lost, per model (noop's are
        # checked for their status only: it has no reference)
        "legit_by_model": _by_model(board, [r for r in refs if r.name not in not_served]),
        "models_not_served": list(not_served),
        "leaks": leaks, "fds_at_ready": base.fds,
        "segments_left_by_crashes": sum(c.leftover_segments for c in crashes),
        "segments_left_after_stop": left_after_stop,
        "final_check": final, "stop_status": stop_status,
        "daemon_starts": daemon.starts, "daemon_log_bytes": daemon.log_bytes,
        "breach_examples": breaches[:20],
        "events": _event_examples(events),
        "workers_killed_at_end": {"attackers": attackers_killed, "legit": legit_killed},
        "attackers_respawned": respawned,
    }


def _by_model(board: Board, refs: list[Reference]) -> dict[str, dict[str, float]]:
    """Per model: the answers checked, wrong and lost, and the slowest answered
    (``slowest_s``, from predict: how near the deadline the daemon came)."""
    out: dict[str, dict[str, float]] = {}
    for ref in refs:
        d = out.setdefault(ref.label, dict.fromkeys(Board.BY_MODEL, 0) | {"slowest_s": 0.0})
        for k in Board.BY_MODEL:
            d[k] += board.model_total(ref.slot, k)
        d["slowest_s"] = round(max(d["slowest_s"], float(board.slowest[:, ref.slot].max(initial=0))), 3)
    return out


def _by_cause(crashes: list[Crash]) -> dict[str, int]:
    """Crashes per root cause: the known ones by name, each new one by its signature."""
    out: dict[str, int] = {}
    for c in crashes:
        key = c.cause if c.cause != "new" else f"new: {c.signature}"
        out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _event_examples(events: list[dict], per_kind: int = 10) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for e in events:
        if e["kind"] == "breach":
            continue
        lst = out.setdefault(e["kind"], [])
        if len(lst) < per_kind:
            lst.append(e)
    return out


#: Summary keys whose non-zero value fails the run.
FAILURES = ("crashes", "lost", "wrong", "refused", "breaches", "fds_leaked", "maps_leaked",
            "segments_leaked", "models_leaked", "reload_not_ready")


def failures(report: dict) -> dict[str, int]:
    return {k: report["summary"][k] for k in FAILURES if report["summary"][k]}


def _argv_of(cfg: FuzzConfig) -> list[str]:
    out = ["--seconds", f"{cfg.seconds:g}", "--seed", str(cfg.seed)]
    if tuple(cfg.families) != tuple(fuzz_attacks.FAMILIES):
        out += ["--families", ",".join(cfg.families)]
    if not cfg.bundle:
        out.append("--no-bundle")
    if cfg.nofile:
        out += ["--nofile", str(cfg.nofile)]
    if cfg.reload_seconds:
        out += ["--reload-every", f"{cfg.reload_seconds:g}"]
    return out


def format_report(r: dict) -> str:
    s = r["summary"]
    lines = [f"fuzzed {s['seconds']} s, attackers as uid {r['attacker_uid']} "
             f"({'another uid' if r['cross_uid'] else 'the same uid'} as the daemon), "
             f"{r['episodes']} episodes",
             f"inputs tried: {s['inputs']}  ("
             + ", ".join(f"{k} {v}" for k, v in r["inputs_by_family"].items()) + ")",
             f"daemon crashes: {s['crashes']}  (starts {r['daemon_starts']})"]
    lines += [f"  {n:5d}  {cause}" for cause, n in r["crashes_by_cause"].items()]
    if r["crash_causes"]:
        lines.append("  by signature:")
    for sig, d in sorted(r["crash_causes"].items(), key=lambda kv: -kv[1]["count"]):
        lines.append(f"  {d['count']:5d}  {sig}")    # (the JSON says what ran meanwhile)
    lines += [f"legitimate requests: {s['legit_requests']}, ok {s['legit_ok']}, "
              f"lost {s['lost']} (daemon alive: {r['legit']['lost_alive']}), "
              f"wrong {s['wrong']}, refused connections {s['refused']}, "
              f"late {s['legit_late']} (after {r['config']['deadline']:g} s; not a failure)"
              + (f" (and {s['refused_own_uid']} refused for the uid's own connection budget, "
                 f"which the attackers of that uid share: not a failure, docs/service.md)"
                 if s["refused_own_uid"] else ""),
              "  by model: " + ", ".join(
                  f"{m} {d['ok']}" + "".join(f" ({k} {d[k]})" for k in ("wrong", "lost", "late") if d[k])
                  for m, d in r.get("legit_by_model", {}).items())
              + (f"; not served by this daemon: {', '.join(r['models_not_served'])}"
                 if r.get("models_not_served") else ""),
              "  slowest answer (s): " + ", ".join(
                  f"{m} {d['slowest_s']:.2f}" for m, d in r.get("legit_by_model", {}).items()),
              f"breaches (another tenant's memory opened): {s['breaches']}"
              + ("" if r["cross_uid"] else " (not checked: attackers share the uid)"),
              (f"leaked after every client left: fds {s['fds_leaked']}, client mappings "
               f"{s['maps_leaked']}, named segments {s['segments_leaked']} "
               if r["leaks"].get("measured", True) else
               "leaks not measured (the daemon died at the end); named segments "
               f"{s['segments_leaked']} ")
              + f"(left by crashes {r['segments_left_by_crashes']})",
              (f"reloads (SIGHUP, models changed): {s['reloads']}; dispatcher models held beyond "
               f"READY: {s['models_leaked']}; device bytes: {s['device_bytes_beyond_ready']:+d} "
               f"(not a failure: the built-in noop, never reloaded, keeps the 64-byte buffer "
               f"sets a flood of it made)" if r["leaks"].get("models_measured") else
               f"reloads (SIGHUP, models changed): {s['reloads']}; dispatcher models not "
               f"measured (the daemon restarted or died)")
              + (" - the last reload never reached READY" if s["reload_not_ready"] else "")
              + (f"; device memory full: {s['memory_waits']} job(s) waited, "
                 f"{s['memory_failures']} request(s) failed for want of it"
                 if s["memory_waits"] or s["memory_failures"] else ""),
              f"final check: {r['final_check']}; daemon stop status {r['stop_status']}; "
              f"daemon log {r['daemon_log_bytes']} bytes; attacker errors {r['attacker_errors']}"]
    bad = failures(r)
    lines.append("FAILED: " + ", ".join(f"{k} {v}" for k, v in bad.items()) if bad else "PASSED")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m paella.fuzz.fuzz_daemon",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", metavar="FILE", help="write the report as JSON")
    p.add_argument("--attackers", type=int, default=3)
    p.add_argument("--legit", type=int, default=2)
    p.add_argument("--families", help="comma-separated subset of: " + ", ".join(fuzz_attacks.FAMILIES))
    p.add_argument("--same-uid", action="store_true",
                   help="attack as our own uid even when run as root")
    p.add_argument("--no-bundle", dest="bundle", action="store_false",
                   help="serve only the built-in models (no repository: no tiny MLP, "
                        "GPTs or cell models)")
    p.add_argument("--deadline", type=float, default=10.0,
                   help="seconds within which a legitimate answer is on time; one not "
                        "come after 3 deadlines is lost (default 10)")
    p.add_argument("--log-level", default="warning", help="the daemon's log level")
    p.add_argument("--nofile", type=int,
                   help="lower the daemon's descriptor limit to this (attack it near EMFILE)")
    p.add_argument("--reload-every", type=float, default=0.0, metavar="S",
                   help="SIGHUP the daemon every S seconds with its models changed (default: never)")
    p.add_argument("--daemon-arg", action="append", default=[], metavar="ARG",
                   help="extra daemon option (repeatable), e.g. --daemon-arg=--max-clients=64")
    a = p.parse_args(argv)
    families = tuple(a.families.split(",")) if a.families else tuple(fuzz_attacks.FAMILIES)
    unknown = set(families) - set(fuzz_attacks.FAMILIES)
    if unknown:
        p.error(f"unknown families {sorted(unknown)}")
    if not a.reload_every >= 0:
        p.error(f"--reload-every must be >= 0 seconds (0: never), got {a.reload_every}")
    cfg = FuzzConfig(seconds=a.seconds, seed=a.seed, attackers=a.attackers, legit=a.legit,
                     families=families, attacker_uid=os.geteuid() if a.same_uid else None,
                     deadline=a.deadline, bundle=a.bundle, log_level=a.log_level,
                     daemon_args=tuple(a.daemon_arg), nofile=a.nofile,
                     reload_seconds=a.reload_every)
    report = run_fuzz(cfg, progress=lambda m: print(m, file=sys.stderr, flush=True))
    print(format_report(report))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 1 if failures(report) else 0


if __name__ == "__main__":
    sys.exit(main())
