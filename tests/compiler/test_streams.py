"""Nimble's stream assignment on random DAGs and random buffer accesses (hypothesis):
no data race, maximum logical concurrency, |E'| - |M| synchronizations, and the
fewest synchronizations of any assignment (brute force up to 8 nodes)."""
from __future__ import annotations

import itertools

import numpy as np

import networkx as nx
from hypothesis import given, settings, strategies as st

from paella.bundle import BufferSpec, KernelArg, KernelSpec, Op, Variant, check_variant
from paella.compiler_pass.streams import (Access, assign_streams, dependency_dag, nimble,
                                          pack_buffers, plan_with_streams, rename_buffers,
                                          step_access, width, with_streams)

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True)


@st.composite
def dags(draw, max_nodes: int = 12) -> nx.DiGraph:
    """A random DAG on 0..n-1 with edges only from lower to higher numbers."""
    n = draw(st.integers(1, max_nodes))
    pairs = [(u, v) for u in range(n) for v in range(u + 1, n)]
    density = draw(st.sampled_from([0.1, 0.25, 0.5]))
    keep = draw(st.lists(st.floats(0, 1), min_size=len(pairs), max_size=len(pairs)))
    g = nx.DiGraph()
    g.add_nodes_from(range(n))
    g.add_edges_from(p for p, x in zip(pairs, keep) if x < density)
    return g


def comparable(closure: nx.DiGraph, u: int, v: int) -> bool:
    return closure.has_edge(u, v) or closure.has_edge(v, u)


@SETTINGS
@given(dags())
def test_streams_are_chains_and_syncs_are_the_unmatched_meg_edges(g):
    a = assign_streams(g)
    n = g.number_of_nodes()
    closure = nx.transitive_closure_dag(g)
    # Maximum logical concurrency (the paper's definition): independent nodes never
    # share a stream; a stream is a chain of the partial order.
    for u, v in itertools.combinations(range(n), 2):
        if a.stream[u] == a.stream[v]:
            assert comparable(closure, u, v)
    meg = set(a.meg)
    g2 = nx.DiGraph(list(meg))
    g2.add_nodes_from(g)
    assert set(nx.transitive_closure_dag(g2).edges) == set(closure.edges)   # same reachability
    for u, v in meg:                     # and minimal: each edge is its pair's only path
        assert not any(closure.has_edge(u, w) and closure.has_edge(w, v) for w in range(n))
    assert len(a.syncs) == len(a.meg) - len(a.matched)
    assert set(a.syncs) | set(a.matched) == meg and not set(a.syncs) & set(a.matched)
    assert all(a.stream[u] != a.stream[v] for u, v in a.syncs)
    # Streams: one per chain of the matching, never fewer than the width (Dilworth).
    assert a.n_streams == n - len(a.matched) >= width(g)


def test_meg_paths_can_need_more_streams_than_the_width():
    """a, b -> c -> d, e: width 2 ({a, b}), but Nimble's chains are paths of G', three."""
    g = nx.DiGraph([(0, 2), (1, 2), (2, 3), (2, 4)])
    a = assign_streams(g)
    assert width(g) == 2 and a.n_streams == 3 and len(a.syncs) == 2


def chain_partitions(nodes: list[int], closure: nx.DiGraph):
    """Every partition of ``nodes`` into chains (blocks of pairwise comparable nodes)."""
    if not nodes:
        yield []
        return
    first, rest = nodes[0], nodes[1:]
    for part in chain_partitions(rest, closure):
        for i, block in enumerate(part):
            if all(comparable(closure, first, x) for x in block):
                yield part[:i] + [[first, *block]] + part[i + 1:]
        yield [[first]] + part


def min_syncs_brute_force(g: nx.DiGraph) -> int:
    """The fewest synchronizations over every assignment with maximum logical
    concurrency. An edge (u, v) of G' is the only path from u to v, so when u and v are
    on different streams nothing but a synchronization on that edge orders them."""
    closure = nx.transitive_closure_dag(g)
    meg = nx.transitive_reduction(g).edges
    best = None
    for part in chain_partitions(sorted(g.nodes), closure):
        stream = {v: i for i, block in enumerate(part) for v in block}
        cost = sum(stream[u] != stream[v] for u, v in meg)
        best = cost if best is None else min(best, cost)
    return best


