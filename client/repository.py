"""The model repository of a running daemon: list its models, load one, unload one (the
daemon side of Triton's model-repository extension; ``paella model``).

Each call is one control message (REPOSITORY_INDEX, LOAD, UNLOAD) on a connection of its
own, without a session (no HELLO, no segment), like ``paella status``. Loading and
unloading change what every tenant is served, so only the daemon's owner, root and the
users of its ``[access] control_users`` may; the index is open to every client the
daemon admits. docs/service.md, "Model control".

* :func:`index` lists every model folder of the repository with its state: ``READY``,
  ``UNAVAILABLE`` (``reason`` says why: ``"unloaded"``, a load error, ...), ``LOADING``
  or ``UNLOADING`` (unloaded, its requests in flight still finishing).
* :func:`load` reads one folder again (the daemon does it off its loop) and returns once
  the model is served; requests running on the previous version finish on it.
* :func:`unload` returns once the model is out of the daemon's table: new requests for it
  are refused as for an unknown model, those in flight finish. The unload holds across
  reloads (SIGHUP) until a :func:`load` of that model.

Each raises :class:`~paella.client.errors.DaemonError` when the daemon refuses, with its
code (``permission``, ``bad_name``, ``unknown_model``, ``load_failed``, ``builtin``,
``busy``, ...) and message, or :class:`~paella.client.errors.DaemonUnavailable` when no
daemon answers in time. A timeout does not cancel a load: the daemon finishes it.
"""
from __future__ import annotations

import argparse
import json
import sys

from paella import wire
from paella.client.control import ask
from paella.client.errors import DaemonError, DaemonUnavailable


def index(path: str | None = None, timeout: float = 5.0) -> list[dict]:
    """Every model folder of the daemon's repository (and every model it still serves
    from a folder since removed), sorted by name: ``{"name", "version", "state",
    "reason"}`` each. A daemon without a repository answers an empty list."""
    msg, _ = ask(wire.encode(wire.REPOSITORY_INDEX), wire.REPOSITORY_INDEX_REPLY, path,
                 timeout)
    models = msg["models"]
    if not all(isinstance(m, dict) for m in models):
        raise DaemonUnavailable(f"the daemon's repository index is malformed: "
                                f"{json.dumps(models)[:200]}")
    return models


def load(name: str, path: str | None = None, timeout: float = 120.0) -> None:
    """Load (or reload) the model folder ``name`` of the daemon's repository; returns once
    it is served (a folder unchanged since its last load: at once)."""
    _control(wire.LOAD, wire.LOAD_REPLY, name, path, timeout)


def unload(name: str, path: str | None = None, timeout: float = 30.0) -> None:
    """Stop serving the model ``name``; returns once new requests for it are refused."""
    _control(wire.UNLOAD, wire.UNLOAD_REPLY, name, path, timeout)


def _control(kind: int, want: int, name: str, path: str | None, timeout: float) -> dict:
    if not isinstance(name, str):
        raise TypeError(f"a model name is a str, got {type(name).__name__}")
    msg, _ = ask(wire.encode(kind, {"name": name}), want, path, timeout)
    return msg["model"]


# --- paella model ----------------------------------------------------------------------
def format_index(models: list[dict]) -> str:
    """The table ``paella model index`` prints."""
    if not models:
        return "no model folder in the daemon's repository"
    width = max(4, *(len(m["name"]) for m in models))
    lines = [f"{'NAME':<{width}}  VERSION  {'STATE':<11}  REASON"]
    lines += [f"{m['name']:<{width}}  {m['version']:<7}  {m['state']:<11}  {m['reason']}".rstrip()
              for m in models]
    return "\n".join(lines)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("model", help="list, load and unload the models of a running "
                                     "daemon's repository",
                       description="The model repository of a running daemon: its model "
                                   "folders and their states (index), load or reload one "
                                   "(load), stop serving one (unload; it stays unloaded "
                                   "across reloads until loaded). Loading and unloading "
                                   "need the daemon's owner, root or [access] control_users.")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--socket", help="control socket (default $PAELLA_SOCKET or "
                                         "/run/paella/paella.sock)")
    common.add_argument("--timeout", type=float, help="seconds to wait for the answer "
                        "(default 5 for index, 120 for load, 30 for unload)")
    i = actions.add_parser("index", parents=[common], help="the repository's models and "
                                                           "their states")
    i.add_argument("--json", action="store_true", help="print the index as JSON")
    i.set_defaults(func=_index, default_timeout=5.0)
    for name, func, timeout, what in (
            ("load", _load, 120.0, "load (or reload) a model folder of the repository"),
            ("unload", _unload, 30.0, "stop serving a model (its requests in flight finish)")):
        a = actions.add_parser(name, parents=[common], help=what, description=what)
        a.add_argument("name", metavar="NAME", help="the model: its folder's name")
        a.set_defaults(func=func, default_timeout=timeout)


def _timeout(args: argparse.Namespace) -> float:
    from paella.cli import CLIError
    t = args.default_timeout if args.timeout is None else args.timeout
    if not 0 < t <= 86400:                       # (also refuses nan and inf)
        raise CLIError(f"--timeout must be a number of seconds in (0, 86400], got {t}")
    return t


def _refused(e: DaemonError) -> int:
    """The daemon refused: the operation failed (exit 1). No daemon at all is a usage
    error (exit 2, as for ``paella status``): a script tells them apart."""
    print(f"paella: error: {e}", file=sys.stderr)
    return 1


def _index(args: argparse.Namespace) -> int:
    ok, models = _ask(args, index)
    if ok:
        print(json.dumps(models, indent=1) if args.json else format_index(models))
    return 0 if ok else 1


def _load(args: argparse.Namespace) -> int:
    ok, _ = _ask(args, load, args.name)
    if ok:
        print(f"loaded {args.name}")
    return 0 if ok else 1


def _unload(args: argparse.Namespace) -> int:
    ok, _ = _ask(args, unload, args.name)
    if ok:
        print(f"unloaded {args.name}: new requests for it are refused; those in flight finish")
    return 0 if ok else 1


def _ask(args: argparse.Namespace, fn, *names: str) -> tuple[bool, object]:
    """``fn(*names, socket, timeout)``: (True, its result); a refusal printed, (False,
    None); no daemon at all a CLIError (exit 2)."""
    from paella.cli import CLIError
    try:
        return True, fn(*names, args.socket, _timeout(args))
    except DaemonUnavailable as e:
        raise CLIError(str(e)) from None
    except DaemonError as e:
        _refused(e)
        return False, None
