"""The asyncio client (``paella.client.aio.AsyncClient``) against a real daemon: many
requests in flight on one connection, each answered with its own outputs; a timeout or a
cancel leaves the region reserved until the daemon answers, then frees it; a daemon
that dies fails every waiter at once; generation; a full ring makes callers wait."""
from __future__ import annotations

import asyncio
import signal

import numpy as np
import pytest

from bundles_for_tests import slow_repository
from paella.client import DaemonGone, RequestFailed, ResultTimeout
from paella.client.aio import AsyncClient
from service_daemon import cleanup, start_daemon

X = np.arange(256, dtype=np.float32)


def run(coro):
    return asyncio.run(coro)


def test_many_in_flight_each_gets_its_own_answer(daemon):
    async def main():
        c = await AsyncClient.connect(daemon.socket)
        try:
            outs = await asyncio.gather(*[c.infer("echo", {"x": X + i}) for i in range(3000)])
            assert all(np.array_equal(o["y"], X + i) for i, o in enumerate(outs))
            assert c.load == 0 and c._alloc.free_bytes == c._alloc.size
            models = await c.list_models_async()
            assert {"echo", "noop"} <= set(models)
            st = await c.status_async()
            assert st["pid"] == daemon.pid
        finally:
            c.close()
    run(main())


def test_bad_inputs_raise_and_leak_nothing(daemon):
    async def main():
        c = await AsyncClient.connect(daemon.socket)
        try:
            with pytest.raises(ValueError, match="takes inputs"):
                await c.infer("echo", {"z": X})
            with pytest.raises(ValueError, match="must have shape"):
                await c.infer("echo", {"x": X[:3]})
            with pytest.raises(ValueError, match="priority"):
                await c.infer("echo", {"x": X}, priority=999)
            assert c._alloc.free_bytes == c._alloc.size and c.load == 0
            assert np.array_equal((await c.infer("echo", {"x": X}))["y"], X)
        finally:
            c.close()
    run(main())


@pytest.fixture(scope="module")
def slow(tmp_path_factory):
    """A daemon serving a tiny MLP whose kernels last ~50 ms each."""
    dp = start_daemon("--models", str(slow_repository(tmp_path_factory, 0.05)))
    yield dp
    cleanup(dp)


def test_timeout_and_cancel_keep_the_region_until_the_answer(slow):
    x = np.ones((2, 16), np.float32)

    async def main():
        c = await AsyncClient.connect(slow.socket)
        try:
            with pytest.raises(ResultTimeout):
                await c.infer("slow", {"x": x}, timeout=0.01)
            task = asyncio.ensure_future(c.infer("slow", {"x": x}))
            await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert len(c._orphans) == 2                       # reserved: in flight still
            assert c._alloc.free_bytes < c._alloc.size
            for _ in range(200):                              # the answers free them
                if not c._orphans:
                    break
                await asyncio.sleep(0.05)
            assert not c._orphans and c._alloc.free_bytes == c._alloc.size
            out = await c.infer("slow", {"x": x}, timeout=30)
            assert out and all(np.isfinite(a).all() for a in out.values())
        finally:
            c.close()
    run(main())


def test_a_daemon_that_dies_fails_every_waiter(tmp_path_factory):
    dp = start_daemon("--models", str(slow_repository(tmp_path_factory, 0.2)))
    x = np.ones((2, 16), np.float32)

    async def main():
        c = await AsyncClient.connect(dp.socket)
        try:
            tasks = [asyncio.ensure_future(c.infer("slow", {"x": x})) for _ in range(20)]
            await asyncio.sleep(0.1)
            dp.proc.send_signal(signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
            assert all(isinstance(r, DaemonGone) for r in results), results
            assert not c.alive
            with pytest.raises(DaemonGone):
                await c.infer("slow", {"x": x})
        finally:
            c.close()
    try:
        run(main())
    finally:
        cleanup(dp)


def test_failed_request_raises_its_reason(daemon):
    """A request the daemon refuses (here: rows on a model without batch variants) raises
    RequestFailed with the daemon's reason, and the connection carries on."""
    async def main():
        c = await AsyncClient.connect(daemon.socket)
        try:
            m = c.model("echo")
            off = c.alloc(64)
            req = c._push(m.model_id, 64, off, 0, 0)          # the wrong length
            fut = asyncio.get_running_loop().create_future()
            c._pending[req] = fut
            status, reason = await asyncio.wait_for(fut, 10)
            with pytest.raises(RequestFailed):
                c._result(req, status, reason)
            c.free(off)
            c._slots.release()
            assert np.array_equal((await c.infer("echo", {"x": X}))["y"], X)
        finally:
            c.close()
    run(main())


def test_more_requests_than_ring_slots_wait_for_room(daemon):
    """Beyond the request ring's slots, callers wait for a slot instead of failing."""
    async def main():
        c = await AsyncClient.connect(daemon.socket)
        try:
            slots = c._seg.layout.req_slots
            n = 3 * slots
            outs = await asyncio.gather(*[c.infer("echo", {"x": X * i}) for i in range(n)])
            assert all(np.array_equal(o["y"], X * i) for i, o in enumerate(outs))
        finally:
            c.close()
    run(main())
