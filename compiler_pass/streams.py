"""Nimble's stream assignment (Kwon et al., NeurIPS'20, Algorithm 1): a launch plan's
kernels on several streams, ordered by events where the streams meet.

A single-stream plan serializes every launch, even those of independent branches
(Inception's towers, NASNet's cells), whose small kernels could share the GPU. This
pass turns the plan into a multi-stream one with the fewest synchronizations that
keep every logically concurrent pair of launches on different streams:

1. **dependency DAG** (:func:`dependency_dag`): a node per plan step (copies included),
   an edge u -> v when v conflicts with an earlier u on a device buffer (v reads what u
   wrote, writes what u read or wrote). The read and write sets come from each
   kernel's parameter access (``KernelSpec.params[i]["access"]``, "r"/"w"/"rw", which
   the TIR lowering reports) and each copy's direction. Buffers are whole: two views at
   different offsets of one statically planned storage conflict (safe, conservative).
2. **minimum equivalent graph** G' (the transitive reduction, unique for a DAG);
3. a **maximum matching** M of the bipartite graph {(x_u, y_v) | (u, v) in E'}
   (Hopcroft-Karp, networkx);
4. the matched edges link nodes into **chains**; each chain is a stream;
5. every **unmatched** edge of G' crosses two streams and gets an event: a ``record``
   after its source, a ``wait`` before its target. That is |E'| - |M| waits, the
   minimum for any assignment with maximum logical concurrency (the paper's Theorem 4).

Before all this, :func:`rename_buffers` gives each new value of a reused storage its own
buffer (a trick: memory for concurrency, see there), so that only the dataflow and
true in-place updates order the launches.

The plan keeps its order (a topological order), so every wait follows its record.
Streams are numbered from 1: no step runs on the legacy default stream 0, whose
implicit synchronization with every other stream would serialize the branches.

Logical concurrency: the paper's "Deg." (Table 3.1) is the largest set of pairwise
independent launches, the DAG's width, computed here by Dilworth's theorem (a maximum
matching on the transitive closure, :func:`width`). Nimble's chains are paths of G',
not chains of the closure, so a DAG can need more streams than its width (a, b -> c
-> d, e: width 2, three streams); :class:`Assignment` reports both.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import networkx as nx

from paella.bundle import BufferSpec, Op, Variant

#: ``paella compile --streams`` choices.
MODES = ("single", "nimble")


@dataclass(frozen=True)
class Access:
    """What one plan step reads and writes (device buffer ids)."""
    reads: frozenset[int]
    writes: frozenset[int]


@dataclass(frozen=True)
class Assignment:
    """The result of Algorithm 1 on a DAG with nodes 0..n-1.

    ``stream[v]``: v's stream, 0..n_streams-1, numbered by each chain's first node.
    ``meg``: the edges of G'. ``matched``: the edges of M (chain links).
    ``syncs``: the unmatched edges of G', each a cross-stream event."""
    stream: tuple[int, ...]
    meg: tuple[tuple[int, int], ...]
    matched: tuple[tuple[int, int], ...]
    syncs: tuple[tuple[int, int], ...]

    @property
    def n_streams(self) -> int:
        return max(self.stream, default=-1) + 1


def step_access(op: Op, variant: Variant) -> Access:
    """The buffers a plan step reads and writes. The io buffer is not a device buffer
    and each copy has its own io range, so copies conflict only on device buffers."""
    if op.op == "h2d":
        return Access(frozenset(), frozenset({op.buffer}))
    if op.op == "d2h":
        return Access(frozenset({op.buffer}), frozenset())
    if op.op != "launch":
        raise ValueError(f"plan step {op.op!r} has no buffer access; assign streams to a plan "
                         f"without record/wait steps (a single-stream plan)")
    params = variant.kernel(op.kernel).params
    reads, writes = set(), set()
    for a, p in zip(op.args, params):
        if p["kind"] != "buffer" or a.buffer is None:
            continue
        access = p.get("access") or "rw"          # unknown: assume both (safe)
        if "r" in access:
            reads.add(a.buffer)
        if "w" in access:
            writes.add(a.buffer)
    return Access(frozenset(reads), frozenset(writes))


