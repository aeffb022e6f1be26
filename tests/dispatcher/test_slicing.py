"""Kernel slicing and the class rule (issue 38): what is cut, that the slices cover every
block once in the launches the device receives, and that an urgent job waits at most about
one slice behind a best-effort kernel, on every path that runs kernels."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paella.dispatcher.adaptor import Plan, PlanAdaptor, PlanOp, ScalarArg, synthetic_plan
from paella.dispatcher.core import STATUS_OK, Dispatcher, Request
from paella.dispatcher.devices.base import KernelInfo
from paella.dispatcher.devices.sim import SimDevice
from paella.dispatcher.instruments import Instrument
from paella.dispatcher.slicing import SliceRule, slice_plan, slices

CORES = ["c", "python", None]
LONG_S = 5e-3                    # the best-effort kernel: 5 ms, 4000 blocks (25 waves on a t4)


def test_a_slice_is_whole_waves_within_the_bound():
    rule = SliceRule(100e-6)
    assert rule.slice_blocks(5e-3, 4000, 160) == 160            # a wave is 200 us: one wave
    assert rule.slice_blocks(1e-3, 16000, 160) == 1600          # 10 us a wave: ten waves
    assert rule.slice_blocks(250e-6, 480, 160) == 160           # 83 us a wave: one wave
    assert rule.slice_blocks(50e-6, 4000, 160) is None          # short enough
    assert rule.slice_blocks(5e-3, 160, 160) is None            # one wave cannot be cut
    assert rule.slice_blocks(150e-6, 320, 160) == 160           # two waves of 75 us: one each
    with pytest.raises(ValueError, match="positive number of seconds"):
        SliceRule(0)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 100_000), st.integers(1, 5_000))
def test_slices_cover_every_block_exactly_once_in_order(total, per):
    got = slices(total, per)
    covered = [b for o, n in got for b in range(o, o + n)]
    assert covered == list(range(total))
    assert all(1 <= n <= per for _, n in got)


def _offset_plan() -> Plan:
    """A plan whose kernels take the block offset last (as `paella compile` emits them)."""
    infos = [KernelInfo("big", 32, duration=LONG_S), KernelInfo("small", 32, duration=20e-6)]
    off = ScalarArg(0, "uint32")
    ops = [PlanOp("h2d", buffer="in", io_offset=0, nbytes=64),
           PlanOp("launch", kernel="big", grid=(50, 80), block=(256,), args=(ScalarArg(7, "int32"), off)),
           PlanOp("launch", kernel="small", grid=(40,), block=(128,), args=(off,)),
           PlanOp("d2h", buffer="out", io_offset=64, nbytes=64)]
    return Plan("p", infos, ops, {"in": 64, "out": 64}, 128, block_offsets=True)


def test_slice_plan_rewrites_the_offset_and_keeps_order_and_the_rest():
    plan = _offset_plan()
    sliced = slice_plan(plan, {1: 1500})
    launches = [op for op in sliced.ops if op.kind == "launch"]
    big = [op for op in launches if op.kernel == "big"]
    assert [op.grid for op in big] == [(1500,), (1500,), (1000,)]
    assert [op.args for op in big] == [(ScalarArg(7, "int32"), ScalarArg(o, "uint32")) for o in (0, 1500, 3000)]
    assert all(op.whole == 4000 and op.stream == 0 for op in big)
    assert launches[-1] == plan.ops[2]                          # not named: left whole
    assert sliced.ops[0] == plan.ops[0] and sliced.ops[-1] == plan.ops[-1]
    with pytest.raises(ValueError, match="not a whole kernel launch"):
        slice_plan(plan, {0: 10})                               # a copy
    with pytest.raises(ValueError, match="not a whole kernel launch"):
        slice_plan(sliced, {1: 10})                             # already a slice
    compiled = Plan("old", plan.kernels, plan.ops, plan.buffers, plan.io_bytes, cubin=b"\x7fELF")
    with pytest.raises(ValueError, match="recompile it"):
        slice_plan(compiled, {1: 1500})                         # device code without offsets


class LaunchLog(SimDevice):
    """A simulated GPU that keeps what each launch asked: kernel, blocks, whole, offset."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.log: list[tuple[str, int, int, int]] = []

    def launch_checked(self, k, stream, launch_id, args=(), group=16, on_complete=None):
        self.log.append((k.name, k.blocks, k.whole, int(args[-1]) if args else -1))
        super().launch_checked(k, stream, launch_id, args, group, on_complete)


