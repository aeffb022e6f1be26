"""Buffer sets made ahead (``Dispatcher(buffer_sets_ahead=)``, the daemon's
``buffer_sets_ahead``): a model's pool makes its per-request buffer sets when the model
is registered, not on the serving path, within a byte bound and an eighth of the free
device memory; they serve jobs like any set and go back when memory is needed. And the
compiled binder and operands that make a set fast give what the step-by-step reference
gives."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from paella.bundle import load_bundle
from paella.dispatcher import kernel_core as kc
from paella.dispatcher.adaptor import PlanAdaptor, synthetic_plan
from paella.dispatcher.core import SETS_AHEAD_BYTES, STATUS_OK, Dispatcher, Request
from paella.dispatcher.devices.sim import SimDevice
from paella.gpus import preset

KIB = 1024


def chain(name: str, set_bytes: int = 512, param_bytes: int = 0) -> PlanAdaptor:
    plan = synthetic_plan(name, [(f"{name}_k{i}", 8, 128, 32, 50e-6) for i in range(3)],
                          in_bytes=set_bytes // 2, out_bytes=set_bytes // 2)
    if param_bytes:
        plan = replace(plan, buffers={**plan.buffers, "w": param_bytes}, params={"w": b""})
    return PlanAdaptor(plan)


def run(d: Dispatcher, mid: int, n: int) -> list[int]:
    done: list[int] = []
    io_bytes = d.models[mid].adaptor.io_bytes
    for i in range(n):
        d.submit(Request(i, 1, mid, np.zeros(io_bytes, np.uint8),
                         on_complete=lambda r, st, err: done.append(st)))
    d.run_until_idle()
    return done


@pytest.mark.parametrize("core", ["auto", None], ids=["kernel-core", "own-path"])
def test_sets_are_made_at_registration_and_serve_the_jobs(core):
    dev = SimDevice("t4", n_streams=16, seed=0)
    d = Dispatcher(dev, "paella", profile_runs=1, kernel_core=core, buffer_sets_ahead=40)
    before = dev.allocated_bytes
    mid = d.register_model("m", chain("m"))
    pool = d.models[mid].pool
    assert pool.created == 40 and len(pool.free) == 40 and pool.in_use == 0
    assert dev.allocated_bytes - before >= 40 * 512
    if core is not None:                      # the core's operands are ready too
        assert all(b.core is not None and b.core[0] is d.models[mid].core for b in pool.free)
    assert run(d, mid, 30) == [STATUS_OK] * 30
    assert pool.created == 40                 # none made while serving


def test_none_ahead_makes_sets_on_demand():
    dev = SimDevice("t4", n_streams=16, seed=0)
    d = Dispatcher(dev, "paella", profile_runs=1, buffer_sets_ahead=0)
    mid = d.register_model("m", chain("m"))
    assert d.models[mid].pool.created == 1    # the profiling run's
    assert run(d, mid, 5) == [STATUS_OK] * 5


def test_the_byte_bound_and_the_free_memory_bound():
    dev = SimDevice("t4", n_streams=16, seed=0)
    d = Dispatcher(dev, "paella", profile_runs=0, buffer_sets_ahead=1000)
    big = SETS_AHEAD_BYTES // 4
    mid = d.register_model("big", chain("big", set_bytes=big))
    assert d.models[mid].pool.created == 4    # 64 MiB of sets at most
    small = SimDevice(preset("t4").with_(mem_bytes=512 * KIB), n_streams=16, seed=0)
    d2 = Dispatcher(small, "paella", profile_runs=0, buffer_sets_ahead=1000)
    mid2 = d2.register_model("m", chain("m", set_bytes=4 * KIB))
    made = d2.models[mid2].pool.created
    assert 0 < made <= 512 // 8 // 4          # an eighth of the free memory


def test_idle_sets_made_ahead_give_way_to_a_model_that_needs_the_memory():
    dev = SimDevice(preset("t4").with_(mem_bytes=1024 * KIB), n_streams=16, seed=0)
    d = Dispatcher(dev, "paella", profile_runs=1, buffer_sets_ahead=1000)
    a = d.register_model("a", chain("a", set_bytes=8 * KIB))
    assert d.models[a].pool.created > 1
    # weights of 900 KiB fit only once model a's idle sets are freed
    b = d.register_model("b", chain("b", set_bytes=8 * KIB, param_bytes=900 * KIB))
    assert run(d, b, 3) == [STATUS_OK] * 3
    assert run(d, a, 3) == [STATUS_OK] * 3


def test_a_bad_count_is_refused():
    dev = SimDevice("t4", n_streams=4, seed=0)
    for bad in (-1, 1.5, True, 1 << 20):
        with pytest.raises(ValueError, match="buffer_sets_ahead must be an int 0..65536"):
            Dispatcher(dev, "paella", buffer_sets_ahead=bad)


@pytest.fixture(scope="module")
def cnn(tmp_path_factory):
    from paella.compiler_pass.build import compile_bundle
    from paella.models.tiny import tiny_cnn
    return load_bundle(compile_bundle(tiny_cnn(), tmp_path_factory.mktemp("cnn") / "b"))


def test_the_compiled_binder_and_operands_equal_the_reference(cnn):
    """A compiled bundle (scalar arguments with their dtypes, buffer offsets): the
    generated binder and core operands against the step-by-step reference, for several
    sets."""
    dev = SimDevice("gtx1660s", n_streams=8, seed=0)
    d = Dispatcher(dev, "paella", profile_runs=0, kernel_core="auto", buffer_sets_ahead=3)
    mid = d.register_model("cnn", PlanAdaptor.from_bundle(cnn))
    m = d.models[mid]
    assert any(not isinstance(a, int) for t in m.pool.free[0].bound if isinstance(t, tuple)
               for a in t), "the premise: the bundle has scalar arguments"
    for b in m.pool.free:
        ref = m.adaptor.bind_reference(b.ptrs)
        assert b.bound == ref
        assert [type(x) for t in b.bound for x in (t if isinstance(t, tuple) else (t,))] == \
            [type(x) for t in ref for x in (t if isinstance(t, tuple) else (t,))]
        fast = kc.set_operands(m.core, m.replay, b.bound, dev.memory)
        slow = kc.set_operands_reference(m.core, m.replay, b.bound, dev.memory)
        assert fast[0] == slow[0]
        for f, s in zip(fast[1], slow[1]):
            assert (f is None) == (s is None)
            if f is not None:
                assert (f[0], f[1], f[3], f[4]) == (s[0], s[1], s[3], s[4])
                assert f[2].ctypes.data == s[2].ctypes.data and f[2].nbytes == s[2].nbytes
        # without device views (a core that does not copy directly)
        assert kc.set_operands(m.core, m.replay, b.bound, None) == \
            kc.set_operands_reference(m.core, m.replay, b.bound, None)


def test_the_daemons_setting_has_the_dispatchers_default_and_bound():
    """[daemon] buffer_sets_ahead repeats the dispatcher's numbers (its config module
    stays light to import): they must agree."""
    from paella.dispatcher.core import DEFAULT_SETS_AHEAD, MAX_SETS_AHEAD
    from paella.dispatcher.daemon.config import ConfigError, DaemonConfig
    assert DaemonConfig().buffer_sets_ahead == DEFAULT_SETS_AHEAD
    DaemonConfig(buffer_sets_ahead=MAX_SETS_AHEAD).check()
    with pytest.raises(ConfigError, match=f"0..{MAX_SETS_AHEAD}"):
        DaemonConfig(buffer_sets_ahead=MAX_SETS_AHEAD + 1).check()
