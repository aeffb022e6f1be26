"""Process set-up for the daemon: the garbage collector kept off the start-up heap, the
service manager's notifications, the loop's core and real-time priority."""
from __future__ import annotations

import gc
import logging
import os
import resource
import socket

from .config import ConfigError

log = logging.getLogger("paella.daemon")


def freeze_heap() -> int:
    """Put what start-up loaded (TVM, the bundles, the models: ~100k objects) out of the
    cyclic collector's reach, after collecting what is already garbage. A full collection
    over that heap takes ~50 ms here, a stall every request in flight would pay whenever
    the loop's own allocations trigger one; frozen, the collector only walks what the
    loop allocated since. It unfreezes first, so that cycles frozen earlier and dropped
    since can be collected. Returns the objects frozen."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def freeze_new_objects() -> int:
    """After a reload: collect and freeze only what was allocated since the last freeze
    (the new models, the loop's own objects). Unfreezing first, as :func:`freeze_heap`
    does, would walk the whole ~100k-object heap (46-124 ms of stalled loop measured
    after a reload). A replaced version frozen earlier still goes: the dispatcher
    retires it once its jobs end, and its objects (adaptor, bundle, CPU build) hold no
    reference cycle, so reference counting frees them without the collector
    (tests/service/test_service_bundles.py). Returns the
    garbage objects collected. (Not ``gc.get_freeze_count()``: it walks the frozen
    heap, 8-12 ms.)"""
    n = gc.collect()
    gc.freeze()
    return n


def sd_notify(message: str) -> bool:
    """Send one sd_notify datagram to $NOTIFY_SOCKET; False when not under systemd."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr[0] == "@":
        addr = "\0" + addr[1:]      # abstract namespace
    try:
        # Non-blocking: a manager that does not read its socket (its queue holds
        # net.unix.max_dgram_qlen datagrams, 10 by default) must not stop the loop; the
        # message is dropped and said so. Serving clients matters more than telling it.
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC
                           | socket.SOCK_NONBLOCK) as s:
            s.connect(addr)
            s.send(message.encode())
    except OSError as e:
        why = "its queue is full (the manager does not read it)" \
            if isinstance(e, BlockingIOError) else str(e)
        log.warning("sd_notify %r to %s dropped: %s", message.split("\n")[0], addr, why)
        return False
    return True


def pin_and_prioritize(cpu: str, rt_priority: int) -> int | None:
    """Pin the loop to its core and ask for SCHED_FIFO; say what was granted. Returns
    the loop's core (None: not pinned)."""
    core = None
    if cpu != "none":
        allowed = sorted(os.sched_getaffinity(0))
        core = allowed[-1] if cpu == "auto" else int(cpu)
        if core not in allowed:
            raise ConfigError(f"cpu {core} is not among this process's cores {allowed}")
        os.sched_setaffinity(0, {core})
        log.info("dispatcher loop pinned to core %d (of %s)", core, allowed)
    else:
        log.info("dispatcher loop not pinned (cpu = none)")
    if rt_priority <= 0:
        log.info("real-time priority off (rt_priority = 0): normal scheduling")
        return core
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(rt_priority))
        log.info("running SCHED_FIFO priority %d", rt_priority)
    except PermissionError:
        log.warning("SCHED_FIFO priority %d not permitted (needs CAP_SYS_NICE or "
                    "LimitRTPRIO); running with normal scheduling", rt_priority)
    return core


def raise_fd_limit() -> int:
    """Raise the soft descriptor limit to the hard one (as Go's runtime does at start):
    each client holds two descriptors, and the per-uid share of them is half the soft
    limit (``paella.dispatcher.frontend``), so a soft limit of 1024 under a hard one of
    524288 (systemd's defaults) would cap the daemon for nothing. Returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as e:
            log.info("could not raise the descriptor limit from %d to %d: %s", soft, hard, e)
    return soft
