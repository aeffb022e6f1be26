"""The scheduling-policy registry: names to policy classes, built-ins and plug-ins.

Policies register with ``@register_policy("name")`` (the built-ins are registered when
the package :mod:`paella.dispatcher.policies` is imported, which importing this module
does first); other packages add theirs through the entry-point group
``paella.policies`` (``name = "module:Class"``). Names are case-insensitive and ``_``
equals ``-``. Unknown or duplicate names raise. An entry point that cannot be loaded (its
module is missing, it raises on import, its name is taken) is skipped and logged, so one
broken distribution does not break the others; asking for that name then raises with
the reason.

The mechanism is :class:`paella.plugins.PluginRegistry`, shared with the batchers.
A policy's options are the keyword parameters of its ``__init__`` (up the class chain
while each passes ``**options`` on); :func:`check_options` checks names and, where the
parameter is annotated with plain types (``float``, ``int``, ``str``, ``bool``,
``X | None``), types, before the policy is ever built.
"""
from __future__ import annotations

from typing import Any, Callable

from paella.plugins import PluginRegistry

from .base import Policy, PolicyError

ENTRY_POINT_GROUP = "paella.policies"
REGISTRY = PluginRegistry("scheduling policy", "policy", "policies", Policy, PolicyError,
                          ENTRY_POINT_GROUP, fixed_args=2, option="parameter")   # self, dispatcher
_REGISTRY = REGISTRY.classes


def register_policy(name: str) -> Callable[[type[Policy]], type[Policy]]:
    return REGISTRY.register(name)


def get_policy(name: str) -> type[Policy]:
    """The policy class registered under ``name`` (built-ins, then plug-ins)."""
    return REGISTRY.get(name)


def policy_names() -> list[str]:
    return REGISTRY.names()


def options_of(cls: type[Policy]) -> dict[str, Any]:
    """The options ``cls`` accepts: parameter name -> type hint (None if unknown)."""
    return REGISTRY.options_of(cls)


def check_options(name: str, options: dict[str, Any],
                  extra: dict[str, Any] | None = None) -> None:
    """Raise :class:`PolicyError` for an option policy ``name`` does not take (listing
    the valid ones) or a value of the wrong type. ``extra``: options the caller
    handles itself (the dispatcher's ``extra_blocks``), name -> type hint."""
    REGISTRY.check_options(name, options, extra)
