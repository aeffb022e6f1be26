"""The batcher interface: requests in, batches (groups of requests run as one job of a
chosen compiled variant) out.

A batcher sits between the front end (which validated each request and knows its
shape) and job creation (:meth:`paella.dispatcher.core.Dispatcher.submit_group`). One
batcher instance serves one model; it sees that model's compiled variants
(:class:`ModelVariants`) and decides *which requests run together* and *on which
variant*. Everything else -- laying the requests' inputs into the variant's io buffer,
scattering the outputs back, per-request completion -- is the batching stage's
(:mod:`.stage`), so a batcher is pure bookkeeping and easy to test in virtual time.

The hooks, all called by the daemon loop (or the harness) only, with the device clock
``now`` in seconds:

* ``add(req, now) -> list[Batch]``   a request arrived; return the batches that are
                                      ready now (possibly none: the request waits);
* ``poll(now) -> list[Batch]``       the timer hook: called at (or after) ``deadline()``
                                      and whenever the loop has time; returns batches
                                      whose wait is over;
* ``deadline() -> float | None``     the device time at which ``poll`` must run next
                                      (None: nothing is waiting);
* ``batch_done(batch, now)``         a batch's job finished (all its requests are
                                      completed): the feedback a step scheduler needs;
* ``remove_client(client_id) -> list[Request]``  the client went away: drop its
                                      queued requests (the stage completes them as
                                      cancelled);
* ``flush(now) -> list[Batch]``      the daemon drains: every queued request, now;
* ``pending``                        requests queued in the batcher.

A batch's variant must take its rows (``sum(r.rows) <= variant.rows``) and every
request's length (``r.seq_len <= variant.seq_len`` for length buckets); the stage
checks that and fails the batch's requests with the reason if a plug-in gets it wrong.
The rows a batch leaves empty are padding, counted in the stage's stats.

Plug-ins of both kinds register under the entry-point group ``paella.batchers`` (see
:mod:`.registry`); their options are the keyword parameters of ``__init__``.

**Schedulers** (:class:`SchedulerBatcher`) are the second kind of plug-in: a step
scheduler (Orca, BatchMaker) or DVABatch does not hand the stage whole batches; it
*drives its own jobs*. It gets a narrow :class:`SchedulerContext` at ``start(ctx)`` and,
through it only, registers internal dispatcher models (iteration buckets, stage
variants), allocates device memory, submits jobs on io buffers it owns, streams partial
results (``ctx.progress``) and completes each request when it decides
(``ctx.complete``). The stage keeps the ledger of the requests it handed over, so a
scheduler that raises or misbehaves can neither lose a request nor answer one twice
(:mod:`.stage`, docs/batching.md "Schedulers"). The context is a scheduler's one way
to the dispatcher, in the daemon and in virtual time alike (``stage.scheduler_context``
builds one for a scheduler its caller drives); the built-in schedulers live in
:mod:`paella.stepsched`, which import-linter keeps off the dispatcher's internals
(pyproject.toml).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Protocol


#: The longest wait any batcher's option may ask for (microseconds): a wait past a day is
#: none (a request that waits it is as good as never served).
MAX_DELAY_US = 86400e6


class BatcherError(ValueError):
    """An unknown batcher, a bad batcher option, or a batch a variant cannot take."""


@dataclass(frozen=True)
class VariantSpec:
    """One compiled variant as a batcher sees it."""
    index: int          # the variant's position in the bundle's manifest
    rows: int           # its batch size
    seq_len: int = 0    # its length bucket (0: the model has no length axis)
    label: str = field(default="", compare=False)   # its name (for logs and profiles)
    #: Its isolated time on the device (seconds; the dispatcher's profile, what
    #: `paella profile` reports), for batchers that plan by cost; 0 = not profiled.
    cost_s: float = field(default=0.0, compare=False)
    #: The model stage it runs (``paella compile --stages``; -1: the whole model).
    stage: int = -1

    def takes(self, rows: int, seq_len: int) -> bool:
        return rows <= self.rows and seq_len <= self.seq_len if self.seq_len else rows <= self.rows


@dataclass(frozen=True)
class ModelVariants:
    """A model's variants, smallest first (by rows, then length)."""
    name: str
    variants: tuple[VariantSpec, ...]

    def __post_init__(self) -> None:
        if not self.variants:
            raise BatcherError(f"model {self.name!r} has no variant to serve")
        object.__setattr__(self, "variants",
                           tuple(sorted(self.variants, key=lambda v: (v.seq_len, v.rows))))
        object.__setattr__(self, "_fits", {})   # Speed: fit() memo, once per request

    @property
    def max_rows(self) -> int:
        return max(v.rows for v in self.variants)

    @property
    def max_seq_len(self) -> int:
        return max(v.seq_len for v in self.variants)

    @property
    def has_length(self) -> bool:
        return self.max_seq_len > 0

    def fit(self, rows: int, seq_len: int = 0) -> VariantSpec | None:
        """The smallest variant taking ``rows`` rows of length ``seq_len`` (the
        shortest length bucket first, then the fewest rows), or None."""
        key = (rows, seq_len)
        try:
            return self._fits[key]
        except KeyError:
            pass
        v = next((v for v in self.variants if v.takes(rows, seq_len)), None)
        if len(self._fits) < 4096:
            self._fits[key] = v
        return v


