"""A model's variants sharing TurboTransformers' chunked allocator (dispatcher/chunked_buffers.py)
on the real dispatcher and simulated GPU: answers stay exact, buffers with disjoint
lifetimes share bytes, a waiting job of one variant gets a slot freed by another."""
from __future__ import annotations

import numpy as np

from paella import rings
from paella.dispatcher.adaptor import BufferArg, Plan, PlanOp
from paella.dispatcher.batchers import ModelVariants, VariantSpec, make_batcher
from paella.dispatcher.batchers.stage import BatchingStage, ServedModel, ServedVariant
from paella.dispatcher.chunked_buffers import ChunkedMemory, plan_usages
from paella.dispatcher.core import Dispatcher
from paella.dispatcher.devices.base import KernelInfo
from paella.dispatcher.devices.sim import SimDevice

import row_model
from row_model import Client


def test_plan_usages_follow_the_plan_and_disjoint_buffers_share_bytes():
    k = KernelInfo("k", 32, duration=1e-6)
    ops = [PlanOp("h2d", buffer="in", nbytes=64, io_offset=0),
           PlanOp("launch", kernel="k", args=(BufferArg("in"), BufferArg("t1"))),
           PlanOp("launch", kernel="k", args=(BufferArg("t1"), BufferArg("t2"))),
           PlanOp("launch", kernel="k", args=(BufferArg("t2"), BufferArg("t3"))),
           PlanOp("launch", kernel="k", args=(BufferArg("t3"), BufferArg("out"), BufferArg("w"))),
           PlanOp("d2h", buffer="out", nbytes=64, io_offset=64)]
    plan = Plan("p", [k], ops, {"in": 64, "t1": 4096, "t2": 4096, "t3": 4096, "out": 64, "w": 8},
                io_bytes=128, params={"w": b"\0" * 8})
    spans = {u.name: (u.first_op, u.last_op) for u in plan_usages(plan)}
    assert spans == {"in": (0, 1), "t1": (1, 2), "t2": (2, 3), "t3": (3, 4), "out": (4, 5)}
    from paella.dispatcher.seqlen_allocator import ChunkAllocator
    where = ChunkAllocator(chunk_size=1 << 16).addresses(plan_usages(plan))
    assert where["t1"] == where["t3"] != where["t2"]          # t1 and t3 never live together


def serve_chunked(sizes=(1, 2, 4, 8), limit=2, batcher="dynamic", options=None):
    dev = SimDevice("t4", n_streams=64, seed=1)
    disp = Dispatcher(dev, "fifo", profile_runs=1)
    stage = BatchingStage(disp)
    memory = ChunkedMemory("rows", limit=limit, chunk_size=4096)
    served = {}
    for i, b in enumerate(sizes):
        ad, layout = row_model.variant_adaptor(b)
        ad.memory = memory
        mid = disp.register_model(f"rows@{b}", ad)
        served[i] = ServedVariant(VariantSpec(i, b, 0, f"rows@{b}"), mid, layout)
    variants = ModelVariants("rows", tuple(s.spec for s in served.values()))
    stage.add_model(100, ServedModel("rows", variants, served,
                                     make_batcher(batcher, variants, options or {})))
    return dev, disp, stage, memory


def test_variants_share_slots_and_every_answer_is_exact():
    dev, disp, stage, memory = serve_chunked(limit=2, batcher="identity")
    c = Client()
    rng = np.random.default_rng(3)
    rows = [int(r) for r in rng.integers(1, 9, 40)]
    for i, r in enumerate(rows):                       # all at once: most wait for a slot
        stage.submit(c.request(i, r, client=i % 5))
    stage.run_until_idle()
    assert set(c.done) == set(range(len(rows)))
    for i in range(len(rows)):
        assert c.done[i] == (rings.OK, None), c.done[i]
        np.testing.assert_array_equal(c.outputs[i], c.expect[i])
    assert memory.in_use == 0 and not memory.waiting and memory.stats.held_bytes > 0
    # One list of 4 KiB chunks for every variant, not a set per variant and per job.
    assert memory.stats.alloc_calls <= 3
    assert memory.stats.inferences == len(rows) + 4    # (+ one profiling run per variant)


def test_close_returns_every_chunk_to_the_device():
    dev, disp, stage, memory = serve_chunked(limit=3)
    c = Client()
    for i in range(12):
        stage.submit(c.request(i, 1 + i % 8))
    stage.run_until_idle()
    assert all(s == (rings.OK, None) for s in c.done.values()) and len(c.done) == 12
    before = dev.memory.allocated if hasattr(dev, "memory") else None
    for m in list(disp.models.values()):
        m.adaptor.close(dev)
    assert memory.closed and not memory.allocator.chunks
    st = memory.stats
    assert st.alloc_calls == st.free_calls and st.held_bytes == 0
    del before