def rename_buffers(variant: Variant) -> Variant:
    """``variant`` with each new value of a reused device buffer in a buffer of its own.

    TVM's static memory plan reuses a few storages for every intermediate tensor (nine
    in our DARTS-like net), and each reuse is a write-after-read dependency that has
    nothing to do with the dataflow: kept, it caps the graph's concurrency at the number
    of storages (DARTS-like: width 3 instead of 7). A trick, labelled as one: like a
    register renamer, give every write that starts a new value its own buffer of the
    storage's size, and point the reads that follow at it. Memory per request grows
    (``paella experiment nimble`` reports by how much); Nimble pays the same, its
    pre-run reserving every tensor of the multi-stream run.

    A write starts a new value when the buffer was read since its last write (or never
    written) and the step does not also read it; a second write with no read between
    (one tensor written by several kernels) joins the value, keeping its order. Only
    buffers every step uses at offset 0 (one tensor at a time, as TVM plans them) and
    not params are renamed; the others keep every dependency."""
    kinds = {b.id: b for b in variant.buffers}
    offsets = _used_at_offsets(variant)
    renamable = {b for b, spec in kinds.items() if spec.kind != "param" and b not in offsets}
    buffers = list(variant.buffers)
    current = {b: b for b in kinds}          # original id -> id of its current value
    read_since_write: dict[int, bool] = {}
    plan: list[Op] = []
    for op in variant.plan:
        acc = step_access(op, variant)
        for b in acc.writes - acc.reads:
            if b in renamable and read_since_write.get(b, False):
                spec = kinds[b]
                current[b] = len(buffers)
                buffers.append(BufferSpec(len(buffers), f"{spec.name}.v{len(buffers)}",
                                          spec.nbytes, spec.kind))
        plan.append(_renamed(op, current))
        for b in acc.reads:
            read_since_write[b] = True
        for b in acc.writes - acc.reads:
            read_since_write[b] = False
    # An output lives where its D2H copy reads it.
    read_at = {(op.io_offset, op.nbytes): op.buffer for op in plan if op.op == "d2h"}
    outputs = [replace(t, buffer=read_at.get((t.offset, t.nbytes), t.buffer)) for t in variant.outputs]
    return replace(variant, buffers=buffers, plan=plan, outputs=outputs)


def pack_buffers(variant: Variant) -> Variant:
    """``variant`` (renamed) with its per-request buffers shared again where no
    concurrency is lost: a buffer takes over another's memory when every step that used
    the other one is an ancestor, in the dependency DAG, of the step that first writes
    it. Such a reuse adds no ordering the DAG does not already have, so the streams and
    events come out the same (the DAG's reachability is unchanged), and the memory that
    renaming added shrinks to what concurrent branches really hold at once.

    Only intermediate and workspace buffers that are written before they are read move,
    each to the smallest free slot at least as large, first come first served in plan
    order."""
    acc = [step_access(op, variant) for op in variant.plan]
    anc = _ancestors(dependency_dag(acc))
    users: dict[int, list[int]] = {}
    for i, a in enumerate(acc):
        for b in a.reads | a.writes:
            users.setdefault(b, []).append(i)
    offsets = _used_at_offsets(variant)
    # A buffer read before anything writes it keeps its own memory (its initial
    # contents matter; check_variant refuses that in a bundle, a hand-made plan may not).
    movable = [b for b in variant.buffers if b.kind in ("intermediate", "workspace")
               and b.id in users and b.id not in offsets
               and b.id in acc[users[b.id][0]].writes - acc[users[b.id][0]].reads]
    slot_of: dict[int, int] = {}
    slots: list[tuple[int, int]] = []               # (bytes, its occupants' steps as a bitset)
    for b in sorted(movable, key=lambda b: users[b.id][0]):
        first, mine = users[b.id][0], _bits(users[b.id])
        free = [k for k, (size, used) in enumerate(slots) if size >= b.nbytes and used & ~anc[first] == 0]
        k = min(free, key=lambda k: slots[k][0]) if free else None
        if k is None:
            slots.append((b.nbytes, mine))
            slot_of[b.id] = len(slots) - 1
        else:
            slots[k] = (slots[k][0], slots[k][1] | mine)
            slot_of[b.id] = k
    # Buffer ids: the unmoved ones first (keeping their order), then one per slot.
    kept = [b for b in variant.buffers if b.id not in slot_of]
    new_id = {b.id: i for i, b in enumerate(kept)}
    first_of = {}
    for b in sorted(movable, key=lambda b: users[b.id][0]):
        first_of.setdefault(slot_of[b.id], b)
    slot_ids = {k: len(kept) + j for j, k in enumerate(sorted(first_of))}
    new_id.update({b: slot_ids[k] for b, k in slot_of.items()})
    buffers = [replace(b, id=i) for i, b in enumerate(kept)]
    buffers += [BufferSpec(slot_ids[k], first_of[k].name, slots[k][0], first_of[k].kind)
                for k in sorted(first_of)]
    plan = [_renamed(op, new_id) for op in variant.plan]
    return replace(variant, buffers=buffers, plan=plan,
                   inputs=[replace(t, buffer=new_id[t.buffer]) for t in variant.inputs],
                   outputs=[replace(t, buffer=new_id[t.buffer]) for t in variant.outputs])


