"""The batcher registry: names to batcher classes, built-ins and plug-ins.

Mirrors the policy registry (:mod:`paella.dispatcher.policies.registry`): batchers
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

import inspect
import logging
import typing
from importlib import metadata
from typing import Any, Callable

from ..policies.registry import _accepts, _type_name
from .base import Batcher, BatcherError

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "paella.batchers"
DEFAULT_BATCHER = "identity"
_REGISTRY: dict[str, type[Batcher]] = {}
_BROKEN: dict[str, str] = {}


def _norm(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def register_batcher(name: str) -> Callable[[type[Batcher]], type[Batcher]]:
    def deco(cls: type[Batcher]) -> type[Batcher]:
        key = _norm(name)
        if key in _REGISTRY and _REGISTRY[key] is not cls:
            raise BatcherError(f"batcher name {key!r} is already registered by "
                               f"{_REGISTRY[key].__module__}.{_REGISTRY[key].__qualname__}; "
                               f"choose another name")
        if "name" not in cls.__dict__:
            cls.name = key
        _REGISTRY[key] = cls
        return cls
    return deco


def _load_entry_points() -> None:
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        key = _norm(ep.name)
        if key in _REGISTRY or key in _BROKEN:
            continue
        try:
            cls = ep.load()
            if not (isinstance(cls, type) and issubclass(cls, Batcher)):
                raise BatcherError(f"{ep.value} is not a Batcher subclass")
            register_batcher(ep.name)(cls)
        except Exception as e:  # noqa: BLE001 - a broken plug-in must not break the others
            _BROKEN[key] = f"entry point {ep.name} = {ep.value!r} failed to load: " \
                           f"{type(e).__name__}: {e}"
            log.warning("batcher plug-in skipped: %s", _BROKEN[key])


def get_batcher(name: str) -> type[Batcher]:
    """The batcher class registered under ``name`` (built-ins, then plug-ins)."""
    if not isinstance(name, str):
        raise BatcherError(f"a batcher name must be a string, got {name!r}")
    key = _norm(name)
    if key not in _REGISTRY:
        _load_entry_points()
    if key in _BROKEN and key not in _REGISTRY:
        raise BatcherError(f"batcher {name!r} is unavailable: {_BROKEN[key]}; reinstall or "
                           f"remove that plug-in, or choose another batcher "
                           f"({', '.join(sorted(_REGISTRY))})")
    try:
        return _REGISTRY[key]
    except KeyError:
        raise BatcherError(f"unknown batcher {name!r}; known batchers: "
                           f"{', '.join(sorted(_REGISTRY))} (plug-ins register under the "
                           f"entry-point group {ENTRY_POINT_GROUP!r})") from None


def batcher_names() -> list[str]:
    _load_entry_points()
    return sorted(_REGISTRY)


def options_of(cls: type[Batcher]) -> dict[str, Any]:
    """The options ``cls`` accepts: parameter name -> type hint (None if unknown), up the
    class chain while each ``__init__`` passes ``**options`` on."""
    opts: dict[str, Any] = {}
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        if klass is Batcher or klass is object:
            break
        try:
            hints = typing.get_type_hints(init)
        except Exception:  # noqa: BLE001 - an unresolvable annotation: no type check
            hints = {}
        passes_on = False
        for i, p in enumerate(inspect.signature(init).parameters.values()):
            if p.kind is p.VAR_KEYWORD:
                passes_on = True
            elif p.kind is not p.VAR_POSITIONAL and i >= 2:   # after self, model
                opts.setdefault(p.name, hints.get(p.name))
        if not passes_on:
            break
    return opts


def check_options(name: str, options: dict[str, Any]) -> type[Batcher]:
    """The class of batcher ``name``, once its ``options`` are known and of plain
    acceptable types; else :class:`BatcherError` listing the valid options."""
    cls = get_batcher(name)
    valid = options_of(cls)
    for key, value in options.items():
        if key not in valid:
            raise BatcherError(f"batcher {cls.name!r} has no option {key!r}; valid options: "
                               f"{', '.join(sorted(valid)) or 'none'}")
        if not _accepts(valid[key], value):
            raise BatcherError(f"batcher option {key} must be {_type_name(valid[key])}, "
                               f"got {value!r}")
    return cls


def make_batcher(name: str, model: Any, options: dict[str, Any] | None = None) -> Batcher:
    """Build batcher ``name`` for ``model`` with ``options``: any failure of the plug-in's
    ``__init__`` (a bad value) becomes a :class:`BatcherError` naming the batcher."""
    opts = dict(options or {})
    cls = check_options(name, opts)
    try:
        return cls(model, **opts)
    except BatcherError:
        raise
    except Exception as e:  # noqa: BLE001 - a plug-in may raise anything on bad values
        raise BatcherError(f"batcher {cls.name!r} refused its options for model "
                           f"{getattr(model, 'name', model)!r}: {type(e).__name__}: {e}") from None
