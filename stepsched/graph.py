"""A request as a graph of typed steps (BatchMaker's *cell graph*).

Each node is one step of one request: an RNN cell, a transformer iteration. Its *kind*
(BatchMaker's cell type) names the compiled code that runs it; steps of one kind batch
across requests whenever their inputs are ready. An *unfolding function* turns a request
into its graph (§4.1 of the BatchMaker paper): a chain for an LSTM, an encoder chain
followed by a decoder chain for Seq2Seq, a tree for TreeLSTM.

BatchMaker schedules *subgraphs*: connected nodes of one kind whose dependencies outside
the subgraph are satisfied (§4.3). Inside a subgraph a node becomes schedulable as soon as
its predecessors are *submitted* to the worker (tasks on one worker run in submission
order, so the data dependency holds); across subgraphs it waits for them to *complete*.
This module keeps both states per node.
"""
from __future__ import annotations

from dataclasses import dataclass, field

#: node states
WAITING, READY, SUBMITTED, DONE = "waiting", "ready", "submitted", "done"


@dataclass(eq=False)
class Step:
    """One node: ``deps`` are node indexes in the same graph."""
    index: int
    kind: str
    deps: tuple[int, ...] = ()
    subgraph: int = 0
    state: str = WAITING
    #: position along its subgraph (the LSTM time step, the tree level): for the reader
    depth: int = 0


@dataclass(eq=False)
class StepGraph:
    """The cell graph of one request, with the bookkeeping Algorithm 1 needs."""
    request: object
    steps: list[Step]
    #: arrival time (orders subgraphs within a kind: oldest first)
    arrival: float = 0.0
    pinned: int | None = None
    _users: dict[int, list[int]] = field(default_factory=dict, repr=False)
    _ready: dict[str, dict[int, Step]] = field(default_factory=dict, repr=False)
    _left: dict[str, int] = field(default_factory=dict, repr=False)   # kind -> not yet submitted
    _done: int = 0

    def __post_init__(self) -> None:
        for s in self.steps:
            for d in s.deps:
                if not 0 <= d < s.index:
                    raise ValueError(f"step {s.index}: dependency {d} must name an earlier step")
                self._users.setdefault(d, []).append(s.index)
        for s in self.steps:
            self._left[s.kind] = self._left.get(s.kind, 0) + 1
            self._ready.setdefault(s.kind, {})
            if self._schedulable(s):
                self._make_ready(s)

    # ---- queries -------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self._done == len(self.steps)

    def ready(self, kind: str) -> list[Step]:
        """Ready steps of ``kind``, in graph order."""
        r = self._ready.get(kind)
        return sorted(r.values(), key=lambda s: s.index) if r else []

    def num_ready(self, kind: str) -> int:
        return len(self._ready.get(kind, ()))

    def unsubmitted(self, kind: str) -> int:
        """Steps of ``kind`` not yet handed to a worker (0: the graph is done with it)."""
        return self._left.get(kind, 0)

    def kinds(self) -> set[str]:
        return set(self._left)

    def _schedulable(self, s: Step) -> bool:
        """Inside its subgraph a predecessor needs only be submitted; outside, done."""
        for d in s.deps:
            p = self.steps[d]
            if p.state == DONE or (p.state == SUBMITTED and p.subgraph == s.subgraph):
                continue
            return False
        return True

    # ---- transitions ---------------------------------------------------------------------
    def submitted(self, s: Step) -> None:
        """Algorithm 1's UpdateNodesDependency: ``s`` went to the worker."""
        assert s.state == READY, s.state
        s.state = SUBMITTED
        del self._ready[s.kind][s.index]
        self._left[s.kind] -= 1
        self._wake(s)

    def completed(self, s: Step) -> None:
        assert s.state == SUBMITTED, s.state
        s.state = DONE
        self._done += 1
        self._wake(s)

    def _wake(self, s: Step) -> None:
        for u in self._users.get(s.index, ()):
            n = self.steps[u]
            if n.state == WAITING and self._schedulable(n):
                self._make_ready(n)

    def _make_ready(self, s: Step) -> None:
        s.state = READY
        self._ready[s.kind][s.index] = s


# ======================================================================================
# Unfolding functions
# ======================================================================================
def unfold_chain(request: object, length: int, kind: str = "lstm", arrival: float = 0.0) -> StepGraph:
    """An LSTM over ``length`` tokens: one chain of cells, one subgraph."""
    if length < 1:
        raise ValueError(f"a chain needs at least one step, got length {length}")
    steps = [Step(i, kind, (i - 1,) if i else (), 0, depth=i) for i in range(length)]
    return StepGraph(request, steps, arrival)


