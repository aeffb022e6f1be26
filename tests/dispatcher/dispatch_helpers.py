"""Shared helpers of the dispatcher tests: small plan models, a fork-join adaptor, a
completion recorder."""
from __future__ import annotations

import numpy as np
from paella.dispatcher.adaptor import JobAdaptor, PlanAdaptor, synthetic_plan
from paella.dispatcher.core import Request
from paella.dispatcher.devices.base import KernelInfo, ModuleImage
from paella.dispatcher import cudart as cuda


def chain(name: str, n: int, grid: int = 8, block: int = 128, regs: int = 32,
          seconds: float = 50e-6, io: bool = True) -> PlanAdaptor:
    kernels = [(f"{name}_k{i}", grid, block, regs, seconds) for i in range(n)]
    return PlanAdaptor(synthetic_plan(name, kernels, in_bytes=256 if io else 0,
                                      out_bytes=64 if io else 0))


class TwoStreams(JobAdaptor):
    """A fork-join job: two streams, an event, a wait-event, the default stream."""
    name = "fork"
    io_bytes = 64

    def init(self, device):
        infos = [KernelInfo(f"fork_{c}", 32, duration=40e-6) for c in "abcd"]
        f = device.load_module(ModuleImage("fork", infos))
        self.k = [f[i.name] for i in infos]
        self.buf = device.alloc(64)

    def run(self, io):
        s1, s2 = cuda.stream_create(), cuda.stream_create(non_blocking=True)
        cuda.memcpy_htod(self.buf, io[:64], s1)
        cuda.launch(self.k[0], 20, 256, s1)
        e = cuda.event_create()
        cuda.event_record(e, s1)
        cuda.launch(self.k[1], 10, 64, s2)
        cuda.stream_wait_event(s2, e)
        cuda.launch(self.k[2], 30, 128, s2)
        cuda.stream_synchronize(s2)
        cuda.launch(self.k[3], 5, 32)          # default stream: behind s1
        cuda.memcpy_dtoh(io[:64], self.buf)
        cuda.device_synchronize()
        cuda.stream_destroy(s1)
        cuda.stream_destroy(s2)


class Recorder:
    """Collects completions: ``done[req_id] = (status, error, latency)``."""

    def __init__(self):
        self.done: dict[int, tuple] = {}
        self.almost: list[int] = []

    def request(self, req_id: int, model_id: int, io_bytes: int, client: int = 0) -> Request:
        return Request(req_id, client, model_id, np.zeros(max(io_bytes, 1), np.uint8),
                       on_almost_finished=lambda r: self.almost.append(r.req_id),
                       on_complete=self._complete)

    def _complete(self, req, status, error):
        assert req.req_id not in self.done, "on_complete fired twice"
        self.done[req.req_id] = (status, error, req.t_done - req.t_submit)
