"""DVABatch (Cui et al., ATC'22): multi-entry multi-exit batching over a model's stages.

* :mod:`.batch_table` -- the batch table (per-stage status maps), the batch queues and
  the meta-operations new, stretch and split;
* :mod:`.buffer_pairs` -- the buffer-pair pool and its per-row state machine
  (available, invalid, in-reading, in-writing);
* :mod:`.diversity` -- the three policies (input, operator, load diversity);
* :mod:`.pipeline` -- one executor per stage, driven by arrivals, timers and stage
  completions through a :class:`~.pipeline.StageRunner`;
* :mod:`.runner` -- the runner that submits each stage's work as jobs of the
  dispatcher, so the kernel scheduler's policy orders their kernels.
"""
from .batch_table import BatchRow, BatchTable, QueueItem
from .buffer_pairs import BufferPool, BufferState, HazardError
from .diversity import group_by_length, length_bucket, may_stretch, split_sizes
from .pipeline import Access, DvaConfig, DvaPipeline, StageRunner, check_hazards

__all__ = ["Access", "BatchRow", "BatchTable", "BufferPool", "BufferState", "DvaConfig",
           "DvaPipeline", "HazardError", "QueueItem", "StageRunner", "check_hazards",
           "group_by_length", "length_bucket", "may_stretch", "split_sizes"]
