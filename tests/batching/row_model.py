"""A row-wise model with compiled variants for the batching tests, on the simulated GPU in
virtual time: y = 3 * x + 1 per row (x, y: rows x 4 float32), the simulated device
computing it as the plan's last kernel's effect, so gather and scatter are checked on
real bytes. ``poison``: a row whose first value equals it makes the kernel fail."""
from __future__ import annotations

import numpy as np

from paella.dispatcher import cudart as cuda
from paella.dispatcher.adaptor import BufferArg, JobAdaptor, PlanAdaptor, synthetic_plan
from paella.dispatcher.devices.base import KernelInfo, ModuleImage
from paella.dispatcher.batchers import ModelVariants, VariantSpec, make_batcher
from paella.dispatcher.batchers.stage import BatchingStage, ServedModel, ServedVariant
from paella.dispatcher.core import Dispatcher, Request
from paella.dispatcher.devices.sim import SimDevice
from paella.dispatcher.devices.sim.functional import model_effect
from paella.shapes import Slot, align

from paella.dispatcher.batchers.gather import IoLayout

COLS = 4
POISON = -999.0


class Tensor:
    def __init__(self, name, shape):
        self.name, self.shape, self.dtype = name, shape, "float32"
        self.nbytes = int(np.prod(shape)) * 4


def compute(values):
    x = values["x"]
    if np.any(x[:, 0] == POISON):
        raise ValueError("poisoned row")
    return {"y": 3 * x + 1}


def variant_adaptor(rows: int, seconds: float = 50e-6) -> tuple[PlanAdaptor, IoLayout]:
    nb = rows * COLS * 4
    inb = align(nb)
    plan = synthetic_plan(f"rows{rows}", [(f"k{rows}a", 4 * rows, 128, 32, seconds),
                                          (f"k{rows}b", 4 * rows, 128, 32, seconds)],
                          in_bytes=inb, out_bytes=align(nb))
    x, y = Tensor("x", (rows, COLS)), Tensor("y", (rows, COLS))
    eff = model_effect([x], [y], compute, 0)
    plan = plan.with_effect(eff, [BufferArg("in", 0), BufferArg("out", 0)])
    layout = IoLayout((Slot("x", (rows, COLS), "float32", 0),),
                      (Slot("y", (rows, COLS), "float32", inb),), inb + align(nb))
    return PlanAdaptor(plan), layout


class RowAdaptor(JobAdaptor):
    """The same model as adaptor code in a greenlet (rather than a plan): it raises on a
    poisoned row, failing its job as any adaptor's bug would."""

    def __init__(self, rows: int, layout: IoLayout):
        self.rows, self.layout, self.io_bytes = rows, layout, layout.io_bytes

    def init(self, device):
        info = KernelInfo(f"row{self.rows}", 32, duration=50e-6)
        self.k = device.load_module(ModuleImage(f"row{self.rows}", [info]))[info.name]

    def run(self, io):
        x, y = self.layout.inputs[0], self.layout.outputs[0]
        xv = io[x.offset:x.offset + x.nbytes].view(np.float32).reshape(x.shape)
        cuda.launch(self.k, 4 * self.rows, 128)
        cuda.device_synchronize()
        out = compute({"x": xv})["y"]
        io[y.offset:y.offset + y.nbytes] = out.view(np.uint8).reshape(-1)


def serve(sizes=(1, 2, 4, 8), batcher="identity", options=None, policy="fifo", model_id=100,
          greenlet=False):
    """A dispatcher and a stage serving the row model with one variant per size."""
    dev = SimDevice("t4", n_streams=64, seed=1)
    disp = Dispatcher(dev, policy, profile_runs=1)
    stage = BatchingStage(disp)
    stage.add_model(model_id, served_model(disp, sizes, "rows", batcher, options, greenlet))
    return disp, stage


def served_model(disp, sizes, tag="rows", batcher="identity", options=None,
                 greenlet=False) -> ServedModel:
    """The row model's variants registered with ``disp`` as ``tag@rows`` (a version of
    it: a reload registers another), behind ``batcher``."""
    served = {}
    for i, b in enumerate(sizes):
        ad, layout = variant_adaptor(b)
        if greenlet:
            ad = RowAdaptor(b, layout)
        mid = disp.register_model(f"{tag}@{b}", ad)
        served[i] = ServedVariant(VariantSpec(i, b, 0, f"{tag}@{b}"), mid, layout)
        assert ad.io_bytes == layout.io_bytes
    variants = ModelVariants("rows", tuple(s.spec for s in served.values()))
    return ServedModel("rows", variants, served, make_batcher(batcher, variants, options))


class Client:
    """Requests of ``rows`` rows with distinct inputs; records each completion once."""

    def __init__(self, model_id=100):
        self.model_id = model_id
        self.done: dict[int, tuple] = {}
        self.expect: dict[int, np.ndarray] = {}
        self.outputs: dict[int, np.ndarray] = {}
        self.woken: set[int] = set()

    def request(self, req_id: int, rows: int, client: int = 0, first: float | None = None):
        x = (np.arange(rows * COLS, dtype=np.float32).reshape(rows, COLS) + 1000 * req_id)
        if first is not None:
            x[0, 0] = first
        inb = align(x.nbytes)
        io = np.zeros(inb + align(x.nbytes), np.uint8)
        io[:x.nbytes] = x.view(np.uint8).reshape(-1)
        slots = (Slot("x", (rows, COLS), "float32", 0), Slot("y", (rows, COLS), "float32", inb))
        self.expect[req_id] = 3 * x + 1
        self.outputs[req_id] = io[inb:inb + x.nbytes].view(np.float32).reshape(rows, COLS)
        return Request(req_id, client, self.model_id, io, rows=rows, layout=slots,
                       on_almost_finished=lambda r: self.woken.add(r.req_id),
                       on_complete=self._complete)

    def _complete(self, req, status, error):
        assert req.req_id not in self.done, "completed twice"
        self.done[req.req_id] = (status, error)
