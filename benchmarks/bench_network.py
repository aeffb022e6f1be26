"""The network front end (``paella kserve``) end to end, beside the local rings.

A daemon (``paella serve --backend sim``, polite: no pinning, no real-time priority)
serving ``echo`` and the tiny GPT (``orca``), ``paella kserve`` in front of it, and
``paella perf echo`` over the local rings, KServe REST and KServe gRPC, closed loop at
concurrency 1 and 8, ``--seconds`` each, with ``--server-pid`` of both processes: per
transport and concurrency, throughput, p50 and p99 latency, the front end's and the
daemon's CPU time per request, the load generator's, and the CPU the rest of the
machine used meanwhile (other jobs on a shared machine make figures drift). Then the
same three transports streaming ``gpt-tiny`` generations (``--stream``: time to first
token and between tokens), unless ``--no-stream``. The figures are compared with the
issue's targets (front-end CPU <= 60 us per request on each protocol, throughput with
8 connections >= 2x the old REST figure, p50 with one connection <= 0.3 ms).

Run: ``python -m paella.benchmarks.bench_network [--seconds S] [--quick] [--no-stream]
[--json FILE]`` (about a minute with the defaults).
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

PAELLA = (sys.executable, "-m", "paella.cli")
#: The issue's figures before this work (REST and rings, 2 cores) and its targets.
OLD = {"rest_c8_rps": (2200, 3200), "rest_c8_p50_ms": 2.2, "rest_c1_p50_ms": (0.45, 0.49),
       "frontend_cpu_us": 335, "rings_c1_p50_ms": 0.029, "rings_c8_rps": 56000}
TARGETS = {"frontend_cpu_us": 60, "c8_speedup": 2.0, "c1_p50_ms": 0.3}
TRANSPORTS = (("local rings", "socket"), ("REST", "kserve"), ("gRPC", "grpc"))


@dataclass
class Row:
    """One transport at one concurrency, as ``paella perf`` measured it."""
    transport: str
    concurrency: int
    throughput_rps: float
    p50_ms: float
    p99_ms: float
    errors: int
    frontend_cpu_us: float
    daemon_cpu_us: float
    client_cpu_us: float
    other_cpu: float              # cores the rest of the machine used over the run
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    tbt_p50_ms: float | None = None
    tbt_p99_ms: float | None = None
    tokens_per_s: float | None = None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _machine_busy() -> float:
    """CPU seconds the whole machine has been busy (every core)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def _process_cpu(pid: int) -> float:
    from paella.client.perf import process_cpu
    return process_cpu(pid)


def start_servers(models: str) -> tuple[subprocess.Popen, str, str, subprocess.Popen, int, int]:
    """The daemon (sim backend, echo and the models in ``models``) and ``paella kserve``
    in front of it: (daemon, socket, its temp dir, front end, HTTP port, gRPC port)."""
    from paella.child_daemon import start_daemon
    from paella.parent_death import end_with_parent
    daemon, sock, tmp = start_daemon("--backend", "sim", "--models", models, "--cpu", "none",
                                     "--rt-priority", "0")
    hp, gp = _free_port(), _free_port()
    front = subprocess.Popen([*PAELLA, "kserve", "--socket", sock, "--http-port", str(hp),
                              "--grpc-port", str(gp), "--log-level", "warning"],
                             preexec_fn=end_with_parent())
    deadline = time.monotonic() + 60
    while True:                          # ready: its REST port answers, the daemon with it
        try:
            c = http.client.HTTPConnection("127.0.0.1", hp, timeout=5)
            c.request("GET", "/v2/health/ready")
            if c.getresponse().status == 200:
                break
        except OSError:
            pass
        if front.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("paella kserve did not become ready (its error is above)")
        time.sleep(0.2)
    return daemon, sock, tmp, front, hp, gp


