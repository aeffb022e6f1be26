"""On the cuda backend (the recording stand-in driver) the variants of one model upload
its weights once: registering three batch sizes copies the params to the GPU once, and
every variant's launches pass the same param pointers (dispatcher/shared_params.py)."""
from __future__ import annotations

import shutil

import pytest

from cuda_fake_driver import FakeDriver
from cuda_fixtures import stand_in_cubins
from paella.dispatcher.adaptor import PlanAdaptor
from paella.dispatcher.core import Dispatcher
from paella.dispatcher.devices.cuda import CudaDevice

SIZES = (1, 2, 4)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """tiny_mlp at three batch sizes, every variant's cubin a stand-in image of its
    kernels (as tests/cuda/test_orca_on_cuda.py does)."""
    from paella.compiler_pass.build import compile_bundle
    from paella.models.tiny import tiny_mlp
    root = tmp_path_factory.mktemp("shared-cuda")
    built = compile_bundle([tiny_mlp(batch=b) for b in SIZES], root / "built")
    shutil.copytree(built, root / "mlp")
    return stand_in_cubins(root / "mlp")


def test_three_variants_upload_the_weights_once(bundle):
    drv = FakeDriver()
    dev = CudaDevice(driver=drv, n_streams=4, notifq_slots=256, counter_pairs=64)
    try:
        d = Dispatcher(dev, "paella", counter_pairs=64, profile_runs=0, buffer_sets_ahead=0)
        weights = bundle.param_bytes(0)
        before = len(drv.calls)
        ads = [PlanAdaptor.from_bundle(bundle, k, name=f"mlp/b{b}") for k, b in enumerate(SIZES)]
        for a, b in zip(ads, SIZES):
            d.register_model(f"mlp/b{b}", a)
        uploads = [args for name, args in drv.calls[before:] if name == "cuMemcpyHtoDAsync"]
        assert sum(a[2] for a in uploads) == sum(len(w) for w in weights.values())
        assert len({tuple(sorted(a.buffers.values())) for a in ads}) == 1
        for bid, data in weights.items():            # what the GPU holds: the weights
            ptr = ads[2].buffers[str(bid)]
            assert bytes(drv._device_view(ptr, len(data))) == data
        ptrs = set(ads[0].buffers.values())
        mids = list(d.models)
        for mid in mids[:-1]:                         # the others retired: still there
            d.retire_model(mid)
        assert ptrs <= set(drv.device_mem)
        d.retire_model(mids[-1])                      # the last one frees them
        assert not ptrs & set(drv.device_mem)
    finally:
        dev.close()
