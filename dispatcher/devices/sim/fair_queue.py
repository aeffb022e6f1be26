"""A bounded queue shared fairly by its owners: the answer workers' waiting room.

The simulated GPU computes a never-seen input's answer on the CPU, 100 ms to seconds a
task, in a few worker processes (:mod:`.effect_workers`). Their queue is bounded, so that
memory is. With one first-come queue, a tenant that floods the daemon with new inputs
fills it, and everyone else's new input is then refused ("overloaded"), or waits behind
the whole flood: one tenant denies service to all. :class:`FairQueue` makes the flood
its sender's problem alone:

* **Room** (longest-queue drop, as fair buffer sharing in packet switches): a full queue
  still takes an owner's task when another owner holds at least two more waiting tasks
  than it does (or any, when it holds none); that owner's newest task is evicted to make
  room, and its caller is told it was refused. So an owner is refused only when it holds
  the largest share itself, and a tenant with nothing waiting is always taken.
* **Turns**: the next task goes to the owner with the fewest tasks running, among
  equals the one served longest ago (never first); an owner's own tasks keep their
  order. A tenant's one new input
  then waits for one task of the flood at most, not for the whole flood.

Owners are any hashable key: the daemon uses the client's tenant (its uid), so a tenant
that opens many connections is still one owner, and a step scheduler's iterations (which
serve all its clients at once) are their model's own.
"""
from __future__ import annotations

from collections import deque
from typing import Callable, Generic, Hashable, Iterator, TypeVar

T = TypeVar("T")


class FairQueue(Generic[T]):
    """Waiting items per owner, at most ``bound`` in all (``push`` checks it only when
    told: an unbounded push, a model's warm-up, may exceed it). Not thread-safe: its
    owner holds a lock around it."""

    def __init__(self, bound: int):
        if type(bound) is not int or bound < 1:
            raise ValueError(f"FairQueue's bound must be an int >= 1, got {bound!r}")
        self.bound = bound
        # owners with waiting items, in the order they came (dicts keep it)
        self._waiting: dict[Hashable, deque[T]] = {}
        self._running: dict[Hashable, int] = {}
        self._served: dict[Hashable, int] = {}      # owner -> its last pop's tick (while
        self._tick = 0                              # it has items waiting or running)
        self._n = 0
        self.busy = 0                               # items popped and not ended, in all

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[T]:
        for q in self._waiting.values():
            yield from q

    def waiting(self, owner: Hashable) -> int:
        """Items ``owner`` has waiting."""
        q = self._waiting.get(owner)
        return len(q) if q else 0

    def running(self, owner: Hashable) -> int:
        """Items of ``owner`` taken by :meth:`pop` and not yet :meth:`ended`."""
        return self._running.get(owner, 0)

    def full(self) -> bool:
        return self._n >= self.bound

    def victim(self, owner: Hashable) -> Hashable | None:
        """The owner whose newest item would make room for one of ``owner``'s in a full
        queue (the one holding the most, earliest in turn among equals), or None when
        ``owner`` may not take another's room: nobody holds two more than it does (or
        one more, when it holds none)."""
        mine = self.waiting(owner)
        best, most = None, 0
        for other, q in self._waiting.items():
            n = len(q)
            if n > most and other != owner:
                best, most = other, n
        if best is not None and (most >= mine + 2 or (mine == 0 and most >= 1)):
            return best
        return None

    def refuses(self, owner: Hashable) -> bool:
        """A bounded :meth:`push` of ``owner``'s would be refused now."""
        return self.full() and self.victim(owner) is None

    def push(self, owner: Hashable, item: T) -> None:
        """Queue ``item`` last among ``owner``'s (the caller checked the bound)."""
        q = self._waiting.get(owner)
        if q is None:
            q = self._waiting[owner] = deque()
        q.append(item)
        self._n += 1

    def evict_newest(self, owner: Hashable) -> T:
        """Take ``owner``'s newest waiting item out (room for another owner's)."""
        q = self._waiting[owner]
        item = q.pop()
        self._n -= 1
        if not q:
            self._forget(owner)
        return item

    def pop(self) -> tuple[Hashable, T] | None:
        """The next item and its owner (now counted running until :meth:`ended`): the
        oldest of the owner with the fewest running, among equals the one served
        longest ago (then the one waiting longest). None when nothing waits."""
        if not self._n:
            return None
        running, served = self._running, self._served
        owner = min(self._waiting, key=lambda o: (running.get(o, 0), served.get(o, -1)))
        self._tick += 1
        served[owner] = self._tick
        q = self._waiting[owner]
        item = q.popleft()
        self._n -= 1
        if not q:
            del self._waiting[owner]
        running[owner] = running.get(owner, 0) + 1
        self.busy += 1
        return owner, item

    def ended(self, owner: Hashable) -> None:
        """An item :meth:`pop` gave out is finished (done, failed or abandoned)."""
        self.busy -= 1
        n = self._running.get(owner, 0) - 1
        if n > 0:
            self._running[owner] = n
        else:
            self._running.pop(owner, None)
            if owner not in self._waiting:
                self._served.pop(owner, None)

    def remove_if(self, drop: Callable[[T], bool]) -> list[T]:
        """Take out every waiting item ``drop`` accepts; returns them."""
        gone: list[T] = []
        for owner, q in list(self._waiting.items()):
            kept: deque[T] = deque()
            for x in q:
                (gone if drop(x) else kept).append(x)
            if len(kept) != len(q):
                self._n -= len(q) - len(kept)
                if kept:
                    self._waiting[owner] = kept
                else:
                    self._forget(owner)
        return gone

    def clear(self) -> list[T]:
        """Take out everything waiting (running counts too); returns the waiting items."""
        items = list(self)
        self._waiting.clear()
        self._running.clear()
        self._served.clear()
        self._n = self.busy = 0
        return items

    def _forget(self, owner: Hashable) -> None:
        del self._waiting[owner]
        if owner not in self._running:
            self._served.pop(owner, None)


__all__ = ["FairQueue"]
