"""The model list travels in every client's WELCOME frame, whose payload is at most
``wire.MAX_PAYLOAD``: a swap that would make it larger refuses the model that does,
instead of serving a list no client can receive (6,000 variants passed the load, then
every connection failed with ``too_large``)."""
from __future__ import annotations

from types import SimpleNamespace

from paella import wire
from paella.dispatcher.daemon import DaemonConfig
from paella.dispatcher.daemon.repository import Scan
from paella.dispatcher.daemon.server import MODEL_LIST_BYTES, Daemon, _listed_bytes


class Huge(SimpleNamespace):
    """A prepared model whose description has ``n`` variants (registration must not be
    reached for the one refused)."""

    def model_info(self, mid: int) -> wire.ModelInfo:
        t = wire.TensorInfo("x" * 40, (1, 3, 224, 224), "float32", 0)
        return wire.ModelInfo(mid, self.model, tuple(
            wire.VariantInfo(602112, (t,), (t,), b + 1) for b in range(self.n)))


def test_a_model_that_would_overflow_every_clients_welcome_is_not_served(tmp_path):
    d = Daemon(DaemonConfig(socket=str(tmp_path / "p.sock"), backend="sim", noop=False))
    per_variant = (_listed_bytes(Huge(model="big", n=2).model_info(0))
                   - _listed_bytes(Huge(model="big", n=1).model_info(0)))
    n = MODEL_LIST_BYTES // per_variant + 10
    prepared = Huge(model="big", n=n, directory=str(tmp_path / "big"), variant_names=["v"] * n)
    scan = Scan(str(tmp_path))
    scan.prepared.append(prepared)
    try:
        d._swap(scan)
    finally:
        if d.device is not None:          # (its answer workers, started with the device)
            d.device.close()
    why = d.unserved[str(tmp_path / "big")]
    assert "would make the list every client receives at connection exceed" in why
    assert f"{n} variant(s)" in why
    assert "big" not in {m.name for m in d.table.by_id.values()}
    payload = wire.encode(wire.WELCOME, {"client_id": 1, "segment": "s", "layout": {},
                                         "models": d.table.describe()})
    assert len(payload) < wire.MAX_PAYLOAD
