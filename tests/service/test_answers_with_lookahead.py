"""Answers stay the request's own when kernels are released ahead (issue 37 review): the
last kernel's launch must not read an input that has not landed yet. With a start effect
the launch waits for the start (a placeholder); a daemon that releases ahead passes
``answers_at_launch=False`` (server._answers_at_launch) and the answer is decided at the
last kernel's completion."""
from __future__ import annotations

import numpy as np
import pytest

from paella.bundle import load_bundle
from paella.dispatcher.core import Dispatcher, Request
from paella.dispatcher.daemon.bundles import FunctionalCache, bundle_adaptor
from paella.dispatcher.devices.sim import SimDevice

from bundles_for_tests import tiny_mlp


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    return load_bundle(tiny_mlp(tmp_path_factory.mktemp("mlp") / "tiny_mlp"))


@pytest.mark.parametrize("early, lookahead, at_launch, core", [
    (True, 1, True, "auto"), (True, 4, True, "auto"), (True, 4, True, None),
    (False, 1, True, "auto"), (False, 4, False, "auto"), (False, 4, False, None),
    (True, 4, False, "auto")])
def test_every_answer_is_its_own_input_s(mlp, early, lookahead, at_launch, core):
    cache = FunctionalCache()
    dev = SimDevice("t4", seed=0)
    d = Dispatcher(dev, "paella", profile_runs=0, lookahead=lookahead, kernel_core=core)
    mid = d.register_model("m", bundle_adaptor(mlp, "m", dev, cache, early_lookup=early,
                                               answers_at_launch=at_launch))
    wrong = []
    for i in range(20):
        x = np.random.default_rng(i % 5).standard_normal((2, 16)).astype(np.float32)
        io = mlp.pack_inputs({"x": x})
        done = []
        d.submit(Request(i, 0, mid, io, on_complete=lambda r, st, err: done.append(st)))
        d.run_until_idle()
        assert done == [0]
        if not np.array_equal(mlp.unpack_outputs(io)["output0"], mlp.run_cpu({"x": x})["output0"]):
            wrong.append(i)
    assert not wrong, f"requests {wrong} got another input's answer"
    assert cache.misses == 5 and cache.hits == 15
