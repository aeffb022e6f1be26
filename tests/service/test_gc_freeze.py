"""The daemon freezes its start-up heap (models, TVM) out of the cyclic collector's
reach, so a full collection does not stall the loop; garbage is collected first, and a
reload unfreezes so that the models it drops can be collected. Run in a subprocess: a
frozen heap would outlive the test."""
from __future__ import annotations

import subprocess
import sys

CODE = r'''
import gc, weakref
from paella.dispatcher.daemon import freeze_heap

class Node:
    pass

a = Node(); a.me = a; ra = weakref.ref(a); del a            # garbage: a cycle
keep = Node(); keep.me = keep                               # live: a model, say
n = freeze_heap()
assert ra() is None, "a garbage cycle survived the freeze"
assert n > 0 and gc.get_freeze_count() == n
b = Node(); b.me = b; rb = weakref.ref(b); del b
gc.collect()
assert rb() is None, "garbage made after the freeze is not collected"
rk = weakref.ref(keep); del keep                            # a reload drops a model
gc.collect()
assert rk() is not None                                     # frozen: out of reach...
freeze_heap()
assert rk() is None, "the next freeze (a reload) did not collect the dropped cycle"
print("ok")
'''


def test_freeze_heap_collects_first_freezes_and_a_reload_releases():
    r = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