@settings(max_examples=60, deadline=None, derandomize=True)
@given(dags(max_nodes=8))
def test_fewest_synchronizations_against_brute_force(g):
    a = assign_streams(g)
    assert len(a.syncs) == min_syncs_brute_force(g)


# -------------------------------------------------------------- plans and data races

@st.composite
def plans(draw, kinds=("param",)) -> Variant:
    """A random single-stream plan over a few buffers: h2d copies, kernels reading and
    writing random buffers (each kernel its own parameter accesses), d2h copies; now and
    then at an offset into the buffer (which renaming and packing must leave alone).
    Buffers of kind "param" count as written at load, so such a plan passes
    check_variant's dataflow check."""
    n_buf = draw(st.integers(1, 5))
    buffers = [BufferSpec(i, f"b{i}", 64, draw(st.sampled_from(kinds))) for i in range(n_buf)]
    plan, kernels = [], []
    for i in range(draw(st.integers(1, 14))):
        kind = draw(st.sampled_from(["launch", "launch", "launch", "h2d", "d2h"]))
        b = draw(st.integers(0, n_buf - 1))
        if kind != "launch":
            plan.append(Op(kind, buffer=b, io_offset=0, nbytes=8,
                           buffer_offset=draw(st.sampled_from([0, 0, 0, 8]))))
            continue
        n_args = draw(st.integers(1, 3))
        params, args = [], []
        for j in range(n_args):
            params.append({"name": f"p{j}", "kind": "buffer", "dtype": "float32",
                           "access": draw(st.sampled_from(["r", "w", "rw"]))})
            args.append(KernelArg(buffer=draw(st.integers(0, n_buf - 1)),
                                  offset=draw(st.sampled_from([0, 0, 0, 8]))))
        kernels.append(KernelSpec(f"k{i}", [1], [32], 0, 0, 32, 0.0, 0, params, False))
        plan.append(Op("launch", kernel=f"k{i}", grid=[1], block=[32], args=args))
    return Variant("v", [], [], buffers, kernels, plan, 8)


def happens_before(plan: list[Op]) -> tuple[nx.DiGraph, list[int]]:
    """The order a multi-stream plan guarantees: each step after its stream's previous
    step, a wait after the record it waits for. Returns the graph on step indices and
    the indices of the original (non-event) steps in order."""
    g = nx.DiGraph()
    last: dict[int, int] = {}
    records: dict[int, int] = {}
    real = []
    for i, op in enumerate(plan):
        g.add_node(i)
        if op.stream in last:
            g.add_edge(last[op.stream], i)
        last[op.stream] = i
        if op.op == "record":
            records[op.event] = i
        elif op.op == "wait":
            g.add_edge(records[op.event], i)
        else:
            real.append(i)
    return g, real


def conflicts(x: Access, y: Access) -> bool:
    return bool(x.writes & (y.reads | y.writes) or y.writes & x.reads)


@SETTINGS
@given(plans())
def test_nimble_plans_have_no_data_race(variant):
    """Every pair of steps that conflict on a buffer is ordered by stream order and
    events, and the plan is still valid (waits after records, reads after writes)."""
    out, a = plan_with_streams(variant)
    nimble = with_streams(variant, "nimble")
    assert nimble.plan == out
    hb, real = happens_before(out)
    assert len(real) == len(variant.plan)
    reach = nx.transitive_closure_dag(hb)
    acc = [step_access(op, variant) for op in variant.plan]
    for i, j in itertools.combinations(range(len(acc)), 2):
        if conflicts(acc[i], acc[j]):
            assert reach.has_edge(real[i], real[j]), (i, j)
    assert all(op.stream >= 1 for op in out)
    assert sum(op.op == "wait" for op in out) == len(a.syncs)
    assert [o.op for o in out if o.op not in ("record", "wait")] == [o.op for o in variant.plan]
    check_variant(nimble)


