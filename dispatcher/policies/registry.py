"""The scheduling-policy registry: names to policy classes, built-ins and plug-ins.

Policies register with ``@register_policy("name")`` (the built-ins are registered when
the package :mod:`paella.dispatcher.policies` is imported, which importing this module
does first); other packages add theirs through the entry-point group
``paella.policies`` (``name = "module:Class"``). Names are case-insensitive and ``_``
equals ``-``. Unknown or duplicate names raise. An entry point that cannot be loaded (its
module is missing, it raises on import, its name is taken) is skipped and logged, so one
broken distribution does not break the others; asking for that name then raises with
the reason.

A policy's options are the keyword parameters of its ``__init__`` (up the class chain
while each passes ``**options`` on); :func:`check_options` checks names and, where the
parameter is annotated with plain types (``float``, ``int``, ``str``, ``bool``,
``X | None``), types, before the policy is ever built.
"""
from __future__ import annotations

import inspect
import logging
import types
import typing
from importlib import metadata
from typing import Any, Callable

from .base import Policy, PolicyError

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "paella.policies"
_REGISTRY: dict[str, type["Policy"]] = {}
#: Entry points that could not be loaded: normalized name -> why (logged once).
_BROKEN: dict[str, str] = {}


def _norm(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def register_policy(name: str) -> Callable[[type["Policy"]], type["Policy"]]:
    def deco(cls: type[Policy]) -> type[Policy]:
        key = _norm(name)
        if key in _REGISTRY and _REGISTRY[key] is not cls:
            raise PolicyError(f"policy name {key!r} is already registered by "
                              f"{_REGISTRY[key].__module__}.{_REGISTRY[key].__qualname__}; "
                              f"choose another name")
        if "name" not in cls.__dict__:
            cls.name = key
        _REGISTRY[key] = cls
        return cls
    return deco


def _load_entry_points() -> None:
    """Register every plug-in not registered yet. Each entry point is isolated: one that
    fails is recorded in ``_BROKEN`` and logged, and the others still load."""
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        key = _norm(ep.name)
        if key in _REGISTRY or key in _BROKEN:
            continue
        dist = getattr(ep, "dist", None)
        where = f"entry point {ep.name} = {ep.value!r}" + (
            f" of distribution {dist.name} {dist.version}" if dist is not None else "")
        try:
            cls = ep.load()
            if not (isinstance(cls, type) and issubclass(cls, Policy)):
                raise PolicyError(f"{ep.value} is not a Policy subclass")
            register_policy(ep.name)(cls)
        except Exception as e:  # noqa: BLE001 - a broken plug-in must not break the others
            _BROKEN[key] = f"{where} failed to load: {type(e).__name__}: {e}"
            log.warning("scheduling policy plug-in skipped: %s", _BROKEN[key])


def get_policy(name: str) -> type["Policy"]:
    """The policy class registered under ``name`` (built-ins, then plug-ins)."""
    key = _norm(name)
    if key not in _REGISTRY:
        _load_entry_points()
    if key in _BROKEN and key not in _REGISTRY:
        raise PolicyError(f"scheduling policy {name!r} is unavailable: {_BROKEN[key]}; "
                          f"reinstall or remove that plug-in, or choose another policy "
                          f"({', '.join(sorted(_REGISTRY))})")
    try:
        return _REGISTRY[key]
    except KeyError:
        raise PolicyError(f"unknown scheduling policy {name!r}; known policies: "
                          f"{', '.join(sorted(_REGISTRY))} (plug-ins register under the "
                          f"entry-point group {ENTRY_POINT_GROUP!r})") from None


def policy_names() -> list[str]:
    _load_entry_points()
    return sorted(_REGISTRY)


def options_of(cls: type["Policy"]) -> dict[str, Any]:
    """The options ``cls`` accepts: parameter name -> type hint (None if unknown).

    Walks the class chain from ``cls`` while each ``__init__`` passes ``**options`` on,
    and stops at :class:`Policy`, whose ``__init__`` refuses any option."""
    opts: dict[str, Any] = {}
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        if klass is Policy or klass is object:
            break
        try:
            hints = typing.get_type_hints(init)
        except Exception:  # noqa: BLE001 - an unresolvable annotation: no type check
            hints = {}
        passes_on = False
        for i, p in enumerate(inspect.signature(init).parameters.values()):
            if p.kind is p.VAR_KEYWORD:
                passes_on = True
            elif p.kind is not p.VAR_POSITIONAL and i >= 2:   # after self, dispatcher
                opts.setdefault(p.name, hints.get(p.name))
        if not passes_on:
            break
    return opts


def _accepts(hint: Any, value: Any) -> bool:
    """Whether ``value`` (from TOML or the command line) fits a plain type hint; hints
    this cannot judge (Literal, generics) are left to the policy's own checks."""
    if hint is None or hint is Any:
        return True
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    for t in (typing.get_args(hint) if union else (hint,)):
        if t is type(None):
            continue
        if not isinstance(t, type):
            return True
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return True
        if t not in (int, float) and isinstance(value, t):
            return True
    return False


def _type_name(hint: Any) -> str:
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    names = [getattr(t, "__name__", str(t)) for t in (typing.get_args(hint) if union else (hint,))
             if t is not type(None)]
    return " or ".join("a number" if n == "float" else f"an {n}" if n == "int" else f"a {n}"
                       for n in names)


def check_options(name: str, options: dict[str, Any],
                  extra: dict[str, Any] | None = None) -> None:
    """Raise :class:`PolicyError` for an option policy ``name`` does not take (listing
    the valid ones) or a value of the wrong type. ``extra``: options the caller
    handles itself (the dispatcher's ``extra_blocks``), name -> type hint."""
    cls = get_policy(name)
    valid = {**(extra or {}), **options_of(cls)}
    for key, value in options.items():
        if key not in valid:
            raise PolicyError(f"policy {cls.name!r} has no parameter {key!r}; valid parameters: "
                              f"{', '.join(sorted(valid)) or 'none'}")
        if not _accepts(valid[key], value):
            raise PolicyError(f"policy parameter {key} must be {_type_name(valid[key])}, "
                              f"got {value!r}")
