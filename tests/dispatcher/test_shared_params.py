"""The variants of one model hold one device copy of its weights (dispatcher/
shared_params.py): a bundle of several batch sizes registered variant by variant
allocates and uploads its params once, every variant's kernels read the same buffers,
and the copy goes only when the last variant using it closes."""
from __future__ import annotations

import numpy as np
import pytest

from paella.bundle import load_bundle
from paella.dispatcher.adaptor import PlanAdaptor
from paella.dispatcher.core import STATUS_OK, Dispatcher, Request
from paella.dispatcher.devices.sim import SimDevice
from paella.dispatcher.shared_params import SharedParams

SIZES = (1, 2, 4)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    from paella.compiler_pass.build import compile_bundle
    from paella.models.tiny import tiny_mlp
    return load_bundle(compile_bundle([tiny_mlp(batch=b) for b in SIZES],
                                      tmp_path_factory.mktemp("shared") / "mlp"))


def weights_bytes(bundle) -> int:
    return sum(len(d) for d in bundle.param_bytes(0).values())


def serve(bundle, d, mid, variant, seed):
    """One request of ``variant`` on model ``mid``, completed OK (a plain plan computes
    nothing on the simulator: what the variants share is checked byte for byte above)."""
    v = bundle.variants[variant]
    x = np.random.default_rng(seed).standard_normal(v.inputs[0].shape).astype(np.float32)
    io = bundle.pack_inputs({"x": x}, variant)
    done = {}
    d.submit(Request(seed, 0, mid, io, on_complete=lambda r, st, err: done.update(st=(st, err))))
    d.run_until_idle()
    assert done["st"] == (STATUS_OK, None)


def test_the_variants_of_a_bundle_share_one_params_file_and_its_bytes(bundle):
    assert len(bundle.variants) == len(SIZES)
    assert all("params" not in v.files for v in bundle.variants[1:])   # variant 0's serves
    first = bundle.param_bytes(0)
    for k in range(1, len(SIZES)):
        assert [d for d in bundle.param_bytes(k).values()] == list(first.values())
        assert all(a is b for a, b in zip(bundle.param_bytes(k).values(), first.values()))


def test_every_variant_reads_one_device_copy_of_the_weights(bundle):
    dev = SimDevice("gtx1660s", n_streams=8, seed=0)
    d = Dispatcher(dev, "paella", profile_runs=0, buffer_sets_ahead=0)
    base = dev.allocated_bytes
    ads = [PlanAdaptor.from_bundle(bundle, k, name=f"mlp/b{b}") for k, b in enumerate(SIZES)]
    mids = [d.register_model(f"mlp/b{b}", a) for a, b in zip(ads, SIZES)]
    w = weights_bytes(bundle)
    assert w > 0
    # The weights once, whatever the number of variants (each variant's per-request
    # buffer sets come on demand, none yet).
    assert dev.allocated_bytes - base == w
    assert d.models[mids[0]].weights_bytes == w and d.models[mids[1]].weights_bytes == 0
    ptrs = [sorted(a.buffers.values()) for a in ads]
    assert ptrs[0] == ptrs[1] == ptrs[2]
    for bid, data in bundle.param_bytes(0).items():
        for a in ads:
            assert dev.memory.view(a.buffers[str(bid)], len(data)).tobytes() == data
    for k, mid in enumerate(mids):
        serve(bundle, d, mid, k, seed=k + 1)
    # The first variant retired: the others keep the copy and still serve.
    held = dev.allocated_bytes
    d.retire_model(mids[0])
    assert dev.allocated_bytes >= w
    for bid, data in bundle.param_bytes(0).items():
        assert dev.memory.view(ads[1].buffers[str(bid)], len(data)).tobytes() == data
    serve(bundle, d, mids[2], 2, seed=9)
    assert dev.allocated_bytes < held              # (variant 0's own buffer sets went)
    d.retire_model(mids[1])
    d.retire_model(mids[2])
    assert dev.allocated_bytes == base             # the last one freed the weights


def test_a_device_of_its_own_gets_its_own_copy(bundle):
    """Pointers belong to one device: another device uploads its own copy."""
    for dev in [SimDevice("gtx1660s", n_streams=8, seed=0) for _ in range(2)]:
        base = dev.allocated_bytes
        Dispatcher(dev, "paella", profile_runs=0, buffer_sets_ahead=0).register_model(
            "mlp", PlanAdaptor.from_bundle(bundle, 0))
        assert dev.allocated_bytes - base == weights_bytes(bundle)


class _Dev:
    def __init__(self):
        self.next, self.live = 0, set()

    def alloc(self, n):
        self.next += 1 << 20
        self.live.add(self.next)
        return self.next

    def free(self, p):
        self.live.remove(p)


def test_the_store_counts_references_by_the_contents_object():
    store, dev = SharedParams(), _Dev()
    a, b = b"\x01" * 64, bytes(bytearray(b"\x01" * 64))   # equal, not the same object
    p1, new1 = store.acquire(dev, a, 64)
    p2, new2 = store.acquire(dev, a, 64)
    p3, new3 = store.acquire(dev, b, 64)
    assert (new1, new2, new3) == (True, False, True) and p1 == p2 != p3
    assert len(store) == 2 and store.nbytes() == 128
    store.release(dev, p1)
    assert p1 in dev.live
    store.release(dev, p2)
    assert p1 not in dev.live and len(store) == 1
    store.release(dev, p3)
    assert not dev.live and len(store) == 0
