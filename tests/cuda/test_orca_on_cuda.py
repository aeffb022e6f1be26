"""Orca's compiled iteration on the cuda backend, on the recording stand-in driver
(issue 39, item 2): every iteration is one job of its (tokens, slots) variant's plan,
the bundle's params uploaded once per variant, the requests' KV slots gathered into the
io and copied in, the compiled kernels launched with the plan's pointers, the next
tokens and the updated slots copied back and scattered into the cache. The stand-in
computes nothing, so the tokens are what its memory holds (zeros); that the kernels
compute the right ones is tests/stepsched/test_compiled_orca.py's (their CPU build)."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

pytest.importorskip("safetensors")

from cuda_fixtures import PAIRS, stand_in_cubins
from paella.dispatcher.batchers.stage import scheduler_context
from paella.dispatcher.core import Dispatcher
from paella.models.gpt import GPTConfig, gpt_weights

CFG = GPTConfig(vocab=64, d=32, n_layer=2, n_head=2, n_ctx=16)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """The compiled iteration (the weights of tests/stepsched/test_compiled_orca.py:
    the compile cache has it), every variant's cubin replaced by a stand-in image of
    the same kernels."""
    from paella.stepsched.compiled_iteration import CompiledIteration
    root = tmp_path_factory.mktemp("orca-cuda")
    c = CompiledIteration(CFG, gpt_weights(CFG, 7), max_tokens=2 * CFG.n_ctx, max_slots=16,
                          out=root / "b")
    path = root / "fake"
    shutil.copytree(c.bundle.path, path)
    c.close()
    c.bundle = stand_in_cubins(path)
    return c


def drive(d, drv, until, limit=20_000):
    for _ in range(limit):
        if until():
            return
        d.step()
        drv.run()
    raise AssertionError("the generations did not end")


def test_iterations_run_the_compiled_plans_on_the_gpu(compiled, dev, drv):
    from paella.stepsched.generation import GenerationEngine
    d = Dispatcher(dev, "paella", counter_pairs=PAIRS, profile_runs=0, buffer_sets_ahead=0)
    eng = GenerationEngine(scheduler_context(d, "gpt"), CFG, max_bs=2, n_slots=16, compiled=compiled)
    assert eng.kv_host is not None and eng.kv_ptr is None     # the cache: host memory
    ran = []                                  # each iteration's variant, in order
    job = eng._job
    eng.runtime.job_for = lambda it: (ran.append(it.variant), job(it))[1]
    a = eng.submit([3, 7, 1, 9], 3, kick=False)
    b = eng.submit([5, 2], 2)
    drive(d, drv, lambda: a.done and b.done)
    assert a.tokens == [0, 0, 0] and b.tokens == [0, 0]       # what the stand-in's memory held
    # 3 iterations (a and b's prefill together, then 2 decodes: b leaves after its
    # second token), each its variant's plan launched in order, one plan registered
    # per variant met (its params uploaded once).
    bundle = compiled.bundle
    assert len(ran) == 3 and len(eng._jobs) == len(set(ran))
    assert [r.kernel for r in drv.launches] == \
        [op.kernel for k in ran for op in bundle.variants[k].launches()]
    assert bundle.variants[ran[0]].rows == 8            # 6 prompt tokens: the bucket of 8
    # The slots came back; the next generation gets all 16.
    assert sorted(eng.free_slots) == list(range(16))
    c = eng.submit([1], 15)
    drive(d, drv, lambda: c.done)
    assert len(c.tokens) == 15 and sorted(eng.free_slots) == list(range(16))


def test_the_orca_plugin_serves_a_checkpoint_on_cuda(compiled, dev, drv, tmp_path):
    """The plug-in through the batching stage on the cuda device: no refusal, a
    request's tokens (the stand-in's zeros) streamed into its io and completed; without a
    checkpoint it refuses, saying why."""
    from paella import rings
    from paella.dispatcher.batchers import ModelVariants, VariantSpec, make_batcher
    from paella.dispatcher.batchers.stage import BatchingStage, ServedModel
    from paella.dispatcher.core import Request
    from paella.models.gpt_checkpoint import save_checkpoint
    from paella.stepsched.orca_plugin import generation_io
    save_checkpoint(tmp_path / "m.safetensors", CFG, gpt_weights(CFG, 7))
    model = ModelVariants("gpt", (VariantSpec(0, 1, 0, "gpt"),))
    sched = make_batcher("orca", model, {"checkpoint": "m.safetensors", "folder": str(tmp_path),
                                         "n_head": 2, "max_bs": 2, "n_slots": 16})
    sched.compiled = compiled                  # (the same bundle, its cubin the stand-in's)
    d = Dispatcher(dev, "paella", counter_pairs=PAIRS, profile_runs=0, buffer_sets_ahead=0)
    stage = BatchingStage(d)
    stage.add_model(5, ServedModel("gpt", model, {}, sched))
    io_info = generation_io(CFG)
    io = np.zeros(io_info.io_bytes, np.uint8)
    p, lens = io_info.inputs
    io[p.offset:p.offset + 8] = np.array([3, 7], np.int32).view(np.uint8)
    io[lens.offset:lens.offset + 8] = np.array([2, 4], np.int32).view(np.uint8)
    done, progress = [], []
    stage.submit(Request(1, 0, 5, io, on_complete=lambda r, st, err: done.append((st, err)),
                         on_progress=lambda r, k: progress.append(k)))
    for _ in range(20_000):
        if done:
            break
        d.step()
        stage.step()
        drv.run()
    assert done == [(rings.OK, None)] and progress == [1, 2, 3, 4]
    tokens, count = io_info.outputs
    assert io[count.offset:count.offset + 4].view(np.int32)[0] == 4
    assert len(sched.engine.free_slots) == 16
    # Without a checkpoint: numpy effects, which a real GPU cannot run.
    seeded = make_batcher("orca", model, {"max_bs": 2})
    with pytest.raises(RuntimeError, match="name a checkpoint"):
        stage.add_model(6, ServedModel("gpt2", model, {}, seeded))
