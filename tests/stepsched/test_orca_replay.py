"""``paella experiment orca``'s speed without a change of figures: its steps replayed as
launch plans on the dispatcher's kernel core give the step adaptor's times bit for bit,
and its load points run in worker processes give the same figures as one after the
other (virtual time, small models)."""
import numpy as np
import pytest

from paella.dispatcher.batchers.stage import scheduler_context
from paella.dispatcher.core import Dispatcher
from paella.dispatcher.devices.sim import SimDevice
from paella.experiments import orca
from paella.models.gpt import GPTConfig
from paella.stepsched.generation import GenerationEngine
from paella.stepsched.padding import RequestBatcher
from paella.stepsched.runtime import StepRuntime

#: A GPT-2-shaped model small enough to compile its iteration's variants in seconds.
CFG = GPTConfig(vocab=64, d=32, n_layer=2, n_head=2, n_ctx=16)


def small_trace():
    p, o = orca.trace(24, seed=1)
    return p // 8, o // 8 + 1


@pytest.mark.parametrize("system", ["orca", "request"])
def test_replayed_steps_give_the_step_adaptors_figures_on_the_shapes_kernels(system):
    p, o = small_trace()
    kw = dict(max_bs=8, n_slots=8192)
    replayed = orca.run_point(system, 200.0, p, o, **kw)
    adaptor = orca.run_point(system, 200.0, p, o, replay=False, **kw)
    assert replayed == adaptor
    assert replayed["tasks"] > 1 and replayed["mean_batch"] > 1     # batches formed


@pytest.fixture(scope="module")
def tiny_kernels(tmp_path_factory):
    from paella.stepsched.compiled_iteration import IterationKernels
    return IterationKernels(CFG, tmp_path_factory.mktemp("orca-iteration"))


@pytest.mark.parametrize("system", ["orca", "request"])
def test_replayed_steps_give_the_step_adaptors_figures_on_the_compiled_kernels(system, tiny_kernels):
    """The experiment's path: TVM's kernels of the iteration, one variant per bucket."""
    rng = np.random.default_rng(3)
    p, o = rng.integers(1, 9, 16), rng.integers(1, 8, 16)
    kw = dict(max_bs=4, n_slots=256, gpu="t4", kernels=tiny_kernels)
    replayed = orca.run_point(system, 3000.0, p, o, **kw)
    assert replayed == orca.run_point(system, 3000.0, p, o, replay=False, **kw)
    assert replayed["mean_batch"] > 1


def test_replayed_steps_are_each_kernel_lists_plan_once():
    """One dispatcher model per distinct kernel list, and no step adaptor registered (it
    would take the dispatcher off its kernel core)."""
    d = Dispatcher(SimDevice("t4"), "paella", profile_runs=0, kernel_core="auto")
    eng = GenerationEngine(scheduler_context(d, "gpt"), GPTConfig.tiny(), max_bs=4, n_slots=64,
                           plans=True)
    for n in (3, 5, 3):
        eng.submit([0] * n, 4, out_len=4, kick=False)
    eng.runtime.kick()                  # (together: the first iteration batches them)
    eng.runtime.drive([])
    assert all(s.done and len(s.times) == 4 for s in eng.streams.values())
    rt = eng.runtime
    assert rt.model_id == -1 and d.core is not None                 # still on the core
    assert len(rt._plan_models) == len(set(rt._plan_models.values())) > 1
    assert rt.stats.tasks > len(rt._plan_models)                    # plans reused


def test_replayed_steps_refuse_what_they_cannot_time():
    d = Dispatcher(SimDevice("t4"), "paella", profile_runs=0)
    with pytest.raises(ValueError, match="timing only"):
        StepRuntime(scheduler_context(d, "a"), RequestBatcher(2), lambda t: None,
                    effect=lambda task, view: None, plans=True)
    with pytest.raises(ValueError, match="without preemption"):
        GenerationEngine(scheduler_context(d, "b"), GPTConfig.tiny(), max_bs=2, n_slots=64,
                         preempt=True, plans=True)


def test_points_in_worker_processes_give_the_same_figures():
    p, o = small_trace()
    kw = dict(max_bs=8, n_slots=8192)
    sweeps = {"orca": [100.0, 400.0], "request": [100.0, 400.0]}

    def then(pts):
        return {s: 0.5 * max(q["throughput"] for q in pts["request"]) for s in pts}
    alone = orca.run_points(sweeps, then, p, o, workers=1, **kw)
    assert orca.run_points(sweeps, then, p, o, workers=2, **kw) == alone
    assert [q["offered"] for q in alone[0]["request"]] == sweeps["request"]


def test_a_worker_loads_the_compiled_kernels_it_meets(tiny_kernels, monkeypatch):
    """What a worker process runs (here, in this one): its own kernels, from the same
    folder and cache, the same figures."""
    monkeypatch.setattr(orca, "_KERNELS", None)
    orca._init_worker((tiny_kernels.cfg, str(tiny_kernels.out), tiny_kernels.cache_dir))
    assert orca._KERNELS is not tiny_kernels and orca._KERNELS.out == tiny_kernels.out
    p, o = np.array([3, 5, 2]), np.array([2, 3, 1])
    kw = dict(max_bs=4, n_slots=256, gpu="t4")
    assert (orca._worker_point("orca", 3000.0, p, o, kw)
            == orca.run_point("orca", 3000.0, p, o, kernels=tiny_kernels, **kw))