def run_perf(model: str, target: list[str], seconds: float, warmup: float,
             pids: tuple[int, int], extra: list[str] = ()) -> tuple[dict, float]:
    """``paella perf`` at concurrency 1 and 8: its JSON, and the cores the rest of the
    machine (not the daemon, the front end or the generator) used meanwhile."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cpu0 = [_process_cpu(p) for p in pids]
        kids0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        busy0, t0 = _machine_busy(), time.monotonic()
        r = subprocess.run([*PAELLA, "perf", model, *target, "--concurrency", "1,8",
                            "--seconds", str(seconds), "--warmup", str(warmup), "--server-pid",
                            ",".join(map(str, pids)), "--json", out.name, "-q", *extra],
                           capture_output=True, text=True, timeout=120 + 4 * seconds)
        wall, busy = time.monotonic() - t0, _machine_busy() - busy0
        kids1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        ours = sum(_process_cpu(p) - c for p, c in zip(pids, cpu0)) + (
            kids1.ru_utime - kids0.ru_utime + kids1.ru_stime - kids0.ru_stime)
        if r.returncode != 0:
            raise RuntimeError(f"paella perf {model} {' '.join(target)} failed:\n{r.stderr}")
        return json.loads(open(out.name).read()), max(0.0, busy - ours) / wall


def _rows(name: str, res: dict, other: float, pids: tuple[int, int]) -> list[Row]:
    rows = []
    for p in res["points"]:
        by_pid = p["server_cpu_us_per_request_by_pid"]
        rows.append(Row(name, p["concurrency"], p["throughput_rps"], p["p50_ms"], p["p99_ms"],
                        p["errors"], by_pid[str(pids[0])], by_pid[str(pids[1])],
                        p["client_cpu_us_per_request"], other, p["ttft_p50_ms"],
                        p["ttft_p99_ms"], p["tbt_p50_ms"], p["tbt_p99_ms"], p["tokens_per_s"]))
    return rows


def transports(seconds: float, warmup: float, stream: bool) -> tuple[list[Row], list[Row], dict]:
    """Every transport at concurrency 1 and 8, with ``echo`` and (``stream``) streaming
    ``gpt-tiny``: (echo rows, streaming rows, meta)."""
    root = tempfile.mkdtemp(prefix="plfront")
    folder = os.path.join(root, "models", "gpt-tiny")
    os.makedirs(folder)
    with open(os.path.join(folder, "config.toml"), "w") as f:
        f.write('[batching]\nbatcher = "orca"\nconfig = "tiny"\nmax_bs = 8\nn_slots = 256\n')
    meta = {"cores": os.cpu_count(), "loadavg_before": os.getloadavg()[0], "seconds": seconds,
            "warmup": warmup}
    daemon, sock, tmp, front, hp, gp = start_servers(os.path.dirname(folder))
    pids = (front.pid, daemon.pid)
    targets = {"socket": ["--socket", sock], "kserve": ["--kserve", f"127.0.0.1:{hp}"],
               "grpc": ["--grpc", f"127.0.0.1:{gp}"]}
    echo, gen = [], []
    try:
        for name, key in TRANSPORTS:
            res, other = run_perf("echo", targets[key], seconds, warmup, pids)
            echo += _rows(name, res, other, pids)
        if stream:
            from paella.client import connect
            with connect(sock) as c:                       # (the first one sets it up)
                list(c.generate("gpt-tiny", [1, 2, 3], 4, timeout=60))
            for name, key in TRANSPORTS:
                res, other = run_perf("gpt-tiny", targets[key], max(1.0, seconds * 2 / 3),
                                      warmup, pids, ["--stream"])
                gen += _rows(name, res, other, pids)
    finally:
        from paella.child_daemon import stop_daemon
        front.terminate()
        front.wait(30)
        stop_daemon(daemon)
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
    meta["loadavg_after"] = os.getloadavg()[0]
    return echo, gen, meta


def _cpu(row: Row, what: str) -> str:
    if what == "frontend_cpu_us" and row.transport == "local rings":
        return "-"                                      # (not on its path)
    return f"{getattr(row, what):.0f}"


def print_tables(echo: list[Row], gen: list[Row]) -> None:
    print(f"{'transport':<12} {'conc':>4} {'req/s':>8} {'p50 ms':>7} {'p99 ms':>7} {'err':>4} "
          f"{'front-end us/req':>16} {'daemon us/req':>13} {'client us/req':>13} "
          f"{'other cores':>11}")
    for r in echo:
        print(f"{r.transport:<12} {r.concurrency:>4} {r.throughput_rps:>8.0f} {r.p50_ms:>7.3f} "
              f"{r.p99_ms:>7.3f} {r.errors:>4} {_cpu(r, 'frontend_cpu_us'):>16} "
              f"{_cpu(r, 'daemon_cpu_us'):>13} {_cpu(r, 'client_cpu_us'):>13} "
              f"{r.other_cpu:>11.2f}")
    if not gen:
        return
    print(f"\nstreaming gpt-tiny (8-token prompt, 16 tokens; CPU per generation)\n"
          f"{'transport':<12} {'conc':>4} {'gen/s':>6} {'p50 ms':>7} {'TTFT p50':>8} "
          f"{'TTFT p99':>8} {'TBT p50':>7} {'TBT p99':>7} {'tok/s':>6} {'err':>4} "
          f"{'front-end us':>12} {'daemon us':>9} {'client us':>9} {'other':>5}")
    for r in gen:
        print(f"{r.transport:<12} {r.concurrency:>4} {r.throughput_rps:>6.0f} {r.p50_ms:>7.2f} "
              f"{r.ttft_p50_ms:>8.2f} {r.ttft_p99_ms:>8.2f} {r.tbt_p50_ms:>7.2f} "
              f"{r.tbt_p99_ms:>7.2f} {r.tokens_per_s:>6.0f} {r.errors:>4} "
              f"{_cpu(r, 'frontend_cpu_us'):>12} {_cpu(r, 'daemon_cpu_us'):>9} "
              f"{_cpu(r, 'client_cpu_us'):>9} {r.other_cpu:>5.2f}")


def against_targets(echo: list[Row]) -> list[dict]:
    """Each network transport's figures against the issue's targets and old figures."""
    out = []
    for name in ("REST", "gRPC"):
        c1 = next(r for r in echo if r.transport == name and r.concurrency == 1)
        c8 = next(r for r in echo if r.transport == name and r.concurrency == 8)
        cpu = max(c1.frontend_cpu_us, c8.frontend_cpu_us)
        lo, hi = OLD["rest_c8_rps"]
        out += [
            {"transport": name, "target": f"front-end CPU <= {TARGETS['frontend_cpu_us']} us "
                                          f"per request (old {OLD['frontend_cpu_us']})",
             "value": f"{c1.frontend_cpu_us:.0f} (c1), {c8.frontend_cpu_us:.0f} (c8)",
             "met": cpu <= TARGETS["frontend_cpu_us"]},
            {"transport": name, "target": f"req/s with 8 connections >= 2x old REST "
                                          f"({lo:,}-{hi:,})",
             "value": f"{c8.throughput_rps:,.0f} = {c8.throughput_rps / hi:.2f}x-"
                      f"{c8.throughput_rps / lo:.2f}x",
             "met": c8.throughput_rps >= TARGETS["c8_speedup"] * hi},
            {"transport": name, "target": f"p50 with one connection <= {TARGETS['c1_p50_ms']} ms "
                                          f"(old REST {OLD['rest_c1_p50_ms'][0]}-"
                                          f"{OLD['rest_c1_p50_ms'][1]})",
             "value": f"{c1.p50_ms:.3f} ms", "met": c1.p50_ms <= TARGETS["c1_p50_ms"]}]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=3.0,
                   help="measured seconds per point (default 3)")
    p.add_argument("--warmup", type=float, default=0.5,
                   help="unmeasured seconds before each point (default 0.5)")
    p.add_argument("--quick", action="store_true", help="1 s per point, 0.3 s warm-up")
    p.add_argument("--no-stream", action="store_true", help="echo only")
    p.add_argument("--json", help="write the rows here")
    a = p.parse_args(argv)
    if a.quick:
        a.seconds, a.warmup = 1.0, 0.3
    if not (0 < a.seconds <= 600 and 0 <= a.warmup <= 60):
        p.error("--seconds must be in (0, 600], --warmup in [0, 60]")
    echo, gen, meta = transports(a.seconds, a.warmup, not a.no_stream)
    print_tables(echo, gen)
    checks = against_targets(echo)
    print(f"\ntargets (old figures: REST {OLD['rest_c8_rps'][0]:,}-{OLD['rest_c8_rps'][1]:,} "
          f"req/s with 8 connections, p50 {OLD['rest_c8_p50_ms']} ms; local rings "
          f"{OLD['rings_c8_rps']:,} req/s, p50 {OLD['rings_c1_p50_ms'] * 1e3:.0f} us)")
    for c in checks:
        print(f"  {c['transport']:<5} {c['target']:<58} {c['value']:<22} "
              f"{'met' if c['met'] else 'NOT met'}")
    print(f"(machine: {meta['cores']} cores, load average {meta['loadavg_before']:.2f} before, "
          f"{meta['loadavg_after']:.2f} after)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "old": OLD, "targets": checks,
                       "rows": [asdict(r) for r in echo], "stream": [asdict(r) for r in gen]},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