def _dispatcher(dev, core, slice_us=100.0, implied=True):
    d = Dispatcher(dev, "paella", slice_us=slice_us, kernel_core=core, implied_copies=implied)
    be = d.register_model("be", PlanAdaptor(_offset_plan()))
    hp = d.register_model("hp", PlanAdaptor(synthetic_plan(
        "hp", [(f"k{i}", 40, 128, 32, 30e-6) for i in range(5)], 64, 64)))
    return d, be, hp


def _io():
    return np.zeros(128, np.uint8)


def test_the_device_receives_slices_covering_every_block_once():
    dev = LaunchLog("t4", n_streams=64, seed=1)
    d, be, hp = _dispatcher(dev, None)
    twin = d.models[be].sliced
    assert twin is not None and twin.parent is d.models[be]
    d.submit(Request(0, 0, hp, _io(), priority=1))              # a more urgent class exists
    d.run_until_idle()
    dev.log.clear()
    d.submit(Request(1, 1, be, _io(), priority=200))
    d.run_until_idle()
    big = [(n, w, o) for name, n, w, o in dev.log if name == "big"]
    assert len(big) > 1 and all(w == 4000 for _, w, _ in big)
    blocks = sorted(b for n, _, o in big for b in range(o, o + n))
    assert blocks == list(range(4000))                          # every block exactly once
    assert [(n, w, o) for name, n, w, o in dev.log if name == "small"] == [(40, 0, 0)]


def _served(core, slice_us: float, hp_after: float = 1e-3) -> dict[int, float]:
    """A best-effort job (priority 200) with a 5 ms kernel; ``hp_after`` into it, an
    urgent request (priority 1). Latency of each, seconds."""
    dev = SimDevice("t4", n_streams=64, seed=1)
    d, be, hp = _dispatcher(dev, core, slice_us)
    lat: dict[int, float] = {}

    def done(r, status, err):
        assert status == 0, err
        lat[r.req_id] = dev.now() - r.t_submit
    d.submit(Request(0, 0, hp, _io(), on_complete=done, priority=1))
    d.run_until_idle()
    solo = lat.pop(0)
    t0 = dev.now()
    d.submit(Request(1, 1, be, _io(), on_complete=done, priority=200))
    while dev.now() < t0 + hp_after:
        d.step()
        dev.run_until(dev.now() + 2e-6)
    d.submit(Request(2, 0, hp, _io(), on_complete=done, priority=1))
    d.run_until_idle()
    return {"solo": solo, "hp": lat[2], "be": lat[1]}


@pytest.mark.parametrize("core", CORES)
def test_an_urgent_request_waits_at_most_about_one_slice(core):
    sliced = _served(core, 100.0)
    whole = _served(core, 0.0)
    # a slice of the 5 ms kernel is one wave, 200 us: the urgent request waits for the
    # slice running when it comes (at most one), not for the rest of the kernel
    assert sliced["hp"] <= sliced["solo"] + 200e-6 + 20e-6
    assert whole["hp"] >= sliced["hp"] + 2e-3                   # unsliced: most of the 5 ms
    assert sliced["be"] < whole["be"] * 1.1                     # and the kernel still ends


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_every_path_gives_the_same_schedule_with_classes_and_slices(seed):
    """The C core, its Python reference and the dispatcher's own path: same completion
    times for a random mix of urgent and best-effort requests with slicing on."""
    rng = np.random.default_rng(seed)
    n = 30
    gaps = rng.exponential(400e-6, n)
    pri = rng.choice([1, 0, 200], n)
    results = []
    for core, implied in [(c, False) for c in CORES] + [(c, True) for c in CORES if c]:
        # (implied copies: the cores' own rule; off, the own path's schedule)
        dev = SimDevice("t4", n_streams=64, seed=seed)
        d, be, hp = _dispatcher(dev, core, implied=implied)
        out = {}

        def done(r, status, err, out=out, dev=dev):
            out[r.req_id] = (status, round(dev.now(), 12))
        t = dev.now()
        for i in range(n):
            t += gaps[i]
            while dev.now() < t:
                d.step()
                dev.run_until(min(t, dev.now() + 5e-6))
            model = be if i % 3 else hp
            d.submit(Request(i, i % 4, model, _io(), on_complete=done, priority=int(pri[i])))
        d.run_until_idle()
        results.append(out)
    assert len(results[0]) == n and all(s == 0 for s, _ in results[0].values())
    assert results[0] == results[1] == results[2]
    assert results[3] == results[4] and all(s == 0 for s, _ in results[3].values())