def test_independent_branches_get_their_own_streams():
    """x -> (a, b) -> c as kernels: a and b on two streams, one event for the join."""
    r, w = ({"name": "i", "kind": "buffer", "dtype": "float32", "access": "r"},
            {"name": "o", "kind": "buffer", "dtype": "float32", "access": "w"})
    k1 = KernelSpec("one", [1], [32], 0, 0, 32, 0.0, 0, [r, w], False)
    k2 = KernelSpec("two", [1], [32], 0, 0, 32, 0.0, 0, [r, r, w], False)
    buf = [BufferSpec(i, f"b{i}", 64, "intermediate") for i in range(4)]
    plan = [Op("h2d", buffer=0, io_offset=0, nbytes=8),
            Op("launch", kernel="one", args=[KernelArg(0), KernelArg(1)]),
            Op("launch", kernel="one", args=[KernelArg(0), KernelArg(2)]),
            Op("launch", kernel="two", args=[KernelArg(1), KernelArg(2), KernelArg(3)]),
            Op("d2h", buffer=3, io_offset=0, nbytes=8)]
    v = Variant("v", [], [], buf, [k1, k2], plan, 8)
    g = dependency_dag([step_access(op, v) for op in plan])
    assert sorted(g.edges) == [(0, 1), (0, 2), (1, 3), (2, 3), (3, 4)]
    out, a = plan_with_streams(v)
    assert a.n_streams == 2 and width(g) == 2 and len(a.syncs) == 2
    assert a.stream[1] != a.stream[2]
    assert [o.op for o in out].count("record") == 2 and [o.op for o in out].count("wait") == 2
    check_variant(Variant("v", [], [], buf, [k1, k2], out, 8))


@SETTINGS
@given(plans(kinds=("param", "intermediate", "intermediate")))
def test_renaming_keeps_every_value_and_the_plan_stays_race_free(variant):
    """Each step reads the values it read before renaming (the same writers), reused
    buffers lose their write-after-read edges, packing changes neither values nor
    orderings, and the streamed plan has no race on the buffers it finally uses."""
    renamed = rename_buffers(variant)
    assert _values_read(renamed) == _values_read(variant)
    assert [b.nbytes for b in renamed.buffers[:len(variant.buffers)]] == \
        [b.nbytes for b in variant.buffers]
    before = dependency_dag([step_access(op, variant) for op in variant.plan])
    after = dependency_dag([step_access(op, renamed) for op in renamed.plan])
    assert set(after.edges) <= set(nx.transitive_closure_dag(before).edges)
    # Packing shares buffers again without adding any ordering or changing a value.
    packed = pack_buffers(renamed)
    assert _values_read(packed) == _values_read(variant)
    assert [b.id for b in packed.buffers] == list(range(len(packed.buffers)))
    assert len(packed.buffers) <= len(renamed.buffers)
    closure = lambda v: set(nx.transitive_closure_dag(     # noqa: E731
        dependency_dag([step_access(op, v) for op in v.plan])).edges)
    assert closure(packed) == closure(renamed)
    streamed = nimble(variant)[0]
    out = streamed.plan
    hb, real = happens_before(out)
    reach = nx.transitive_closure_dag(hb)
    acc = [step_access(op, streamed) for op in [o for o in out if o.op not in ("record", "wait")]]
    for i, j in itertools.combinations(range(len(acc)), 2):
        if conflicts(acc[i], acc[j]):
            assert reach.has_edge(real[i], real[j]), (i, j)


def test_renaming_frees_a_reused_storage():
    """TVM's plan: storage 1 holds a, then (after a is read) c. Renamed, c gets its own
    buffer and the second branch no longer waits for the first one's reader."""
    r, w = ({"name": "i", "kind": "buffer", "dtype": "float32", "access": "r"},
            {"name": "o", "kind": "buffer", "dtype": "float32", "access": "w"})
    k = KernelSpec("k", [1], [32], 0, 0, 32, 0.0, 0, [r, w], False)
    buf = [BufferSpec(0, "x", 64, "input"), BufferSpec(1, "s1", 64, "intermediate"),
           BufferSpec(2, "s2", 64, "intermediate")]
    plan = [Op("h2d", buffer=0, io_offset=0, nbytes=8),
            Op("launch", kernel="k", args=[KernelArg(0), KernelArg(1)]),    # a = f(x)  in s1
            Op("launch", kernel="k", args=[KernelArg(1), KernelArg(2)]),    # b = f(a)  in s2
            Op("launch", kernel="k", args=[KernelArg(0), KernelArg(1)]),    # c = f(x)  in s1 again
            Op("d2h", buffer=1, io_offset=0, nbytes=8)]
    from paella.bundle import TensorSpec
    v = Variant("v", [], [TensorSpec("out", [2], "float32", 0, 8, 1)], buf, [k], plan, 8)
    g = dependency_dag([step_access(op, v) for op in plan])
    assert width(g) == 1                       # the reuse orders c after b
    renamed = rename_buffers(v)
    assert [b.id for b in renamed.buffers] == [0, 1, 2, 3]
    assert renamed.plan[3].args[1].buffer == 3 and renamed.plan[4].buffer == 3
    assert renamed.outputs[0].buffer == 3
    g2 = dependency_dag([step_access(op, renamed) for op in renamed.plan])
    assert width(g2) == 2 and not g2.has_edge(2, 3)
    check_variant(nimble(v)[0])


