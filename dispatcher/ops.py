"""What a job asks of the GPU: :class:`KernelLaunch` records and :class:`Op` s.

Three concepts, each with only what it needs:

* the **waitlist node** (:class:`~paella.dispatcher.waitlist.Node`): kind, stream and
  dependency links, all the waitlist reads;
* the **launch record** (:class:`KernelLaunch`): the loaded function, grid, block,
  dynamic shared memory and the tracker's :class:`~paella.dispatcher.tracker.Demand`.
  It is the same for every launch of one shape, so it is made once (per plan step, or
  per shape in the dispatcher's cache) and shared by the ops of every request;
* the **op** (:class:`Op`, a node): the one job's operands (a kernel's bound ``args``,
  a copy's ``host`` array and device pointer ``dptr``) and what the dispatcher records
  when it releases the op (real ``stream``, ``launch_id``, times).

The occupancy tracker sees neither ops nor launch records: only a launch's ``Demand``,
and the op as an opaque token it hands back at completion.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from paella.dispatcher.devices.base import KERNEL, KIND_NAMES, Dim3, Function
from paella.occupancy import Footprint

from .waitlist import STATE_NAMES, WAITING, Node, VStream

if TYPE_CHECKING:
    from .tracker import Demand


@dataclass(frozen=True, slots=True, eq=False)
class KernelLaunch:
    """One kernel launch shape, checked: it fits on an SM (``fp``) and its notifications
    fit in the notifQ (``demand.entries``). ``name`` is the kernel's (the profile's key)."""
    func: Function
    grid: Dim3
    block: Dim3
    dyn_smem: int
    fp: Footprint
    demand: "Demand"
    name: str
    blocks: int
    #: A slice (paella.dispatcher.slicing): the blocks of the kernel's whole grid (0: not one).
    whole: int = 0


class Op(Node):
    """An operation a job issued for the GPU: a kernel launch or a copy."""
    __slots__ = ("job", "launch", "key", "args", "host", "dptr", "almost_finished", "stream",
                 "launch_id", "t_issue", "t_release", "step")

    def __init__(self, kind: int, job: Any, vstream: VStream, launch: KernelLaunch | None = None,
                 args: tuple = (), host: np.ndarray | None = None, dptr: int = 0,
                 almost_finished: bool = False, t_issue: float = 0.0):
        # Speed: Node.__init__ inlined (an op is made per kernel of every request).
        self.kind = kind
        self.vstream = vstream
        self.deps = 0
        self.pred = None
        self.pred_pending = False
        self.succ = None
        self.dependents = None
        self.state = WAITING
        self.job = job
        self.launch = launch
        #: The kernel's name (the profile's key), copied from the launch record: read per
        #: release by the SRPT charge.
        self.key = launch.name if launch is not None else None
        self.args = args
        self.host = host
        self.dptr = dptr
        self.almost_finished = almost_finished
        self.stream = -1
        self.launch_id = -1
        self.t_issue = t_issue
        self.t_release = 0.0
        # ``step``: its node in a compiled replay (paella.dispatcher.replay), set there only.

    def forget(self) -> None:
        """A dropped op: no predecessor, no operands (a copy's view of a client's memory)."""
        self.pred = None
        self.host = None
        self.args = ()

    def __repr__(self) -> str:
        what = self.key if self.kind == KERNEL else KIND_NAMES[self.kind]
        return f"<Op {what} v{self.vstream.vid} {STATE_NAMES[self.state]}>"


@dataclass(eq=False, slots=True)
class CoreOp:
    """An op run by the kernel core, as instruments see it.

    Why it exists: the core keeps no :class:`Op` objects (a node index per op is all it
    needs), so while an instrument listens to op events the dispatcher makes one of these
    per op, with the attributes instruments read from an :class:`Op` (``job``, ``kind``,
    ``key``, ``vstream.vid``, ``stream``, ``launch_id``, ``almost_finished``, the times).
    One object per op from its issue to its end, so an instrument may key on it."""
    job: Any
    node: int                          # its node in the model's compiled plan
    kind: int
    key: str | None                    # a kernel's name; None for a copy
    vstream: VStream
    launch: KernelLaunch | None
    almost_finished: bool
    stream: int = -1
    launch_id: int = -1
    t_issue: float = 0.0
    t_release: float = 0.0

    def __repr__(self) -> str:
        what = self.key if self.kind == KERNEL else KIND_NAMES[self.kind]
        return f"<CoreOp {what} v{self.vstream.vid} node {self.node}>"
