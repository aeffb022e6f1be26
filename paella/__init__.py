"""Paella-py: software-defined GPU scheduling for low-latency model serving.

The client API of the paper is available at the top level::

    import paella
    out = paella.infer("resnet18", {"x": x})  # inputs in, outputs back, default connection
    client = paella.connect()                  # or paella.predict(...) on a default connection
    req = client.predict("resnet18", length, io_offset)
    done = client.read_result()                # or read_result(paella.NONBLOCK) -> -EAGAIN
    for token in paella.generate("gpt-tiny", [1, 2, 3], max_tokens=8):   # streamed
        ...

They are loaded on first use, so ``import paella.protocol`` and friends stay light.
"""
from __future__ import annotations

__version__ = "0.1.0"

from paella.tvm_loader import install as _hide_torch_from_tvm  # noqa: E402

_hide_torch_from_tvm()        # (TVM imports torch otherwise: 3 s a process; see tvm_loader)

_CLIENT_API = {"connect", "predict", "read_result", "infer", "generate", "NONBLOCK", "Client", "default_client",
               "PaellaError", "DaemonUnavailable", "DaemonGone", "DaemonError", "UnknownModel",
               "NothingInFlight", "RingFull", "ArenaFull", "RequestFailed", "ResultTimeout"}


def __getattr__(name: str):
    if name in _CLIENT_API:
        from paella import client
        return getattr(client, name)
    raise AttributeError(f"module 'paella' has no attribute {name!r}")


__all__ = sorted(_CLIENT_API)
