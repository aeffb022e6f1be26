"""A connection to the Paella daemon: predict / read_result (§5.1, §5.3) and infer.

Requests go through shared memory: the inputs are written into the client's arena,
one entry {req_id, model_id, offset, length, options} is pushed on the request ring,
and the outputs appear in the same arena when the completion shows up on the
completion ring. The Unix socket only carries the handshake, the model list and, in
the default *hybrid* mode, an "almost finished" wake-up per request: a blocking
``read_result`` sleeps in ``recv`` until a wake-up arrives, then polls the ring for
the few microseconds the job's last operation takes.

Wait modes (chosen at connect time, the daemon sends notifications accordingly):

* ``hybrid``  (default) sleep on the socket until WAKE, then poll the ring;
* ``polling`` spin on the completion ring (lowest latency, burns a core per client);
* ``socket``  sleep on the socket until DONE, sent after the completion is pushed.

Threads: a :class:`Client` may be shared by threads. Submission (predict, the request
ring) and reception (read_result, the completion ring, the socket) have one lock each,
so a thread can predict while another blocks in read_result. ``read_result`` returns
whichever request completed first, whoever submitted it; :meth:`Client.infer` and
:meth:`Client.wait` wait for one request id and keep the others for later readers.
Reception is serialized, so a thread waiting on a long job delays another thread's
wait for a short one: for the lowest latency, give each thread its own client.

The segment arrives as a descriptor with WELCOME: a memfd the daemon sealed against
resizing, mapped here as it is. Ring indices are stored through ``paella.rings``'
uint64 view, one aligned 8-byte store each, as the protocol requires (a torn store
of ``cmp_head`` can look corrupt to the daemon, which then drops the client).
"""
from __future__ import annotations

import errno
import mmap
import os
import select
import socket
import threading
import time
from typing import Iterator, Mapping

import numpy as np

from paella import rings, shapes, wire
from paella.client.arena import ArenaAllocator
from paella.client.errors import (DaemonError, DaemonGone, DaemonUnavailable, NothingInFlight,
                                  PaellaError, RequestFailed, ResultTimeout, RingFull,
                                  UnknownModel)

#: read_result option: return -errno.EAGAIN instead of waiting.
NONBLOCK = 1

DEFAULT_SOCKET = "/run/paella/paella.sock"

#: Spins between two looks at the socket while polling, so a dead daemon is noticed.
_SPINS_PER_CHECK = 2048


def default_socket() -> str:
    """``$PAELLA_SOCKET`` if set, else the systemd unit's socket path."""
    return os.environ.get("PAELLA_SOCKET", DEFAULT_SOCKET)


def connect(socket: str | None = None, mode: str = "hybrid", arena_bytes: int | None = None,
            timeout: float = 5.0) -> "Client":
    """Connect to the daemon at ``socket`` (default: :func:`default_socket`)."""
    return Client(socket or default_socket(), mode, arena_bytes, timeout)


