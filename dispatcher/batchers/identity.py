"""The identity batcher (the default): every request is a batch of its own, on the
smallest variant that takes its rows and length. With one variant of the request's own
size this is exactly the unbatched path (and the io region is used in place, no copy)."""
from __future__ import annotations

from typing import Any

from .base import Batch, Batcher
from .registry import register_batcher


@register_batcher("identity")
class IdentityBatcher(Batcher):
    def add(self, req: Any, now: float) -> list[Batch]:
        v = self.fit([req])
        if v is None:   # the stage checks shapes on admission; this is a plug-in's guard
            raise ValueError(f"no variant of {self.model.name} takes {req.rows} rows of length "
                             f"{req.seq_len}")
        return [Batch([req], v)]
