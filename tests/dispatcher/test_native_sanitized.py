"""The C modules under AddressSanitizer and UndefinedBehaviorSanitizer: rebuilt with
both, loaded in a subprocess in place of the installed builds, and driven through the
tracker's, the heap's and the compiled replay's edge cases and whole dispatcher runs
(single- and multi-stream plans, compiled and reference replay), and the kernel core
against its Python reference, its loop in C (``Core.spin``) included. A memory error or
undefined behaviour aborts the subprocess, which fails the test. The subprocess runs
with ``PYTHONMALLOC=malloc``: Python's own small-object allocator would otherwise serve
most objects from its arenas, where ASan sees neither a use after free nor an
overflow into a neighbour."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import sanitized_build
from sanitized_build import ROOT
MODULES = ("_tracker", "_pqueue", "_replay", "_kcore")

DRIVER = r'''
import importlib.util, random, sys
TESTS = sys.argv.pop(1)
for name, path in zip(sys.argv[1::2], sys.argv[2::2]):
    spec = importlib.util.spec_from_file_location(f"paella.dispatcher.{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.modules[f"paella.dispatcher.{name}"] = mod
from paella.dispatcher import tracker, pqueue, replay
assert tracker.TrackerCore.__module__ == "paella.dispatcher._tracker"
assert replay._replay.PlanRun.__module__ == "paella.dispatcher._replay"
h = pqueue.IndexedHeap()
rng = random.Random(3)
items = [object() for _ in range(500)]
for _ in range(40000):
    it = rng.choice(items)
    r = rng.random()
    if r < 0.5:
        h.push(it, rng.uniform(-1, 1), rng.randint(0, 5))
    elif r < 0.8:
        h.remove(it)
    elif len(h):
        h.pop()
    if rng.random() < 0.001:
        h.shift(0.5)
h.clear()
import numpy as np
from paella.gpus import preset
tt = tracker.Tracker(preset("t4"), np.zeros(1024, np.uint64), extra_blocks=0, group=1)
dd, tiny = tracker.Demand(80, 32, 32768, 0, 160), tracker.Demand(1, 1, 1024, 0, 2)
tt.release(dd, object())
assert not tt.admits(dd) and tt.admits_after(dd, dd) and not tt.admits_after(dd, tiny)
from paella.benchmarks import bench_dispatcher as b
b.measure_alone(300, "paella", window=100)
b.measure_whole(200, "paella")
sys.path.insert(0, TESTS)
import test_compiled_replay as t
for plans in ([t.random_plan(1), t.event_plan(streams=True)], [t.random_plan(7)]):
    for policy, ahead in (("paella", 1), ("paella", 3), ("fifo", 1)):
        assert t.run(plans, policy, True, ahead, 2) == t.run(plans, policy, False, ahead, 2)
t.test_the_graph_and_the_run_refuse_what_does_not_fit()
t.test_a_compiled_job_drops_its_ops_when_done()
import test_tracker
assert test_tracker.serve_uneven_conv(16, requests=2) == (0, {0})
test_tracker.test_a_launch_behind_a_running_kernel_is_not_unplaced_work_until_that_kernel_ends()
import test_kernel_core as k
from paella.dispatcher import kernel_core
assert kernel_core.load("_kcore").KernelCore.__module__ == "paella.dispatcher._kcore"
for policy, ahead in (("paella", 3), ("paella", 1), ("fifo", 1), ("ms-jbj", 3), ("priority", 1)):
    k.test_both_cores_serve_plans_as_the_legacy_dispatcher(policy, ahead, None, None, 150e-6)
    k.test_both_cores_serve_plans_as_the_legacy_dispatcher(policy, ahead, 0, 2, 20e-6)   # saturated
plans = [t.random_plan(s) for s in (3, 4)]
times = k.arrivals(25, 3, 50e-6)
picks = [i % 2 for i in range(25)]
for policy in ("paella", "rr", "ms-kbk"):
    assert (k.run_core("c", plans, policy, 3, 0, times, picks, True)
            == k.run_core("python", plans, policy, 3, 0, times, picks, True))
    assert (k.run_core("c", plans, policy, 1, None, times, picks, False, True)
            == k.run_core("python", plans, policy, 1, None, times, picks, False, True))
    assert (k.run_core("c", plans, policy, 1, 0, times, picks, True, False, True)
            == k.run_core("python", plans, policy, 1, 0, times, picks, True, False, True))
k.test_a_refused_launch_fails_its_job_and_the_others_go_on()
import test_slicing as sl                   # classes, the class rule and sliced plans
sl.test_every_path_gives_the_same_schedule_with_classes_and_slices(1)
sl.test_no_less_urgent_kernel_goes_while_an_urgent_job_is_live("c")
k.test_a_plan_spec_that_lies_is_refused_with_a_reason()
import test_core_spin as cs                 # the core's loop in C (real time)
cs.test_spinning_answers_every_request_once_as_single_passes_do("c")
cs.test_an_unchanged_probe_lets_the_spin_run_to_its_deadline()
cs.test_the_spin_ends_at_its_deadline_while_a_kernel_runs()
import test_core_meter as cm                # the metered entry points
cm.test_metering_counts_every_entry_call_and_changes_no_event("c")
cm.test_the_c_step_takes_a_time_of_any_real_type_and_refuses_what_is_not_one()
import test_core_job_of as jo               # a launch id's live job (late faults)
jo.test_a_released_kernel_names_its_live_job_and_none_once_it_has_finished("c")
jo.test_the_c_core_refuses_a_launch_id_that_is_not_an_int()
print("sanitized run ok")
'''


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc to build the sanitized modules")
def test_c_modules_are_clean_under_asan_and_ubsan(tmp_path):
    sanitized_build.sanitizer_libs()
    args = []
    for name in MODULES:
        args += [name, str(sanitized_build.build(ROOT / "dispatcher" / f"{name}.c", tmp_path, name))]
    r = sanitized_build.run_driver(DRIVER, str(Path(__file__).parent), *args)
    assert r.returncode == 0 and "sanitized run ok" in r.stdout, r.stderr[-4000:]
