"""Plug-in registries: names to classes, built-ins and entry points, with checked options.

Scheduling policies (:mod:`paella.dispatcher.policies.registry`) and batchers
(:mod:`paella.dispatcher.batchers.registry`) are both found by name this way, so the
mechanism is written once here and each kind only names itself:

* classes register with a decorator (``@registry.register("name")``); other packages
  add theirs through an entry-point group (``name = "module:Class"``). Names are
  case-insensitive and ``_`` equals ``-``. Unknown or duplicate names raise the kind's
  error;
* an entry point that cannot be loaded (module missing, raising on import, not a
  subclass, name taken) is skipped and logged, so one broken distribution does not break
  the others; asking for that name then raises with the reason;
* a class's options are the keyword parameters of its ``__init__`` after the fixed
  positional ones (up the class chain while each passes ``**options`` on);
  :meth:`PluginRegistry.check_options` checks names and, where annotated with plain
  types (``float``, ``int``, ``str``, ``bool``, ``X | None``), types, before the class
  is ever built.
"""
from __future__ import annotations

import inspect
import logging
import types
import typing
from importlib import metadata
from typing import Any, Callable

log = logging.getLogger(__name__)


#: Where the plug-ins loaded from entry points live: the top-level package of each class's
#: module (its full module name when that package is ``paella`` itself). The daemon's
#: watchdog (:mod:`paella.dispatcher.daemon.watchdog`) interrupts only code from these.
PLUGIN_PACKAGES: set[str] = set()


#: What a call into a plug-in may raise and the daemon survives: any exception, and
#: ``sys.exit()`` (``SystemExit``), which must not end a daemon other clients use. (Free
#: on the hot path: an ``except`` clause costs nothing until something is raised.)
PLUGIN_ERRORS: tuple[type[BaseException], ...] = (Exception, SystemExit)


def plugin_package(module: str) -> str:
    """What :data:`PLUGIN_PACKAGES` holds for a class defined in ``module``."""
    top = module.partition(".")[0]
    return module if top == "paella" else top


def norm(name: str) -> str:
    return name.strip().lower().replace("_", "-")


