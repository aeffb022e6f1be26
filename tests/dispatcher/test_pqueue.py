"""IndexedHeap against a sorted-list oracle: random pushes, re-keys, removals and pops
keep exactly the oracle's order; items are held by identity and released."""
from __future__ import annotations

import gc
import random
import weakref

import pytest

from paella.dispatcher.pqueue import IndexedHeap


class Item:
    def __init__(self, i):
        self.i = i

    def __eq__(self, other):          # equal by value: the heap must not care
        return True

    def __hash__(self):
        return 0


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_match_an_oracle(seed):
    rng = random.Random(seed)
    items = [Item(i) for i in range(300)]
    h = IndexedHeap()
    oracle = {}                          # id -> (key, tie, item)
    for step in range(20000):
        r = rng.random()
        it = rng.choice(items)
        if r < 0.45:
            key = float(rng.randint(0, 40)) if rng.random() < 0.5 else rng.uniform(-5, 5)
            tie = rng.randint(0, 10)
            h.push(it, key, tie)
            oracle[id(it)] = (key, tie, it)
        elif r < 0.75:
            assert h.remove(it) == (id(it) in oracle)
            oracle.pop(id(it), None)
        elif r < 0.85 and oracle:
            best = min(oracle.values(), key=lambda e: (e[0], e[1]))
            got = h.pop()
            assert oracle[id(got)][:2] == best[:2]   # (equal keys and ties: any of them)
            del oracle[id(got)]
        elif r < 0.9 and oracle:
            d = rng.uniform(-3, 3)
            h.shift(d)
            oracle = {k: (v[0] + d, v[1], v[2]) for k, v in oracle.items()}
        assert len(h) == len(oracle)
        assert (it in h) == (id(it) in oracle)
        if oracle:
            best = min((e[0], e[1]) for e in oracle.values())
            top = h.top()
            assert oracle[id(top)][:2] == best and h.top_key() == best[0]
            assert h.key(top) == best
        else:
            assert h.top() is None
    assert sorted(x.i for x in h.items()) == sorted(e[2].i for e in oracle.values())


def test_bad_use_is_refused_clearly():
    h = IndexedHeap()
    with pytest.raises(IndexError, match="empty"):
        h.pop()
    with pytest.raises(IndexError, match="empty"):
        h.top_key()
    with pytest.raises(ValueError, match="NaN"):
        h.push(object(), float("nan"), 0)
    with pytest.raises(TypeError):
        h.push(object(), "1", 0)
    x = object()
    with pytest.raises(KeyError):
        h.key(x)
    assert h.remove(x) is False and len(h) == 0


def test_items_are_released_and_cycles_collected():
    h = IndexedHeap()
    a = Item(1)
    ref = weakref.ref(a)
    h.push(a, 1.0, 0)
    a.heap = h                            # a cycle through the heap
    del a, h
    gc.collect()
    assert ref() is None
    h = IndexedHeap()
    b = Item(2)
    h.push(b, 0.0, 0)
    h.remove(b)
    h.push(b, 1.0, 0)
    h.clear()
    rb = weakref.ref(b)
    del b
    assert rb() is None and len(h) == 0


def test_a_missing_compiled_module_names_the_fix():
    from paella.dispatcher.native import load
    assert load("_pqueue").IndexedHeap is IndexedHeap
    with pytest.raises(ImportError, match=r"dispatcher/_nope\.c.*pip install -e \."):
        load("_nope")


def test_clear_survives_a_finalizer_that_uses_the_heap():
    """Items are released after the heap is emptied, so a finalizer may push again."""
    h = IndexedHeap()
    keep = [Item(i) for i in range(3)]

    class Pusher:
        def __del__(self):
            for i, k in enumerate(keep):
                h.push(k, float(i), i)
    h.push(Pusher(), 0.0, 0)
    for i in range(5):
        h.push(Item(10 + i), float(i), i)
    h.clear()
    assert len(h) == 3 and all(k in h for k in keep) and h.pop() is keep[0]


def test_shift_by_a_non_finite_delta_and_constructor_arguments_are_refused():
    h = IndexedHeap()
    h.push(Item(0), 1.0, 0)
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError, match="finite"):
            h.shift(bad)
    assert h.top_key() == 1.0
    with pytest.raises(TypeError, match="no arguments"):
        IndexedHeap(1)
