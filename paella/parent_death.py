"""Child processes that end with the process that started them.

A benchmark or test that starts a daemon and then dies (SIGKILL, a crash, a CI job's
timeout) would otherwise leave it running: a daemon under SCHED_FIFO that spins
(``--idle spin``) then starves every other process pinned to its core, on this kind
of 2-core machine for good. Launchers pass :func:`end_with_parent` as ``preexec_fn``:
the kernel sends the child SIGTERM (so it drains and removes its segments as on any
stop) when the launching thread exits. A daemon run by systemd needs none of this.
"""
from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def end_with_parent(sig: int = signal.SIGTERM):
    """A ``preexec_fn`` that makes the child receive ``sig`` when its parent exits.
    Linux only; elsewhere it does nothing."""
    parent = os.getpid()

    def preexec() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        except (OSError, AttributeError):
            return
        if os.getppid() != parent:      # the parent died before the prctl: too late for it
            os.kill(os.getpid(), sig)
    return preexec
