"""The simulator's engine (_engine.c) under AddressSanitizer and UndefinedBehaviorSanitizer:
rebuilt with both, loaded in a subprocess in place of the installed build, and driven
through mixed kernels with jitter, copies, markers, gates (opened at the head, before
arrival, from callbacks, and with stale or forged handles), bulk arrivals, callbacks that
submit more work or raise, a notifQ overrun and a whole dispatcher run. A memory error or
undefined behaviour aborts the subprocess, which fails the test (checked by hand: an
overflow planted in the dirty-SM list aborts it)."""
from __future__ import annotations

import shutil

import pytest

import sanitized_build

DRIVER = sanitized_build.sim_module_preamble("_engine") + r'''
from paella.dispatcher.devices.base import KernelInfo, ModuleImage, NotifQOverrun
from paella.dispatcher.devices.sim import SimDevice
from paella import protocol
assert type(SimDevice("t4").gpu).__module__ == name

rng = random.Random(5)
for gpu, jitter in (("a100", 0.2), ("p100", 0.0), ("gtx1660s", 0.0)):
    dev = SimDevice(gpu, n_streams=48, seed=3, jitter=jitter)
    infos = [KernelInfo(f"k{i}", rng.choice([16, 32, 64, 128]), static_smem=rng.choice([0, 8192, 40000]),
                        flops=rng.uniform(1e5, 1e9), bytes=rng.uniform(0, 1e8),
                        duration=(rng.uniform(1e-6, 1e-4) if i % 3 == 0 else None)) for i in range(12)]
    funcs = dev.load_module(ModuleImage("m", infos))
    ptr = dev.alloc(1 << 16)
    host = np.zeros(1 << 16, np.uint8)
    head, mask, ring = 0, dev.notifq.size - 1, dev.notifq
    done = []
    gates = []
    notifying, reached = set(), set()
    for i in range(1500):
        f = funcs[rng.choice(infos).name]
        s = rng.randrange(48)
        r = rng.random()
        if r < 0.8:
            cb = (lambda: done.append(1)) if rng.random() < 0.5 else (
                lambda s=s: dev.launch(f, 3, 64, s, 7, instrumented=False))
            try:
                dev.launch(f, rng.randint(1, 700), rng.choice([32, 96, 128, 256, 512]), s, i,
                           group=rng.choice([1, 7, 16]), on_complete=cb)
            except Exception as e:       # a shape that can never run is refused cleanly
                assert "can never run" in str(e) or "not even one block" in str(e), e
        elif r < 0.9:
            dev.memcpy_htod(ptr, host[:rng.randint(1, 1 << 16)], s)
        elif r < 0.95:
            ev = dev.record_event(s)
        else:
            notify = rng.random() < 0.5
            gates.append(dev.gpu.gate(s, notify))
            if notify:
                notifying.add(gates[-1])
        if i % 7 == 0:
            for h in dev.gpu.reached():      # each notifying gate listed once at most
                assert h in notifying and h not in reached, h
                reached.add(h)
            rng.shuffle(gates)
            n = rng.randint(0, len(gates))
            for h in gates[:n]:              # at the head, before arrival, or stale (False)
                dev.gpu.open(h)
            gates = gates[n:] + [h for h in gates[:n] if rng.random() < 0.2]
            dev.run_until(dev.now() + rng.uniform(0, 2e-4))
            while ring[head & mask]:
                ring[head & mask] = protocol.INVALID
                head += 1
    while dev.next_event_time() != float("inf") or dev.gpu.gates:
        if dev.next_event_time() == float("inf"):
            for h in gates:                  # only closed gates hold work back
                dev.gpu.open(h)
            gates = []
            continue
        dev.step()
        while ring[head & mask]:
            ring[head & mask] = protocol.INVALID
            head += 1
    assert dev.gpu.resident == 0 and not dev.gpu.busy() and dev.gpu.gates == 0
    blocks, warps, smem, regs = dev.gpu.state()
    assert set(blocks) == {dev.props.max_blocks_per_sm}

# gates: stale and forged handles, slots reused, opened from a callback that then raises
dev = SimDevice("t4", n_streams=4)
f = dev.load_module(ModuleImage("f", [KernelInfo("k", 32, flops=1e8)]))["k"]
old = []
for i in range(200):
    h = dev.gpu.gate(i % 4)
    dev.launch(f, 3, 128, i % 4, i, instrumented=False)
    if i % 3 == 0:
        dev.gpu.open(h)
    old.append(h)
    for bad in (rng.randrange(1 << 40), -rng.randrange(1, 1 << 40), rng.randrange(1 << 80)):
        try:
            dev.gpu.open(bad)
        except ValueError:
            pass
dev.run()
for h in old:
    dev.gpu.open(h)
dev.run()
def opener(h):
    dev.gpu.open(h)
    raise KeyError("after open")
g2 = dev.gpu.gate(0)
dev.launch(f, 3, 128, 0, 8, instrumented=False)
dev.launch(f, 3, 128, 1, 9, instrumented=False, on_complete=lambda: opener(g2))
try:
    dev.run()
    raise SystemExit("no error")
except KeyError:
    pass
dev.run()
for h in old + [g2]:
    assert dev.gpu.open(h) is False
assert dev.gpu.gates == 0 and not dev.gpu.busy()

# bulk arrivals, profiling records
dev = SimDevice("gtx1660s", n_streams=1024)
f = dev.load_module(ModuleImage("f", [KernelInfo("k", 9, duration=3e-4)]))["k"]
shape = dev._shapes[dev.block_footprint(f, (128, 1, 1), 0)]
t = np.repeat(np.sort(np.random.default_rng(1).uniform(0, 0.01, 3000)), 8)
dev.gpu.record = []
dev.gpu.bulk(t.tobytes(), (np.arange(t.size, dtype=np.int32) // 8 % 1024).tobytes(),
             np.arange(t.size, dtype=np.uint32).tobytes(), shape, 1, 0.0, 0.0, 3e-4, False, 16)
dev.run()
assert len(dev.gpu.record) == t.size and dev.gpu.placements == t.size

# stream priorities: a more urgent stream's kernel placed before an earlier one's blocks
dev = SimDevice("t4", n_streams=4)
fs = dev.load_module(ModuleImage("f", [KernelInfo("k", 32, duration=1e-3), KernelInfo("one", 32, duration=1e-5)]))
dev.set_stream_priority(1, -2)
dev.set_stream_priority(2, 3)
ends = {}
for s, grid in ((0, 2000), (2, 100), (1, 1)):
    dev.launch(fs["one"] if s == 1 else fs["k"], grid, 256, s, 10 + s, instrumented=False,
               on_complete=lambda s=s: ends.__setitem__(s, dev.now()))
dev.run()
assert ends[1] < 2e-4 < ends[0] < ends[2], ends

# a callback that raises surfaces, and the engine stays usable
dev = SimDevice("t4")
f = dev.load_module(ModuleImage("f", [KernelInfo("k", 32, flops=1e8)]))["k"]
def boom():
    raise KeyError("boom")
dev.launch(f, 10, 256, 0, 1, on_complete=boom)
try:
    dev.run()
    raise SystemExit("no error")
except KeyError:
    pass
dev.launch(f, 10, 256, 1, 2)
dev.run()

# overrun
dev = SimDevice("t4", notifq_slots=64)
f = dev.load_module(ModuleImage("f", [KernelInfo("k", 32, flops=1e8)]))["k"]
dev.launch(f, 40, 256, 0, 1, group=1)
try:
    dev.run()
    raise SystemExit("no overrun")
except NotifQOverrun:
    pass
del dev

from paella.benchmarks import bench_dispatcher as b
b.measure_alone(200, "paella", window=100)
print("sanitized run ok")
'''


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc to build the sanitized engine")
def test_engine_is_clean_under_asan_and_ubsan(tmp_path):
    sanitized_build.check_sim_module("_engine", DRIVER, tmp_path, "sanitized run ok")