def unfold_seq2seq(request: object, src_len: int, tgt_len: int, arrival: float = 0.0) -> StepGraph:
    """Seq2Seq (Figure 12): an encoder chain, then a decoder chain fed by its last state.
    Two subgraphs: the decoders wait for the encoder's last cell to complete."""
    if src_len < 1 or tgt_len < 1:
        raise ValueError(f"seq2seq needs src_len, tgt_len >= 1, got {src_len}, {tgt_len}")
    steps = [Step(i, "encoder", (i - 1,) if i else (), 0, depth=i) for i in range(src_len)]
    for j in range(tgt_len):
        i = src_len + j
        steps.append(Step(i, "decoder", (i - 1,), 1, depth=j))
    return StepGraph(request, steps, arrival)


def unfold_tree(request: object, n_leaves: int, arrival: float = 0.0) -> StepGraph:
    """TreeLSTM over a complete binary tree with ``n_leaves`` leaves (a power of two, as
    in §4.4's example): each leaf its own subgraph, the internal nodes one subgraph."""
    if n_leaves < 1 or n_leaves & (n_leaves - 1):
        raise ValueError(f"n_leaves must be a power of two, got {n_leaves}")
    steps = [Step(i, "leaf", (), i, depth=0) for i in range(n_leaves)]
    level, depth = list(range(n_leaves)), 1
    while len(level) > 1:
        nxt = []
        for a, b in zip(level[::2], level[1::2]):
            i = len(steps)
            steps.append(Step(i, "internal", (a, b), n_leaves, depth=depth))
            nxt.append(i)
        level, depth = nxt, depth + 1
    return StepGraph(request, steps, arrival)


class TreeError(ValueError):
    """A parent-index array that is not a tree the cells can run."""


def tree_order(parents: list[int], max_children: int = 2) -> list[int]:
    """Check ``parents`` (``parents[i]``: node i's parent, -1 at the one root) and return
    its nodes children first (each node after its children, children in index order).
    Raises :class:`TreeError` naming the first fault: an empty tree, a parent out of
    range, no root or several, a node its own ancestor (a cycle), too many children."""
    n = len(parents)
    if n < 1:
        raise TreeError("the tree is empty; send at least one node")
    kids: list[list[int]] = [[] for _ in range(n)]
    roots = []
    for i, p in enumerate(parents):
        if type(p) is not int or not -1 <= p < n:
            raise TreeError(f"node {i}: parent {p!r} is out of range (-1 for the root, else 0..{n - 1})")
        if p == i:
            raise TreeError(f"node {i} is its own parent (a cycle)")
        if p == -1:
            roots.append(i)
        else:
            kids[p].append(i)
    if not roots:
        raise TreeError("the tree has no root (parent -1): its parents form a cycle")
    if len(roots) > 1:
        raise TreeError(f"a tree has one root (parent -1); got {len(roots)}: nodes {roots[:8]}")
    for i, k in enumerate(kids):
        if len(k) > max_children:
            raise TreeError(f"node {i} has {len(k)} children; these cells take at most {max_children}")
    order, stack = [], [(roots[0], False)]
    while stack:
        i, expanded = stack.pop()
        if expanded:
            order.append(i)
            continue
        stack.append((i, True))
        stack.extend((k, False) for k in reversed(kids[i]))
    if len(order) != n:
        lost = sorted(set(range(n)) - set(order))
        raise TreeError(f"nodes {lost[:8]} do not reach the root: a cycle in the parents")
    return order


def unfold_parents(request: object, parents: list[int], arrival: float = 0.0) -> tuple[StepGraph, list[int]]:
    """TreeLSTM over any binary tree given as a parent-index array (checked by
    :func:`tree_order`): a ``leaf`` cell per childless node, each its own subgraph, and
    an ``internal`` cell per other node, all in one subgraph (as :func:`unfold_tree`).
    Returns the graph and the tree node of each step (step index -> node)."""
    order = tree_order(parents)
    pos = {node: k for k, node in enumerate(order)}
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        if p >= 0:
            kids.setdefault(p, []).append(i)
    n, steps = len(parents), []
    for k, node in enumerate(order):
        ch = kids.get(node, [])
        if ch:
            steps.append(Step(k, "internal", tuple(pos[c] for c in ch), n, depth=k))
        else:
            steps.append(Step(k, "leaf", (), node, depth=0))
    return StepGraph(request, steps, arrival), order


def random_binary_tree(rng, n: int) -> list[int]:
    """A random binary tree of ``n`` nodes as a parent-index array: node 0 the root, each
    other node under a uniformly chosen earlier node with fewer than two children."""
    parents, kids = [-1], [0] * n
    open_ = [0]
    for i in range(1, n):
        k = int(rng.integers(len(open_)))
        p = open_[k]
        parents.append(p)
        kids[p] += 1
        if kids[p] == 2:
            open_[k] = open_[-1]
            open_.pop()
        open_.append(i)
    return parents
