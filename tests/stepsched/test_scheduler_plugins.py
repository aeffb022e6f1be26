"""Scheduler plug-ins: one home (``paella.stepsched``), one registry and entry-point group
(``paella.batchers``, the built-ins declared there as a third party's would be), one host
contract (the scheduler context, and nothing else of the dispatcher)."""
from __future__ import annotations

import importlib
import inspect
import pkgutil
import typing
from importlib import metadata

import numpy as np
import pytest

from paella import rings
from paella.dispatcher.batchers import (BatcherError, ModelVariants, SchedulerBatcher,
                                        SchedulerContext, VariantSpec, check_options,
                                        get_batcher, get_scheduler, make_batcher,
                                        scheduler_names)
from paella.dispatcher.batchers.registry import ENTRY_POINT_GROUP

#: The context's members: what a scheduler may use of it.
CONTEXT_MEMBERS = frozenset(
    {n for n in vars(SchedulerContext) if not n.startswith("_")}
    | set(SchedulerContext.__annotations__))


def own_entry_points() -> dict[str, metadata.EntryPoint]:
    """This distribution's ``paella.batchers`` entry points, by name."""
    return {ep.name: ep for ep in metadata.distribution("paella-py").entry_points
            if ep.group == ENTRY_POINT_GROUP}


def stepsched_schedulers() -> set[type]:
    """Every scheduler class defined in the schedulers' home."""
    import paella.stepsched as home
    found = set()
    for info in pkgutil.walk_packages(home.__path__, "paella.stepsched."):
        mod = importlib.import_module(info.name)
        for obj in vars(mod).values():
            if (isinstance(obj, type) and issubclass(obj, SchedulerBatcher)
                    and obj is not SchedulerBatcher and obj.__module__ == mod.__name__):
                found.add(obj)
    return found


def test_every_built_in_scheduler_is_found_by_name_through_the_entry_point_group():
    eps = own_entry_points()
    assert {"dvabatch", "orca"} <= set(eps)
    homes = stepsched_schedulers()
    assert {c.name for c in homes} >= {"dvabatch", "orca"}
    for cls in homes:                # each one declared, under its own name
        assert cls.name in eps, f"{cls.__qualname__} is not declared in pyproject.toml"
        assert get_scheduler(cls.name) is cls and get_batcher(cls.name) is cls
    for name, ep in eps.items():     # and each declared one lives in the one home
        cls = ep.load()
        assert cls.__module__.startswith("paella.stepsched."), name
        if cls.drives_jobs:
            assert name in scheduler_names()
    # The dispatcher's own package registers none itself (no decorator): the registry
    # learns them from the entry points, as it learns a third party's.
    import paella.dispatcher.batchers.registry as registry
    assert not any(c.drives_jobs and c.__module__.startswith("paella.dispatcher")
                   for c in registry.REGISTRY.classes.values())


def test_a_wrong_name_lists_the_batchers_and_the_schedulers():
    with pytest.raises(BatcherError, match=r"unknown batcher 'orka'; known batchers: .*dynamic"
                                           r".*identity.*; schedulers: .*dvabatch.*orca"):
        get_scheduler("orka")
    with pytest.raises(BatcherError, match=r"'dynamic' is a batcher, not a scheduler.*"
                                           r"schedulers: .*dvabatch.*orca"):
        get_scheduler("dynamic")


def test_config_toml_names_keep_working():
    """``[batching] batcher = "orca"`` / ``"dvabatch"``: the names the daemon's model
    config checks its options against (model_config, repository)."""
    assert check_options("orca", {"max_bs": 2}).name == "orca"
    assert check_options("DVABatch", {"pairs": 1}).name == "dvabatch"
    with pytest.raises(BatcherError, match="batcher 'dvabatch' has no option 'pair'"):
        check_options("dvabatch", {"pair": 1})


@pytest.mark.parametrize("name", ["dvabatch", "orca"])
def test_a_scheduler_is_started_with_the_context_alone(name):
    """``start`` takes one argument, typed as the context; ``__init__`` the model's
    variants and the options (nothing of the dispatcher)."""
    cls = get_scheduler(name)
    params = list(inspect.signature(cls.start).parameters)
    assert params == ["self", "ctx"]
    assert typing.get_type_hints(cls.start)["ctx"] is SchedulerContext
    init = list(inspect.signature(cls.__init__).parameters.values())
    assert init[1].name == "model" and all(p.kind is p.KEYWORD_ONLY or p.default is not p.empty
                                           for p in init[2:])


class ContextOnly:
    """A scheduler context that lets a scheduler see nothing but the protocol's members
    (anything else raises, naming it), recording what it used."""

    def __init__(self, ctx):
        object.__setattr__(self, "_ctx", ctx)
        object.__setattr__(self, "used", set())

    def __getattr__(self, name):
        if name not in CONTEXT_MEMBERS:
            raise AttributeError(f"{name!r} is not part of the scheduler context")
        self.used.add(name)
        return getattr(self._ctx, name)

    def __setattr__(self, name, value):
        raise AttributeError(f"a scheduler set {name!r} on its context")


