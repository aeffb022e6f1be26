"""The comparison thread and digest (_offload.c) under AddressSanitizer and
UndefinedBehaviorSanitizer: rebuilt with both, loaded in a subprocess in place of the
installed build, and driven through many comparisons in flight, buffers dropped before
and after their answers, refused arguments, digests of odd sizes and the functional
cache's early lookups. A memory error or undefined behaviour aborts the subprocess,
which fails the test."""
from __future__ import annotations

import shutil

import pytest

import sanitized_build

DRIVER = sanitized_build.sim_module_preamble("_offload") + r'''
from paella.dispatcher.daemon import bundles
assert bundles._offload is mod

rng = random.Random(7)
pool = [np.frombuffer(rng.randbytes(rng.choice([0, 1, 7, 8, 4095, 4096, 70001])), np.uint8)
        for _ in range(40)]
held = []
for i in range(3000):
    x = rng.choice(pool)
    cands = [[rng.choice(pool) if rng.random() < 0.7 else x.copy()] for _ in range(rng.randint(0, 5))]
    p = mod.compare([x], cands)
    if rng.random() < 0.5:
        held.append((p, x, cands))
    elif rng.random() < 0.5:
        want = next((k for k, c in enumerate(cands) if c[0].tobytes() == x.tobytes()), -1)
        assert p.result() == want
    del p                               # dropped while (maybe) still running
    if len(held) > 200:
        p, x, cands = held.pop(rng.randrange(len(held)))
        want = next((k for k, c in enumerate(cands) if c[0].tobytes() == x.tobytes()), -1)
        assert p.result() == want
    d = mod.digest([x, rng.choice(pool)], rng.choice([1, 3, 4096, 1 << 20]))
    assert len(d) == 16
for bad in ((5, []), ([np.zeros(4)], [[1]]), ([np.zeros((4, 4))[:, ::2]], [])):
    try:
        mod.compare(*bad)
    except (TypeError, ValueError, BufferError):
        pass
    else:
        raise AssertionError(bad)
held.clear()
gc.collect()
cache = bundles.FunctionalCache()
class B:
    def run_cpu(self, inputs, variant=0):
        return {"y": inputs["x"] * 2}
xs = [np.full(5000, i, np.float32) for i in range(6)]
for x in xs:
    cache.outputs("m", B(), {"x": x})
for i in range(200):
    x = xs[i % 6].copy()
    lk = cache.begin("m", B(), {"x": x})
    assert (cache.finish("m", B(), {"x": x}, answer=lk)["y"] == x * 2).all()
print("compare ok")
'''


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc to build the sanitized module")
def test_compare_is_clean_under_asan_and_ubsan(tmp_path):
    sanitized_build.check_sim_module("_offload", DRIVER, tmp_path, "compare ok")
