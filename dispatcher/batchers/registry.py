"""The batching stage's registry: names to plug-in classes of both kinds, batchers and
schedulers, built-ins and third parties alike.

The same mechanism as the policies' (:class:`paella.plugins.PluginRegistry`). A *batcher*
(:class:`~.base.Batcher`) forms batches the stage runs; a *scheduler*
(:class:`~.base.SchedulerBatcher`: DVABatch, Orca, BatchMaker's cells) drives its own
jobs through the scheduler context. Both are named by ``[batching] batcher = "..."`` in
a model's ``config.toml`` and found here, by one name space:

* the built-in batchers of this package register with ``@register_batcher("name")``
  when :mod:`paella.dispatcher.batchers` is imported;
* every scheduler, the built-in ones (:mod:`paella.stepsched`) included, and any
  batcher of another package, through the entry-point group ``paella.batchers``
  (``name = "module:Class"``): the dispatcher never imports them.

Names are case-insensitive and ``_`` equals ``-``. An unknown name raises
:class:`BatcherError` listing the known batchers and schedulers; a duplicate name
raises too; an entry point that cannot be loaded is skipped and logged, and asking for
its name then raises with the reason.

A plug-in's options are the keyword parameters of its ``__init__`` after ``model``;
:func:`check_options` checks names and plain-type annotations before it is built, so
a bad ``config.toml`` is refused at load time with the valid options listed.
"""
from __future__ import annotations

from typing import Any, Callable

from paella.plugins import PLUGIN_ERRORS, PluginRegistry

from .base import Batcher, BatcherError, SchedulerBatcher

ENTRY_POINT_GROUP = "paella.batchers"
DEFAULT_BATCHER = "identity"


class BatchingRegistry(PluginRegistry):
    """The one registry of both kinds; its errors list each kind apart."""

    def known(self) -> str:
        kinds = ([n for n, c in sorted(self.classes.items()) if not c.drives_jobs],
                 [n for n, c in sorted(self.classes.items()) if c.drives_jobs])
        return f"{', '.join(kinds[0]) or 'none'}; schedulers: {', '.join(kinds[1]) or 'none'}"


REGISTRY = BatchingRegistry("batcher", "batcher", "batchers", Batcher, BatcherError,
                            ENTRY_POINT_GROUP, fixed_args=2)        # self, model


def register_batcher(name: str) -> Callable[[type[Batcher]], type[Batcher]]:
    return REGISTRY.register(name)


def get_batcher(name: str) -> type[Batcher]:
    """The batcher class registered under ``name`` (built-ins, then plug-ins)."""
    return REGISTRY.get(name)


def batcher_names() -> list[str]:
    """Every name, batchers' and schedulers'."""
    return REGISTRY.names()


def get_scheduler(name: str) -> type[SchedulerBatcher]:
    """The scheduler class registered under ``name``; :class:`BatcherError` if the name
    is unknown or names a plain batcher (which drives no jobs of its own)."""
    cls = REGISTRY.get(name)
    if not cls.drives_jobs:
        raise BatcherError(f"{name!r} is a batcher, not a scheduler (it forms batches the "
                           f"stage runs); schedulers: {', '.join(scheduler_names()) or 'none'}")
    return cls


def scheduler_names() -> list[str]:
    """The names of the schedulers (built-ins and plug-ins)."""
    return [n for n in REGISTRY.names() if REGISTRY.classes[n].drives_jobs]


def options_of(cls: type[Batcher]) -> dict[str, Any]:
    """The options ``cls`` accepts: parameter name -> type hint (None if unknown)."""
    return REGISTRY.options_of(cls)


def check_options(name: str, options: dict[str, Any]) -> type[Batcher]:
    """The class of batcher ``name``, once its ``options`` are known and of plain
    acceptable types; else :class:`BatcherError` listing the valid options."""
    return REGISTRY.check_options(name, options)


def make_batcher(name: str, model: Any, options: dict[str, Any] | None = None) -> Batcher:
    """Build batcher ``name`` for ``model`` with ``options``: any failure of the plug-in's
    ``__init__`` (a bad value) becomes a :class:`BatcherError` naming the batcher."""
    opts = dict(options or {})
    cls = check_options(name, opts)
    try:
        return cls(model, **opts)
    except BatcherError:
        raise
    except PLUGIN_ERRORS as e:  # a plug-in may raise anything, sys.exit() included
        raise BatcherError(f"batcher {cls.name!r} refused its options for model "
                           f"{getattr(model, 'name', model)!r}: {type(e).__name__}: {e}") from None
