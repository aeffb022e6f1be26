"""Per-call cost of the front end's two hot calls, in process, without a daemon.

* ``poll``: one :meth:`Frontend.poll_rings` pass over ``--clients`` ready clients whose
  rings are empty (what the loop pays on every iteration while idle-spinning);
* ``complete``: one :meth:`Frontend.complete` (the completion pushed on the ring, the
  client's head validated), per finished request.

The clients are real segments (anonymous shared mappings) and real socket pairs; no
executor runs. Wall-clock figures on a shared machine drift; for a repeatable
comparison count instructions with callgrind at two call counts and take the
difference per call::

    valgrind --tool=callgrind python -m paella.benchmarks.bench_frontend poll --n 1000
    valgrind --tool=callgrind python -m paella.benchmarks.bench_frontend poll --n 6000

Run: ``python -m paella.benchmarks.bench_frontend {poll,complete} [--n N] [--repeat R]``.
"""
from __future__ import annotations

import argparse
import mmap
import socket
import statistics
import time

from paella import rings
from paella.dispatcher.frontend import ClientConn, Frontend, FrontendConfig, ModelTable


def make_frontend(n_clients: int) -> tuple[Frontend, list[socket.socket]]:
    """A front end with ``n_clients`` ready clients (polling mode, empty rings)."""
    front = Frontend(FrontendConfig(socket_path="/nonexistent/bench.sock"), ModelTable())
    layout = rings.Layout(1024, 1024, 1 << 16)
    peers = []
    for cid in range(1, n_clients + 1):
        ours, theirs = socket.socketpair()
        c = ClientConn(cid, ours, 1, 0, 0, mode="polling")
        c.seg = rings.Segment(mmap.mmap(-1, layout.total_bytes), layout)
        c.seg.init_header()
        c.reqs, c.cmps = rings.RequestConsumer(c.seg), rings.CompletionProducer(c.seg)
        front.clients[cid] = c
        front.ready.append(c)
        peers.append(theirs)
    return front, peers


def time_calls(what: str, n: int, n_clients: int) -> float:
    """Nanoseconds per call, over ``n`` calls."""
    front, _peers = make_frontend(n_clients)
    c = front.clients[1]
    hdr = c.seg.hdr                                    # type: ignore[union-attr]
    t0 = time.perf_counter()
    if what == "poll":
        for _ in range(n):
            front.poll_rings()
    else:
        for i in range(n):
            c.inflight[i] = False
            front.complete(1, i, rings.OK, None)
            hdr[rings.CMP_HEAD] = c.cmps.tail          # the client reads it at once
    return (time.perf_counter() - t0) / n * 1e9


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=("poll", "complete"))
    p.add_argument("--n", type=int, default=200_000, help="calls per run")
    p.add_argument("--repeat", type=int, default=1, help="runs (the median is printed)")
    p.add_argument("--clients", type=int, default=8, help="ready clients")
    a = p.parse_args(argv)
    runs = [time_calls(a.what, a.n, a.clients) for _ in range(a.repeat)]
    print(f"{a.what}: {statistics.median(runs):.0f} ns per call (median of {a.repeat}; "
          f"runs {', '.join(f'{r:.0f}' for r in runs)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
