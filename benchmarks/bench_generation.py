"""Streamed generation through the real daemon: time to first token, time between
tokens, and what streaming costs against the same generation answered at its end.

Starts a daemon (``paella serve --backend sim``, polite: no pinning, no real-time
priority) serving the tiny GPT with the ``orca`` scheduler plug-in from a
``config.toml``-only model folder, then, from one client, alternately runs a
generation of ``--tokens`` tokens after a 4-token prompt streamed
(``Client.generate``: a progress entry and a PROGRESS frame per token) and the same one
unstreamed (``Client.infer``: one completion), ``--n`` times each, and reports medians
(and p99 of the gaps between streamed tokens).

Run: ``python -m paella.benchmarks.bench_generation [--n 20] [--tokens 32] [--mode hybrid]
[--json FILE]``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import tempfile
import time

import numpy as np

from paella.child_daemon import start_daemon


def run(n: int, tokens: int, mode: str) -> dict:
    from paella.client import connect
    root = tempfile.mkdtemp(prefix="plgen")
    folder = os.path.join(root, "models", "gpt-tiny")
    os.makedirs(folder)
    with open(os.path.join(folder, "config.toml"), "w") as f:
        f.write('[batching]\nbatcher = "orca"\nconfig = "tiny"\nmax_bs = 8\n')
    proc, sock, tmp = start_daemon("--backend", "sim", "--models", os.path.dirname(folder),
                                   "--cpu", "none", "--rt-priority", "0")
    prompt = [3, 7, 1, 9]
    ttft, gaps, streamed, whole = [], [], [], []
    try:
        with connect(sock, mode=mode) as c:
            ins = {"prompt": np.r_[prompt, np.zeros(64 - len(prompt))],
                   "lengths": np.array([len(prompt), tokens])}
            for _ in range(n):
                t0 = time.perf_counter()
                times = []
                for _tok in c.generate("gpt-tiny", prompt, tokens, timeout=60):
                    times.append(time.perf_counter())
                streamed.append(time.perf_counter() - t0)
                ttft.append(times[0] - t0)
                gaps += list(np.diff(times))
                t0 = time.perf_counter()
                c.infer("gpt-tiny", ins, timeout=60)
                whole.append(time.perf_counter() - t0)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
    ms = lambda xs: round(statistics.median(xs) * 1e3, 3)   # noqa: E731
    return {"mode": mode, "n": n, "tokens": tokens,
            "ttft_ms_p50": ms(ttft), "inter_token_ms_p50": ms(gaps),
            "inter_token_ms_p99": round(float(np.percentile(gaps, 99)) * 1e3, 3),
            "streamed_ms_p50": ms(streamed), "unstreamed_ms_p50": ms(whole),
            "streaming_ratio": round(statistics.median(streamed) / statistics.median(whole), 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=20)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--mode", default="hybrid", choices=("hybrid", "polling", "socket"))
    p.add_argument("--json")
    args = p.parse_args(argv)
    r = run(args.n, args.tokens, args.mode)
    print(json.dumps(r, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
