"""The STATUS reply's ``queued_work_us`` against a real daemon: 0 when idle, the sum of
the live jobs' SRPT estimates while requests run (what the cluster's ``p2c-work`` router
reads, paella.cluster.router), falling as they finish, 0 again at the end."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from bundles_for_tests import slow_repository
from paella.client.aio import AsyncClient
from service_daemon import cleanup, start_daemon

KERNEL_S = 0.05


@pytest.fixture(scope="module")
def slow(tmp_path_factory):
    dp = start_daemon("--models", str(slow_repository(tmp_path_factory, KERNEL_S)))
    yield dp
    cleanup(dp)


def test_queued_work_follows_the_live_jobs(slow):
    x = np.ones((2, 16), np.float32)

    async def main():
        c = await AsyncClient.connect(slow.socket)
        try:
            idle = await c.status_async()
            assert idle["queued_work_us"] == 0
            await c.infer("slow", {"x": x}, timeout=30)        # one alone: its time
            n = 4
            tasks = [asyncio.ensure_future(c.infer("slow", {"x": x}, timeout=60))
                     for _ in range(n)]
            st = await c.status_async()
            for _ in range(100):                               # until the daemon has them all
                if st["in_flight"] == n:
                    break
                await asyncio.sleep(0.01)
                st = await c.status_async()
            busy = st["queued_work_us"]
            # at least what is left of the last job (a whole job: it has not started),
            # at most n whole jobs; every kernel lasts ~KERNEL_S
            assert KERNEL_S * 1e6 <= busy, st
            await tasks[0]
            for _ in range(200):            # the daemon drops the job just after answering
                later = (await c.status_async())["queued_work_us"]
                if later < busy:
                    break
                await asyncio.sleep(0.01)
            assert later < busy
            await asyncio.gather(*tasks)
            done = await c.status_async()
            assert done["queued_work_us"] == 0 and done["in_flight"] == 0
            return busy, later
        finally:
            c.close()
    busy, later = asyncio.run(main())
    # n whole jobs at most (each a couple of ~KERNEL_S kernels): a loose upper bound
    assert busy <= 4 * 10 * KERNEL_S * 1e6 and 0 <= later < busy
