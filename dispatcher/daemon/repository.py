"""The model repository: reading bundles off the dispatcher loop.

Loading a bundle is slow: the manifest and params are read, the adaptor is built and,
on the simulator, the bundle's CPU build is loaded (a shared object: ~1 s for big
models) to answer the profiling runs. Done inside the loop, a SIGHUP reload stalled
every client for as long (189 ms worst latency against 19 ms). So the daemon splits a
load in two:

* :func:`scan` does everything that needs no loop state, in any thread: it lists the
  repository (one folder per model: the folder name is the model name, ``config.toml``
  its settings, versions as numbered subfolders), keeps what did not change, and turns
  each new or changed model into a :class:`Prepared` model (one adaptor per compiled
  variant, built and warmed; its batcher built). A bad model fails alone, with its
  reason; the others go on.
* the daemon's loop then *swaps* (registers the prepared models with the dispatcher and
  replaces the model table) between two iterations, so clients see either the old set
  of models or the new one.

:class:`BackgroundScan` runs :func:`scan` in a thread for a reload. The thread holds the
GIL only for Python work: reading a shared object and TVM's CPU kernels release it.

Model control (``paella model``: REPOSITORY_INDEX, LOAD, UNLOAD) uses the same two
halves for one model: :func:`scan_one` reads one folder a client named (checked first by
:func:`name_problem`: a name, never a path) and :func:`model_folders` lists the
repository, both in a :class:`Background` thread.
"""
from __future__ import annotations

import itertools
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from paella.plugins import PLUGIN_ERRORS

log = logging.getLogger("paella.repository")

#: Generation numbers of registered bundles: a changed bundle registers under a new
#: name (``model#gen``), so that jobs of the old version keep their own model.
_generations = itertools.count(1)


@dataclass
class Prepared:
    """A new or changed model, read and warmed off the loop: what the swap registers."""
    directory: str             # the model's folder (its name)
    model: str
    key: tuple                 # (cache key, manifest mtime, config mtime, bundle dir): "changed"
    bundle: Any                # paella.bundle.Bundle
    adaptors: list             # one JobAdaptor per variant, ready for register_model
    label: str                 # the dispatcher's name for this version: model#gen
    seconds: float             # how long preparing it took
    config: Any = None         # its ModelConfig (config.toml)
    batcher: Any = None        # its batcher, built for its variants (None: built once profiled)
    version: str = ""          # the version folder served ("" for an unversioned bundle)

    @property
    def variant_names(self) -> list[str]:
        if self.bundle is None:              # a standalone scheduler's model
            return [f"{self.config.batcher} (no bundle)"]
        return [v.name for v in self.bundle.variants]

    def model_info(self, model_id: int) -> Any:
        """What clients see of it: the bundle's variants, or the io a standalone
        scheduler (``SchedulerBatcher.standalone``) defines."""
        from paella import wire

        from .bundles import model_info_from_bundle
        if self.bundle is None:
            variants = self.batcher.client_variants()
            try:                             # what every client's HELLO will carry
                info = wire.ModelInfo(model_id, self.model, tuple(variants))
                wire.ModelInfo.from_dict(info.to_dict())
                if not variants or not all(isinstance(v, wire.VariantInfo) for v in variants):
                    raise TypeError("not a non-empty list of them")
            except Exception as e:  # noqa: BLE001 - a plug-in may return anything
                raise ValueError(f"scheduler {self.config.batcher!r}: client_variants() must "
                                 f"return a list of wire.VariantInfo, got {variants!r:.120} "
                                 f"({type(e).__name__}: {e})") from None
        else:
            info = model_info_from_bundle(model_id, self.bundle, self.model)
        tokenizer = getattr(self.config, "tokenizer", "")
        return replace(info, tokenizer=tokenizer) if tokenizer else info


@dataclass
class Scan:
    """One pass over the repository."""
    path: str
    prepared: list[Prepared] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)       # directory -> unchanged model
    failed: dict[str, str] = field(default_factory=dict)     # directory -> why
    skipped: list[str] = field(default_factory=list)         # folders of ``skip``: not read
    interrupted: bool = False                                # stop() said so midway
    seconds: float = 0.0

    @property
    def found(self) -> int:
        """Models in the repository (served, kept or failed)."""
        return len(self.prepared) + len(self.kept) + len(self.failed)