def _used_at_offsets(variant: Variant) -> set[int]:
    """Buffers some step uses at a non-zero offset (they may hold several tensors)."""
    out = set()
    for op in variant.plan:
        if op.op == "launch":
            out.update(a.buffer for a in op.args if a.buffer is not None and a.offset)
        elif op.op in ("h2d", "d2h") and op.buffer_offset:
            out.add(op.buffer)
    return out


def _bits(steps: Sequence[int]) -> int:
    out = 0
    for i in steps:
        out |= 1 << i
    return out


def _ancestors(g: nx.DiGraph) -> list[int]:
    """Per node (0..n-1, numbered in a topological order), the bitset of its ancestors."""
    anc = [0] * g.number_of_nodes()
    for v in range(len(anc)):
        for u in g.predecessors(v):
            anc[v] |= anc[u] | (1 << u)
    return anc


def _renamed(op: Op, current: dict[int, int]) -> Op:
    if op.op == "launch":
        return replace(op, args=[replace(a, buffer=current[a.buffer]) if a.buffer is not None else a
                                 for a in op.args])
    if op.op in ("h2d", "d2h"):
        return replace(op, buffer=current[op.buffer])
    return op


def dependency_dag(accesses: Sequence[Access]) -> nx.DiGraph:
    """Nodes 0..n-1 in plan order; an edge to each step from the steps it must follow:
    the last writer of what it reads or writes (read-after-write, write-after-write),
    and the readers since that write of what it writes (write-after-read). Every
    conflicting pair is then ordered by a path (an earlier reader comes before the
    writer it preceded, which comes before the next)."""
    g = nx.DiGraph()
    g.add_nodes_from(range(len(accesses)))
    last_writer: dict[int, int] = {}
    readers: dict[int, list[int]] = {}
    for v, acc in enumerate(accesses):
        for b in acc.reads | acc.writes:
            w = last_writer.get(b)
            if w is not None:
                g.add_edge(w, v)
        for b in acc.writes:
            for r in readers.get(b, ()):
                if r != v:
                    g.add_edge(r, v)
        for b in acc.reads:
            readers.setdefault(b, []).append(v)
        for b in acc.writes:
            last_writer[b] = v
            readers[b] = [v] if b in acc.reads else []
    return g


def minimum_equivalent_graph(g: nx.DiGraph) -> nx.DiGraph:
    """G': the fewest edges with G's reachability (for a DAG, its transitive reduction)."""
    return nx.transitive_reduction(g)


