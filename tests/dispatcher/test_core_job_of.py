"""``core.job_of(launch_id)``, on both kernel cores: the live job that released a kernel,
found from its launch id alone. The dispatcher asks it for a kernel that failed after
the device reported it done (``Device.late_faults``, the process simulator's answers)
to fail that kernel's job only."""
from __future__ import annotations

import numpy as np
import pytest

from paella import protocol
from paella.benchmarks import bench_kernel_core as bench
from paella.dispatcher import kernel_core as kc


@pytest.mark.parametrize("impl", ["c", "python"])
def test_a_released_kernel_names_its_live_job_and_none_once_it_has_finished(impl):
    dev, core, m, cm, _ = bench.setup("single", impl)
    sets = [m.pool.acquire() for _ in range(2)]
    io = np.zeros(m.adaptor.io_bytes, np.uint8)
    for token, b in zip(("first", "second"), sets):
        args, copies = kc.set_operands(cm, m.replay, b.bound, dev.memory)
        core.admit(token, 0 if token == "first" else 1, cm.plan, cm.profile, 0, 0, -1,
                   args, copies, io)
    seen: dict[int, object] = {}
    finished = []
    while len(finished) < 2:
        for e in core.step(dev.now()) or ():
            if e[0] == kc.FINISHED:
                finished.append(e[1])
        if not core.pending_arrivals:
            dev.run_until(dev.next_event_time())
        for w in dev.notifq:                 # (before the next step drains them)
            if w:
                lid = protocol.decode(int(w)).launch_id
                if lid not in seen:
                    seen[lid] = core.job_of(lid)
    # Every kernel seen in the notifQ while its job lived named that job; both jobs did.
    assert set(seen.values()) == {"first", "second"}, seen
    assert all(core.job_of(lid) is None for lid in seen)          # (both finished)
    assert core.job_of(max(seen) + 1000) is None and core.job_of(-1) is None


def test_the_c_core_refuses_a_launch_id_that_is_not_an_int():
    _, core, *_ = bench.setup("single", "c")
    with pytest.raises(TypeError):
        core.job_of("7")