def test_orca_served_through_the_context_alone():
    """The orca plug-in behind the batching stage, handed a context that offers only the
    protocol: every generation streams the reference tokens."""
    from paella.dispatcher.batchers.stage import BatchingStage, ServedModel
    from paella.dispatcher.core import Dispatcher, Request
    from paella.dispatcher.devices.sim import SimDevice
    from paella.models.gpt import GPTConfig, generate_reference, gpt_weights
    from paella.stepsched.orca_plugin import generation_io

    cfg, io = GPTConfig.tiny(), generation_io(GPTConfig.tiny())
    model = ModelVariants("gpt", (VariantSpec(0, 1, 0, "gpt"),))
    sched = make_batcher("orca", model, {"max_bs": 2, "n_slots": 64})
    seen = []
    real_start = sched.start

    def start(*args, **kw):
        seen.append((args, kw))
        proxy = ContextOnly(args[0])
        seen.append(proxy)
        real_start(proxy)
    sched.start = start
    disp = Dispatcher(SimDevice("t4", n_streams=32, seed=0), "paella", profile_runs=0)
    stage = BatchingStage(disp)
    served = ServedModel("gpt", model, {}, sched)
    stage.add_model(5, served)
    (args, kw), proxy = seen
    assert args == (served.ctx,) and not kw          # the stage's context, and nothing else
    done, bufs = [], []
    for rid, prompt in enumerate(([3, 7, 1], [5, 2])):
        buf = np.zeros(io.io_bytes, np.uint8)
        p, lens = io.inputs
        buf[p.offset:p.offset + 4 * len(prompt)] = np.array(prompt, np.int32).view(np.uint8)
        buf[lens.offset:lens.offset + 8] = np.array([len(prompt), 4], np.int32).view(np.uint8)
        bufs.append((prompt, buf))
        stage.submit(Request(rid, rid, 5, buf, on_complete=lambda q, s, e: done.append((s, e))))
    stage.run_until_idle()
    assert done == [(rings.OK, None)] * 2
    w = gpt_weights(cfg)
    for prompt, buf in bufs:
        t, count = io.outputs
        k = int(buf[count.offset:count.offset + 4].view(np.int32)[0])
        assert buf[t.offset:t.offset + 4 * k].view(np.int32).tolist() == \
            generate_reference(cfg, w, prompt, 4)
    assert {"register_model", "submit", "alloc", "complete", "progress"} <= proxy.used


def test_dvabatch_stage_runs_through_the_context_alone():
    """DVABatch's stage runner on a bare pipeline, handed a context that offers only the
    protocol: every query leaves, each stage run a job submitted through it."""
    from paella.dispatcher.adaptor import PlanAdaptor, synthetic_plan
    from paella.dispatcher.batchers.stage import scheduler_context
    from paella.dispatcher.core import Dispatcher
    from paella.dispatcher.devices.sim import SimDevice
    from paella.stepsched.dvabatch import DvaConfig, DvaPipeline
    from paella.stepsched.dvabatch.runner import DispatcherStageRunner, drive_pipeline

    class Q:
        def __init__(self, i, arrival):
            self.i, self.arrival, self.seq_len = i, arrival, 0

    disp = Dispatcher(SimDevice("t4", n_streams=16, seed=1), "paella", profile_runs=0)
    ctx = ContextOnly(scheduler_context(disp, "toy"))
    runner = DispatcherStageRunner(ctx, lambda s, b, l: PlanAdaptor(synthetic_plan(
        f"s{s}", [(f"k{s}", 8 * b, 128, 32, 0.1e-3)])), own_streams=True)
    cfg = DvaConfig(2, lambda s, b, l: 0.1e-3, pairs=2, bs_max=8, t_comp_wait=0.2e-3)
    done = []
    pipe = DvaPipeline(cfg, runner, lambda q, now: done.append(q.i), ctx.now)
    qs = [Q(i, disp.device.now() + 50e-6 * i) for i in range(24)]
    drive_pipeline(ctx, pipe, qs, lambda q: q.arrival)
    assert sorted(done) == list(range(24)) and not runner.failed
    assert ctx.used >= {"register_model", "submit", "adaptor", "now", "run_virtual"}


def test_a_context_without_the_dispatcher_is_refused_its_internals():
    """The proxy above is strict: an attribute of the stage's context outside the
    protocol (its dispatcher) is not reachable through it."""
    from paella.dispatcher.batchers.stage import scheduler_context
    from paella.dispatcher.core import Dispatcher
    from paella.dispatcher.devices.sim import SimDevice
    ctx = scheduler_context(Dispatcher(SimDevice("t4", n_streams=4, seed=0), "paella",
                                       profile_runs=0))
    assert ctx.stage.disp is not None
    with pytest.raises(AttributeError, match="'stage' is not part of the scheduler context"):
        ContextOnly(ctx).stage
