"""Batchers: requests grouped into jobs of a compiled variant (the interface,
:mod:`.base`; the registry, :mod:`.registry`; the built-ins, one module each; the
stage that runs them between the front end and the dispatcher, :mod:`.stage`)."""
from .base import Batch, Batcher, BatcherError, ModelVariants, VariantSpec
from .registry import (DEFAULT_BATCHER, ENTRY_POINT_GROUP, batcher_names, check_options,
                       get_batcher, make_batcher, options_of, register_batcher)
from . import dynamic, identity, turbo_dp  # noqa: E402,F401  (built-ins register)
from .dvabatch import batcher as _dvabatch  # noqa: E402,F401  (registers "dvabatch")

__all__ = ["Batch", "Batcher", "BatcherError", "DEFAULT_BATCHER", "ENTRY_POINT_GROUP",
           "ModelVariants", "VariantSpec", "batcher_names", "check_options", "get_batcher",
           "make_batcher", "options_of", "register_batcher"]