@dataclass(eq=False)
class Batch:
    """Requests that run as one job of ``variant`` (rows in request order)."""
    requests: list[Any]               # paella.dispatcher.core.Request, each with .rows, .seq_len
    variant: VariantSpec
    #: Set by the stage: when the batch was formed (device seconds).
    t_formed: float = 0.0
    meta: Any = None                  # the batcher's own notes (priority, step), if any

    @property
    def rows(self) -> int:
        return sum(r.rows for r in self.requests)

    @property
    def seq_len(self) -> int:
        return max((r.seq_len for r in self.requests), default=0)

    @property
    def padding(self) -> int:
        """Rows of the variant no request fills."""
        return self.variant.rows - self.rows


class Batcher:
    """Base class: a batcher of one model's requests. Subclasses override the hooks;
    options are keyword parameters of ``__init__`` (checked before it is built)."""

    name: ClassVar[str] = "base"
    #: Whether it plans with each variant's profiled time (``VariantSpec.cost_s``): the
    #: daemon then builds it once the variants are registered and profiled.
    needs_costs: ClassVar[bool] = False
    #: A scheduler (:class:`SchedulerBatcher`): it submits its own jobs and completes
    #: requests itself through a :class:`SchedulerContext`.
    drives_jobs: ClassVar[bool] = False

    def __init__(self, model: ModelVariants, **options: Any):
        if options:
            raise BatcherError(f"batcher {self.name!r} takes no option(s) "
                               f"{', '.join(sorted(options))}")
        self.model = model

    def add(self, req: Any, now: float) -> list[Batch]:
        raise NotImplementedError("need add")

    def poll(self, now: float) -> list[Batch]:
        return []

    def deadline(self) -> float | None:
        return None

    def batch_done(self, batch: Batch, now: float) -> None:
        pass

    def remove_client(self, client_id: int) -> list[Any]:
        return []

    def flush(self, now: float) -> list[Batch]:
        return []

    @property
    def pending(self) -> int:
        return 0

    # -- helpers for subclasses --------------------------------------------------------
    def max_batch_size_option(self, value: int) -> int:
        """A ``max_batch_size`` option checked against the compiled variants (0: the
        largest variant's rows)."""
        largest = self.model.max_rows
        if not 0 <= value <= largest:
            raise BatcherError(f"max_batch_size must be 1..{largest} (the largest compiled "
                               f"variant of {self.model.name}), got {value}")
        return value or largest

    def fit(self, requests: list[Any]) -> VariantSpec | None:
        """The smallest variant taking ``requests`` together."""
        if len(requests) == 1:
            r = requests[0]
            return self.model.fit(r.rows, r.seq_len)
        return self.model.fit(sum(r.rows for r in requests),
                              max(r.seq_len for r in requests))


# -- schedulers: batchers that drive their own jobs -----------------------------------------
class RequestRefused(ValueError):
    """Raised by :meth:`SchedulerBatcher.add` for a request it will not serve (a token id
    out of the vocabulary, a prompt too long): the stage answers that request alone with
    the message (status ``E_OPTIONS``); the scheduler keeps serving."""


