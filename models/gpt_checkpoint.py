"""A user's GPT-2-family checkpoint in the safetensors format, as :mod:`.gpt`'s weights.

The file is what Hugging Face's ``GPT2LMHeadModel.save_pretrained`` writes (and what
the ``gpt2`` repositories ship as ``model.safetensors``): tensors named ``wte.weight``,
``wpe.weight``, ``h.{i}.ln_1.weight``, ``h.{i}.attn.c_attn.weight`` ... ``ln_f.bias``,
with or without the ``transformer.`` prefix. GPT-2's ``Conv1D`` layers store their
weights ``[in, out]``, which is :class:`.gpt.Block`'s layout, so nothing is transposed.
The LM head is tied to ``wte`` (an ``lm_head.weight`` must equal it). The causal-mask
buffers some files carry (``attn.bias``, ``attn.masked_bias``) are skipped.

The shapes give the configuration: the vocabulary and ``d`` from ``wte``, the context
from ``wpe``, the layers from the ``h.{i}`` present. The number of heads is not in the
file: it is ``n_head`` of the model's ``config.toml``, by default ``d / 64`` (every
GPT-2 size has 64-wide heads).

What is checked, each failure a :class:`CheckpointError` naming the tensor and the
reason: the file can be read (a truncated or corrupt file is refused by ``safetensors``
itself), every tensor is present, every shape is the configuration's, every dtype is
float32 or float16 (converted to float32). Read with the ``safetensors`` package
(``pip install 'paella-py[serve]'``).

One difference from GPT-2 itself: :class:`.gpt.Block` uses the erf form of GELU, GPT-2
was trained with its tanh approximation (``gelu_new``); the two differ by at most about
1e-3 per activation, so a real GPT-2 checkpoint's greedy tokens can differ from
``transformers``' where two logits are that close.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

from .gpt import GPTConfig

#: Our parameter names (:class:`.gpt.GPTIteration`) by GPT-2's, per block.
BLOCK_NAMES = {
    "ln_1.weight": "ln1_scale", "ln_1.bias": "ln1_shift",
    "attn.c_attn.weight": "w_qkv", "attn.c_attn.bias": "b_qkv",
    "attn.c_proj.weight": "w_o", "attn.c_proj.bias": "b_o",
    "ln_2.weight": "ln2_scale", "ln_2.bias": "ln2_shift",
    "mlp.c_fc.weight": "w_fc", "mlp.c_fc.bias": "b_fc",
    "mlp.c_proj.weight": "w_proj", "mlp.c_proj.bias": "b_proj",
}
TOP_NAMES = {"wte.weight": "wte", "wpe.weight": "wpe",
             "ln_f.weight": "lnf_scale", "ln_f.bias": "lnf_shift"}
SKIPPED = re.compile(r"^h\.\d+\.attn\.(bias|masked_bias)$")
DTYPES = (np.float32, np.float16)


class CheckpointError(ValueError):
    """A checkpoint that cannot be served; the message names the file and the reason."""


def gpt2_names(cfg: GPTConfig) -> dict[str, str]:
    """GPT-2's tensor name for each of our parameter names."""
    names = {ours: theirs for theirs, ours in TOP_NAMES.items()}
    for i in range(cfg.n_layer):
        names.update({f"blocks.{i}.{ours}": f"h.{i}.{theirs}" for theirs, ours in BLOCK_NAMES.items()})
    return names


