"""Names of the daemon's POSIX shared-memory segments, and the start-up sweep.

A daemon killed with SIGKILL (or by the OOM killer, or a power cut of its cgroup) cannot
unlink its segments: they stay in ``/dev/shm`` until reboot. So every segment a daemon
creates carries its owner in its name::

    paella.<pid>.t<start>.<what>.<random>

``<pid>`` is the creating process, ``t<start>`` its start time (field 22 of
``/proc/<pid>/stat``, clock ticks since boot). The start time is the marker that tells a
dead predecessor from a live process that happens to have the same pid: in a container a
restarted daemon often gets the pid its predecessor had, and on a busy host pids wrap.

:func:`sweep` runs once at start-up, before the daemon creates any segment, and unlinks
the segments whose owner is dead. It also recognises the older ``paella.<pid>.<...>``
names (no marker; an older daemon's client segments), judged by the pid alone. It never
touches a segment of a live owner, nor one another user owns.
"""
from __future__ import annotations

import os
import re

SHM_DIR = "/dev/shm"
_NAME = re.compile(r"paella\.(\d+)\.(?:t(\d+)\.)?")


def start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot; None if it does not exist (or
    there is no /proc to ask)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: count from the last ')'.
    return int(stat.rsplit(b")", 1)[1].split()[19])


def segment_name(what: str) -> str:
    """A fresh name (with the leading ``/`` posix_ipc wants) for a segment of this process."""
    pid = os.getpid()
    return f"/paella.{pid}.t{start_time(pid) or 0}.{what}.{os.urandom(4).hex()}"


def owner_alive(pid: int, start: int | None) -> bool:
    """Whether the process that made a segment named with ``pid`` (and ``start``) lives."""
    if pid == os.getpid():
        # This process creates its segments after the sweep: one named with its pid
        # now is a predecessor's that had the same pid (the start time says so too).
        return start is not None and start == start_time(pid)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass                     # it exists, as another user
    if start is None:
        return True              # an old name: the pid is all we can check
    now = start_time(pid)
    return now is None or now == start


def stale_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Names in ``shm_dir`` that a dead daemon made and this user owns."""
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return []                # no /dev/shm here: nothing to sweep
    uid = os.geteuid()
    stale = []
    for name in names:
        m = _NAME.match(name)
        if m is None:
            continue
        try:
            if os.lstat(os.path.join(shm_dir, name)).st_uid != uid:
                continue         # another user's: not ours to judge
        except FileNotFoundError:
            continue             # gone meanwhile
        start = int(m.group(2)) if m.group(2) is not None else None
        if not owner_alive(int(m.group(1)), start):
            stale.append(name)
    return sorted(stale)


def sweep(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink the segments dead daemons left behind; returns the names removed."""
    removed = []
    for name in stale_segments(shm_dir):
        try:
            os.unlink(os.path.join(shm_dir, name))
        except FileNotFoundError:
            continue             # another daemon's sweep got there first
        except OSError:
            continue             # not removable by us (sticky /dev/shm): leave it
        removed.append(name)
    return removed