class SchedulerContext(Protocol):
    """What the stage gives a :class:`SchedulerBatcher` (``start(ctx)``): the only way it
    reaches the dispatcher and the clients. Implemented by
    :class:`paella.dispatcher.batchers.stage.StageContext`; a test may pass its own.

    Every method may be called from any hook and from a job's ``on_done``."""

    #: The client-visible model's name (for messages).
    name: str
    #: The bundle's compiled variants as the dispatcher serves them, by index
    #: (``.spec``: VariantSpec, ``.model_id``: its dispatcher model, ``.layout``: its io
    #: layout); empty for a model without a bundle (a scheduler that defines its own io).
    variants: dict[int, Any]

    def now(self) -> float:
        """The device clock (seconds)."""

    def register_model(self, name: str, adaptor: Any, *, profile_runs: int | None = 0) -> int:
        """Register an internal dispatcher model (an iteration, a stage variant): its own
        launch plan and SRPT profile. Returns its id, for :meth:`submit`. ``profile_runs``:
        jobs run to seed its profile (None: the dispatcher's own setting, as its variants
        got)."""

    def submit(self, model_id: int, io: Any, clients: "list[int]",
               on_done: "Callable[[int, str | None], None]", stream: str | None = None,
               priority: int = 0, bindings: Any = None, ready: Any = None) -> None:
        """Run one job of internal model ``model_id`` on ``io`` (a 1-D uint8 numpy
        array the scheduler owns; a request's own ``req.io`` is allowed too) on behalf
        of ``clients`` (client ids, one part each: the policy's fairness and the GPU
        share see them; a client that leaves cancels its part, and a job whose parts
        are all cancelled stops). ``on_done(status, error)`` is called once when the job
        ended: ``OK`` if it ran for any client, else the first part's status.
        ``stream``: run the job's ops on a real stream of the scheduler's own, reserved
        under that name (DVABatch: one per stage executor); jobs of one name follow one
        another in that stream's order (``Dispatcher.stream_named``). None: streams from
        the dispatcher's pool, as any job. ``priority``: the class the job runs at (its
        most urgent request's, as ``Request.priority``: 1 the most urgent; 0 the
        default), which every built-in policy orders by first. ``bindings``: the job's
        buffer set, bound by the scheduler (its model's pool takes it back when the job
        ends; DVABatch binds stage plans to its pairs' device memory). ``ready``: the
        future of what the job's kernels compute on the simulated GPU, being computed
        elsewhere (``Dispatcher.submit_group``)."""

    def adaptor(self, model_id: int) -> Any:
        """The job adaptor of a variant or of a model it registered (its plan)."""

    def alloc(self, nbytes: int) -> int:
        """Device memory (a pointer) owned by this scheduler; freed by :meth:`free`, or
        by the stage once the scheduler is closed and its jobs are over."""

    def free(self, ptr: int) -> None: ...

    def view(self, ptr: int, nbytes: int) -> Any:
        """A host numpy view of device memory (the simulated GPU's functional memory;
        the CUDA backend raises: copy through a job instead)."""

    @property
    def device_props(self) -> Any:
        """The device's properties (PCIe bandwidth, peak FLOPs: for cost decisions)."""

    @property
    def effects(self) -> Any:
        """Where the simulated GPU's functional computations run (``submit(fn, *args) ->
        Future``: the daemon's worker processes, never its loop); None on a real GPU."""

    def progress(self, req: Any, n: int) -> bool:
        """``n`` outputs of ``req`` are valid in its io region so far (streaming): the
        client is told if it asked to stream and its completion ring has room; counts
        are cumulative, so one the client misses is covered by the next. False if the
        stage does not hold ``req`` (already answered, or cancelled)."""

    def complete(self, req: Any, status: int = 0, error: str | None = None) -> bool:
        """Answer ``req`` (exactly once: a second call is refused and logged; False)."""

    def held(self) -> "list[Any]":
        """The requests handed to this scheduler and not answered yet."""

    def run_virtual(self, front: Any = None, arrivals: Any = (), submit: Any = None,
                    until: Any = None, *, name: str = "scheduler") -> bool:
        """Virtual time only (a scheduler its caller drives: experiments, tests): step
        the dispatcher and ``front`` (a ``virtual_time.FrontStage``: the scheduler's own
        work in front of it) until nothing is left, ``submit(due)`` called at each
        instant of ``arrivals``; see ``VirtualDriver.run``. The daemon's loop drives a
        served scheduler: there it raises."""


class SchedulerBatcher(Batcher):
    """Base class of a batcher that drives its own jobs (see the module docstring).

    Hooks (all optional but ``add``; the stage guards each: one that raises takes the
    scheduler out of service, every request it held is answered ``E_INTERNAL`` with the
    reason, and later requests of its model too, until a reload):

    * ``start(ctx)``            once, before any request: register internal models,
                                allocate device memory (a failure here refuses the model
                                at load time, with the reason);
    * ``add(req, now)``         a request arrived; the scheduler owns it until it calls
                                ``ctx.complete(req, ...)``. Raise :class:`RequestRefused`
                                to refuse this one request cleanly;
    * ``poll(now)``             called at ``deadline()`` (and whenever the loop has time);
    * ``deadline()``            when ``poll`` must run next (None: jobs' ``on_done`` drive it);
    * ``remove_client(cid)``    the client went away: forget its requests (the stage
                                answers those still held as cancelled, and cancels the
                                client's parts of running jobs);
    * ``close()``               the daemon abandons the model (drain deadline passed, or
                                the model was replaced and drained): stop submitting. The
                                stage answers what is still held as cancelled and frees
                                the device memory once no job of it is running.

    ``standalone = True``: the scheduler defines the model's io itself
    (:meth:`client_variants`), and a model repository folder needs only a ``config.toml``
    naming it (no bundle): ``ModelVariants`` then has one placeholder variant.
    """

    drives_jobs: ClassVar[bool] = True
    standalone: ClassVar[bool] = False

    def start(self, ctx: SchedulerContext) -> None:
        self.ctx = ctx

    def add(self, req: Any, now: float) -> None:        # type: ignore[override]
        raise NotImplementedError("need add")

    def poll(self, now: float) -> None:                  # type: ignore[override]
        return None

    def close(self) -> None:
        pass

    def client_variants(self) -> list:
        """Standalone schedulers: the io layout clients see (``paella.wire.VariantInfo``
        list, one per variant a request can name)."""
        raise NotImplementedError(f"scheduler {self.name!r} is not standalone")
