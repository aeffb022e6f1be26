"""DVABatch on the kernel scheduler: stage slicing, each stage run as a job of the real
dispatcher on the simulated GPU, and the experiment's summary keys."""
from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

import numpy as np
import pytest

from paella.compiler_pass.stages import OpProfile, preferred_batch, slice_stages
from paella.dispatcher.adaptor import PlanAdaptor, synthetic_plan
from paella.stepsched.dvabatch import DvaConfig, DvaPipeline, check_hazards
from paella.stepsched.dvabatch.runner import DispatcherStageRunner, drive_pipeline
from paella.dispatcher.batchers.stage import scheduler_context
from paella.dispatcher.core import Dispatcher
from paella.dispatcher.devices.sim import SimDevice

SIZES = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class _Query:
    """A query of the bare pipeline (it reads ``seq_len``)."""
    i: int
    arrival: float
    seq_len: int


def _drive(runner, pipe, qs) -> None:
    drive_pipeline(runner.ctx, pipe, qs, lambda q: q.arrival)


def op(name: str, pref: int, t: float = 1.0) -> OpProfile:
    """Flat up to ``pref``, then proportional."""
    return OpProfile(name, tuple((b, t * max(b, pref) / pref) for b in SIZES))


def test_preferred_batch_and_slicing_cut_where_the_preference_changes():
    assert preferred_batch(op("a", 8)) == 8
    assert preferred_batch(op("b", 1)) == 1
    assert preferred_batch(OpProfile("c", tuple((b, 1.0) for b in SIZES))) == 64
    ops = [op(f"e{i}", 32) for i in range(6)] + [op(f"d{i}", 4) for i in range(6)]
    stages = slice_stages(ops, 4)
    # Even in time (2 x 6 then 16 x 6 at batch 64: the longest stage at best 32), and the
    # first cut on the change of preference, which keeps that longest stage.
    assert stages == [range(0, 6), range(6, 8), range(8, 10), range(10, 12)]
    # Without a change: balanced in time at batch 64.
    same = [op(f"x{i}", 16, t=1.0 + (i == 0) * 3) for i in range(8)]
    assert slice_stages(same, 2) == [range(0, 2), range(2, 8)]     # 20 | 24 of 44
    with pytest.raises(ValueError):
        slice_stages(same, 9)


def test_stages_run_as_dispatcher_jobs_without_hazards():
    """A 3-stage model whose stage variants are plans of the real dispatcher: every
    query leaves, batches split and stretch, no stage touches rows another is using."""
    dev = SimDevice("t4", n_streams=64, seed=3)
    disp = Dispatcher(dev, "paella", profile_runs=0)
    blocks = {0: 5, 1: 40, 2: 40}           # stage 0 prefers batch 32, the others batch 4

    def time_of(stage: int, rows: int) -> float:
        return -(-blocks[stage] * rows // 160) * 0.2e-3

    def adaptor(stage: int, rows: int, seq_len: int) -> PlanAdaptor:
        return PlanAdaptor(synthetic_plan(f"s{stage}", [
            (f"k{stage}", blocks[stage] * rows, 256, 32, time_of(stage, rows))]))
    runner = DispatcherStageRunner(scheduler_context(disp, "toy3"), adaptor)
    cfg = DvaConfig(3, lambda s, b, l: time_of(s, b), pairs=2, bs_max=64,
                    t_comp_wait=time_of(0, 1))
    done = {}
    pipe = DvaPipeline(cfg, runner, lambda q, now: done.__setitem__(q.i, now), dev.now)
    rng = np.random.default_rng(0)
    qs = [_Query(i, float(t), 0) for i, t in
          enumerate(dev.now() + np.cumsum(rng.exponential(1 / 3000, 300)))]
    _drive(runner, pipe, qs)
    assert not runner.failed
    assert sorted(done) == list(range(300))
    assert all(done[q.i] >= q.arrival + sum(time_of(s, 1) for s in range(3)) - 1e-9 for q in qs)
    assert pipe.stats.split > 0 and pipe.stats.stretch > 0
    assert check_hazards(pipe.accesses) == []
    # Each run used the variant of its own size (stage, rows, length).
    assert {k[1] for k in runner.model_ids} >= {1, 4}
    assert all(disp.models[m].name == f"toy3/s{s}/b{b}/l{l}@{m}"
               for (s, b, l), m in runner.model_ids.items())


def test_experiment_refuses_an_unknown_model():
    r = subprocess.run([sys.executable, "-m", "paella.cli", "experiment", "dvabatch",
                        "--models", "vgg"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "paella: error: unknown model(s) vgg" in r.stderr and "Traceback" not in r.stderr


def test_each_stage_executor_runs_on_its_own_stream():
    """``own_streams``: every op of stage s's jobs goes to the real stream reserved for
    stage s, no other job's op lands there, and the pipeline still finishes every query
    without a hazard (the policy still picks the kernels; the stream only orders a
    stage's own runs)."""
    from paella.dispatcher.instruments import Instrument

    class Streams(Instrument):
        def __init__(self):
            self.seen = []

        def op_released(self, op, t):
            self.seen.append((op.job.model.name, op.stream, t))

    dev = SimDevice("t4", n_streams=16, seed=3)
    rec = Streams()
    disp = Dispatcher(dev, "paella", profile_runs=0, instruments=[rec])
    other = disp.register_model("other", PlanAdaptor(synthetic_plan(
        "o", [("ko", 80, 256, 32, 0.3e-3)] * 3)), profile_runs=0)

    def adaptor(stage: int, rows: int, seq_len: int) -> PlanAdaptor:
        return PlanAdaptor(synthetic_plan(f"s{stage}", [
            (f"k{stage}", 10 * rows, 256, 32, 0.2e-3 * (1 + rows // 8))] * 2))
    runner = DispatcherStageRunner(scheduler_context(disp, "toy"), adaptor, own_streams=True)
    cfg = DvaConfig(3, lambda s, b, l: 0.2e-3 * (1 + b // 8), pairs=2, bs_max=16,
                    t_comp_wait=1e-3)
    done = []
    pipe = DvaPipeline(cfg, runner, lambda q, now: done.append(q.i), dev.now)
    rng = np.random.default_rng(1)
    qs = [_Query(i, float(t), 0) for i, t in
          enumerate(dev.now() + np.cumsum(rng.exponential(1 / 4000, 120)))]
    from paella.dispatcher.core import Request
    # Reserved up front (as a served model does when it loads): from then on no other
    # job's op lands on them.
    pinned = [disp.stream_named(runner.stream_name(s)) for s in range(3)]
    for i in range(20):                     # another model's jobs on the pool meanwhile
        disp.submit(Request(10_000 + i, 7, other, np.zeros(1, np.uint8)))
    _drive(runner, pipe, qs)
    assert not runner.failed and sorted(done) == list(range(120))
    assert check_hazards(pipe.accesses) == []
    assert [disp.stream_named(runner.stream_name(s)) for s in range(3)] == pinned
    assert len(set(pinned)) == 3
    for name, stream, _ in rec.seen:
        if name.startswith("toy/"):
            assert stream == pinned[int(name.split("/")[1][1:])], name
        else:
            assert stream not in pinned, name
    assert any(n == "other" for n, _, _ in rec.seen)
    # A stage's runs follow one another on its stream: its accesses never overlap.
    for s in range(3):
        acc = sorted((a for a in pipe.accesses if a.stage == s), key=lambda a: a.t0)
        assert all(a.t1 <= b.t0 + 1e-12 for a, b in zip(acc, acc[1:]))
