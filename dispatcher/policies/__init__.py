"""Scheduling policies: the interface (:mod:`.base`), the registry (:mod:`.registry`) and
one module per built-in policy, each registering itself when this package is imported."""
from .base import HeapPolicy, Policy, PolicyError
from .registry import (ENTRY_POINT_GROUP, check_options, get_policy, options_of, policy_names,
                       register_policy)
from . import fifo, ms_jbj, ms_kbk, paella, priority, rr, sjf, slack  # noqa: E402,F401  (built-ins register)

__all__ = ["ENTRY_POINT_GROUP", "HeapPolicy", "Policy", "PolicyError", "check_options",
           "get_policy", "options_of", "policy_names", "register_policy"]
