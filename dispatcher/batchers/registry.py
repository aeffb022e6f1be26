"""The batcher registry: names to batcher classes, built-ins and plug-ins.

The same mechanism as the policies' (:class:`paella.plugins.PluginRegistry`): batchers
register with ``@register_batcher("name")`` (the built-ins when the package
:mod:`paella.dispatcher.batchers` is imported); other packages add theirs through the
entry-point group ``paella.batchers`` (``name = "module:Class"``). Names are
case-insensitive and ``_`` equals ``-``. Unknown or duplicate names raise
:class:`BatcherError`; an entry point that cannot be loaded is skipped and logged, and
asking for its name then raises with the reason.

A batcher's options are the keyword parameters of its ``__init__`` after ``model``;
:func:`check_options` checks names and plain-type annotations before it is built, so
a bad ``config.toml`` is refused at load time with the valid options listed.
"""
from __future__ import annotations

from typing import Any, Callable

from paella.plugins import PLUGIN_ERRORS, PluginRegistry

from .base import Batcher, BatcherError

ENTRY_POINT_GROUP = "paella.batchers"
DEFAULT_BATCHER = "identity"
REGISTRY = PluginRegistry("batcher", "batcher", "batchers", Batcher, BatcherError,
                          ENTRY_POINT_GROUP, fixed_args=2)          # self, model


def register_batcher(name: str) -> Callable[[type[Batcher]], type[Batcher]]:
    return REGISTRY.register(name)


def get_batcher(name: str) -> type[Batcher]:
    """The batcher class registered under ``name`` (built-ins, then plug-ins)."""
    return REGISTRY.get(name)


def batcher_names() -> list[str]:
    return REGISTRY.names()


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
