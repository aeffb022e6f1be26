"""``python -m paella.benchmarks.bench_chunked``: what the chunked allocator costs the
dispatcher loop per job (placing a job's buffers by Algorithm 1, binding its plan, letting
them go), on the turbo experiment's BERT-base variants (the smallest and the largest),
medians of ``--repeat`` acquire/release pairs. Needs the bundle ``paella experiment turbo
--quick`` compiles."""
from __future__ import annotations

import argparse
import time

from paella.bundle import DEFAULT_ZOO_DIR, load_bundle
from paella.dispatcher.adaptor import PlanAdaptor, plan_from_bundle
from paella.dispatcher.chunked_buffers import ChunkedMemory
from paella.dispatcher.devices.sim import SimDevice


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", default=str(DEFAULT_ZOO_DIR / "turbo_bert_12x768x12x3072_4l4b"))
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args()
    b = load_bundle(args.bundle)
    dev, mem = SimDevice("rtx2060"), ChunkedMemory(b.model, limit=4)
    for vi in (0, len(b.variants) - 1):
        ad = PlanAdaptor(plan_from_bundle(b, vi, weights=False), memory=mem)
        ad.init(dev)
        pool, ts = ad.buffer_pool, []
        for _ in range(args.repeat):
            t = time.perf_counter()
            pool.release(pool.acquire())
            ts.append(time.perf_counter() - t)
        ts.sort()
        print(f"variant {b.variants[vi].name}: {len(ad.plan.ops)} plan steps, "
              f"{len(pool.usages)} buffers: acquire + release median {ts[len(ts) // 2] * 1e6:.0f} us")


if __name__ == "__main__":
    main()
