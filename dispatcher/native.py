"""The dispatcher's compiled modules (``dispatcher/*.c``), imported with an error that
says how to build them.

They are built by ``pip install -e .`` (``make install`` does it), which needs a C
compiler and the Python headers. Running from a source tree that was never installed,
or after editing a ``.c`` file without reinstalling, would otherwise fail with a bare
"No module named ..." far from its cause.
"""
from __future__ import annotations

import importlib
from types import ModuleType

#: The compiled modules (setup.py builds one per ``dispatcher/<name>.c``, and the
#: simulator's engine and comparison thread, ``dispatcher/devices/sim/*.c``).
MODULES = ("_tracker", "_pqueue", "_replay", "_kcore", "devices.sim._engine", "devices.sim._offload")


def load(name: str) -> ModuleType:
    """``paella.dispatcher.<name>``, or ImportError naming the fix."""
    full = f"paella.dispatcher.{name}"
    try:
        return importlib.import_module(full)
    except ImportError as e:
        missing = getattr(e, "name", None)
        if missing and not full.startswith(missing) and not missing.startswith(full):
            # A Python dependency of the package holding the module is absent (a client-only
            # install has no posix_ipc, greenlet...): that is an install, not a build, problem.
            raise ImportError(
                f"paella.dispatcher.{name} needs the Python package {missing!r}, which is not "
                f"installed; the daemon's dependencies come with the [serve] extra: "
                f"pip install 'paella-py[serve]' (make install takes every extra)") from e
        raise ImportError(
            f"the dispatcher's compiled module paella.dispatcher.{name} "
            f"(dispatcher/{name.replace('.', '/')}.c) "
            f"is not built or does not load ({e}); build it with `make install` or "
            f"`pip install -e .` in the project directory (needs gcc and the Python headers, "
            f"python3-dev)") from e


def status() -> dict[str, str | None]:
    """Per compiled module: None if it loads, else why not (for ``paella doctor``)."""
    out: dict[str, str | None] = {}
    for name in MODULES:
        try:
            load(name)
            out[name] = None
        except ImportError as e:
            out[name] = str(e)
    return out
