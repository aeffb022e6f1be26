"""The wake-up lead: a hybrid client's "almost finished" wake-up goes out when its job's
estimated unreleased work drops to ``wake_lead`` seconds (once), or at the op the job
marked (the paper's rule, and the only one while ``wake_lead`` is 0)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from paella.dispatcher.core import STATUS_OK, Request
from paella.dispatcher.devices.base import D2H, KERNEL
from paella.dispatcher.instruments import Instrument

from dispatch_helpers import chain

KERNELS = 8                  # of 50 us each (dispatch_helpers.chain)
#: Every path decides the same: the dispatcher's own (None), the reference kernel core and
#: the C one.
CORES = [None, "python", "c"]


class Woken(Instrument):
    def __init__(self):
        self.log: list[tuple] = []

    def op_released(self, op, t):
        self.log.append(("rel", op.kind, op.key, t))

    def request_woken(self, req):
        self.log.append(("woken", req.req_id, None, None))


def serve(make, **kw):
    """One request of an 8-kernel chain (the model profiled first): the instrument's log
    of that request, and the op whose release sent its wake-up (the wake-up is sent as
    that op goes, before the op_released hook): ("rel", kind, key, t)."""
    dev, d = make("paella", instruments=[w := Woken()], **kw)
    mid = d.register_model("c", chain("c", KERNELS))
    w.log.clear()
    req = Request(1, 1, mid, np.zeros(d.models[mid].adaptor.io_bytes, np.uint8),
                  on_almost_finished=lambda r: None)
    d.submit(req)
    d.run_until_idle()
    assert req.status == STATUS_OK
    woken = [i for i, row in enumerate(w.log) if row[0] == "woken"]
    assert len(woken) == 1, "exactly one wake-up per request"
    return next(row for row in w.log[woken[0]:] if row[0] == "rel"), d


@pytest.mark.parametrize("core", CORES)
def test_without_a_lead_the_wake_up_goes_with_the_last_copy(make, core):
    by, _ = serve(make, kernel_core=core)
    assert by[1] == D2H


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("lookahead", [1, 3])
def test_a_lead_wakes_the_client_when_that_much_work_is_left(make, lookahead, core):
    # Each kernel's profiled time is about 50 us: with a 120 us lead the wake-up goes at
    # the release that leaves two kernels (100 us <= 120 us) unreleased, not before.
    by, d = serve(make, wake_lead=120e-6, lookahead=lookahead, kernel_core=core)
    prof = d.models[next(iter(d.models))].profile
    times = sorted(k.time for k in prof.kernels.values())
    assert 40e-6 < times[0] and times[-1] < 60e-6       # the premise of the arithmetic
    assert by[1] == KERNEL and by[2] == f"c_k{KERNELS - 3}"
    # ... and once only: the marked D2H copy does not send a second one (serve checks).


@pytest.mark.parametrize("core", CORES)
def test_a_lead_longer_than_the_job_wakes_at_the_first_release(make, core):
    by, _ = serve(make, wake_lead=1.0, kernel_core=core)
    assert by[1] == KERNEL and by[2] == "c_k0"


@pytest.mark.parametrize("bad", [-1e-6, 1.5, math.nan, math.inf, True, "1", None])
def test_the_lead_must_be_seconds_between_0_and_1(make, bad):
    with pytest.raises(ValueError, match="wake_lead must be 0..1 seconds"):
        make("paella", wake_lead=bad)
