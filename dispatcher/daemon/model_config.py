"""A model's own settings: the ``config.toml`` beside its bundle in the model repository.

::

    version = 2                   # serve this version (subfolder 2), not the latest
    tokenizer = "tokenizer.json"  # a generative model's tokenizer (Hugging Face's JSON,
                                  # beside this file): the OpenAI API then takes text

    [batching]
    batcher = "dynamic"           # a batcher by name (built-in or plug-in); default identity
    max_batch_size = 8            # ... and its options (here the dynamic batcher's)
    preferred_batch_sizes = [4, 8]
    max_queue_delay_us = 500

    [policy]
    profile_runs = 2              # profiling runs seeding each variant's SRPT estimate

    [memory]
    allocator = "chunked"         # "sets" (default): each variant its own buffer sets;
                                  # "chunked": TurboTransformers' chunk allocator shared
                                  # by all the variants (docs/turbotransformers.md)

Unknown keys are errors naming the key and the valid ones; the batcher's options are
checked against the batcher's own parameters (:mod:`paella.dispatcher.batchers`).
"""
from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paella.dispatcher.batchers import BatcherError, DEFAULT_BATCHER, check_options, options_of

CONFIG = "config.toml"
TOP_KEYS = ("version", "tokenizer", "batching", "policy", "memory")
ALLOCATORS = ("sets", "chunked")
POLICY_KEYS = {"profile_runs": int}
MAX_PROFILE_RUNS = 20


class ModelConfigError(ValueError):
    """A bad config.toml: the message names the file, the key and what is valid."""


@dataclass
class ModelConfig:
    version: int | None = None
    batcher: str = DEFAULT_BATCHER
    batcher_options: dict[str, Any] = field(default_factory=dict)
    profile_runs: int | None = None
    allocator: str = "sets"         # per-request buffers: "sets" or "chunked"
    mtime: float = 0.0              # of the file (0: none): a changed file reloads the model
    tokenizer: str = ""             # absolute path of the tokenizer.json ("" none)


def load_model_config(folder: str | Path) -> ModelConfig:
    """``folder/config.toml`` (defaults if there is none)."""
    path = Path(folder) / CONFIG
    cfg = ModelConfig()
    if not os.path.lexists(path):
        return cfg
    if not path.exists():                    # a dangling symlink or a loop: not "no file"
        raise ModelConfigError(f"{path} is a symlink that leads to no file (dangling, or a "
                               f"loop); point it at the model's TOML settings or remove it")
    if not path.is_file():                   # a fifo would block the load, a directory is
        raise ModelConfigError(f"{path} is not a regular file; make it the model's TOML "
                               f"settings or remove it")   # (was: its settings ignored)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise ModelConfigError(f"{path}: cannot read it ({e})") from None
    except tomllib.TOMLDecodeError as e:
        raise ModelConfigError(f"{path} is not valid TOML: {e}") from None
    except RecursionError:
        raise ModelConfigError(f"{path} is not valid TOML: nested too deeply to read") from None
    cfg.mtime = path.stat().st_mtime
    for key in data:
        if key not in TOP_KEYS:
            raise ModelConfigError(f"{path}: unknown key {key!r}; valid keys: "
                                   f"{', '.join(TOP_KEYS)}")
    if "version" in data:
        v = data["version"]
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ModelConfigError(f"{path}: version must be a version number (the name of "
                                   f"a subfolder, such as 2), got {v!r}")
        cfg.version = v
    if "tokenizer" in data:
        cfg.tokenizer = _tokenizer(path, data["tokenizer"])
    batching = _table(data, "batching", path)
    name = batching.pop("batcher", DEFAULT_BATCHER)
    try:
        cls = check_options(name, batching)
    except BatcherError as e:
        valid = ["batcher"]
        try:
            from paella.dispatcher.batchers import get_batcher
            valid += sorted(options_of(get_batcher(name)))
        except BatcherError:
            pass  # the name itself is bad: the message says so
        raise ModelConfigError(f"{path}: [batching] {e} (valid keys of [batching] for this "
                               f"batcher: {', '.join(valid)})") from None
    cfg.batcher, cfg.batcher_options = cls.name, batching
    policy = _table(data, "policy", path)
    for key, value in policy.items():
        if key not in POLICY_KEYS:
            raise ModelConfigError(f"{path}: unknown key {key!r} in [policy]; valid keys: "
                                   f"{', '.join(POLICY_KEYS)} (the scheduling policy itself "
                                   f"is the daemon's: [policy] of paella.toml)")
        if not isinstance(value, POLICY_KEYS[key]) or isinstance(value, bool) \
                or not 0 <= value <= MAX_PROFILE_RUNS:
            # Bounded: the runs are whole jobs on the device, in the loop, at every
            # (re)load of the model (2000 stalled every client for half a second).
            raise ModelConfigError(f"{path}: [policy] {key} must be an integer "
                                   f"0..{MAX_PROFILE_RUNS}, got {value!r}")
    cfg.profile_runs = policy.get("profile_runs")
    memory = _table(data, "memory", path)
    for key, value in memory.items():
        if key != "allocator":
            raise ModelConfigError(f"{path}: unknown key {key!r} in [memory]; valid keys: allocator")
        if value not in ALLOCATORS:
            raise ModelConfigError(f"{path}: [memory] allocator must be one of "
                                   f"{', '.join(map(repr, ALLOCATORS))}, got {value!r}")
    cfg.allocator = memory.get("allocator", "sets")
    return cfg


def _table(data: dict, key: str, path: Path) -> dict:
    t = data.get(key, {})
    if not isinstance(t, dict):
        raise ModelConfigError(f"{path}: {key!r} must be a [{key}] table, got {t!r}")
    return dict(t)


def _tokenizer(path: Path, value: Any) -> str:
    """The ``tokenizer`` file, checked to exist (its content is the front end's to read:
    the daemon never parses it)."""
    if not isinstance(value, str) or not value or "\0" in value:
        raise ModelConfigError(f"{path}: tokenizer must be the file name of a tokenizer.json "
                               f"(relative to the model's folder), got {value!r}")
    file = (path.parent / value).resolve()
    if not file.is_file():
        raise ModelConfigError(f"{path}: tokenizer {value!r} is not a file ({file}); put the "
                               f"model's tokenizer.json there or remove the key")
    return str(file)
