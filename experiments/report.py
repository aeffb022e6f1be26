"""``paella experiment report``: write docs/EXPERIMENTS.md from the experiments' JSON.

Every figure in the report is read from ``docs/figures/<name>.json`` (written by
``paella experiment <name> --json ...``), so the text cannot drift from the data. A
section whose JSON is missing says so and gives the command that produces it.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Callable

from paella.experiments.harness import saturated
from paella.experiments.nimble import report_section as _nimble
from paella.experiments.cellular import report_section as _cellular
from paella.experiments.orca import report_section as _orca
from paella.experiments.dvabatch import report_section as _dvabatch
from paella.experiments.turbo import report_section as _turbo
from paella.experiments.windtunnel import report_section as _windtunnel

FIGURES = Path("docs/figures")


def _load(name: str, figures: Path) -> dict | None:
    path = figures / f"{name}.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        from paella.cli import CLIError
        raise CLIError(f"{path} is not an experiment's JSON ({e}); run the experiment again "
                       f"with --json {path}") from None


def _calibrate(d: dict) -> list[str]:
    tm, s = d["timing_model"], d["summary"]
    rows = ["| model | launches | GFLOP | simulated ms | paper ms (TVM, T4) | ratio | kernel time: compute / memory / latency |",
            "|---|---:|---:|---:|---:|---:|---|"]
    for name, m in d["models"].items():
        b = m["bound"]
        rows.append(f"| {name} | {m['kernels']} | {m['gflops']:.2f} | {m['simulated_ms']:.2f} | "
                    f"{m['paper_ms']:.2f} | {m['ratio']:.2f} | {b['compute']:.0%} / {b['memory']:.0%} / "
                    f"{b['latency']:.0%} |")
    fb = s["feature_bound"]
    return [
        f"Nothing is fitted: the timing model's figures come from spec sheets and published measurements "
        f"(docs/simulator.md): {tm['peak_tflops']:.1f} TFLOPS and {tm['mem_bw_gbs']:.0f} GB/s (T4 data sheet), "
        f"{tm['warps_to_hide_arithmetic']:g} warps hide arithmetic latency ({tm['ilp']}-way ILP), DRAM latency "
        f"{tm['mem_latency_ns']:.0f} ns, launch latency {tm['launch_latency_us']:.1f} us.",
        "", *rows, "",
        f"Worst relative error: **{s['worst_relative_error']:.0%}** (goal {s['goal']:.0%}: "
        f"{'met' if s['within_goal'] else '**not met**'}); same ordering as the paper: "
        f"{'yes' if s['same_ordering'] else '**no**'} (paper: {', '.join(s['paper_order'])}; simulated: "
        f"{', '.join(s['simulated_order'])}).",
        "",
        f"Our kernels at the model's figures run {1 / s['geomean_ratio']:.1f}x faster than the paper's TVM 0.10 "
        f"kernels on its T4 (geometric mean), and the ratios span {s['ratio_spread']:.1f}x: the one global "
        f"factor that would fit best ({s['scaled']['factor']:.2f}x, not applied) would still leave "
        f"{s['scaled']['worst_relative_error']:.0%} on one model, so the difference is in the models' relative "
        "times, not a constant. No cost model built from the kernels' work can close it: on every per-kernel "
        f"quantity `calibrate` computes, {fb['slower']} has at most {fb['max_feature_ratio']:.2f}x of "
        f"{fb['faster']}'s, yet the paper times it at {fb['paper_ratio']:.2f}x, so any model summing "
        f"non-negative multiples of them is at least {fb['bound']:.0%} off on one of the two. The paper's times "
        "reflect the kernels TVM 0.10 generated on its T4; our bundles are TVM 0.27 DLight kernels, different "
        "programs (PyPI offers apache-tvm 0.25-0.27 only), and matching the paper would take per-model "
        "factors, agreement by construction rather than by modelling. The model is checked instead against "
        "the papers' published trends (the fidelity section).",
    ]


def _fidelity(d: dict) -> list[str]:
    rows = ["| source | GPU | check | paper | this project | reproduced |", "|---|---|---|---:|---:|---|"]
    notes = []
    for c in d["checks"]:
        verdict = {True: "yes", False: "**no**", None: "(absolute)"}[c["agrees"]]
        rows.append(f"| {c['source']} | {c['gpu']} | {c['what']} | {c['paper']} | {c['ours']} | {verdict} |")
        if c["note"]:
            notes.append(f"- {c['source']}, {c['what']}: {c['note']}.")
    s = d["summary"]
    return [
        "Our compiled operators and models (TVM DLight kernels) on the simulated GPUs the papers used, beside "
        "the trends the papers state in their text. Nothing is tuned to these points. A knee is the largest "
        f"batch whose time stays within {d['setting']['knee_tolerance']:.0%} of the smallest batch's.",
        "", *rows, "",
        f"Trends reproduced: **{s['trends_reproduced']} of {s['trend_checks']}**.", "", *notes,
    ]


def _hol(d: dict) -> list[str]:
    s = d["setting"]
    return [
        f"Setting: `{s['gpu']}`, jobs of {s['kernels_per_job']} dependent one-block kernels "
        f"({s['block']} threads, {s['regs']} registers, {s['kernel_us']} us), lognormal arrivals "
        f"(sigma {s['sigma']}), {s['jobs_per_point']} jobs per load point, p99 SLO {s['slo_ms']} ms.",
        "",
        "| | this project | paper |",
        "|---|---:|---:|",
        f"| goodput ratio, occupancy-aware over naive | {d['goodput_ratio']:.2f}x | 2.2x |",
        f"| resident blocks under naive submission (peak of means) | {d['naive_peak_resident_blocks']:.1f} of "
        f"{d['possible_resident_blocks']} | 32 of 176 |",
        f"| resident blocks under aware release | {d['aware_peak_resident_blocks']:.1f} of "
        f"{d['possible_resident_blocks']} | |",
        "",
        "Both effects of the paper show: naive submission is capped near the 32 hardware queues "
        "(slightly above, because a queue starts the next job's first kernel while the previous job's "
        "last one still runs), and occupancy-aware release fills the GPU. Our ratio is larger than the "
        "paper's because this driver is ideal: it reads the simulator's ground truth for free, where "
        "Paella learns occupancy from notifications and pays for its own dispatching.",
    ]


def _hol_dispatcher(d: dict) -> list[str]:
    s, g = d["setting"], d["goodput"]
    return [
        f"The Figure 2 setting through the real dispatcher: `paella` against `ms-jbj`, "
        f"{s['jobs_per_point']} jobs per load point, p99 SLO {s['slo_ms']} ms, dispatcher CPU charged "
        f"at scale {s['cpu_scale']:g} (0: a free dispatcher).",
        "",
        "| | this project | paper |",
        "|---|---:|---:|",
        *[f"| goodput of `{p}` | {v / 1e3:.1f}k jobs/s | |" for p, v in g.items()],
        f"| goodput ratio, paella over ms-jbj | {d['goodput_ratio']:.2f}x | 2.2x |",
        "",
        _hol_cpu_note(s, d["goodput_ratio"]),
    ]


def _hol_cpu_note(s: dict, ratio: float) -> str:
    need = s["kernel_releases_to_fill_gpu_per_s"]
    budget = (f"Filling the GPU here takes {need:,.0f} kernel releases per second (one every "
              f"{1e6 / need:.1f} us)")
    if s["cpu_scale"] != 0:
        return (f"{budget}. Charged here at scale {s['cpu_scale']:g}: the C kernel core "
                "(docs/dispatcher.md, \"The kernel core\") and the control plane's Python take "
                "about 8-15 us of CPU per job (session 25; 28 us in round 11), and every driver "
                "call its launches and copies stand for is charged 2 us (12 per job: 8 launches, "
                "the input copy, which records no event since session 25 because the kernel "
                "behind it tells its completion (\"Implied copies\", docs/dispatcher.md), and the "
                "output copy with its event's record and query: 24 us; 14 and 28 us before), so "
                "one job costs about 30-39 us of the dispatcher's core: "
                f"{ratio:.2f}x (1.01x with the Python per-kernel path, 52.7k instructions per "
                "kernel; 1.73x in round 11; 2.02x in session 22; 2.08x in session 25). Since "
                "session 26 each model's per-request buffer sets are made when it is registered "
                "(docs/dispatcher.md, \"Sets made ahead\"), as the daemon does at load: before, a "
                "burst larger than any before made a set per job on the loop (8-10 us each), and "
                "near the knee that pushed a load point past the SLO in some runs (the parent "
                "tree, alternated with this one: 2.24x, 2.08x, 2.48x against 2.58x, 2.59x, "
                "2.59x; docs/benchmarks.md, round 16). The driver calls are most of the "
                "cost; the paper's 2.2x is a C++ dispatcher on a real driver. Each knee is refined "
                "by bisection (`refine_knee`), the same for both policies. Scale-1 figures vary "
                "between runs with the machine's load (this tree: 2.44-2.59x in fifteen runs, at 512 and 1,024 sets made ahead).")
    return ("With the dispatcher free, the policy and the +B release rule fill the GPU as the ideal "
            f"driver does. {budget}; with its CPU charged (the next section) the dispatcher's own "
            "cost per job, not the policy, sets the goodput.")


def _fairness(d: dict) -> list[str]:
    s, st = d["summary"], d["setting"]
    rows = ["| threshold | short mean (ms) | long mean (ms) | long/short |", "|---:|---:|---:|---:|"]
    for t, a, b, r in zip(s["thresholds"], s["short_mean_ms"], s["long_mean_ms"], s["long_short_ratio"]):
        rows.append(f"| {'off (SRPT)' if t >= 1e8 else f'{t:g}'} | {a:.2f} | {b:.2f} | {r:.2f} |")
    rows.append(f"| fifo | {s['fifo_short_mean_ms']:.2f} | {s['fifo_long_mean_ms']:.2f} | "
                f"{s['fifo_long_short_ratio']:.2f} |")
    return [
        f"Two job types, {st['short_kernels']} and {st['long_kernels']} kernels, {st['rate']:g} requests/s, "
        f"deficits per {st['fairness_unit']}, dispatcher CPU charged at scale {st['cpu_scale']:g}.",
        "", *rows, "",
        f"As the threshold falls to 0 the system approaches fifo (`approaches_fifo`: "
        f"{s['approaches_fifo']}), as the paper's Figure 13 shows; a large threshold is SRPT, which "
        "serves short jobs first. The paper gives no numbers for this figure, only the trend.",
    ]


def _short_long(d: dict) -> list[str]:
    s = d["summary"]
    rows = []
    for key, per in d["results"].items():
        for pa, jb in zip(per.get("paella", []), per.get("ms-jbj", [])):
            r, i = "resnet18", "inception_v3"
            rows.append(f"| {key}, {pa['offered']:g} req/s | {pa['per_model'][r]['p99_ms']:.1f} / "
                        f"{pa['per_model'][i]['p99_ms']:.0f} | {jb['per_model'][r]['p99_ms']:.1f} / "
                        f"{jb['per_model'][i]['p99_ms']:.0f} |"
                        + (" saturated |" if saturated(pa) else f" {jb['per_model'][r]['p99_ms'] / pa['per_model'][r]['p99_ms']:.2f}x |"))
    return [
        "ResNet-18 and InceptionV3 on the t4 preset (synthetic kernel lists from the layers' shapes), "
        "requests inversely proportional to size, lognormal arrivals, dispatcher CPU charged at scale "
        f"{d['setting']['cpu_scale']:g}.",
        "",
        "| | this project | paper |",
        "|---|---:|---:|",
        f"| ResNet-18 p99, ms-jbj over paella (best load below saturation) | {s['short_p99_speedup']:.2f}x "
        f"| up to 3x |",
        *[f"| ... at {k} | {v:.2f}x | |" for k, v in s["short_p99_speedup_per_sigma"].items()],
        "",
        "| point | paella p99, ResNet-18 / InceptionV3 (ms) | ms-jbj p99 (ms) | ResNet-18 speedup |",
        "|---|---:|---:|---:|",
        *rows,
        "",
        f"The issue asks for at least 2x: {'met' if s['meets_2x'] else '**not met**'} in this run. "
        "ResNet-18's tail under plain SRPT was set by InceptionV3's multi-wave kernels, whose blocks "
        "cannot be preempted once placed: the GPU was backfilled with them between two ResNet-18 kernels. "
        "Paella's hold rule keeps such a kernel back while a much shorter job runs (docs/policies.md); "
        "InceptionV3 pays with a longer p99 than under ms-jbj, the SRPT trade-off that the deficits bound.",
    ]


def _sched_delay(d: dict) -> list[str]:
    s, st = d["summary"], d["setting"]
    rows = ["| delay per decision | " + " | ".join(f"{r:g} req/s: p99 growth" for r in st["rates"]) + " |",
            "|---:|" + "---:|" * len(st["rates"])]
    for delay in s["delays_us"]:
        rows.append(f"| {delay:g} us | " + " | ".join(f"{x:.2f}x" for x in s["p99_ratio_to_no_delay"][f"{delay:g}"])
                    + " |")
    return [
        f"`paella` on the short-long workload (sigma {st['sigma']}), the delay charged to the simulated "
        "clock for every kernel released; p99 growth is the larger of the whole mix's and ResNet-18's.",
        "", *rows, "",
        f"Headroom: **{s['headroom_us']:g} us** per decision keeps p99 within "
        f"{s['tolerance'] - 1:.0%}. " + _decision_cost(s)
        + " The paper shows the same sensitivity (Figure 9) for its C++ dispatcher.",
    ]


def _decision_cost(s: dict) -> str:
    """What a released kernel costs the dispatcher, beside the headroom: on the C kernel
    core (what the experiments and the daemon run; JSON written before it was recorded
    says only the Python path's) and on the dispatcher's own Python path."""
    core, py, room = s.get("core_decision_us"), s["python_decision_us"], s["headroom_us"]
    if core is None:
        return (f"This dispatcher's own Python path spends about {py:g} us of CPU per released "
                "kernel, everything included.")
    verdict = ("within that headroom, so charging its CPU in full (`--cpu-scale 1`) keeps "
               "short-long's speedup (its section with the CPU charged, above)"
               if core <= room else
               "beyond that headroom, so the experiments that charge its CPU in full "
               "(`--cpu-scale 1`) lose to the baselines")
    return (f"A released kernel costs the dispatcher as the experiments and the daemon run it "
            f"(the C kernel core) about {core:g} us as `--cpu-scale 1` charges it (its measured "
            f"CPU, about 2 us, and 2 us per driver call): {verdict}. On the dispatcher's own "
            f"Python path it costs about {py:g} us of CPU.")


def _overhead(d: dict) -> list[str]:
    st, s, dm = d["setting"], d["summary"], d["daemon"]
    cases = list(d["cases"])
    rows = ["| component | " + " | ".join(f"{c.replace('_', ' ')}: p50 / p99 (us)" for c in cases) + " |",
            "|---|" + "---:|" * len(cases)]
    names = [("e2e", "**end to end** (client)"), ("communication", "**communication**"),
             ("comm_in", "- client to daemon"), ("comm_out", "- daemon to client"),
             ("scheduling_framework", "**scheduling and framework**"), ("sched_start", "- job start"),
             ("sched_gaps", "- releases (GPU idle between the job's operations)"),
             ("sched_completion", "- completion"), ("device", "**device**"),
             ("device_busy", "- simulated GPU busy"), ("sim_cpu_idle", "- simulator CPU while the GPU idles"),
             ("functional_cpu_idle", "- the simulator's answer lookup ahead of the job")]
    for k, label in names:
        rows.append(f"| {label} | " + " | ".join(
            f"{d['cases'][c]['stats_us'][k]['p50']:.0f} / {d['cases'][c]['stats_us'][k]['p99']:.0f}" for c in cases) + " |")
    med = s["median_us"]
    fifo = "SCHED_FIFO" if dm["policy"] == "SCHED_FIFO" else f"{dm['policy']} (SCHED_FIFO not granted)"
    spin = d["cases"].get("spin_back_to_back", {}).get("stats_us")
    out = [
        f"One {st['model']} request at a time from a real client process through the real daemon "
        f"(`paella serve`, policy `{st['policy']}`, simulated `{st['gpu']}` stepped in the daemon's loop, "
        f"real time), loop on core(s) {dm['cores']} under {fifo}, client on the other core of "
        f"{dm['machine_cores']}. Cases: {st['n']} requests back to back, {st['idle_n']} requests "
        f"{st['idle_gap_ms']:g} ms apart (the adaptive daemon has gone to sleep and needs a KICK), and "
        f"{st['spin_n']} back to back with `--idle spin`. Timestamps from the client, the daemon (its "
        "instruments: a request's admission, wake-up and finish) and the simulated GPU's self-log "
        "(`Gpu.logging`: each op's device interval and each stretch of the simulator's own work, "
        "recorded in C; nothing of the device is replaced, so the daemon's kernel core launches into "
        "the engine and spins in C as it does untraced), all on CLOCK_MONOTONIC; the components "
        "partition each request's end-to-end interval.",
        "", *rows, "",
        "| | this project (median) | paper (Figure 10) |",
        "|---|---:|---|",
        f"| communication | {med['communication']:.0f} us | value not in the text; lower than Clockwork's, "
        "much lower than Triton's (gRPC) |",
        f"| scheduling and framework | {med['scheduling_framework']:.0f} us | value not in the text; "
        "comparable to Triton's, lower than Clockwork's |",
        f"| device: simulated GPU busy | {s['gpu_busy_us'] / 1e3:.2f} ms | excluded from Figure 10; "
        "MobileNetV2 takes 1.67 ms on a T4 (Table 2) |",
        f"| device: simulator CPU | {s['simulator_cpu_us'] / 1e3:.2f} ms | none (a real GPU) |",
        "",
        "The paper's bars are in a figure whose values the text does not give, so only its ordering can be "
        f"compared. Communication, {med['communication']:.0f} us, is the shared-memory rings plus a "
        f"socket wake-up, and the daemon pushing the completion and its wake-up frame (the daemon's "
        f"share ends just before that push) (the echo model's whole round trip: "
        f"{d['echo']['e2e_p50_us']:.0f} us p50)"
        + (f"; with `--idle spin` it is {spin['communication']['p50']:.0f} us: the adaptive loop sleeps "
           "once nothing has been in flight for `idle_spin_us` (200 us), and a request arriving after "
           "that pays a KICK and an epoll wake-up; on this loaded 2-core machine the client's own "
           "turnaround often exceeds 200 us" if spin else "")
        + ". Scheduling and framework, "
        f"{med['scheduling_framework'] / 1e3:.1f} ms, is mostly the GPU waiting between the job's "
        f"{d['cases'][cases[0]]['stats_us']['kernels']['p50']:.0f} kernels for the dispatcher's loop "
        f"to read their notifications and release the next one ({s['release_gap_us']:.1f} us per "
        "kernel: the C kernel core spinning, docs/dispatcher.md \"The loop in C\"; 4.3 us before "
        "session 22), the job's start, and its completion, where the hybrid client's wake-up frame "
        "(a socket send) outlasts the short output copy. Paella releases each kernel late by "
        "design, so this cost sits on the critical path; "
        "the paper's text implies its C++ dispatcher's per-job cost is a small fraction of "
        "MobileNet's 1.67 ms (it allows about 30x more jobs per second before throughput suffers), "
        f"while this one's overheads are {1 / s['gpu_over_overhead']:.2f}x the simulated GPU "
        "time. The simulated GPU "
        f"is busy {s['gpu_busy_us']:.0f} us of the request's isolated time in virtual time "
        f"({s['isolated_device_us']:.0f} us, `paella profile`'s number, copies and the launch latency "
        "between kernels included; the paper's T4 takes 1.67 ms). "
        f"The simulator itself costs {s['simulator_cpu_us'] / 1e3:.1f} ms of the daemon loop's CPU per "
        f"request while the GPU idles, {s['simulator_cpu_us'] / s['gpu_busy_us']:.2f}x the GPU time it "
        "simulates (firing its events, placing blocks, moving the copies' bytes, looking up the "
        "answer); it is counted as device time (the hardware's work), not as scheduling; on a real "
        "GPU it would not exist.",
        "",
        f"Checks: the mean components add up to the mean end-to-end latency ({s['sum_of_means_us']:.1f} "
        f"against {s['e2e_mean_us']:.1f} us; largest residual {s['max_abs_residual_us']:.3f} us)."
        + f" Tracing records {d['cases'][cases[0]]['stats_us']['traced_calls']['p50']:.0f} entries per "
        f"request at most {d['wrapper_cost_us']:.2f} us each (two clock reads), so it adds at most "
        f"about {s['tracing_estimate_us']:.0f} us"
        + (f"; an untraced daemon's median end to end is {d['untraced_e2e_us']['p50'] / 1e3:.1f} ms against "
           f"the traced one's {s['e2e_p50_us'] / 1e3:.1f} ms in this run." if "untraced_e2e_us" in d else ".")
        + f" Writing the input into the arena, before predict, takes the client "
        f"{d['input_write_us']:.0f} us (not in the end to end). The p99s carry this shared machine's "
        f"other work (load average {d['load_average']:.1f} on {dm['machine_cores']} cores).",
    ]
    return out


def _mix_at(d: dict, key: str, load: float) -> str:
    """Each model's p99 under paella and ms-jbj at one load, against its SLO."""
    st = d["setting"]
    per = d["results"][key]
    at = {sy: next((p for p in per.get(sy, []) if p["offered"] == load), None) for sy in ("paella", "ms-jbj")}
    if None in at.values():
        return ""
    cells = [f"{m} {at['paella']['per_model'][m]['p99_ms']:.1f} / {at['ms-jbj']['per_model'][m]['p99_ms']:.1f}"
             f" (SLO {slo:.0f})" for m, slo in st["slo_ms"].items()]
    return (f"At {load:g} req/s ({key}), p99 in ms under paella / ms-jbj: " + "; ".join(cells) + ". ")


def _overall_note(s: dict) -> str:
    o = s["overall_slo"]["load_ratio_vs_ms_jbj"]
    if o > 1.0:
        return f"Under the overall bound paella also sustains more ({o:.2f}x). " + _tried()
    return (f"Under the overall bound paella does **not** sustain more ({o:.2f}x): the whole mix's p99 is "
            "set by the longest models, which SRPT makes wait behind the short ones; the paper's 1.4x is "
            "on that axis, so this part of Figure 11 is not reproduced. " + _tried())


def _tried() -> str:
    """The other policies run on this figure (``mix_<policy>.json``), one sentence each."""
    out = []
    for path in sorted(FIGURES.glob("mix_*.json")):
        systems = (_load(path.stem, FIGURES) or {}).get("summary", {}).get("vs_ms_jbj", {})
        for name, r in systems.get("systems", {}).items():
            def fmt(key: str) -> str:
                return " / ".join("n/a" if v is None else f"{v:.2f}x" for v in r[key].values())
            out.append(f"`{name}` (`{path.name}`, sigma {' / '.join(k.split('=')[1] for k in r['overall_load'])}): "
                       f"per-model load {fmt('per_model_load')}, overall {fmt('overall_load')}, "
                       f"saturation {fmt('saturation')} of ms-jbj's; "
                       f"{'it dominates ms-jbj' if r.get('dominates') else 'it does not dominate ms-jbj'}.")
    if not out:
        return ""
    return ("Other orderings tried on this figure (docs/policies.md, 'slack', says what each "
            "variant measured and why): " + " ".join(out) + " ")


def _cluster(d: dict) -> list[str]:
    st, s = d["setting"], d["summary"]
    ns = sorted(s["scaling_efficiency"], key=int)
    at = s["router_gain_at"]
    rows = ["| GPUs | " + " | ".join(ns) + " |", "|---|" + "---:|" * len(ns),
            f"| scaling efficiency ({s['scaling_efficiency_router']}) | "
            + " | ".join(f"{s['scaling_efficiency'][n]:.2f}" for n in ns) + " |"]
    for r, eff in s["scaling_efficiency_by_router"].items():
        if r != s["scaling_efficiency_router"]:
            rows.append(f"| scaling efficiency ({r}) | "
                        + " | ".join(f"{eff[n]:.2f}" if eff.get(n) is not None else "n/a"
                                     for n in ns) + " |")
    return [
        f"N simulated GPUs ({st['base_gpu']}; the heterogeneous case alternates {st['base_gpu']} and "
        f"{st['fast_gpu']}), each with the real dispatcher (`{st['policy']}` policy), behind the "
        f"routers of `paella.cluster` ({', '.join(st['routers'])}), in one virtual-time run; the "
        f"Table 2 mix as {st['kernels_per_model']}-kernel models timed by FLOPs, {st['arrivals']} "
        f"arrivals at a fraction of the cluster's capacity ({', '.join(map(str, st['loads']))}). "
        f"p99 bound {st['p99_bound_ms']:.1f} ms ({st['slo_x']:g}x the mix's mean isolated time). "
        "Scaling efficiency: throughput at the p99 bound with N GPUs over N times one GPU's.", "",
        *rows, "",
        f"Above 1: one GPU meets the bound only at a low load, while a pooled cluster with a "
        f"load-aware router meets it at a higher one (random routing, which splits the arrivals "
        f"into N independent streams, is the no-pooling reference, near 1). The issue aimed at "
        f"90% or better. Router gain, heterogeneous GPUs: at load {at['load']} with "
        f"{at['n_gpus']} GPUs, p2c by queue length's p99 is {at['p99_ms']['p2c-queue']:.0f} ms "
        f"against {at['p99_ms']['p2c-work']:.0f} ms routing by the daemons' estimated queued work "
        f"(**{at['gain']:.2f}x**). There is no paper figure to set beside these: Paella is one GPU.",
    ]


def _claim_rows(s: dict) -> list[str]:
    rows = ["| the paper's claim (Figure 11) | paper | this project, paella over ms-jbj | reproduced |",
            "|---|---:|---:|---|"]
    for c in s.get("claims", []):
        paper = "" if c["paper"] is None else f"{c['paper']:g}x"
        ours = "n/a" if math.isnan(c["ours"]) else f"{c['ours']:.2f}x"
        verdict = {True: "yes", False: "**no**", None: "(context)"}[c["reproduced"]]
        rows.append(f"| {c['claim']} | {paper} | {ours} | {verdict} |")
    return rows


def _rate_basis(d: dict) -> str:
    """What saturation was judged against in these results: the rate each load's
    arrivals had (``arrival_rate``), or, in results written before it existed, the
    nominal offered load."""
    points = [p for per in d["results"].values() for pts in per.values() for p in pts]
    if points and all("arrival_rate" in p for p in points):
        return "the rate the load's arrivals had (its lognormal draw, not the nominal load)"
    return "the offered load"


def _mix(d: dict) -> list[str]:
    st, s = d["setting"], d["summary"]
    labels = {"cuda-ss": "CUDA-SS", "cuda-ms": "CUDA-MS", "fifo": "Paella-SS (`fifo`)",
              "ms-jbj": "Paella-MS-jbj", "ms-kbk": "Paella-MS-kbk", "paella": "**Paella**",
              "sjf": "Paella-SJF", "rr": "Paella-RR"}
    keys = list(d["results"])
    o = s["overall_slo"]
    rows = ["| system | " + " | ".join(f"sustained, per-model SLO, {k} | sustained, overall bound, {k} | "
                                       f"throughput at saturation, {k}" for k in keys) + " |",
            "|---|" + "---:|---:|---:|" * len(keys)]
    for system in d["results"][keys[0]]:
        cells = []
        for k in keys:
            pts = d["results"][k][system]
            cells += [f"{s['sustained_load'][k][system]:g}", f"{o['sustained_load'][k][system]:g}",
                      f"{max(p['throughput'] for p in pts):.0f}"]
        rows.append(f"| {labels.get(system, system)} | " + " | ".join(cells) + " |")
    top = max(st["rates"])
    capped = [k for k in keys if s["sustained_load"][k].get("paella") == top]
    capped_note = (f"Paella meets the SLO at the highest load tried ({top:g} req/s, {', '.join(capped)}), "
                   "so its sustained load there is a lower bound. " if capped else "")
    details = "".join(_mix_at(d, k, max(s["sustained_load"][k]["paella"], s["sustained_load"][k]["ms-jbj"]))
                      for k in keys)
    same = [f"{a} and {b}" for k in keys for a, b in (("fifo", "cuda-ss"), ("ms-jbj", "cuda-ms"))
            if a in d["results"][k] and b in d["results"][k]
            and [p["p99_ms"] for p in d["results"][k][a]] == [p["p99_ms"] for p in d["results"][k][b]]]
    slos = ", ".join(f"{m} {v:.1f} ms" for m, v in st["slo_ms"].items())
    return [
        f"A uniform mix of the eight Table 2 models (compiled bundles) on `{st['gpu']}`, lognormal "
        f"arrivals ({', '.join(keys)}), offered loads {', '.join(f'{r:g}' for r in st['rates'])} req/s, "
        f"{st['requests_per_point']} requests per point (first {st['warmup']:.0%} dropped), one seed "
        f"({st['seed']}) for every load, dispatcher CPU charged at scale {st['cpu_scale']:g} (0: a free "
        "dispatcher). CUDA-SS and CUDA-MS submit the same plans straight to the simulated device. A load is "
        "sustained when it and every lower load of the grid meet the criterion and throughput keeps within "
        f"90% of {_rate_basis(d)}. Per-model SLO: every model's p99 within **{st['slo_x']:g}x its isolated "
        f"time** ({slos}). Overall bound, the paper's axis: the whole mix's p99 within "
        f"{st['overall_slo_ms']:.1f} ms ({st['slo_x']:g}x the mean isolated time), which the longest "
        "models set.",
        "", *rows, "",
        *_claim_rows(s), "",
        capped_note + details + _overall_note(s) + "The paper's gap also includes its C++ dispatch path, "
        f"which virtual time at cpu_scale {st['cpu_scale']:g} does not charge."
        + (f" With a free dispatcher, {', '.join(same)} give identical points: the dispatcher adds "
           "nothing to those submission orders." if same else ""),
    ]


#: Figures before and after the two changes that moved them: the timing model of issue 21
#: and the release rule of issue 13 (Figure 1's ideal schedule: the +B rule counts the
#: candidate, the order rule keeps B's slack for the most urgent job, ties on a 1 ns
#: grid). Rows: (figure, measure, key path into its JSON, why the timing model moved it,
#: why the release rule moved it). The "before" values are commit aac29be's JSON
#: (``docs/figures/before_timing_model.json``), the middle ones the timing model's alone
#: (``docs/figures/timing_model_only.json``, the JSON of the branch that introduced it);
#: the "after" values are read from the current JSON, so they cannot drift.
MOVES: list[tuple[str, str, list, str, str]] = [
    ("calibrate", "Table 2, resnet18 (ms)", ["models", "resnet18", "simulated_ms"],
     "no fitted 48.75 us per kernel and 0.47 efficiency: the SMs' peak where enough warps are resident", "-"),
    ("calibrate", "Table 2, inceptionv3 (ms)", ["models", "inceptionv3", "simulated_ms"], "the same", "-"),
    ("calibrate", "Table 2, worst relative error", ["summary", "worst_relative_error"],
     "nothing is fitted to Table 2 any more (the fit reached 140%)", "-"),
    ("hol", "Figure 2: goodput ratio, aware over naive", ["goodput_ratio"],
     "synthetic 300 us kernels keep their time; each kernel now also waits 0.5 us of launch latency",
     "- (the aware driver is not the dispatcher)"),
    ("hol_dispatcher", "Figure 2 through the dispatcher: paella over ms-jbj", ["goodput_ratio"], "the same",
     "one-block kernels that fit never wait; the +B slack counts the candidate, a little less lookahead "
     "at the highest loads (then 4.97; 5.00 on the kernel core of issue 36, whose copies complete as "
     "one engine event instead of a copy and a marker; since session 22 each knee is refined by "
     "bisection, which finds ms-jbj's goodput at 12.9k jobs/s where the grid gave 12.2k; 4.71 "
     "before session 31's saturation rule: past 16 queued jobs the gate is lifted, and paella's "
     "knee moves from 60.7k to 59.5k jobs/s)"),
    ("hol_dispatcher_cpu1", "... with its CPU charged", ["goodput_ratio"],
     "the same, within the run-to-run noise of measured CPU time",
     "measured CPU time: varies with the host's load from run to run (then 1.01; 1.73 on the C kernel "
     "core of issue 36, docs/benchmarks.md round 11, and from the full grid of 16 loads; 2.02 in "
     "session 22: the core's cheaper passes, round 14, and each knee refined by bisection, where "
     "the grid jumped from 20k to 30k jobs/s and rounded paella's goodput down to 19.7k; 2.08 in "
     "session 25; from session 26 the buffer sets are made at registration, not in the bursts)"),
    ("short_long", "Figure 12: ResNet-18 p99, ms-jbj over paella", ["summary", "short_p99_speedup"],
     "synthetic kernels keep their Table 2 times; 0.5 us launch latency per kernel",
     "an InceptionV3 kernel that cannot start no longer waits in a hardware queue ahead of ResNet-18's next kernel"),
    ("short_long_cpu1", "... with the dispatcher's CPU charged", ["summary", "short_p99_speedup"], "the same",
     "the same, and measured CPU time"),
    ("sched_delay", "Figure 9: headroom per decision (us)", ["summary", "headroom_us"], "the same", "-"),
    ("fairness", "Figure 13: short mean at threshold 0 (ms)", ["summary", "short_mean_ms", 0], "the same", "-"),
    ("fairness", "Figure 13: short mean at threshold 256, the default (ms)", ["summary", "short_mean_ms", 5], "-",
     "SRPT's order kept by the hardware too: short jobs' kernels no longer queue behind long ones' (mean 1.75 -> 1.09 ms)"),
    ("fairness", "Figure 13: long mean at threshold 256 (ms)", ["summary", "long_mean_ms", 5], "-",
     "the price: long jobs wait for every short one (SRPT's trade-off, now exact)"),
    ("overhead", "Figure 10: MobileNetV2 simulated GPU busy (us)", ["summary", "gpu_busy_us"],
     "its isolated time under the timing model (was the fitted model's)", "-"),
    ("overhead", "Figure 10: end to end p50 (us)", ["summary", "e2e_p50_us"],
     "a shorter GPU time and a cheaper simulator (real time: it varies with the host's load)",
     "the redesign (issue 13): the CPU build runs as the simulated device's effect, plans are issued whole; "
     "session 14: the functional answer's input compare runs on a thread of its own "
     "(1.82 -> 1.36 ms, on a quieter machine too)"),
    ("overhead", "Figure 10: simulator CPU per request (us)", ["summary", "simulator_cpu_us"],
     "the engine in C; then about twice the GPU time it simulates, mostly the Python calls into it "
     "(real time: it varies with the host's load)",
     "now includes the CPU build (the device's functional effect); session 14: its "
     "input compare moved off the loop (540 -> 271 us)"),
    ("mix", "Figure 11: sustained load, paella over ms-jbj (per-model SLO)", ["summary", "load_ratio_vs_ms_jbj"],
     "2,000 requests per point (was 300), one seed for every load, only contiguous passing loads, "
     "models 3x faster alone", "none: the same sustained loads (p99 at ms-jbj's load 0.91x -> 0.94x, mean 0.98x -> 1.02x)"),
    ("mix", "Figure 11: the same under the overall p99 bound", ["summary", "overall_slo", "load_ratio_vs_ms_jbj"],
     "the same", "none"),
]


def _dig(d: dict | None, path: list):
    for k in path:
        if d is None:
            return None
        try:
            d = d[k]
        except (KeyError, IndexError, TypeError):
            return None
    return d


def _moves(figures: Path) -> list[str]:
    before = _load("before_timing_model", figures)
    if before is None:
        return []
    middle = _load("timing_model_only", figures) or {}
    rows = ["| figure | measure | before | timing model | after | why: timing model (issue 21) | "
            "why: release rule (issue 13) |", "|---|---|---:|---:|---:|---|---|"]
    fmt = lambda v: "n/a" if v is None else (f"{v:.3g}" if isinstance(v, float) else str(v))  # noqa: E731
    for name, label, path, why_model, why_rule in MOVES:
        rows.append(f"| {name} | {label} | {fmt(_dig(before.get(name), path))} | "
                    f"{fmt(_dig(middle.get(name), path))} | "
                    f"{fmt(_dig(_load(name, figures), path))} | {why_model} | {why_rule} |")
    return ["## Before and after: the timing model (issue 21) and the release rule (issue 13)", "",
            f"Every figure was re-run when the simulator's cost model (a fitted roofline) was replaced by "
            f"the timing model of docs/simulator.md, and again when the dispatcher's release rule changed "
            f"(docs/dispatcher.md: B = 0 means no kernel waits in a hardware queue; the order rule; ties "
            f"to the earlier arrival). Before: commit {before.get('commit', '?')}; timing model: "
            f"commit {middle.get('commit', '?')}, before the release rule; after: both.", "",
            *rows, ""]


def _batching(d: dict) -> list[str]:
    s = d["summary"]
    rows = ["| model | policy | max throughput unbatched (req/s) | dynamic (req/s) | ratio | "
            "load for equal-load p99 (req/s) | p99 unbatched (ms) | p99 dynamic (ms) |",
            "|---|---|---:|---:|---:|---:|---:|---:|"]
    for model, e in s["per_model"].items():
        for policy, t in e["max_throughput"].items():
            q = e["p99_at_equal_load"].get(policy) or {}
            dyn = q.get("dynamic_p99_ms")
            rows.append(f"| {model} | {policy} | {t['unbatched']:.0f} | {t['dynamic']:.0f} | "
                        f"{e['max_throughput_ratio'][policy]:.2f} | {q.get('load', float('nan')):.0f} | "
                        f"{q.get('unbatched_p99_ms', float('nan')):.2f} | "
                        f"{'n/a' if dyn is None else f'{dyn:.2f}'} |")
    dyn = d["dynamic"]
    return [
        f"One model alone on the simulated `{d['gpu']}`, compiled at batch sizes "
        f"{', '.join(map(str, d['sizes']))} (the encoder at length {d['seq_len']}); lognormal "
        f"arrivals (sigma 1.5) of one-row requests, {d['requests_per_point']} per load, swept past "
        f"saturation; dispatcher CPU charged at scale {d['cpu_scale']:g}. Unbatched: the identity "
        f"batcher (one request per job, today's path). Dynamic: Triton's semantics with "
        f"max_batch_size {dyn['max_batch_size']}, max_queue_delay_us {dyn['max_queue_delay_us']}, "
        f"{dyn['max_inflight_batches']} batches in flight (Triton's model instances). "
        f"`summary.max_throughput_ratio` (batched over unbatched at saturation, paella, the smaller "
        f"model): **{s['max_throughput_ratio']:.2f}x**.", "", *rows, "",
        "Beside the published claims, one sentence per difference:", "",
        "- *Triton's optimization guide* presents the dynamic batcher as a main lever "
        "for throughput (its Inception example serves 62.6-73.2 infer/s without it at concurrency "
        "1-2); we quote no batched figure from it that we could check. Here the encoder gains what "
        "batching promises, but ResNet-18 gains nothing: on the simulated T4 its batch-1 jobs, run "
        "concurrently by the kernel scheduler, already fill the GPU (b16 alone costs 8x b1 for 16x "
        "the rows, and concurrent b1 jobs reach the same rows per second), which real GPUs with "
        "Triton's one-job-per-instance execution do not get.",
        "- *Paella* (§8) argues dynamic batching hurts latency (the wait and the copy) and may pay "
        "only near saturation; the equal-load p99 column shows both: for ResNet-18 the batched p99 "
        "is higher at every unsaturated load, for the encoder the batched p99 is lower once "
        "unbatched jobs queue.",
        "- *DVABatch* reports up to 2.12x throughput over Triton-style batching (DelayBatch) from "
        "splitting batches by stage, and that some operators gain nothing from batching; that "
        "comparison is batched-vs-batched and is not run here (our dynamic batcher is its "
        "DelayBatch baseline).",
        "- Under `fifo` batching gains far more than under `paella`: fifo releases one job's "
        "kernels in arrival order, so concurrent batch-1 jobs overlap little and the GPU idles "
        "between small kernels; batching is then the only source of parallelism, as in the "
        "one-job-at-a-time executors the seed papers measured against.",
        "- *BatchMaker* and *TurboTransformers* batch variable-length and step-wise work; this "
        "experiment uses one fixed length, so its padding comes only from batch counts between "
        "compiled sizes (`padding_waste` of each point in the JSON), not from lengths.",
    ]


def _priority(d: dict) -> list[str]:
    s, st = d["summary"], d["setting"]
    per = s["per_mechanism"]
    label = {"paella-classes": "paella, classes + slicing (this project)", "paella": "paella, no classes",
             "ms-jbj": "ms-jbj (CUDA-MS)", "stream-priority": "CUDA stream priorities (ms-jbj)"}
    rows = [f"| {label.get(m, m)} | {p['hp_p50_ms']:.2f} | {p['hp_p99_ms']:.2f} | "
            f"{p['hp_p99_over_solo']:.2f}x | {p['be_throughput']:.1f} | {p['be_throughput_over_solo']:.2f}x |"
            for m, p in per.items()]
    ok = s.get("meets_targets")
    return [
        f"ResNet-18 (latency-critical, batch 1, lognormal arrivals sigma {st['sigma']:g} at "
        f"{st['hp_load']:.2f} of its solo capacity: {st['hp_rate']:.0f} req/s) beside ResNet-50 at batch 8 "
        f"(best-effort, {st['be_depth']} requests always outstanding), both compiled bundles timed by "
        f"the t4 cost model; {st['requests']} latency-critical requests; slices of at most "
        f"{st['slice_us']:g} us; dispatcher CPU charged at scale {st['cpu_scale']:g}. Solo: ResNet-18 p99 "
        f"{s['solo']['hp_p99_ms']:.2f} ms (isolated {s['solo']['hp_isolated_ms']:.2f} ms), ResNet-50 b8 "
        f"{s['solo']['be_throughput']:.1f} req/s.",
        "",
        "| mechanism | HP p50 (ms) | HP p99 (ms) | HP p99 / solo | BE req/s | BE / solo |",
        "|---|---:|---:|---:|---:|---:|",
        *rows,
        "",
        "| | this project | published |",
        "|---|---:|---:|",
        f"| HP p99 over solo | {s['hp_p99_over_solo']:.3f}x | Tally 1.072x (beside training); target <= 1.10x |",
        f"| BE throughput over solo | {s['be_throughput_over_solo']:.2f}x | target >= 0.60x |",
        "",
        f"Targets {'met' if ok else '**not met**'} in this run. Differences: Tally's best-effort "
        "tenant is training and its GPU an A100, ours a batch-8 inference loop on the t4 preset; "
        "Tally preempts by slicing and by unloading kernels, this project only slices and holds "
        "(blocks are never preempted), so the urgent request still waits for the blocks "
        "running when it arrives (one slice at most). CUDA stream priorities order only the "
        "blocks not yet placed: every ResNet-18 kernel still waits for a wave of ResNet-50 "
        "blocks and then shares SMs with them, and its jobs share eight high-priority streams "
        "round-robin, so a burst also queues in them: best at the median of the baselines, "
        "last at the tail.",
    ]


def _timelines(d: dict) -> list[str]:
    f1, f2 = d["figure1"], d["figure2"]
    ms = lambda xs: ", ".join(f"{x:g}" for x in xs)
    return [
        "Drawn from traces of the real dispatcher in virtual time (`dispatcher/trace.py`, the same "
        "recorder `paella trace` installs in a running daemon; `--trace-dir DIR` writes each "
        "scenario's Trace Event JSON for Perfetto). Above: the paper's Figure 1 toy (four tasks of "
        "three 1 ms kernels, each filling one of two SMs, all submitted at 0). Under `paella` the "
        f"tasks finish at {ms(f1['paella']['completion_ms'])} ms (mean "
        f"{f1['paella']['mean_ms']:g}): the ideal schedule the paper draws (3, 3, 6, 6). Under "
        f"`ms-jbj` (every task's kernels at once on its own stream) they finish at "
        f"{ms(f1['ms-jbj']['completion_ms'])} ms (mean {f1['ms-jbj']['mean_ms']:g}): the hardware "
        "interleaves the tasks, so the short ones finish late.",
        "",
        "![timelines_hol](figures/timelines_hol.png)",
        "",
        "Below: Figure 2's job (8 dependent one-block kernels of 300 us) at 30k jobs/s on the GTX "
        "1660 SUPER, 40 jobs admitted from 4 ms on. Under `paella` each job's kernels follow each "
        f"other at once (p99 {f2['paella']['p99_ms']:g} ms, {f2['paella']['jobs']} jobs); under "
        "`ms-jbj` each job's whole chain sits in one of the 32 hardware queues behind other "
        "jobs' chains, and the grey bars are jobs waiting with the GPU mostly idle (p99 "
        f"{f2['ms-jbj']['p99_ms']:g} ms).",
        *_timelines_priority(d.get("priority")),
    ]


def _timelines_priority(p: dict | None) -> list[str]:
    if not p:
        return []
    a, b = p["paella-classes"], p["paella"]
    return [
        "",
        "![timelines_priority](figures/timelines_priority.png)",
        "",
        "A 12 ms stretch of the priority experiment (a row per job, ResNet-18 red, ResNet-50 at "
        "batch 8 blue). With classes and kernel slicing (above), the best-effort jobs' slices "
        "stop while a ResNet-18 request is live and resume when it is answered: ResNet-18 "
        f"runs as if alone (p99 {a['hp_p99_ms']:g} ms in this short run). Without classes "
        "(below), SRPT still favours ResNet-18, but every one of its kernels waits behind "
        "ResNet-50 blocks released in between and shares the SMs with them (p99 "
        f"{b['hp_p99_ms']:g} ms).",
    ]


SECTIONS: list[tuple[str, str, str, Callable[[dict], list[str]]]] = [
    ("calibrate", "Table 2 under the timing model (calibrate)",
     "paella experiment calibrate --json docs/figures/calibrate.json --plot docs/figures/calibrate.png",
     _calibrate),
    ("fidelity", "Fidelity: the papers' published measurements",
     "paella experiment fidelity --json docs/figures/fidelity.json --plot docs/figures/fidelity.png",
     _fidelity),
    ("hol", "Head-of-line blocking (Figure 2)",
     "paella experiment hol --json docs/figures/hol.json --plot docs/figures/hol.png", _hol),
    ("timelines", "The schedules, drawn (Figures 1 and 2, issue 43)",
     "paella experiment timelines --json docs/figures/timelines.json --plot "
     "docs/figures/timelines.png", _timelines),
    ("hol_dispatcher", "Head-of-line blocking through the dispatcher (Figure 2, issue 4)",
     "paella experiment hol --driver dispatcher --quick --json docs/figures/hol_dispatcher.json "
     "--plot docs/figures/hol_dispatcher.png", _hol_dispatcher),
    ("hol_dispatcher_cpu1", "Head-of-line blocking through the dispatcher, its CPU charged (--cpu-scale 1)",
     "paella experiment hol --driver dispatcher --cpu-scale 1 --json "
     "docs/figures/hol_dispatcher_cpu1.json --plot docs/figures/hol_dispatcher_cpu1.png", _hol_dispatcher),
    ("short_long", "Short and long jobs (Figure 12)",
     "paella experiment short-long --quick --json docs/figures/short_long.json "
     "--plot docs/figures/short_long.png", _short_long),
    ("short_long_cpu1", "Short and long jobs, the dispatcher's CPU charged (Figure 12, --cpu-scale 1)",
     "paella experiment short-long --quick --cpu-scale 1 --json docs/figures/short_long_cpu1.json "
     "--plot docs/figures/short_long_cpu1.png", _short_long),
    ("priority", "Priorities that hold: a latency-critical tenant beside a best-effort one (issue 38)",
     "paella experiment priority --json docs/figures/priority.json --plot docs/figures/priority.png",
     _priority),
    ("priority_cpu1", "Priorities that hold, the dispatcher's CPU charged (--cpu-scale 1)",
     "paella experiment priority --cpu-scale 1 --json docs/figures/priority_cpu1.json "
     "--plot docs/figures/priority_cpu1.png", _priority),
    ("sched_delay", "Scheduling delay (Figure 9)",
     "paella experiment sched-delay --quick --json docs/figures/sched_delay.json "
     "--plot docs/figures/sched_delay.png", _sched_delay),
    ("overhead", "Overhead breakdown of one request (Figure 10)",
     "paella experiment overhead --json docs/figures/overhead.json --plot docs/figures/overhead.png",
     _overhead),
    ("mix", "Model mix (Figure 11)",
     "paella experiment mix --json docs/figures/mix.json --plot docs/figures/mix.png", _mix),
    ("cluster", "Beyond one GPU: routers over N simulated GPUs (issue 41)",
     "paella experiment cluster --json docs/figures/cluster.json --plot docs/figures/cluster.png",
     _cluster),
    ("fairness", "Fairness threshold (Figure 13)",
     "paella experiment fairness --quick --json docs/figures/fairness.json "
     "--plot docs/figures/fairness.png", _fairness),
    ("batching", "Dynamic batching under the kernel scheduler (issue 14)",
     "paella experiment batching --json docs/figures/batching.json --plot docs/figures/batching.png",
     _batching),
    ("windtunnel", "WindTunnel: pipelines translated, fine-tuned and served (Tables 5.3-5.5)",
     "paella experiment windtunnel --json docs/figures/windtunnel.json --plot docs/figures/windtunnel.png",
     _windtunnel),
    ("nimble", "Nimble: multi-stream launch plans (Table 3.1)",
     "paella experiment nimble --json docs/figures/nimble.json --plot docs/figures/nimble.png",
     _nimble),
    ("cellular", "Cellular batching: BatchMaker's LSTM, Seq2Seq and TreeLSTM (Figures 8, 11, 13 and 14)",
     "paella experiment cellular --json docs/figures/cellular.json --plot docs/figures/cellular.png",
     _cellular),
    ("orca", "Iteration-level scheduling: Orca (Figure 4.8)",
     "paella experiment orca --quick --json docs/figures/orca.json --plot docs/figures/orca.png", _orca),
    ("turbo", "TurboTransformers: variable-length batching and the chunked allocator (Figures 15-16)",
     "paella experiment turbo --json docs/figures/turbo.json --plot docs/figures/turbo.png", _turbo),
    ("dvabatch", "DVABatch against ZeroBatch and DelayBatch (DVABatch, Figures 14-16; issue 16)",
     "paella experiment dvabatch --json docs/figures/dvabatch.json --plot docs/figures/dvabatch.png",
     _dvabatch),
]


def render(figures: Path = FIGURES) -> str:
    out = ["# Experiments", "",
           "Generated by `paella experiment report` from `docs/figures/*.json`; do not edit by hand. "
           "Every run is on the simulated GPU (`sim` backend) in virtual time, except the overhead "
           "breakdown (real time, real daemon and client processes).", ""]
    for name, title, command, section in SECTIONS:
        out += [f"## {title}", "", f"Command: `{command}`", ""]
        data = _load(name, figures)
        if data is None:
            out += [f"Not run yet: `{figures / (name + '.json')}` is missing.", ""]
            continue
        if (figures / f"{name}.png").is_file():
            out += [f"![{name}](figures/{name}.png)", ""]
        out += section(data) + [""]
        if "wall_seconds" in data:
            out += [f"Running time: {data['wall_seconds']:.0f} s.", ""]
    out += _moves(figures)
    out += ["## Not reproduced yet", "",
            "- Figure 14 (client CPU per wait mode) is measured by `python -m paella.experiments.client_cpu`; "
            "its figures are in docs/service.md.", ""]
    return "\n".join(out)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="write docs/EXPERIMENTS.md from docs/figures/*.json")
    p.add_argument("--figures", default=str(FIGURES))
    p.add_argument("-o", "--out", default="docs/EXPERIMENTS.md")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    text = render(Path(args.figures))
    Path(args.out).write_text(text)
    print(f"wrote {args.out}")
    return 0
