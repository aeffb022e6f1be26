"""The ingress's gRPC server on its own, without a Ray cluster (the cluster test,
tests/cluster/test_ray_cluster.py, sends load through it on Ray): the ingress class of
``paella cluster`` built as Ray builds it (``async __init__`` in a loop of its own, as
in a replica), over fake GPU replicas. Its port is its own (a second server on it fails
naming the address, instead of sharing its connections), and the destructor Ray calls
when the deployment stops closes it."""
from __future__ import annotations

import asyncio
import gc
import socket
import threading

import numpy as np
import pytest

pytest.importorskip("ray")
grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

from paella.cluster.ray_config import parse_config  # noqa: E402
from paella.cluster.ray_ingress import ingress_deployment, start_grpc  # noqa: E402
from paella.kserve.rpc import make_server  # noqa: E402
from paella.kserve.service import ModelSpec  # noqa: E402
from paella.kserve.tensors import TensorSpec  # noqa: E402

ECHO = ModelSpec("echo", (TensorSpec("x", "FP32", (4,)),), (TensorSpec("y", "FP32", (4,)),))


class _Method:
    """``handle.METHOD``: ``remote(**kwargs)`` is awaited, as a Ray response is."""

    def __init__(self, fn):
        self.fn = fn

    def remote(self, **kwargs):
        return self.fn(**kwargs)


class FakeReplicas:
    """The GPU replicas' deployment handle: an echo model."""

    def __init__(self):
        self.spec = _Method(self._spec)
        self.infer = _Method(self._infer)

    async def _spec(self, model, avoid=None):
        return ECHO

    async def _infer(self, model, inputs, avoid=None, timeout=None, priority=0):
        return {"y": inputs["x"]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def loop():
    """An event loop in a thread of its own (a replica's user-code loop)."""
    lp = asyncio.new_event_loop()
    t = threading.Thread(target=lp.run_forever, daemon=True)
    t.start()
    yield lambda coro: asyncio.run_coroutine_threadsafe(coro, lp).result(30)
    lp.call_soon_threadsafe(lp.stop)
    t.join(10)
    lp.close()


# (Ray awaits the async destructor; the garbage collector's own call of it is not)
@pytest.mark.filterwarnings("ignore:coroutine .*__del__' was never awaited")
def test_the_ingress_serves_grpc_on_its_port_alone_and_closes_it_when_stopped(loop):
    port = _free_port()
    cfg = parse_config({"models": ["echo"], "grpc": {"port": port}})
    wrapper = ingress_deployment(cfg).func_or_class
    cls = next(c for c in wrapper.__mro__ if c.__name__ == "PaellaIngress" and c is not wrapper)
    ingress = cls.__new__(cls)
    loop(ingress.__init__(FakeReplicas()))
    c = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        assert c.is_server_ready()
        x = grpcclient.InferInput("x", [4], "FP32")
        x.set_data_from_numpy(np.arange(4, dtype=np.float32))
        assert np.array_equal(c.infer("echo", [x]).as_numpy("y"), np.arange(4))
        with pytest.raises(InferenceServerException, match="unknown model"):
            c.infer("nope", [x])
        # the repository index is the config's models; loading is refused
        index = c.get_model_repository_index().models
        assert [(m.name, m.state) for m in index] == [("echo", "READY")]
        with pytest.raises(InferenceServerException, match="not served through paella "
                                                           "cluster") as e:
            c.load_model("echo")
        assert e.value.status() == "StatusCode.PERMISSION_DENIED"
        # the port is the ingress's alone: a second server (ours, or one with grpc's
        # default SO_REUSEPORT, as paella kserve's) cannot bind it
        with pytest.raises(OSError, match=f"127.0.0.1:{port}"):
            loop(start_grpc(ingress.service, "127.0.0.1", port))
        with pytest.raises((OSError, RuntimeError)):
            make_server(ingress.service, f"127.0.0.1:{port}")
        # Ray's destructor call stops the server: the port is free (nobody listens: a
        # listener of our own binds it, as a restarted ingress would), calls fail
        loop(ingress.__del__())
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (TIME_WAIT is no user)
            s.bind(("127.0.0.1", port))
            s.listen()
        with pytest.raises(InferenceServerException, match="UNAVAILABLE|failed to connect"):
            c.is_server_live(client_timeout=2)
        loop(ingress.__del__())                      # (a second call: nothing to do)
    finally:
        c.close()
        del ingress                  # (here, where the collector's call is expected)
        gc.collect()
