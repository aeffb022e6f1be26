"""Shared fixtures: small simulated GPUs and kernels in virtual time."""
from __future__ import annotations

import os

# Tests use gRPC clients in this process (tritonclient.grpc, grpc.aio servers) and then
# fork: daemons started with a preexec_fn, the fuzzer's workers. With grpcio's fork
# support on, its fork handlers ran in such a child and could abort it before its exec
# ("epoll_wait error: Bad file descriptor": a daemon dead at start, in 3 of about 8
# suite runs). No child here uses gRPC after a fork, so the handlers are turned off,
# before anything starts gRPC's core (it reads this when it starts).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import pytest  # noqa: E402

from paella.dispatcher.devices.base import KernelInfo, ModuleImage
from paella.dispatcher.devices.sim import SimDevice


def _load(dev: SimDevice, *infos: KernelInfo):
    funcs = dev.load_module(ModuleImage("test", list(infos)))
    return [funcs[i.name] for i in infos]


@pytest.fixture
def kernels():
    """``kernels(dev, KernelInfo(...), ...)`` loads kernels and returns them in order."""
    return _load


@pytest.fixture
def gtx():
    return SimDevice("gtx1660s")


#: Test files that leave grpcio's threads (Ray's driver, an in-process grpc.aio server)
#: running in this process. They run last: any fork after them (a daemon started with a
#: ``preexec_fn``, an attacker started under another uid) runs grpcio's fork handlers in
#: the child, which can abort it before its exec ("epoll_wait error: Bad file
#: descriptor", seen twice in one suite run). The product does not fork after loading
#: grpcio (the cluster's replicas spawn their daemons without a preexec_fn).
_GRPC_THREADS_LAST = ("tests/cluster/test_ray_cluster.py", "tests/cluster/test_ray_ingress_grpc.py")


def pytest_collection_modifyitems(config, items):
    def leaves_grpc_threads(item) -> bool:
        path = str(item.path).replace("\\", "/")
        return any(path.endswith(p) for p in _GRPC_THREADS_LAST)
    items.sort(key=leaves_grpc_threads)    # stable: the order is kept within each part