class Client:
    """One connection: a control socket plus a mapped segment (rings and arena)."""

    def __init__(self, path: str, mode: str = "hybrid", arena_bytes: int | None = None,
                 timeout: float = 5.0):
        if mode not in wire.MODES:
            raise ValueError(f"mode must be one of {wire.MODES}, got {mode!r}")
        self.path = path
        self.mode = mode
        self._reader = wire.FrameReader()
        self._sock = self._dial(path, timeout)
        try:
            welcome, fd = self._handshake(mode, arena_bytes, timeout)
        except BaseException:
            self._sock.close()
            raise
        self.client_id: int = welcome["client_id"]
        #: The segment's name as /proc shows it (``memfd:paella.<daemon pid>.<id>``);
        #: it is in no file system.
        self.segment_name: str = welcome["segment"]
        try:
            layout = rings.Layout.from_dict(welcome["layout"])
            if os.fstat(fd).st_size < layout.total_bytes:   # mapping past the end faults
                raise DaemonUnavailable(f"the segment passed by the daemon is smaller than "
                                        f"its announced layout ({layout.total_bytes} bytes)")
            self._mm = mmap.mmap(fd, layout.total_bytes)
        except ValueError as e:
            self._sock.close()
            raise DaemonUnavailable(f"the daemon sent a bad segment layout: {e}") from None
        except BaseException:
            self._sock.close()
            raise
        finally:
            os.close(fd)
        self._seg = rings.Segment(self._mm, layout)
        self._seg.check_header()
        self._requests = rings.RequestProducer(self._seg)
        self._completions = rings.CompletionConsumer(self._seg)
        #: The shared-memory arena (uint8). Zero-copy users place inputs here themselves,
        #: with offsets from :meth:`alloc`, and pass them to :meth:`predict`.
        self.arena: np.ndarray = self._seg.arena
        self._alloc = ArenaAllocator(layout.arena_bytes)
        self.models: dict[str, wire.ModelInfo] = {}
        self._set_models(welcome["models"])
        self._submit_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._next_id = 1
        self._submitted = 0       # under _submit_lock
        self._completed = 0       # under _recv_lock
        self._notified = 0        # WAKE/DONE frames received, under _recv_lock
        self._stash: dict[int, tuple[int, str]] = {}   # read by wait(), not yet returned
        #: Streaming requests: req id -> outputs valid so far (the last progress entry).
        self._progress: dict[int, int] = {}
        #: Requests a generate() call reads: their progress count outlives their final
        #: entry (a failed generation still yields the tokens announced before it failed).
        self._streaming: set[int] = set()
        #: Requests whose ``infer`` timed out: req id -> io offset, freed (and the result
        #: dropped) when the completion arrives; the daemon may write the region till then.
        self._orphans: dict[int, int] = {}
        self._replies: list[tuple[int, object]] = []
        self._sock.settimeout(None)
        self.closed = False

    # -- connection ------------------------------------------------------------------
    @staticmethod
    def _dial(path: str, timeout: float) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout)
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    s.connect(path)
                    break
                except BlockingIOError:
                    # A Unix socket refuses a connection at once (EAGAIN) while the
                    # daemon's accept backlog is full, as under a burst of connections:
                    # wait for room until the timeout, as a TCP connect would.
                    if time.monotonic() >= deadline:
                        raise
                    time.sleep(0.001)
        except (FileNotFoundError, ConnectionRefusedError) as e:
            s.close()
            raise DaemonUnavailable(f"no paella daemon listens on {path} ({e.strerror}); "
                                    f"start one with `paella serve` or set PAELLA_SOCKET") from None
        except OSError as e:
            s.close()
            raise DaemonUnavailable(f"cannot connect to {path}: {e}") from None
        return s

    def _handshake(self, mode: str, arena_bytes: int | None, timeout: float) -> tuple[dict, int]:
        hello: dict = {"version": wire.PROTOCOL_VERSION, "mode": mode}
        if arena_bytes is not None:
            hello["arena_bytes"] = int(arena_bytes)
        try:
            self._sock.sendall(wire.encode(wire.HELLO, hello))
        except OSError:
            pass   # a refusing daemon may close before HELLO: its ERROR is still readable
        fds: list[int] = []
        try:
            msg = self._await_welcome(fds, timeout)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise DaemonUnavailable(f"WELCOME carried {len(fds)} descriptors, expected the "
                                    f"segment's one")
        return msg, fds[0]

    def _await_welcome(self, fds: list[int], timeout: float) -> dict:
        """Read until WELCOME, collecting the descriptors that come along in ``fds``."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                data, got, _, _ = socket.recv_fds(self._sock, 1 << 16, 1)
            except socket.timeout:
                raise DaemonUnavailable(f"the daemon at {self.path} did not answer HELLO "
                                        f"within {timeout} s") from None
            except OSError as e:
                raise DaemonUnavailable(f"the daemon at {self.path} dropped the connection "
                                        f"during the handshake: {e}") from None
            fds += got
            if not data:
                raise DaemonUnavailable(f"the daemon at {self.path} closed the connection "
                                        f"during the handshake")
            try:
                frames = self._reader.feed(data)
            except wire.WireError as e:
                raise DaemonUnavailable(f"the daemon sent a malformed frame: {e}") from None
            for kind, msg in frames:
                if kind == wire.ERROR:
                    raise DaemonUnavailable(f"the daemon refused the connection: "
                                            f"{msg['error']}: {msg['message']}")
                if kind == wire.WELCOME:
                    return msg
            if time.monotonic() > deadline:
                raise DaemonUnavailable(f"no WELCOME from {self.path} within {timeout} s")

    def close(self) -> None:
        """Close the socket (the daemon drops its mapping) and unmap the arena."""
        if self.closed:
            return
        self.closed = True
        self._sock.close()
        self._seg.release()
        self.arena = None   # type: ignore[assignment]
        self._requests = self._completions = None   # type: ignore[assignment]
        # No self._mm.close(): numpy views do not pin an mmap, so closing it under a
        # view the caller kept would crash on the next access. The last reference
        # going away unmaps it.
        self._mm = None

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- models ------------------------------------------------------------------------
    def _set_models(self, descs: list) -> None:
        self.models = {m.name: m for m in (wire.ModelInfo.from_dict(d) for d in descs)}
        self._ids = {m.model_id for m in self.models.values()}

    def model(self, model: str | int) -> wire.ModelInfo:
        if isinstance(model, str):
            m = self.models.get(model)
        else:
            m = next((x for x in self.models.values() if x.model_id == model), None)
        if m is None:
            raise UnknownModel(f"the daemon serves no model {model!r}; it serves "
                               f"{sorted(self.models) or 'none'}")
        return m

    def list_models(self, timeout: float | None = None) -> dict[str, wire.ModelInfo]:
        """Ask the daemon again (it reloads its repository on SIGHUP)."""
        self._send(wire.encode(wire.LIST_MODELS))
        with self._recv_lock:
            kind, msg = self._await_reply(timeout)
        if kind == wire.ERROR:
            raise DaemonError(msg.get("error", "?"), msg.get("message", ""))   # type: ignore[union-attr]
        self._set_models(msg["models"])   # type: ignore[index]
        return self.models

    def status(self, timeout: float = 5.0) -> dict:
        """The daemon's STATUS reply (``paella status``): models, clients, in flight,
        occupancy."""
        self._send(wire.encode(wire.STATUS))
        with self._recv_lock:
            kind, msg = self._await_reply(timeout)
        if kind == wire.ERROR:
            raise DaemonError(msg.get("error", "?"), msg.get("message", ""))   # type: ignore[union-attr]
        return msg["status"]   # type: ignore[index]

    # -- §5.1: predict ---------------------------------------------------------------------
    def predict(self, model: str | int, length: int, io_offset: int, options: int = 0, *,
                priority: int = 0, _track: bool = False) -> int:
        """Submit a request whose io region is ``arena[io_offset:io_offset+length]``.

        Returns its request id. The daemon validates every field; a bad request still
        gets an id, and its read_result raises :class:`RequestFailed` with the reason.
        ``priority``: 0 (none: the batcher's default level) or 1 (highest) .. 255, for
        batchers that order by priority (``priority_levels`` of ``dynamic``; ``orca``
        with ``priorities``); others ignore it.
        """
        if isinstance(model, str):
            m = self.models.get(model)
            if m is None:
                self.model(model)   # raises UnknownModel with the list
            model_id = m.model_id   # type: ignore[union-attr]
        else:
            model_id = model
        if not (0 <= model_id <= rings.U32 and 0 <= length <= wire.LENGTH_MASK
                and 0 <= io_offset <= rings.U64 and 0 <= options <= rings.U32):
            raise ValueError(f"predict fields out of range: model {model_id}, length {length}, "
                             f"offset {io_offset}, options {options}")
        if type(priority) is not int or not 0 <= priority <= wire.MAX_PRIORITY:
            raise ValueError(f"priority must be an int 0..{wire.MAX_PRIORITY} (0: none, 1: the "
                             f"highest), got {priority!r}")
        length |= priority << wire.PRIORITY_SHIFT
        with self._submit_lock:
            req_id = self._next_id
            # Counted before the push, so a reader never sees more completions than
            # submissions (it would otherwise wait on a request it already got).
            self._submitted += 1
            if _track:              # generate(): before any entry of it can be read
                self._streaming.add(req_id)
            if not self._requests.push(req_id, model_id, io_offset, length, options):
                try:
                    self._wait_for_room(req_id, model_id, io_offset, length, options)
                except PaellaError:
                    self._submitted -= 1
                    self._streaming.discard(req_id)
                    raise
            self._next_id += 1
            if self._requests.daemon_sleeping():
                self._send(wire.KICK_FRAME)
        return req_id

    def _wait_for_room(self, *entry: int) -> None:
        deadline = time.monotonic() + 2.0
        while not self._requests.push(*entry):
            if self._requests.daemon_sleeping():
                self._send(wire.KICK_FRAME)
            if time.monotonic() > deadline:
                raise RingFull(f"the request ring ({self._seg.layout.req_slots} slots) stayed "
                               f"full for 2 s; read results so the daemon can take more")
            time.sleep(0.0001)

    # -- §5.3: read_result -----------------------------------------------------------------
    def read_result(self, options: int = 0, timeout: float | None = None) -> int:
        """Id of the first completed request.

        Raises :class:`RequestFailed` (with the daemon's reason) when that request
        failed, and :class:`NothingInFlight` when no request is outstanding. With
        ``NONBLOCK`` returns ``-errno.EAGAIN`` when nothing is ready yet. With a
        ``timeout`` (seconds) raises :class:`ResultTimeout` when nothing completed by
        then (the default, None, waits as long as the daemon lives).
        """
        deadline = _deadline(timeout)
        with self._recv_lock:
            if self._stash:
                req_id = next(iter(self._stash))
                return self._result(req_id, *self._stash.pop(req_id))
            got = self._next_completion(bool(options & NONBLOCK), deadline)
            if got is None:
                return -errno.EAGAIN
            return self._result(*got)

    def wait(self, req_id: int, timeout: float | None = None) -> None:
        """Wait for one request; raises RequestFailed if it failed, ResultTimeout if it
        did not complete within ``timeout`` seconds (it stays in flight)."""
        deadline = _deadline(timeout)
        with self._recv_lock:
            while req_id not in self._stash:
                got = self._next_completion(False, deadline)
                self._stash[got[0]] = got[1:]   # type: ignore[index]
            self._result(req_id, *self._stash.pop(req_id))

    @staticmethod
    def _result(req_id: int, status: int, reason: str) -> int:
        if status:
            raise RequestFailed(req_id, status, reason)
        return req_id

    def _next_completion(self, nonblock: bool, deadline: float | None = None
                         ) -> tuple[int, int, str] | None:
        """Pop one completion, waiting according to the mode, until ``deadline``
        (time.monotonic(); None: no limit). Caller holds _recv_lock. Completions of
        orphaned requests (an ``infer`` that timed out) free their region and are
        skipped."""
        while True:
            got = self._pop_completion(nonblock, deadline)
            if got is None or not self._orphans or got[0] not in self._orphans:
                return got
            self._alloc.free(self._orphans.pop(got[0]))

    def _pop_completion(self, nonblock: bool, deadline: float | None
                        ) -> tuple[int, int, str] | None:
        pop = self._pop_entry
        spins = 0
        while True:
            got = pop()
            if got is not None:
                return got
            if nonblock:
                self._pump(block=False)   # consume wake-ups, notice a dead daemon
                return pop()
            if self._submitted == self._completed:
                raise NothingInFlight("read_result: no request is in flight")
            if self.mode == "polling" or self._notified > self._completed:
                spins += 1           # the completion is on its way: poll shared memory
                if spins % _SPINS_PER_CHECK == 0:
                    self._pump(block=False)
                    _check(deadline, self)
            else:
                # hybrid/socket: sleep until the daemon speaks (or the deadline)
                self._pump(block=True, timeout=_remaining(deadline, self))

    def _pop_entry(self) -> tuple[int, int, str] | None:
        """The next completion on the ring; progress entries on the way are recorded in
        ``_progress`` (the latest count per request) and skipped."""
        pop = self._completions.pop
        while True:
            got = pop()
            if got is None:
                return None
            if got[1] != rings.PROGRESS:
                self._completed += 1
                if self._progress and got[0] not in self._streaming:
                    self._progress.pop(got[0], None)     # (its count is of no use any more)
                return got      # type: ignore[return-value]
            if got[0] not in self._orphans:
                self._progress[got[0]] = max(self._progress.get(got[0], 0), got[2])  # type: ignore[arg-type]

    def _wait_stream(self, req_id: int, seen: int, deadline: float | None
                     ) -> tuple[int, int, str] | None:
        """Wait until streaming request ``req_id`` has more than ``seen`` outputs (None)
        or its completion arrived (its (req_id, status, reason)). Caller holds _recv_lock."""
        spins = 0
        while True:
            if req_id in self._stash:
                return (req_id, *self._stash.pop(req_id))
            if self._progress.get(req_id, 0) > seen:
                return None
            got = self._pop_entry()
            if got is not None:
                if got[0] in self._orphans:
                    self._alloc.free(self._orphans.pop(got[0]))
                else:
                    self._stash[got[0]] = got[1:]   # type: ignore[assignment]
                continue
            if self.mode == "polling" or self._notified > self._completed:
                spins += 1
                if spins % _SPINS_PER_CHECK == 0:
                    self._pump(block=False)
                    _check(deadline, self)
            else:   # hybrid/socket: a PROGRESS, WAKE or DONE frame follows each entry
                self._pump(block=True, timeout=_remaining(deadline, self))

    def _pump(self, block: bool, timeout: float | None = None) -> None:
        """Read what the socket holds (waiting for at least one frame if ``block``, at
        most ``timeout`` seconds if given: then it returns having read nothing)."""
        if block and timeout is not None:
            # poll, not settimeout: the socket's mode is shared with the sending threads.
            if not select.select([self._sock], [], [], timeout)[0]:
                return

        try:
            data = self._sock.recv(65536) if block else self._sock.recv(65536, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            raise DaemonGone(f"lost the daemon at {self.path}: {e}") from None
        if not data:
            raise DaemonGone(f"the daemon at {self.path} closed the connection "
                             f"({self._submitted - self._completed} requests were in flight)")
        try:
            frames = self._reader.feed(data)
        except wire.WireError as e:
            raise DaemonGone(f"the daemon sent a malformed frame: {e}") from None
        for kind, msg in frames:
            if kind in (wire.WAKE, wire.DONE):
                self._notified += 1
            elif kind == wire.PROGRESS:
                pass        # waking up was the point: the entry is on the ring
            elif kind == wire.ERROR:
                self._replies.append((kind, msg))
            elif kind in (wire.MODELS, wire.STATUS_REPLY):
                self._replies.append((kind, msg))
            else:
                raise DaemonGone(f"the daemon sent an unexpected {wire.NAMES[kind]}")
        if self._replies and not self._awaiting:
            kind, msg = self._replies.pop(0)
            raise DaemonError(msg.get("error", "?"), msg.get("message", ""))   # type: ignore[union-attr]

    _awaiting = False

    def _await_reply(self, timeout: float | None = None) -> tuple[int, object]:
        deadline = _deadline(timeout)
        self._awaiting = True
        try:
            while not self._replies:
                self._pump(block=True, timeout=_remaining(deadline, self))
            return self._replies.pop(0)
        finally:
            self._awaiting = False

    def _send(self, frame: bytes) -> None:
        with self._send_lock:
            try:
                self._sock.sendall(frame)
            except OSError as e:
                raise DaemonGone(f"lost the daemon at {self.path}: {e}") from None

    # -- convenience -------------------------------------------------------------------
    def alloc(self, nbytes: int) -> int:
        """Reserve an io region in the arena (zero-copy use); free it with :meth:`free`."""
        return self._alloc.alloc(nbytes)

    def free(self, offset: int) -> None:
        self._alloc.free(offset)

    def io_views(self, model: str | int, offset: int, variant: int = 0
                 ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """numpy views of a variant's inputs and outputs in the region at ``offset``."""
        v = self.model(model).variants[variant]
        def view(t: wire.TensorInfo) -> np.ndarray:
            start = offset + t.offset
            return self.arena[start:start + t.nbytes].view(t.dtype).reshape(t.shape)
        return {t.name: view(t) for t in v.inputs}, {t.name: view(t) for t in v.outputs}

    def shaped_views(self, model: str | int, offset: int, rows: int, seq_len: int = 0
                     ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], int]:
        """numpy views of the inputs and outputs of a request of ``rows`` rows (and
        sequence length ``seq_len``) in the region at ``offset``, and the region's size.
        For models compiled with ``--batch-sizes``: the daemon's batcher groups such
        requests and the outputs hold exactly these rows. ValueError (a
        :class:`paella.shapes.ShapeError`) for a shape the model does not take."""
        slots, nbytes = shapes.request_layout(self.model(model).variants, rows, seq_len)

        def view(t: shapes.Slot) -> np.ndarray:
            start = offset + t.offset
            return self.arena[start:start + t.nbytes].view(t.dtype).reshape(t.shape)
        n_in = len(self.model(model).variants[0].inputs)
        return ({t.name: view(t) for t in slots[:n_in]},
                {t.name: view(t) for t in slots[n_in:]}, nbytes)

    def predict_shaped(self, model: str | int, offset: int, rows: int, seq_len: int = 0,
                       *, priority: int = 0) -> int:
        """Submit a request of ``rows`` rows (length ``seq_len``) laid out as
        :meth:`shaped_views` says, at ``offset``; returns its id."""
        m = self.model(model)
        _, nbytes = shapes.request_layout(m.variants, rows, seq_len)
        return self.predict(m.model_id, nbytes, offset,
                            shapes.RequestShape(rows, seq_len).options(), priority=priority)

    def infer(self, model: str | int, inputs: Mapping[str, np.ndarray],
              variant: int = 0, timeout: float | None = None, *, rows: int | None = None,
              seq_len: int = 0, priority: int = 0) -> dict[str, np.ndarray]:
        """Run one request: place inputs, predict, wait, return copies of the outputs.

        Inputs must match the variant's names and shapes exactly (values are cast to
        the tensor's dtype as numpy assignment does). With ``rows`` (models compiled
        with ``--batch-sizes``), the request carries that many rows (and ``seq_len``)
        instead, the inputs have that shape, and the daemon batches it with others.
        For zero-copy use, take a region with :meth:`alloc`, fill the views from
        :meth:`io_views` (or :meth:`shaped_views`), and call :meth:`predict` (or
        :meth:`predict_shaped`) and :meth:`wait` yourself. ``timeout`` (seconds, default
        no limit) raises :class:`ResultTimeout` when the answer has not come by then; the
        request's arena region stays reserved until its completion arrives.
        ``priority`` as for :meth:`predict`.
        """
        m = self.model(model)
        off, nbytes, options, outs = self._place(m, inputs, variant, rows, seq_len)
        orphaned = False
        try:
            req_id = self.predict(m.model_id, nbytes, off, options, priority=priority)
            try:
                self.wait(req_id, timeout)
            except ResultTimeout:
                self._orphans[req_id] = off     # the daemon may still write the region
                orphaned = True
                raise
            return {k: a.copy() for k, a in outs.items()}
        finally:
            if not orphaned:
                self._alloc.free(off)

    def _place(self, m: wire.ModelInfo, inputs: Mapping[str, np.ndarray], variant: int,
               rows: int | None, seq_len: int) -> tuple[int, int, int, dict[str, np.ndarray]]:
        """Reserve a region for one request of ``m`` and copy ``inputs`` into it: its
        offset, length, options and output views (what :meth:`infer` does before it
        predicts; shared with the asyncio client). ValueError, the region freed, when
        the inputs are not the model's."""
        if rows is None:
            if not 0 <= variant < len(m.variants):
                raise ValueError(f"{m.name} has {len(m.variants)} variant(s); no variant {variant}")
            v = m.variants[variant]
            names, nbytes, options = [t.name for t in v.inputs], v.io_bytes, variant
        else:
            names = [t.name for t in m.variants[0].inputs]
            nbytes = shapes.request_layout(m.variants, rows, seq_len)[1]
            options = shapes.RequestShape(rows, seq_len).options()
        if set(inputs) != set(names):
            raise ValueError(f"{m.name} takes inputs {sorted(names)}, got {sorted(inputs)}")
        off = self._alloc.alloc(nbytes)
        try:
            if rows is None:
                ins, outs = self.io_views(m.model_id, off, variant)
            else:
                ins, outs, _ = self.shaped_views(m.model_id, off, rows, seq_len)
            for name, view in ins.items():
                a = np.asarray(inputs[name])
                if a.shape != view.shape:
                    raise ValueError(f"{m.name} input {name!r} must have shape {view.shape} "
                                     f"({view.dtype}), got {a.shape}")
                view[...] = a
        except BaseException:
            self._alloc.free(off)
            raise
        return off, nbytes, options, outs

    def generate(self, model: str | int, prompt_ids, max_tokens: int,
                 timeout: float | None = None, *, priority: int = 0) -> Iterator[int]:
        """Generate up to ``max_tokens`` tokens after ``prompt_ids`` with a generative
        model (one served by a streaming scheduler such as ``orca``): yields each token
        id as the iteration that made it completes, over the rings (progress entries).

        The model's io (``paella.stepsched.orca_plugin``): inputs ``prompt`` (int32,
        its capacity) and ``lengths`` (int32 [prompt length, max_tokens]); outputs
        ``tokens`` and ``n_tokens``. The daemon checks the ids, the lengths and the KV
        cache and answers a bad request with :class:`RequestFailed` (its reason) before
        any token. ``timeout`` (seconds, the whole generation; default no limit) raises
        :class:`ResultTimeout`; as with :meth:`infer`, the request's region then stays
        reserved until its completion arrives, and so it does if the caller stops
        iterating early (the generation runs to its end in the daemon). ``priority`` as
        for :meth:`predict` (``orca`` orders by it with ``priorities = true``)."""
        m = self.model(model)
        v = m.variants[0]
        prompt = self._generation_args(m, prompt_ids, max_tokens)
        deadline = _deadline(timeout)
        off = self._alloc.alloc(v.io_bytes)
        done = False
        req_id = None
        try:
            views_out = self._place_generation(m, off, prompt, max_tokens)
            req_id = self.predict(m.model_id, v.io_bytes, off, wire.STREAM, _track=True,
                                  priority=priority)
            tokens, seen = views_out["tokens"], 0
            while True:
                with self._recv_lock:
                    end = self._wait_stream(req_id, seen, deadline)
                    n = self._progress.get(req_id, seen) if end is None else None
                if end is not None:
                    done = True
                    # The tokens the progress entries announced come first, also when the
                    # generation then failed: its final entry may be read in the same
                    # drain of the ring as the progress entries before it.
                    n = self._progress.pop(req_id, seen)
                    if end[1] == rings.OK:
                        n = int(views_out["n_tokens"][0])
                for t in tokens[seen:min(n, tokens.size)].tolist():
                    yield t
                seen = max(seen, min(n, tokens.size))
                if end is not None:
                    self._result(*end)
                    return
        finally:
            with self._recv_lock:
                self._streaming.discard(req_id)
                self._progress.pop(req_id, None)
                if not (done or req_id is None):
                    # in flight still (a timeout, or the caller stopped iterating)
                    self._orphans[req_id] = off
            if done or req_id is None:
                self._alloc.free(off)

    @staticmethod
    def _generation_args(m: wire.ModelInfo, prompt_ids, max_tokens: int) -> np.ndarray:
        """The prompt of a generation by ``m`` as an array, every argument checked
        (ValueError naming what is wrong)."""
        v = m.variants[0]
        ins = {t.name: t for t in v.inputs}
        outs = {t.name: t for t in v.outputs}
        if set(ins) != {"prompt", "lengths"} or set(outs) != {"tokens", "n_tokens"}:
            raise ValueError(f"{m.name} is not a generative model (its inputs are "
                             f"{sorted(ins)}, a generative model's are ['lengths', 'prompt'])")
        prompt = np.asarray(prompt_ids)
        if prompt.ndim != 1 or (prompt.size and prompt.dtype.kind not in "iu"):
            raise ValueError(f"prompt_ids must be a 1-D sequence of token ids, got "
                             f"{prompt.dtype} of shape {prompt.shape}")
        cap = ins["prompt"].shape[0]
        if prompt.size > cap:
            raise ValueError(f"the prompt has {prompt.size} tokens; {m.name} takes at most {cap}")
        if type(max_tokens) is not int or not 0 <= max_tokens < 2 ** 31:
            raise ValueError(f"max_tokens must be an int in 0..2**31-1, got {max_tokens!r}")
        i32 = np.iinfo(np.int32)
        if prompt.size and (prompt.min() < i32.min or prompt.max() > i32.max):
            raise ValueError("token ids must fit in int32")
        return prompt

    def _place_generation(self, m: wire.ModelInfo, off: int, prompt: np.ndarray,
                          max_tokens: int) -> dict[str, np.ndarray]:
        """Write a generation's inputs into the region at ``off``; its output views."""
        views_in, views_out = self.io_views(m.model_id, off)
        views_in["prompt"][:prompt.size] = prompt
        views_in["prompt"][prompt.size:] = 0
        views_in["lengths"][:] = (prompt.size, max_tokens)
        views_out["n_tokens"][:] = 0
        return views_out

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet read back."""
        return self._submitted - self._completed


def _deadline(timeout: float | None) -> float | None:
    if timeout is None:
        return None
    if not timeout >= 0:
        raise ValueError(f"timeout must be >= 0 seconds or None, got {timeout}")
    return time.monotonic() + timeout


def _remaining(deadline: float | None, client: Client) -> float | None:
    """Seconds left before ``deadline``; ResultTimeout once it has passed."""
    if deadline is None:
        return None
    _check(deadline, client)
    return deadline - time.monotonic()


def _check(deadline: float | None, client: Client) -> None:
    if deadline is not None and time.monotonic() >= deadline:
        raise ResultTimeout(f"no answer from the daemon at {client.path} in time "
                            f"({client.in_flight} request(s) in flight); it is busy, hung "
                            f"or stopped")


__all__ = ["Client", "connect", "NONBLOCK", "default_socket", "PaellaError"]
