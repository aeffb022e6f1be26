"""Instrumentation: hooks on what the dispatcher does, free when nobody listens.

Subclass :class:`Instrument`, override the hooks you want, and add it to a dispatcher
(``Dispatcher(..., instruments=[mine])`` or ``dispatcher.instruments.add(mine)``).
Every hook is called synchronously from the dispatcher loop, with the device clock in
``dispatcher.now``:

* ``request_admitted(req)``     the dispatcher accepted the request (``submit``);
* ``request_started(req)``      its job started (after any wait for a buffer set);
* ``request_woken(req)``        its "almost finished" wake-up was sent
  (``on_almost_finished`` returned);
* ``request_finished(req)``     its completion was delivered (``on_complete`` returned);
  ``req.status`` and ``req.error`` say how it ended;
* ``request_retried(req)``      its job failed and the batching stage runs it again, alone
  (its batch's failure is not its answer): called by the stage before the new job, from
  the failed job's completion, whose ``request_finished`` still follows;
* ``job_finished(job)``         a job ended, just before its requests' completions;
  ``job.model`` is the model, ``job.kcount`` how often it released each kernel (one
  call per job where ``op_released`` is one per op: per-model kernel counts for free);
* ``op_issued(op)``             a job issued an op (kernel launch or copy) into its waitlist;
* ``op_released(op, t)``        the op went to a real stream at device time ``t``;
* ``op_started(op, t)``         the dispatcher learned that the op started on the device:
  a kernel's first PLACEMENT notification was read at ``t``; a copy's start is an event
  recorded before it on its stream, seen complete at ``t`` (such events are recorded
  only while someone listens to this hook);
* ``op_ended(op, t)``           the op completed on the device, as seen at ``t``
  (a kernel's last COMPLETION notification, a copy's event);
* ``answer_looked_up(job, t0, t1)`` the simulated GPU's answer lookup ahead of ``job``
  (``Dispatcher._await_answer``) ran on the loop from ``t0`` to ``t1``
  (``time.perf_counter`` seconds): the simulated device's functional work, which a real
  GPU does not have (``paella experiment overhead`` counts it as device time);
* ``model_removed(model)``      a retired model (``Dispatcher.retire_model``: a reload
  replaced it) had no job left and was removed, its adaptor closed.

Cost when unused (Trio's rule): the dispatcher tests ``"hook" in instruments``, one dict
lookup, before it builds any argument; an :class:`Instruments` maps a hook name only
while some instrument overrides it. An instrument that raises is logged and removed, so
a broken probe never takes the dispatcher down.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Iterable

log = logging.getLogger(__name__)

HOOKS = ("request_admitted", "request_started", "request_woken", "request_finished",
         "request_retried", "job_finished", "op_issued", "op_released", "op_started", "op_ended",
         "policy_held", "model_removed", "answer_looked_up")


class Instrument:
    """Base class of instruments: every hook does nothing; override the ones you need."""

    def request_admitted(self, req: Any) -> None:
        """The dispatcher accepted ``req``."""

    def request_started(self, req: Any) -> None:
        """``req``'s job started."""

    def request_woken(self, req: Any) -> None:
        """``req``'s "almost finished" wake-up was sent."""

    def request_finished(self, req: Any) -> None:
        """``req``'s completion was delivered."""

    def request_retried(self, req: Any) -> None:
        """``req``'s job failed; the batching stage runs it again, alone."""

    def job_finished(self, job: Any) -> None:
        """``job`` ended (completed, failed or cancelled)."""

    def answer_looked_up(self, job: Any, t0: float, t1: float) -> None:
        """The simulated GPU's answer lookup ahead of ``job`` ran from ``t0`` to ``t1``
        (``time.perf_counter`` seconds)."""

    def model_removed(self, model: Any) -> None:
        """A retired model's last job ended; its adaptor is closed (Dispatcher.retire_model)."""

    def op_issued(self, op: Any) -> None:
        """A job issued ``op`` into its waitlist."""

    def op_released(self, op: Any, t: float) -> None:
        """``op`` went to a real stream at device time ``t``."""

    def op_started(self, op: Any, t: float) -> None:
        """``op`` was seen started on the device at ``t``."""

    def op_ended(self, op: Any, t: float) -> None:
        """``op`` was seen completed on the device at ``t``."""

    def policy_held(self, queued: int, t: float) -> None:
        """The policy released nothing at ``t`` although ``queued`` jobs had a ready
        kernel (a hold: paella's class, hold and order rules, a strict priority, a plug-in's
        choice); reported at the first such pick after a release, not at every poll."""


class Instruments(dict):
    """hook name -> {instrument: its bound hook} (insertion-ordered), holding only the hooks
    that some added instrument overrides: ``"op_released" in instruments`` is the whole
    cost of a hook nobody listens to."""

    def __init__(self, instruments: Iterable[Instrument] = ()):
        super().__init__()
        for instrument in instruments:
            self.add(instrument)

    def add(self, instrument: Instrument) -> None:
        """Start calling ``instrument``'s overridden hooks."""
        if not isinstance(instrument, Instrument):
            raise TypeError(f"an instrument must subclass paella.dispatcher.instruments."
                            f"Instrument, got {type(instrument).__name__}")
        for hook in HOOKS:
            if getattr(type(instrument), hook) is not getattr(Instrument, hook):
                self.setdefault(hook, {})[instrument] = getattr(instrument, hook)

    def remove(self, instrument: Instrument) -> None:
        """Stop calling ``instrument`` (KeyError if it was never added)."""
        found = False
        for hook in list(self):
            if self[hook].pop(instrument, None) is not None:
                found = True
            if not self[hook]:
                del self[hook]
        if not found:
            raise KeyError(f"instrument {instrument!r} is not installed")

    def call(self, hook: str, *args: Any) -> None:
        """Call ``hook`` on every instrument that listens to it (check ``hook in self``
        first on hot paths). One that raises is logged and removed."""
        for instrument, fn in list(self.get(hook, {}).items()):
            try:
                fn(*args)
            except Exception:
                log.exception("instrument %r raised in %s(); removing it", instrument, hook)
                self.remove(instrument)


#: Factories called with every Dispatcher made while they are registered (see
#: :func:`instrument_every_dispatcher`).
_EVERY: list[Callable[[Any], "Instrument | None"]] = []


@contextmanager
def instrument_every_dispatcher(factory: Callable[[Any], "Instrument | None"]) -> Iterator[None]:
    """While the ``with`` block runs, each new Dispatcher calls ``factory(dispatcher)``
    and installs the instrument it returns (None: none). Why: a tool that observes a
    whole run it did not write (``paella experiment NAME --trace FILE``) cannot pass
    its instrument to the dispatchers the run makes."""
    _EVERY.append(factory)
    try:
        yield
    finally:
        _EVERY.remove(factory)


def every_dispatcher_instruments(dispatcher: Any) -> list[Instrument]:
    """The instruments of the registered factories for a new ``dispatcher``."""
    made = (make(dispatcher) for make in list(_EVERY))
    return [i for i in made if i is not None]
