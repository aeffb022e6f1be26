"""BatchMaker on the step runtime with real arithmetic: LSTM chains whose state lives in
device memory, one row per request, gathered and scattered by each batched cell.

Every request gets a state row ``(h, c)`` in one device allocation when it arrives
(zeros: the chain's initial state). A batched cell's functional effect (applied in
simulated device memory when the task's last kernel completes) gathers the rows of the
requests in the task, runs the cell (:func:`paella.models.rnn.lstm_reference`, the same
weights as the compiled cell) on each request's input at its own time step, and scatters
the new state back: BatchMaker's gather, done by the effect. A request's final ``h`` is
its result, copied out when its last cell completes; its row is then free.
"""
from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

from paella.dispatcher.batchers.base import SchedulerContext
from paella.models.rnn import lstm_reference

from .cell_scheduler import CellType, CellularScheduler
from .graph import unfold_chain
from .runtime import StepRuntime


class LSTMEngine:
    def __init__(self, ctx: SchedulerContext, kernels: dict[int, Any], w: np.ndarray,
                 b: np.ndarray, *, max_requests: int = 1024, max_tasks_to_submit: int = 5,
                 name: str = "lstm"):
        self.ctx = ctx
        self.w, self.b = w, b
        self.hidden = w.shape[1] // 4
        self.rows = max_requests
        self.state_ptr = ctx.alloc(self.rows * 2 * self.hidden * 4)
        self.free_rows: deque[int] = deque(range(self.rows))
        self.row: dict[Any, int] = {}
        self.inputs: dict[Any, np.ndarray] = {}
        self.results: dict[Any, np.ndarray] = {}
        sched = CellularScheduler([CellType("lstm", tuple(sorted(kernels)))], max_tasks_to_submit)
        self.runtime = StepRuntime(ctx, sched, lambda t: kernels[t.batch_size], name=name,
                                   effect=self._effect, on_task_done=self._after)

    def submit(self, request: Any, xs: np.ndarray, kick: bool = True) -> None:
        """Queue one chain: ``xs`` [length, hidden] are its inputs, one per time step."""
        xs = np.asarray(xs, np.float32)
        if xs.ndim != 2 or xs.shape[1] != self.hidden or len(xs) < 1:
            raise ValueError(f"request {request!r}: inputs must be [length >= 1, {self.hidden}], "
                             f"got {list(xs.shape)}")
        if not self.free_rows:
            raise ValueError(f"request {request!r}: all {self.rows} state rows are in use; "
                             f"raise max_requests or wait for requests to finish")
        r = self.free_rows.popleft()
        self._state()[r] = 0.0
        self.row[request], self.inputs[request] = r, xs
        self.runtime.add(unfold_chain(request, len(xs)), kick=kick)

    def _state(self, view=None) -> np.ndarray:
        nbytes = self.rows * 2 * self.hidden * 4
        raw = (view or self.ctx.view)(self.state_ptr, nbytes)
        return raw.view(np.float32).reshape(self.rows, 2, self.hidden)

    def _effect(self, task: Any, view) -> None:
        st = self._state(view)
        rows = [self.row[g.request] for g, _ in task.nodes]
        x = np.stack([self.inputs[g.request][s.depth] for g, s in task.nodes])
        h, c = lstm_reference(x, st[rows, 0], st[rows, 1], self.w, self.b)
        st[rows, 0], st[rows, 1] = h, c

    def _after(self, task: Any, done: list) -> None:
        st = self._state()
        for req in done:
            r = self.row.pop(req)
            self.results[req] = st[r, 0].copy()
            self.free_rows.append(r)
            del self.inputs[req]
