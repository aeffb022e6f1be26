"""Cost of gathering requests' rows into a variant's io buffer and scattering the outputs
back (:mod:`paella.dispatcher.batchers.gather`), against running in place (zero copy).

For a model's per-row tensors (ResNet-18: a 3x224x224 float32 image in, 1000 scores
out; the BERT-like encoder: 64x128 float32 embeddings + mask in, 64x128 out), a batch
of B one-row requests is gathered into the batch-B variant's buffer and scattered
back; the figure is the median over ``--repeat`` runs of the time per batch and per
request, next to the device time of the batch on the simulated T4 when known.

Run: ``python -m paella.benchmarks.bench_gather [--repeat 200]``; ``--identity`` for the
stage's own cost on the unbatched path, ``--serve {direct,stage} N`` for callgrind.
"""
from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import numpy as np

from paella.dispatcher.batchers.gather import IoLayout, gather, in_place, scatter_one
from paella.shapes import Slot, layout

MODELS = {
    "resnet18": ([("x", (1, 3, 224, 224), "float32")], [("output0", (1, 1000), "float32")], 0),
    "bert_encoder": ([("x", (1, 64, 128), "float32"), ("mask", (1, 64), "float32")],
                     [("output0", (1, 64, 128), "float32")], 64),
}


def variant_layout(ins, outs, rows: int, seq: int) -> IoLayout:
    slots, n = layout([*ins, *outs], 1, seq, rows, seq)
    return IoLayout(tuple(slots[:len(ins)]), tuple(slots[len(ins):]), n)


def one_row_requests(ins, outs, seq: int, n: int) -> list:
    slots, size = layout([*ins, *outs], 1, seq, 1, seq)
    rng = np.random.default_rng(0)
    return [SimpleNamespace(io=rng.integers(0, 255, size, dtype=np.uint8), rows=1, seq_len=seq,
                            layout=tuple(slots)) for _ in range(n)]


def measure(name: str, batch: int, repeat: int) -> dict:
    ins, outs, seq = MODELS[name]
    lay = variant_layout(ins, outs, batch, seq)
    reqs = one_row_requests(ins, outs, seq, batch)
    staging = np.zeros(lay.io_bytes, np.uint8)
    g, s = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        gather(reqs, lay, staging)
        t1 = time.perf_counter()
        for i, r in enumerate(reqs):
            scatter_one(r, i, lay, staging)
        t2 = time.perf_counter()
        g.append(t1 - t0)
        s.append(t2 - t1)
    gm, sm = statistics.median(g), statistics.median(s)
    return {"model": name, "batch": batch, "gather_us": gm * 1e6, "scatter_us": sm * 1e6,
            "per_request_us": (gm + sm) * 1e6 / batch,
            "bytes_in": sum(t.nbytes for t in lay.inputs),
            "zero_copy_alone": in_place(reqs[:1], variant_layout(ins, outs, 1, seq))}


def _identity_setup():
    """A one-kernel plan on the simulated T4, its dispatcher model id, and a function
    making a batching stage that serves it (identity batcher) as model 7."""
    from paella.dispatcher.adaptor import PlanAdaptor, synthetic_plan
    from paella.dispatcher.batchers import ModelVariants, VariantSpec, make_batcher
    from paella.dispatcher.batchers.stage import BatchingStage, ServedModel, ServedVariant
    from paella.dispatcher.core import Dispatcher
    from paella.dispatcher.devices.sim import SimDevice

    dev = SimDevice("t4", n_streams=64, seed=1)
    d = Dispatcher(dev, "fifo", profile_runs=1)
    plan = synthetic_plan("p", [("k1", 8, 128, 32, 20e-6)], in_bytes=64, out_bytes=64)
    mid = d.register_model("p", PlanAdaptor(plan))
    lay = IoLayout((Slot("x", (1, 16), "float32", 0),), (Slot("y", (1, 16), "float32", 64),), 128)
    v = VariantSpec(0, 1)

    def make_stage():
        stage = BatchingStage(d)
        stage.add_model(7, ServedModel("p", ModelVariants("p", (v,)),
                                       {0: ServedVariant(v, mid, lay)},
                                       make_batcher("identity", ModelVariants("p", (v,)))))
        return stage
    return d, mid, make_stage