class Releases(Instrument):
    def __init__(self):
        self.log: list[tuple[float, int, str]] = []

    def op_released(self, op, t):
        if op.key is not None:
            self.log.append((t, op.job.level, op.key))


@pytest.mark.parametrize("core", CORES)
def test_no_less_urgent_kernel_goes_while_an_urgent_job_is_live(core):
    dev = SimDevice("t4", n_streams=64, seed=1)
    d, be, hp = _dispatcher(dev, core, slice_us=0.0)            # the rule alone, no slicing
    rec = Releases()
    d.instruments.add(rec)
    live: list[tuple[float, float]] = []

    def done(r, status, err):
        live.append((r.t_submit, dev.now()))
    for i in range(4):
        d.submit(Request(10 + i, 1, be, _io(), priority=200))
    d.submit(Request(0, 0, hp, _io(), on_complete=done, priority=1))
    d.run_until_idle()
    (start, end), = live
    assert [1] * 5 == [lv for t, lv, _ in rec.log if lv == 1]
    assert not [k for t, lv, k in rec.log if lv == 200 and start < t < end]
    assert any(lv == 200 and t >= end for t, lv, _ in rec.log)  # best effort resumes after


@pytest.mark.parametrize("bad", [-1, float("nan"), 2e6, "100", True])
def test_a_bad_slice_bound_is_refused_with_the_range(bad):
    with pytest.raises(ValueError, match=r"slice_us must be 0\.\.1000000 microseconds"):
        Dispatcher(SimDevice("t4", n_streams=8), "paella", slice_us=bad)


def test_a_sliced_twin_looks_answers_up_and_names_owners_as_its_model_does():
    # A job of the less urgent class runs on the twin: without its model's hooks it
    # skipped the lookup ahead (its new input then computed at its kernels, held on the
    # device) and its computations named no owner.
    from concurrent.futures import Future
    asked, told = [], []
    answer: Future = Future()
    armed = False

    class Answered(PlanAdaptor):
        def answer_ahead(self, io, owner=None):
            if not armed:
                return None                                     # (the profiling runs)
            asked.append(owner)
            return answer

        def answer_owner(self, bindings, owner):
            told.append(owner)
    dev = SimDevice("t4", n_streams=64, seed=1)
    d = Dispatcher(dev, "paella", slice_us=100.0, kernel_core="c")
    be = d.register_model("be", Answered(_offset_plan()))
    hp = d.register_model("hp", PlanAdaptor(synthetic_plan(
        "hp", [(f"k{i}", 40, 128, 32, 30e-6) for i in range(5)], 64, 64)))
    twin = d.models[be].sliced
    assert twin.answer_ahead == d.models[be].answer_ahead
    d.submit(Request(0, 0, hp, _io(), priority=1))              # a more urgent class exists
    d.run_until_idle()
    armed, told[:] = True, []
    done = []
    d.submit(Request(1, 7, be, _io(), priority=200,
                     on_complete=lambda r, st, err: done.append(st)))
    d.step()
    assert asked == [("client", 7)] and not done and d.answers_awaited == 1
    answer.set_result(None)
    d.run_until_idle()
    assert done == [STATUS_OK] and told == [("client", 7)]
