"""The model repository: reading bundles off the dispatcher loop.

Loading a bundle is slow: the manifest and params are read, the adaptor is built and,
on the simulator, the bundle's CPU build is loaded (a shared object: ~1 s for big
models) to answer the profiling runs. Done inside the loop, a SIGHUP reload stalled
every client for as long (189 ms worst latency against 19 ms). So the daemon splits a
load in two:

* :func:`scan` does everything that needs no loop state, in any thread: it lists the
  repository, keeps what did not change, and turns each new or changed bundle into a
  :class:`Prepared` model (adaptor built and warmed). A bad bundle fails alone, with
  its reason; the others go on.
* the daemon's loop then *swaps* (registers the prepared models with the dispatcher and
  replaces the model table) between two iterations, so clients see either the old set
  of models or the new one.

:class:`BackgroundScan` runs :func:`scan` in a thread for a reload. The thread holds the
GIL only for Python work: reading a shared object and TVM's CPU kernels release it.
"""
from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

log = logging.getLogger("paella.repository")

#: Generation numbers of registered bundles: a changed bundle registers under a new
#: name (``model#gen``), so that jobs of the old version keep their own model.
_generations = itertools.count(1)


@dataclass
class Prepared:
    """A new or changed bundle, read and warmed off the loop: what the swap registers."""
    directory: str
    model: str
    key: tuple                 # (manifest cache key, manifest mtime): "changed" means this
    bundle: Any                # paella.bundle.Bundle
    adaptor: Any               # a JobAdaptor, ready for Dispatcher.register_model
    label: str                 # the dispatcher's name for this version: model#gen
    seconds: float             # how long preparing it took


@dataclass
class Scan:
    """One pass over the repository."""
    path: str
    prepared: list[Prepared] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)       # directory -> unchanged model
    failed: dict[str, str] = field(default_factory=dict)     # directory -> why
    interrupted: bool = False                                # stop() said so midway
    seconds: float = 0.0

    @property
    def found(self) -> int:
        """Bundles in the repository (served, kept or failed)."""
        return len(self.prepared) + len(self.kept) + len(self.failed)


def scan(path: str, known: dict[str, tuple], make_adaptor: Callable[[Any, str], Any],
         stop: Callable[[], bool] = lambda: False) -> Scan:
    """Read every bundle directory under ``path``.

    ``known``: model name -> key of the version being served; a bundle whose key is
    unchanged is only listed in ``kept``. ``make_adaptor(bundle, label)`` builds the
    adaptor; if it has a ``warm()`` method, that runs here too. ``stop()`` is asked
    between bundles (SIGTERM during start-up). Touches no loop state.
    """
    from paella.bundle import BundleError, load_bundle
    t0 = time.monotonic()
    out = Scan(path)
    seen: dict[str, str] = {}
    for d in sorted(os.listdir(path)):
        bdir = os.path.join(path, d)
        if not os.path.isfile(os.path.join(bdir, "manifest.json")):
            continue
        if stop():
            out.interrupted = True
            break
        t1 = time.monotonic()
        try:
            bundle = load_bundle(bdir)
            model = bundle.model
            if model in seen:
                raise ValueError(f"model {model!r} is already served from {seen[model]}; "
                                 f"give each bundle its own model name")
            seen[model] = bdir
            key = (bundle.manifest.cache_key, os.path.getmtime(bundle.path / "manifest.json"))
            if known.get(model) == key:
                out.kept[bdir] = model
                continue
            label = f"{model}#{next(_generations)}"
            adaptor = make_adaptor(bundle, label)
            warm = getattr(adaptor, "warm", None)
            if warm is not None:
                warm()
        except Exception as e:  # noqa: BLE001 - a bad bundle fails alone, with its reason
            out.failed[bdir] = str(e) if isinstance(e, BundleError) else f"{type(e).__name__}: {e}"
            continue
        out.prepared.append(Prepared(bdir, model, key, bundle, adaptor, label,
                                     time.monotonic() - t1))
    out.seconds = time.monotonic() - t0
    return out


class BackgroundScan:
    """:func:`scan` in a thread of its own. ``done`` turns True (then ``notify()`` is
    called, to wake the loop) once ``result`` or ``error`` is set."""

    def __init__(self, notify: Callable[[], None], *args: Any, **kwargs: Any):
        self.result: Scan | None = None
        self.error: BaseException | None = None
        self.done = False
        self._notify = notify
        self._args, self._kwargs = args, kwargs
        # A daemon thread: a SIGTERM must not wait for a slow model to finish loading.
        self.thread = threading.Thread(target=self._run, name="paella-model-load", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.result = scan(*self._args, **self._kwargs)
        except BaseException as e:  # noqa: BLE001 - reported to the loop, which logs it
            self.error = e
        self.done = True
        self._notify()