def _values_read(variant: Variant) -> list[list[int]]:
    """Per step, which earlier steps wrote the values it reads (-1: the buffer's
    initial contents): renaming must not change what any step sees."""
    writer: dict[int, int] = {}
    out = []
    for i, op in enumerate(variant.plan):
        acc = step_access(op, variant)
        out.append(sorted(writer.get(b, -1) for b in acc.reads))
        for b in acc.writes:
            writer[b] = i
    return out


# -------------------------------------------------------------- paella compile --streams

def _fork_join():
    """x -> two convolution branches -> their sum: the smallest branchy model (branch a
    has two convolutions, so that TVM cannot fuse the sum into a lone convolution of
    each branch)."""
    from tvm.relax.frontend import nn

    from paella.models.base import export
    from paella.models.layers import ConvBN

    class ForkJoin(nn.Module):
        def __init__(self):
            self.a1, self.a2 = ConvBN(3, 4, 3, padding=1), ConvBN(4, 4, 1)
            self.b = ConvBN(3, 4, 1)

        def forward(self, x):
            return self.a2(self.a1(x)) + self.b(x)

    return export("fork_join", ForkJoin(), {"x": ((1, 3, 8, 8), "float32")})


def test_compile_streams_nimble_writes_events_the_dispatcher_replays(tmp_path, cache_dir, monkeypatch):
    import json

    from paella.bundle import load_bundle
    from paella.compiler_pass import cli
    from paella.dispatcher.core import STATUS_OK, Dispatcher, Request
    from paella.dispatcher.devices.sim import SimDevice
    from paella.models import zoo
    monkeypatch.setattr(zoo, "get", lambda name: _fork_join())
    args = ["fork_join", "--cache-dir", str(cache_dir), "-q", "--no-instrument"]
    single, multi = tmp_path / "single", tmp_path / "nimble"
    assert cli.main([*args, "-o", str(single)]) == 0
    assert cli.main([*args, "-o", str(multi), "--streams", "nimble"]) == 0
    s, m = load_bundle(single).variants[0], load_bundle(multi).variants[0]
    assert {op.stream for op in s.plan} == {0}
    assert len({op.stream for op in m.plan}) >= 2 and 0 not in {op.stream for op in m.plan}
    assert {"record", "wait"} <= {op.op for op in m.plan}
    assert [op.kernel for op in m.plan if op.op == "launch"] == \
        [op.kernel for op in s.plan if op.op == "launch"]
    key = json.loads((multi / "manifest.json").read_text())["cache_key"]
    assert key.startswith(json.loads((single / "manifest.json").read_text())["cache_key"] + "-nimble-")
    assert cli.main([*args, "-o", str(multi), "--streams", "nimble"]) == 0     # up to date
    assert json.loads((multi / "manifest.json").read_text())["cache_key"] == key
    # Served as `paella serve` serves a bundle on the simulator (the CPU build as the
    # last kernel's effect): both plans answer what the CPU build answers.
    from paella.dispatcher.daemon.bundles import functional_adaptor
    x = np.random.default_rng(5).standard_normal((1, 3, 8, 8)).astype(np.float32)
    answers = {}
    for path in (single, multi):
        bundle = load_bundle(path)
        dev = SimDevice("v100", n_streams=64)
        d = Dispatcher(dev, "paella", profile_runs=1)
        mid = d.register_model("fj", functional_adaptor(bundle, "fj"))
        done, io = [], bundle.pack_inputs({bundle.inputs[0].name: x})
        d.submit(Request(0, 0, mid, io, on_complete=lambda r, st, err: done.append((st, err))))
        d.run_until_idle()
        assert done == [(STATUS_OK, None)]
        answers[path] = bundle.unpack_outputs(io)["output0"]
    assert d.models[mid].replay.n_events >= 1
    np.testing.assert_array_equal(answers[multi], answers[single])
    np.testing.assert_allclose(answers[multi], load_bundle(single).run_cpu({"x": x})["output0"],
                               rtol=1e-5)
