"""The batching stage and its two kinds of plug-in: *batchers* group requests into jobs
of a compiled variant; *schedulers* drive their own jobs through the scheduler context
(the interface of both, :mod:`.base`; the one registry, :mod:`.registry`; the built-in
batchers, one module each; the stage that runs them between the front end and the
dispatcher, and the context it gives a scheduler, :mod:`.stage`). The built-in
schedulers live in :mod:`paella.stepsched` and register through the entry-point group,
as a third party's do."""
from .base import (Batch, Batcher, BatcherError, ModelVariants, RequestRefused,
                   SchedulerBatcher, SchedulerContext, VariantSpec)
from .registry import (DEFAULT_BATCHER, ENTRY_POINT_GROUP, batcher_names, check_options,
                       get_batcher, get_scheduler, make_batcher, options_of,
                       register_batcher, scheduler_names)
from . import dynamic, identity, turbo_dp  # noqa: E402,F401  (built-ins register)

__all__ = ["Batch", "Batcher", "BatcherError", "DEFAULT_BATCHER", "ENTRY_POINT_GROUP",
           "ModelVariants", "RequestRefused", "SchedulerBatcher", "SchedulerContext",
           "VariantSpec", "batcher_names", "check_options", "get_batcher", "get_scheduler",
           "make_batcher", "options_of", "register_batcher", "scheduler_names"]