def _max_matching(nodes: Sequence[int], edges) -> dict[int, int]:
    """A maximum matching of the bipartite graph {(x_u, y_v) | (u, v) in edges}, as
    u -> v for its edges (Hopcroft-Karp)."""
    b = nx.Graph()
    tops = [("x", u) for u in nodes]
    b.add_nodes_from(tops)
    b.add_nodes_from(("y", v) for v in nodes)
    b.add_edges_from((("x", u), ("y", v)) for u, v in edges)
    m = nx.bipartite.hopcroft_karp_matching(b, top_nodes=tops)
    return {u: m[("x", u)][1] for u in nodes if ("x", u) in m}


def assign_streams(g: nx.DiGraph) -> Assignment:
    """Algorithm 1 on ``g`` (a DAG on nodes 0..n-1)."""
    if not nx.is_directed_acyclic_graph(g):
        raise ValueError("the dependency graph has a cycle; streams need a DAG")
    nodes = sorted(g.nodes)
    meg = minimum_equivalent_graph(g)
    edges = sorted(meg.edges)
    nxt = _max_matching(nodes, edges)
    has_pred = set(nxt.values())
    stream = {}
    for head in nodes:                   # chains, numbered by their first node
        if head in has_pred:
            continue
        s, v = len(set(stream.values())), head
        while v is not None:
            stream[v] = s
            v = nxt.get(v)
    matched = tuple(sorted(nxt.items()))
    syncs = tuple(e for e in edges if nxt.get(e[0]) != e[1])
    return Assignment(tuple(stream[v] for v in nodes), tuple(edges), matched, syncs)


def width(g: nx.DiGraph) -> int:
    """The maximum number of pairwise independent nodes (Dilworth: n minus a maximum
    matching on the transitive closure), the paper's degree of logical concurrency."""
    closure = nx.transitive_closure_dag(g)
    return g.number_of_nodes() - len(_max_matching(sorted(g.nodes), closure.edges))


def plan_with_streams(variant: Variant) -> tuple[list[Op], Assignment]:
    """``variant``'s plan on Nimble's streams (numbered from 1) with record / wait steps
    for the unmatched edges; plan order unchanged. One event per source step, recorded
    once right after it, waited on before each of its cross-stream successors."""
    plan = variant.plan
    if any(op.stream or op.op in ("record", "wait") for op in plan):
        raise ValueError(f"variant {variant.name!r} is already a multi-stream plan; assign "
                         f"streams to its single-stream form")
    a = assign_streams(dependency_dag([step_access(op, variant) for op in plan]))
    event_of: dict[int, int] = {}
    waits: dict[int, list[int]] = {}
    for u, v in a.syncs:
        event_of.setdefault(u, len(event_of))
        waits.setdefault(v, []).append(u)
    out: list[Op] = []
    for i, op in enumerate(plan):
        s = a.stream[i] + 1
        for u in waits.get(i, ()):
            out.append(Op("wait", stream=s, event=event_of[u]))
        out.append(_on_stream(op, s))
        if i in event_of:
            out.append(Op("record", stream=s, event=event_of[i]))
    return out, a


def _on_stream(op: Op, stream: int) -> Op:
    return Op(op.op, stream=stream, buffer=op.buffer, buffer_offset=op.buffer_offset,
              io_offset=op.io_offset, nbytes=op.nbytes, kernel=op.kernel, grid=op.grid,
              block=op.block, dyn_smem=op.dyn_smem, args=op.args, event=op.event)


def nimble(variant: Variant) -> tuple[Variant, Assignment]:
    """``variant`` renamed (:func:`rename_buffers`), its buffers packed again
    (:func:`pack_buffers`), and on Nimble's streams (:func:`plan_with_streams`), with
    the assignment."""
    renamed = pack_buffers(rename_buffers(variant))
    plan, a = plan_with_streams(renamed)
    return replace(renamed, plan=plan), a


def with_streams(variant: Variant, mode: str) -> Variant:
    """``variant`` with its plan assigned to streams by ``mode`` (see :data:`MODES`):
    ``single`` leaves it as compiled, ``nimble`` applies :func:`nimble`."""
    if mode not in MODES:
        raise ValueError(f"unknown stream mode {mode!r}; use one of {', '.join(MODES)}")
    return variant if mode == "single" else nimble(variant)[0]