#: A version subfolder's name: ASCII digits (str.isdigit also takes "²", which int() refuses).
_VERSION = re.compile(r"[0-9]{1,18}")

#: The longest model name, in bytes: a folder name's limit (NAME_MAX).
MAX_NAME_BYTES = 255
#: Model folders an error message names at most (a repository may hold thousands).
_LISTED_NAMES = 20


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a model folder of the repository, or None. A client's
    LOAD names a folder *in* the repository: this runs before the name touches the file
    system, so no path (``../x``, ``a/b``), no hidden folder and nothing the scan would
    refuse as a model name reaches it."""
    if not name:
        return "it is empty"
    try:
        size = len(os.fsencode(name))
    except UnicodeEncodeError:               # (a lone surrogate JSON may carry)
        return "it is not a valid file name"
    if size > MAX_NAME_BYTES:
        return f"it is {size} bytes long; a model folder's name has at most {MAX_NAME_BYTES}"
    if "/" in name or name in (".", ".."):
        return "it is a path; name a folder of the model repository"
    if name.startswith("."):
        return "folders whose name starts with '.' are not models (the repository skips them)"
    if not name.isprintable() or name != name.strip():
        return "it has control characters or surrounding spaces"
    return None


def _holds_model(folder: str) -> bool:
    """Whether ``folder`` looks like a model folder: a bundle, a config.toml, or a
    version subfolder holding a bundle (names and file types only, nothing is read)."""
    if any(os.path.lexists(os.path.join(folder, f)) for f in ("manifest.json", "config.toml")):
        return True
    try:
        entries = os.listdir(folder)
    except OSError:
        return False                         # unreadable: the scan reports it if it can
    return any(_VERSION.fullmatch(e) and os.path.isfile(os.path.join(folder, e, "manifest.json"))
               for e in entries)


def model_folders(path: str) -> list[str]:
    """The names of the model folders of the repository ``path``, sorted: what
    REPOSITORY_INDEX lists. Reads names and file types only (a thread runs it anyway: the
    repository may sit on slow storage)."""
    return [d for d in sorted(os.listdir(path))
            if not d.startswith(".") and os.path.isdir(os.path.join(path, d))
            and _holds_model(os.path.join(path, d))]


def _listing(path: str) -> str:
    """The model folders of ``path`` for an error message, cut to a few."""
    try:
        names = model_folders(path)
    except OSError as e:
        return f"the repository cannot be listed ({e.strerror or e})"
    if not names:
        return "it holds no model folder"
    more = f", ... ({len(names) - _LISTED_NAMES} more)" if len(names) > _LISTED_NAMES else ""
    return "its model folders: " + ", ".join(names[:_LISTED_NAMES]) + more


def bundle_folder(folder: str, pinned: int | None) -> tuple[str, str] | None:
    """The bundle a model folder serves and its version: the folder itself if it holds a
    bundle, else its latest numbered subfolder holding one (or ``pinned``); None if the
    folder has no bundle at all (not a model)."""
    manifest = os.path.join(folder, "manifest.json")
    if os.path.lexists(manifest) and not os.path.isfile(manifest):
        raise ValueError(f"{manifest} is not a regular file")
    if pinned is None and os.path.isfile(manifest):
        return folder, ""
    named: dict[int, str] = {}               # version -> its subfolder's name
    for d in sorted(os.listdir(folder)):
        if not (_VERSION.fullmatch(d) and os.path.isfile(os.path.join(folder, d, "manifest.json"))):
            if d.isascii() and d.isdigit() and len(d) > 18:
                raise ValueError(f"subfolder {d[:40]} is not a version number of at most 18 "
                                 f"digits; rename it")
            continue
        other = named.setdefault(int(d), d)
        if other != d:
            raise ValueError(f"subfolders {other} and {d} are both version {int(d)}; "
                             f"rename or remove one")
    versions = sorted(named)
    if pinned is not None:
        if pinned not in versions:
            raise ValueError(f"config.toml pins version {pinned}, but the folder has "
                             f"{'versions ' + ', '.join(map(str, versions)) if versions else 'no version subfolders'}; "
                             f"fix the pin or add the version")
        return os.path.join(folder, named[pinned]), str(pinned)
    if not versions:
        return None
    return os.path.join(folder, named[versions[-1]]), str(versions[-1])


def scan(path: str, known: dict[str, tuple], make_adaptor: Callable[[Any, str, int], Any],
         stop: Callable[[], bool] = lambda: False, reserved: tuple[str, ...] = (), *,
         only: str | None = None, taken: dict[str, str] | None = None,
         skip: frozenset[str] = frozenset()) -> Scan:
    """Read every model folder under ``path``: the folder name is the model name, its
    ``config.toml`` its settings, its bundle either in the folder or in numbered
    version subfolders (the latest served, or the one config.toml pins).

    ``known``: model name -> key of the version being served; a model whose key is
    unchanged is only listed in ``kept``. ``make_adaptor(bundle, label, variant)`` builds
    each variant's adaptor; if it has a ``warm()`` method, that runs here too.
    ``reserved``: names already taken (the built-in models). ``stop()`` is asked between
    models (SIGTERM during start-up). ``only``: read that folder alone (a LOAD), with
    ``taken`` the names other folders hold (lower case -> folder), since the others are
    not listed. ``skip``: folders not to read (models unloaded explicitly), listed in
    ``skipped``. Touches no loop state.
    """
    from paella.bundle import BundleError, load_bundle
    from paella.dispatcher.batchers import (BatcherError, ModelVariants, VariantSpec, get_batcher,
                                            make_batcher)
    from paella.dispatcher.chunked_buffers import ChunkedMemory

    from .model_config import ModelConfigError, load_model_config
    t0 = time.monotonic()
    out = Scan(path)
    seen: dict[str, str] = {r.lower(): "the daemon's built-in models" for r in reserved}
    seen.update(taken or {})
    for d in [only] if only is not None else sorted(os.listdir(path)):
        folder = os.path.join(path, d)
        if d.startswith(".") or not os.path.isdir(folder):
            continue
        if d in skip:
            seen.setdefault(d.lower(), folder)
            out.skipped.append(folder)
            continue
        if not d.isprintable() or d != d.strip():
            # (a newline in a model's name split the daemon's log lines; a blank name)
            out.failed[folder] = (f"the folder name {d!r} is not a model name: it has "
                                  f"control characters or surrounding spaces; rename it")
            continue
        if stop():
            out.interrupted = True
            break
        t1 = time.monotonic()
        try:
            cfg = load_model_config(folder)
            found = bundle_folder(folder, cfg.version)
            kind = get_batcher(cfg.batcher)
            standalone = getattr(kind, "standalone", False)
            if found is None and standalone:
                model = d
                if model.lower() in seen:
                    raise ValueError(f"model name {model!r} is already taken by "
                                     f"{seen[model.lower()]}; rename one folder")
                seen[model.lower()] = folder
                key = ("standalone", cfg.mtime, folder)
                if known.get(model) == key:
                    out.kept[folder] = model
                    continue
                # A scheduler that defines its own io (Orca): a config.toml and no bundle.
                options = dict(cfg.batcher_options)
                if getattr(kind, "wants_folder", False):   # (files it names are the folder's)
                    if "folder" in options:
                        raise ValueError("[batching] folder is the model's own folder, which "
                                         "the daemon passes; remove it from config.toml")
                    options["folder"] = folder
                batcher = make_batcher(cfg.batcher, ModelVariants(model, (VariantSpec(0, 1, 0, model),)),
                                       options)
                out.prepared.append(Prepared(folder, model, key, None, [], f"{model}#{next(_generations)}",
                                             time.monotonic() - t1, cfg, batcher))
                continue
            if found is None:
                if os.path.isfile(os.path.join(folder, "config.toml")):
                    raise ValueError("the folder has a config.toml but no bundle (no "
                                     "manifest.json in it or in a version subfolder)")
                continue                          # not a model folder
            if standalone:
                raise ValueError(f"batcher {cfg.batcher!r} serves a model of its own (its io, "
                                 f"no bundle), but this folder holds a bundle: remove the "
                                 f"bundle, or choose a batcher for bundles")
            bdir, version = found
            model = d
            if model.lower() in seen:
                raise ValueError(f"model name {model!r} is already taken by "
                                 f"{seen[model.lower()]}; model names are folder names and "
                                 f"must differ (case aside): rename one folder")
            seen[model.lower()] = folder
            bundle = load_bundle(bdir)
            key = (bundle.manifest.cache_key, os.path.getmtime(bundle.path / "manifest.json"),
                   cfg.mtime, bdir)
            if known.get(model) == key:
                out.kept[folder] = model
                continue
            specs = tuple(VariantSpec(k, v.rows, v.seq_len, v.name, stage=v.stage)
                          for k, v in enumerate(bundle.variants))
            # Built now, so a bad option fails here, before any variant is registered
            # (each reload would otherwise register and profile them again, and keep
            # them). One that plans by cost is built on placeholder costs only to check
            # its options; the real one once the variants are profiled
            # (Executors.register_variants).
            if kind.needs_costs:                  # (the options checked, the batcher dropped)
                make_batcher(cfg.batcher, ModelVariants(
                    model, tuple(replace(v, cost_s=1e-3) for v in specs)), cfg.batcher_options)
                batcher = None
            else:
                batcher = make_batcher(cfg.batcher, ModelVariants(model, specs),
                                       cfg.batcher_options)
            label = f"{model}#{next(_generations)}"
            adaptors = []
            for k in range(len(bundle.variants)):
                adaptor = make_adaptor(bundle, label, k)
                warm = getattr(adaptor, "warm", None)
                if warm is not None:
                    warm()
                adaptors.append(adaptor)
            if cfg.allocator == "chunked":        # one chunk list for all the variants
                limit = max(getattr(a, "max_buffer_sets", 1) for a in adaptors)
                memory = ChunkedMemory(model, limit=limit)
                for a in adaptors:
                    a.memory = memory
        except PLUGIN_ERRORS as e:  # a bad model fails alone, with its reason
            plain = isinstance(e, (BundleError, ModelConfigError, BatcherError, ValueError))
            out.failed[folder] = str(e) if plain else f"{type(e).__name__}: {e}"
            if isinstance(e, MemoryError):
                out.failed[folder] += (" (the host has not the memory this bundle asks for: "
                                       "check io_bytes and the buffers' nbytes in its "
                                       "manifest.json)")
            continue
        out.prepared.append(Prepared(folder, model, key, bundle, adaptors, label,
                                     time.monotonic() - t1, cfg, batcher, version))
    out.seconds = time.monotonic() - t0
    return out


class NoModelFolder(LookupError):
    """A LOAD named no model folder of the repository (the message lists them)."""


def scan_one(path: str, name: str, known: dict[str, tuple],
             make_adaptor: Callable[[Any, str, int], Any], reserved: tuple[str, ...] = (),
             taken: dict[str, str] | None = None) -> Scan:
    """:func:`scan` of the one model folder ``name`` (a LOAD; ``name`` passed
    :func:`name_problem`). :class:`NoModelFolder`, naming the repository's model
    folders, when ``path`` has no model folder of that name."""
    folder = os.path.join(path, name)
    if not os.path.isdir(folder):
        raise NoModelFolder(f"the model repository {path} has no folder {name!r}; "
                            f"{_listing(path)}")
    out = scan(path, known, make_adaptor, reserved=reserved, only=name, taken=taken)
    if not out.found:
        raise NoModelFolder(f"{folder} is not a model folder (no manifest.json in it or in a "
                            f"version subfolder, and no config.toml); {_listing(path)}")
    return out


class Background:
    """``fn(*args, **kwargs)`` in a thread of its own. ``done`` turns True (then
    ``notify()`` is called, to wake the loop) once ``result`` or ``error`` is set."""

    def __init__(self, notify: Callable[[], None], fn: Callable[..., Any], *args: Any,
                 thread_name: str = "paella-model-load", **kwargs: Any):
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = False
        self._notify = notify
        self._fn, self._args, self._kwargs = fn, args, kwargs
        # A daemon thread: a SIGTERM must not wait for a slow model to finish loading.
        self.thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.result = self._fn(*self._args, **self._kwargs)
        except BaseException as e:  # noqa: BLE001 - reported to the loop, which logs it
            self.error = e
        self.done = True
        self._notify()


class BackgroundScan(Background):
    """:func:`scan` in a thread of its own (a SIGHUP reload): ``result`` is its Scan."""

    def __init__(self, notify: Callable[[], None], *args: Any, **kwargs: Any):
        super().__init__(notify, scan, *args, **kwargs)
