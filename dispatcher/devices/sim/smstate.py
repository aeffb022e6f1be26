"""Every SM's free resources as one interned state id, with memoized transitions.

The simulator asks the same few questions millions of times: how many blocks of this
kernel fit on an SM in this state, and what state does placing (or ending) ``n`` of them
leave. The answers depend only on the SM's state and the block's footprint, and a run
visits few distinct states (an SM holds at most a handful of blocks of a handful of
kernels), so each answer is computed once, by :class:`paella.occupancy.SMResources`
(the Occupancy Calculator's rules, tested against NVIDIA's header), and then looked up:
a dict lookup on an int instead of ~1 us of arithmetic per SM, or a numpy round trip
per wave. The results are those of ``SMResources`` by construction.

A state is the tuple ``(blocks, warps, smem, regs of sub-partition 0, 1, ...)``; its id
is its index in :attr:`SMStates.states`. A placement returns a *delta* id that records
what it took (footprint, blocks and the per-sub-partition warp split) so that its end
gives back exactly that.
"""
from __future__ import annotations

from paella.gpus import GpuSpec
from paella.occupancy import Footprint, SMResources, limits_per_resource

#: Take keys are ``state << TAKE_SHIFT | n``; n is at most max_blocks_per_sm (<= 32).
TAKE_SHIFT = 8
#: Give keys are ``state << GIVE_SHIFT | delta``.
GIVE_SHIFT = 32


class _Memo(dict):
    """A dict that computes a missing entry with ``fn(key)`` and keeps it (``d[key]``
    on a hit costs what a plain dict lookup costs)."""
    __slots__ = ("fn",)

    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def __missing__(self, key):
        v = self[key] = self.fn(key)
        return v


class Shape:
    """One block footprint on one :class:`SMStates`: its memo tables.

    ``fit[state]``: blocks that fit; ``take[state << TAKE_SHIFT | n]``: (new state,
    delta) after placing ``n``. ``per_sm``: blocks per SM on an empty GPU."""
    __slots__ = ("fp", "fit", "take", "per_sm")

    def __init__(self, states: "SMStates", fp: Footprint):
        self.fp = fp
        self.fit = _Memo(lambda sid: states._compute_fit(sid, fp))
        self.take = _Memo(lambda key: states._compute_take(key, fp))
        self.per_sm = min(limits_per_resource(states.spec, fp).values())


class SMStates:
    """The simulator's ground truth of free SM resources (see the module docstring).

    ``sid[sm]`` is SM ``sm``'s state id. The ``blocks``, ``warps``, ``smem`` and
    ``regs`` properties and :meth:`fit`, :meth:`take`, :meth:`give`, :meth:`used` give
    the view and the interface of :class:`paella.occupancy.SMResources`."""

    def __init__(self, spec: GpuSpec):
        self.spec = spec
        self._scratch = SMResources(spec.with_(sm_count=1))
        self.parts = self._scratch.parts
        self.part_regs = self._scratch.part_regs
        self.states: list[tuple[int, ...]] = []
        self._ids: dict[tuple[int, ...], int] = {}
        #: ``no_room[state]``: no block of any kernel fits (no block slot or no warp left).
        self.no_room: list[bool] = []
        self.deltas: list[tuple[Footprint, int, tuple[int, ...]]] = []
        self._delta_ids: dict[tuple[Footprint, int, tuple[int, ...]], int] = {}
        self.give_memo = _Memo(self._compute_give)
        self._shapes: dict[Footprint, Shape] = {}
        empty = self._save()
        self.sid = [empty] * spec.sm_count

    def shape(self, fp: Footprint) -> Shape:
        s = self._shapes.get(fp)
        if s is None:
            s = self._shapes[fp] = Shape(self, fp)
        return s

    # -- the rules, applied to a one-SM SMResources ----------------------------------------
    def _load(self, sid: int) -> SMResources:
        st = self.states[sid]
        r = self._scratch
        r.blocks[0], r.warps[0], r.smem[0] = st[0], st[1], st[2]
        r.regs[:] = st[3:]
        return r

    def _save(self) -> int:
        r = self._scratch
        st = (r.blocks[0], r.warps[0], r.smem[0], *r.regs)
        sid = self._ids.get(st)
        if sid is None:
            sid = self._ids[st] = len(self.states)
            self.states.append(st)
            self.no_room.append(not (st[0] and st[1]))
        return sid

    def _compute_fit(self, sid: int, fp: Footprint) -> int:
        return self._load(sid).fit(0, fp)

    def _compute_take(self, key: int, fp: Footprint) -> tuple[int, int]:
        n = key & ((1 << TAKE_SHIFT) - 1)
        split = self._load(key >> TAKE_SHIFT).take(0, fp, n)
        d = (fp, n, split)
        did = self._delta_ids.get(d)
        if did is None:
            did = self._delta_ids[d] = len(self.deltas)
            self.deltas.append(d)
        return self._save(), did

    def _compute_give(self, key: int) -> int:
        fp, n, split = self.deltas[key & ((1 << GIVE_SHIFT) - 1)]
        self._load(key >> GIVE_SHIFT).give(0, fp, n, split)
        return self._save()

    # -- the SMResources interface (tests, tools; the simulator uses the memos) ------------
    def fit(self, sm: int, fp: Footprint) -> int:
        """How many more blocks of ``fp`` fit on ``sm`` right now."""
        return self.shape(fp).fit[self.sid[sm]]

    def take(self, sm: int, fp: Footprint, n: int) -> tuple[int, ...]:
        """Allocate ``n`` blocks on ``sm``; returns the warps taken per sub-partition."""
        self.sid[sm], did = self.shape(fp).take[(self.sid[sm] << TAKE_SHIFT) | n]
        return self.deltas[did][2]

    def give(self, sm: int, fp: Footprint, n: int, split: tuple[int, ...]) -> None:
        r = self._load(self.sid[sm])
        r.give(0, fp, n, tuple(split))
        self.sid[sm] = self._save()

    def _column(self, i: int) -> list[int]:
        states = self.states
        return [states[s][i] for s in self.sid]

    @property
    def blocks(self) -> list[int]:
        return self._column(0)

    @property
    def warps(self) -> list[int]:
        return self._column(1)

    @property
    def smem(self) -> list[int]:
        return self._column(2)

    @property
    def regs(self) -> list[int]:
        """Free registers per sub-partition, flat: ``sm * parts + p``."""
        states = self.states
        return [r for s in self.sid for r in states[s][3:]]

    #: Totals in use over all SMs: SMResources' own, read through the properties above.
    used = SMResources.used
