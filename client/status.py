"""``paella status``: what a running daemon is doing (models, clients, requests in flight,
per-SM occupancy), asked over its control socket with one STATUS message.

It needs no shared-memory segment (STATUS is allowed before HELLO), so it works against
a daemon whose client limit is reached, and it costs the daemon one small reply.
"""
from __future__ import annotations

import argparse
import json

from paella import wire
from paella.client.control import ask
from paella.client.errors import DaemonError, DaemonUnavailable


def daemon_status(path: str | None = None, timeout: float = 5.0) -> dict:
    """The daemon's STATUS reply (see docs/service.md, "Status"), as a dict."""
    msg, _ = ask(wire.encode(wire.STATUS), wire.STATUS_REPLY, path, timeout)
    return msg["status"]


def _size(nbytes: int) -> str:
    """Bytes in the largest binary unit that keeps a leading digit (2.0 MiB, 64 B)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.1f} {unit}"
    return f"{nbytes} B"


def format_status(st: dict) -> str:
    """The human-readable report of ``paella status``."""
    lines = [f"daemon pid {st['pid']} on {st['socket']}, up {st['uptime_s']:.0f} s, backend "
             f"{st['backend']}{' (draining)' if st.get('draining') else ''}",
             f"in flight: {st['in_flight']} request(s); {st['stats'].get('requests', 0)} "
             f"accepted since start, {st['stats'].get('rejected', 0)} rejected",
             f"models ({len(st['models'])}):"]
    for m in st["models"]:
        mem = m.get("device_memory_bytes")      # (daemons before session 12 lack it)
        lines.append(f"  {m['id']:>3} {m['name']:<24} {m['variants']} variant(s), "
                     f"{m.get('in_flight', 0)} in flight"
                     + (f", {_size(mem)} on the GPU" if mem else ""))
    cls = st.get("classes")
    if cls and cls["accepted"]:
        lines.append("priority classes (accepted): " + ", ".join(
            f"{k}: {v}" for k, v in cls["accepted"].items())
            + f"; {cls['clamped']} clamped to their tenant's highest"
            + ("; in flight: " + ", ".join(f"{k}: {v}" for k, v in cls["in_flight"].items())
               if cls.get("in_flight") else ""))
    lines.append(f"clients ({len(st['clients'])}):")
    for c in st["clients"]:
        lines.append(f"  {c['id']:>3} pid {c['pid']:<8} uid {c['uid']:<6} {c['mode']:<8} "
                     f"{c['in_flight']} in flight")
    d = st.get("dispatcher")
    if d:
        occ = d["sm_occupancy"]
        mean = sum(occ) / len(occ) if occ else 0.0
        lines.append(f"GPU {d['gpu']} ({d['sm_count']} SMs), policy {d['policy']}: "
                     f"{d['resident_blocks']} blocks resident, mean SM occupancy {mean:.0%}, "
                     f"notifQ depth {d['notifq_depth']}, {d['policy_fallbacks']} policy "
                     f"fallback(s)")
        lines.append("  per-SM occupancy: " + " ".join(f"{x:.0%}" for x in occ))
        if "models" in d:                    # (daemons before session 10 lack these)
            total = d.get("device_memory_total_bytes")
            lines.append(f"  {d['models']} dispatcher model(s) (variants, internal models, "
                         f"replaced ones still finishing), device memory "
                         f"{d['device_memory_bytes'] / 2**20:.1f} MiB"
                         + (f" of {total / 2**30:.1f} GiB" if total else ""))
        if d.get("memory_waits") or d.get("memory_failures"):
            lines.append(f"  device memory full: {d['memory_waits']} job(s) waited for "
                         f"memory, {d['memory_failures']} request(s) failed for want of it")
        e = d.get("effects")
        if e:                                # (the simulated GPU's answer workers)
            lines.append(f"  answer workers: {e['alive']} of {e['workers']} alive, {e['queued']} "
                         f"queued, {e['running']} computing, {e.get('awaiting_jobs', 0)} job(s) "
                         f"and {e['held_kernels']} kernel(s) waiting for theirs; "
                         f"{e['completed']} computed, {e['failed']} failed "
                         f"({e['crashed']} crashed, {e['timed_out']} timed out)"
                         + (f", {e['evicted']} refused for another tenant's"
                            if e.get("evicted") else ""))
    return "\n".join(lines)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="what a running daemon is doing",
                       description="Models, clients, requests in flight and per-SM occupancy "
                                   "of a running daemon.")
    p.add_argument("--socket", help="control socket (default $PAELLA_SOCKET or "
                                    "/run/paella/paella.sock)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait (default 5)")
    p.add_argument("--json", action="store_true", help="print the reply as JSON")
    p.set_defaults(func=_status)


def _status(args: argparse.Namespace) -> int:
    from paella.cli import CLIError
    if not 0 < args.timeout <= 86400:            # (also refuses nan and inf)
        raise CLIError(f"--timeout must be a number of seconds in (0, 86400], got {args.timeout}")
    try:
        st = daemon_status(args.socket, args.timeout)
    except (DaemonUnavailable, DaemonError) as e:
        raise CLIError(str(e)) from None
    print(json.dumps(st, indent=1) if args.json else format_status(st))
    return 0