def serve_identity(mode: str, n: int) -> None:
    """Serve ``n`` requests of the one-kernel plan in virtual time, submitted to the
    dispatcher directly (``direct``) or through the stage (``stage``): what callgrind
    counts for docs/batching.md ("Cost of the stage on the unbatched path")."""
    from paella.dispatcher.core import Request
    d, mid, make_stage = _identity_setup()
    stage = make_stage()
    io = np.zeros(128, np.uint8)
    done: list[int] = []
    for i in range(n):
        r = Request(i, 0, 7 if mode == "stage" else mid, io,
                    on_complete=lambda *a: done.append(1))
        stage.submit(r) if mode == "stage" else d.submit(r)
    stage.run_until_idle()
    assert len(done) == n, f"{len(done)} of {n} requests completed"


def identity_overhead(n: int, repeat: int) -> dict:
    """The batching stage's own cost per request on the daemon's default path (identity
    batcher, zero copy): ``n`` submissions to the dispatcher directly vs through the
    stage (submission side: fit, batcher, completion wrapper, submit_group), then the
    completion side (the stage's wrapper around each request's on_complete), timed apart
    from the serving itself. Medians of ``repeat`` runs."""
    from paella.dispatcher.core import Request

    d, mid, make_stage = _identity_setup()
    io = np.zeros(128, np.uint8)
    sub, done = {False: [], True: []}, []
    for _ in range(repeat):
        for staged in (False, True):
            stage = make_stage()
            reqs = [Request(i, 0, 7 if staged else mid, io, on_complete=lambda *a: None)
                    for i in range(n)]
            t0 = time.perf_counter()
            for r in reqs:
                stage.submit(r) if staged else d.submit(r)
            sub[staged].append((time.perf_counter() - t0) / n)
            if staged:
                t0 = time.perf_counter()
                for r in reqs:                # the completion wrapper alone (scatter skipped:
                    r.on_complete(r, 0, None)  # zero copy), as the dispatcher calls it
                done.append((time.perf_counter() - t0) / n)
            d.abandon_all("bench")            # drop the jobs without serving them
            d.in_flight = 0
    direct = statistics.median(sub[False])
    staged = statistics.median(sub[True])
    return {"direct_us": direct * 1e6, "staged_us": staged * 1e6,
            "completion_us": statistics.median(done) * 1e6,
            "stage_cost_us": (staged - direct + statistics.median(done)) * 1e6}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=200)
    p.add_argument("--identity", action="store_true",
                   help="instead: the stage's cost per request on the identity path")
    p.add_argument("--serve", nargs=2, metavar=("MODE", "N"),
                   help="instead: serve N requests of a one-kernel plan, MODE direct or "
                        "stage (run it under callgrind for instruction counts)")
    args = p.parse_args(argv)
    if args.serve:
        serve_identity(args.serve[0], int(args.serve[1]))
        return 0
    if args.identity:
        r = identity_overhead(2000, max(3, args.repeat // 40))
        print(f"submit per request: direct {r['direct_us']:.2f} us, through the stage "
              f"{r['staged_us']:.2f} us; the stage's completion wrapper {r['completion_us']:.2f} "
              f"us; the stage's cost per request {r['stage_cost_us']:.2f} us")
        return 0
    print("| model | batch | gather (us) | scatter (us) | per request (us) | input bytes |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in MODELS:
        for b in (1, 2, 4, 8, 16):
            r = measure(name, b, args.repeat)
            print(f"| {name} | {b} | {r['gather_us']:.1f} | {r['scatter_us']:.1f} | "
                  f"{r['per_request_us']:.1f} | {r['bytes_in']:,} |")
    print("(a batch of one request on its own variant runs in place: no copy at all)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