def expected_shapes(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape, by our name (:class:`.gpt.GPTIteration`'s)."""
    d = cfg.d
    shapes = {"wte": (cfg.vocab, d), "wpe": (cfg.n_ctx, d), "lnf_scale": (d,), "lnf_shift": (d,)}
    per = {"ln1_scale": (d,), "ln1_shift": (d,), "w_qkv": (d, 3 * d), "b_qkv": (3 * d,),
           "w_o": (d, d), "b_o": (d,), "ln2_scale": (d,), "ln2_shift": (d,),
           "w_fc": (d, 4 * d), "b_fc": (4 * d,), "w_proj": (4 * d, d), "b_proj": (d,)}
    for i in range(cfg.n_layer):
        shapes.update({f"blocks.{i}.{k}": v for k, v in per.items()})
    return shapes


def save_checkpoint(path: str | Path, cfg: GPTConfig, weights: dict[str, np.ndarray],
                    prefix: str = "") -> None:
    """Write ``weights`` (by our names) as a GPT-2 safetensors file (tests, and a model
    made here served as a user's)."""
    from safetensors.numpy import save_file
    names = gpt2_names(cfg)
    save_file({prefix + names[k]: np.ascontiguousarray(v) for k, v in weights.items()}, str(path),
              metadata={"format": "pt"})


def load_checkpoint(path: str | Path, n_head: int = 0) -> tuple[GPTConfig, dict[str, np.ndarray]]:
    """The configuration and the float32 weights (by our names) of the GPT-2 checkpoint
    at ``path``; ``n_head`` 0: ``d / 64``. Raises :class:`CheckpointError`."""
    path = Path(path)
    try:
        from safetensors import SafetensorError, safe_open
    except ImportError:
        raise CheckpointError("reading a safetensors checkpoint needs the safetensors package "
                              "(pip install 'paella-py[serve]')") from None
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist (or is not a file)")
    raw: dict[str, np.ndarray] = {}
    try:
        with safe_open(str(path), framework="numpy") as f:
            for key in f.keys():
                raw[key] = f.get_tensor(key)
    except (SafetensorError, OSError, ValueError, TypeError) as e:
        size = os.path.getsize(path)
        raise CheckpointError(f"checkpoint {path} ({size} bytes) cannot be read as safetensors: "
                              f"{e} (a truncated or corrupt file?)") from None
    prefixed = [k for k in raw if k.startswith("transformer.")]
    if prefixed:
        raw = {k[len("transformer."):] if k.startswith("transformer.") else k: v for k, v in raw.items()}
    for key in ("wte.weight", "wpe.weight"):
        if key not in raw:
            raise CheckpointError(f"checkpoint {path}: tensor {key!r} is missing (not a GPT-2 "
                                  f"checkpoint? it holds {_some(raw)})")
        if raw[key].ndim != 2:
            raise CheckpointError(f"checkpoint {path}: tensor {key!r} has shape "
                                  f"{tuple(raw[key].shape)}; expected 2 dimensions")
    vocab, d = raw["wte.weight"].shape
    n_ctx = raw["wpe.weight"].shape[0]
    if vocab < 1 or d < 1 or n_ctx < 1:
        raise CheckpointError(f"checkpoint {path}: vocabulary {vocab}, d {d} and context {n_ctx} "
                              f"(from 'wte.weight' and 'wpe.weight') must each be at least 1")
    layers = {int(m.group(1)) for k in raw if (m := re.match(r"^h\.(\d+)\.", k))}
    n_layer = len(layers)
    if n_layer == 0:
        raise CheckpointError(f"checkpoint {path} has no transformer blocks (no 'h.0.*' tensors)")
    if layers != set(range(n_layer)):
        # (checked before anything is sized by the largest index: h.99999999999 alone
        # would otherwise make the expected names of that many layers)
        missing = min(set(range(n_layer)) - layers)
        raise CheckpointError(f"checkpoint {path}: its transformer blocks are not numbered "
                              f"h.0 .. h.{n_layer - 1} ({n_layer} blocks; h.{missing} is missing, "
                              f"the largest index is h.{max(layers)})")
    heads = n_head or d // 64
    if heads < 1 or d % heads:
        raise CheckpointError(f"checkpoint {path}: n_head = {heads} does not divide d = {d}; set "
                              f"n_head in config.toml")
    cfg = GPTConfig(vocab=int(vocab), d=int(d), n_layer=n_layer, n_head=heads, n_ctx=int(n_ctx))
    names = gpt2_names(cfg)
    weights: dict[str, np.ndarray] = {}
    for ours, shape in expected_shapes(cfg).items():
        theirs = names[ours]
        a = raw.pop(theirs, None)
        if a is None:
            raise CheckpointError(f"checkpoint {path}: tensor {theirs!r} is missing ({n_layer} "
                                  f"layers, d {d})")
        if tuple(a.shape) != shape:
            raise CheckpointError(f"checkpoint {path}: tensor {theirs!r} has shape "
                                  f"{tuple(a.shape)}; expected {shape} (vocabulary {vocab}, d {d})")
        if a.dtype not in DTYPES:
            raise CheckpointError(f"checkpoint {path}: tensor {theirs!r} has dtype {a.dtype}; "
                                  f"expected float32 (or float16)")
        weights[ours] = np.ascontiguousarray(a, np.float32)
    lm = raw.pop("lm_head.weight", None)
    if lm is not None and not (lm.shape == weights["wte"].shape
                               and np.array_equal(lm.astype(np.float32), weights["wte"])):
        raise CheckpointError(f"checkpoint {path}: 'lm_head.weight' is not tied to 'wte.weight'; "
                              f"this GPT computes its logits with wte")
    extra = [k for k in raw if not SKIPPED.match(k)]
    if extra:
        raise CheckpointError(f"checkpoint {path}: unexpected tensors {_some(dict.fromkeys(extra))} "
                              f"(a GPT-2 checkpoint of {n_layer} layers has none)")
    return cfg, weights


def _some(d: dict) -> str:
    keys = sorted(d)
    more = f" and {len(keys) - 5} more" if len(keys) > 5 else ""
    return ", ".join(repr(k) for k in keys[:5]) + more