class PluginRegistry:
    """One kind of plug-in. ``kind`` names it in messages ("scheduling policy"),
    ``short`` where the message is about one ("policy"), ``plural`` for the list;
    ``fixed_args``: the positional parameters of ``__init__`` before the options (self
    and what the caller passes); ``option`` is what an option is called ("parameter")."""

    def __init__(self, kind: str, short: str, plural: str, base: type, error: type[Exception],
                 group: str, fixed_args: int, option: str = "option"):
        self.kind, self.short, self.plural = kind, short, plural
        self.base, self.error, self.group = base, error, group
        self.fixed_args, self.option = fixed_args, option
        self.classes: dict[str, type] = {}
        #: Entry points that could not be loaded: normalized name -> why (logged once).
        self.broken: dict[str, str] = {}

    def register(self, name: str) -> Callable[[type], type]:
        def deco(cls: type) -> type:
            key = norm(name)
            old = self.classes.get(key)
            if old is not None and old is not cls:
                raise self.error(f"{self.short} name {key!r} is already registered by "
                                 f"{old.__module__}.{old.__qualname__}; choose another name")
            if "name" not in cls.__dict__:
                cls.name = key
            self.classes[key] = cls
            return cls
        return deco

    def load_entry_points(self) -> None:
        """Register every plug-in not registered yet; one that fails is recorded in
        :attr:`broken` and logged, and the others still load."""
        for ep in metadata.entry_points(group=self.group):
            key = norm(ep.name)
            if key in self.classes or key in self.broken:
                continue
            dist = getattr(ep, "dist", None)
            where = f"entry point {ep.name} = {ep.value!r}" + (
                f" of distribution {dist.name} {dist.version}" if dist is not None else "")
            try:
                cls = ep.load()
                if not (isinstance(cls, type) and issubclass(cls, self.base)):
                    raise self.error(f"{ep.value} is not a {self.base.__name__} subclass")
                self.register(ep.name)(cls)
                PLUGIN_PACKAGES.add(plugin_package(cls.__module__))
            except PLUGIN_ERRORS as e:  # a broken plug-in must not
                # break the others (nor end the process: sys.exit() at import is SystemExit)
                self.broken[key] = f"{where} failed to load: {type(e).__name__}: {e}"
                log.warning("%s plug-in skipped: %s", self.kind, self.broken[key])

    def get(self, name: str) -> type:
        """The class registered under ``name`` (built-ins, then plug-ins)."""
        if not isinstance(name, str):
            raise self.error(f"a {self.short} name must be a string, got {name!r}")
        key = norm(name)
        if key not in self.classes:
            self.load_entry_points()
        if key in self.broken and key not in self.classes:
            raise self.error(f"{self.kind} {name!r} is unavailable: {self.broken[key]}; "
                             f"reinstall or remove that plug-in, or choose another "
                             f"{self.short} ({self.known()})")
        try:
            return self.classes[key]
        except KeyError:
            raise self.error(f"unknown {self.kind} {name!r}; known {self.plural}: {self.known()} "
                             f"(plug-ins register under the entry-point group "
                             f"{self.group!r})") from None

    def known(self) -> str:
        """The registered names, as the errors list them (a kind with sub-kinds may
        group them)."""
        return ", ".join(sorted(self.classes))

    def names(self) -> list[str]:
        self.load_entry_points()
        return sorted(self.classes)

    def options_of(self, cls: type) -> dict[str, Any]:
        """The options ``cls`` accepts: parameter name -> type hint (None if unknown),
        up the class chain while each ``__init__`` passes ``**options`` on, stopping at
        the base class (whose ``__init__`` refuses any option)."""
        opts: dict[str, Any] = {}
        for klass in cls.__mro__:
            init = klass.__dict__.get("__init__")
            if init is None:
                continue
            if klass is self.base or klass is object:
                break
            try:
                hints = typing.get_type_hints(init)
            except Exception:  # noqa: BLE001 - an unresolvable annotation: no type check
                hints = {}
            passes_on = False
            for i, p in enumerate(inspect.signature(init).parameters.values()):
                if p.kind is p.VAR_KEYWORD:
                    passes_on = True
                elif p.kind is not p.VAR_POSITIONAL and i >= self.fixed_args:
                    opts.setdefault(p.name, hints.get(p.name))
            if not passes_on:
                break
        return opts

    def check_options(self, name: str, options: dict[str, Any],
                      extra: dict[str, Any] | None = None) -> type:
        """The class of ``name``, once ``options`` are names it takes with values of
        acceptable types; else the kind's error listing the valid ones. ``extra``:
        options the caller handles itself, name -> type hint."""
        cls = self.get(name)
        valid = {**(extra or {}), **self.options_of(cls)}
        for key, value in options.items():
            if key not in valid:
                raise self.error(f"{self.short} {cls.name!r} has no {self.option} {key!r}; "
                                 f"valid {self.option}s: {', '.join(sorted(valid)) or 'none'}")
            if not accepts(valid[key], value):
                raise self.error(f"{self.short} {self.option} {key} must be "
                                 f"{type_name(valid[key])}, got {value!r}")
        return cls


def accepts(hint: Any, value: Any) -> bool:
    """Whether ``value`` (from TOML or the command line) fits a plain type hint; hints
    this cannot judge (Literal, generics) are left to the class's own checks."""
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


def type_name(hint: Any) -> str:
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    names = [getattr(t, "__name__", str(t)) for t in (typing.get_args(hint) if union else (hint,))
             if t is not type(None)]
    return " or ".join("a number" if n == "float" else f"an {n}" if n == "int" else f"a {n}"
                       for n in names)
