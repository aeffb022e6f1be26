"""What one batched step launches: kernel lists per step kind and batch size.

Two sources, one shape (:class:`StepKernels`: kernel records plus the launch order):

* :func:`from_bundle` -- a compiled step (an RNN cell at one batch size: one variant of
  the bundle :func:`compile_steps` builds): TVM's own kernels, their grids, FLOPs and
  bytes, in the order the Relax VM launches them. The simulated GPU times them with its
  cost model like any bundle's.
* :func:`transformer_iteration` -- a transformer iteration under selective batching,
  from the model's shapes: the dense kernels (QKV, output projection, MLP, LM head) over
  the flattened tokens of the batch, and one ragged attention launch whose blocks are
  (request, head) pairs over each request's own context (what vLLM's paged attention
  kernel does). FLOPs and bytes are counted from the shapes; the GEMM tiling (64 x 64
  tiles, 256 threads, 64 registers) is a typical cuBLAS-like choice, labelled as such.

Steps are compiled per batch size as the variants of one bundle (the batching layer's
``paella compile --batch-sizes``), by :func:`compile_steps` alone.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from paella.dispatcher.devices.base import KernelInfo

#: GEMM tiling of the analytic kernels (a common cuBLAS-like tile; an assumption)
TILE, GEMM_THREADS, GEMM_REGS = 64, 256, 64
ATTN_THREADS, ATTN_REGS = 128, 64


@dataclass(frozen=True)
class Launch:
    kernel: str
    grid: tuple[int, ...]
    block: tuple[int, ...]
    dyn_smem: int = 0


@dataclass
class StepKernels:
    """The kernels of one step variant and the launches it makes, in order; ``copies``
    (``("d2h" | "h2d", bytes)``) go first on the same stream, so the kernels wait for
    them (a KV cache swapped out for this step's newcomers, or back in)."""
    name: str
    kernels: list[KernelInfo]
    launches: list[Launch]
    copies: tuple[tuple[str, int], ...] = ()

    def repeated(self, n: int, name: str | None = None) -> "StepKernels":
        """The same launches ``n`` times (a padded graph of ``n`` cells)."""
        return StepKernels(name or f"{self.name}x{n}", self.kernels, self.launches * n)

    def named(self, tag: str) -> "StepKernels":
        """The same with every kernel's name prefixed by ``tag/``: variants of one bundle
        (and cells of different bundles) share kernel names, which one task running
        several of them (:func:`concat`) must tell apart."""
        from dataclasses import replace
        return StepKernels(f"{tag}/{self.name}", [replace(k, name=f"{tag}/{k.name}") for k in self.kernels],
                           [replace(ln, kernel=f"{tag}/{ln.kernel}") for ln in self.launches], self.copies)


class NotBuilt(RuntimeError):
    """A step's bundle is not in the compile cache, and building it was not asked for."""


def compile_steps(make: Callable[[int], Any], batches: Sequence[int], out_dir: str | Path,
                  build: bool = True) -> dict[int, StepKernels]:
    """Compile the step ``make(batch)`` (a ModelDef) at every batch size as one bundle of
    variants (the batching layer's ``paella compile --batch-sizes``; the compile cache
    makes repeats free) and return each variant's kernels by batch size. ``build=False``:
    raise :class:`NotBuilt` unless the compile cache holds the bundle (a daemon's plug-in,
    whose calls must be short)."""
    from paella.bundle import load_bundle
    from paella.compiler_pass.build import compile_bundle, is_cached
    models = []
    for b in batches:
        m = make(b)
        m.batch = b
        models.append(m)
    if not build and not is_cached(models):
        raise NotBuilt(f"{models[0].name} at batch sizes {list(batches)} is not compiled yet")
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    bundle = load_bundle(compile_bundle(models, Path(out_dir) / models[0].name))
    return {b: from_bundle(bundle, i) for i, b in enumerate(batches)}


def from_bundle(bundle: Any, variant: int = 0) -> StepKernels:
    v = bundle.variants[variant]
    kernels = [KernelInfo(k.name, k.registers, static_smem=k.static_smem, flops=k.flops, bytes=k.bytes)
               for k in v.kernels]
    launches = [Launch(op.kernel, tuple(op.grid), tuple(op.block), op.dyn_smem)
                for op in v.plan if op.op == "launch"]
    return StepKernels(f"{bundle.model}/{v.name}", kernels, launches)


def _gemm(name: str, m: int, k: int, n: int) -> tuple[KernelInfo, Launch]:
    flops = 2.0 * m * k * n
    nbytes = 4.0 * (m * k + k * n + m * n)
    grid = max(1, math.ceil(m / TILE) * math.ceil(n / TILE))
    return (KernelInfo(name, GEMM_REGS, static_smem=2 * TILE * 32 * 4, flops=flops, bytes=nbytes),
            Launch(name, (grid,), (GEMM_THREADS,)))


def bucket(n: int) -> int:
    """The power of two at or above ``n``: token and context buckets, as an engine
    captures one CUDA graph per bucket (bounded variants, bounded SRPT profiles)."""
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def transformer_iteration(cfg: Any, new_tokens: list[int], contexts: list[int]) -> StepKernels:
    """One selectively batched iteration of a GPT (``cfg``: d, n_layer, n_head, vocab):
    request i brings ``new_tokens[i]`` tokens and attends over ``contexts[i]`` keys.
    Layers repeat the same kernels; the LM head runs on each request's last token only.
    Tokens and the total context are rounded up to their buckets (:func:`bucket`), and
    the attention's work is counted from the buckets: ``4 d C T / b`` FLOPs (exact for
    decode iterations, where each request brings one token; a prompt of n tokens counts
    n^2 key-query pairs where causality needs half) and every cached key and value read
    once."""
    T, b, d = bucket(sum(new_tokens)), len(new_tokens), cfg.d
    C = bucket(sum(contexts))
    attn_flops = 4.0 * d * C * T / b
    attn_bytes = 4.0 * (2 * C * d + 2 * T * d)
    tag = f"t{T}_b{b}_c{C}"
    rows = [_gemm(f"qkv_{tag}", T, d, 3 * d),
            (KernelInfo(f"attn_{tag}", ATTN_REGS, flops=attn_flops, bytes=attn_bytes),
             Launch(f"attn_{tag}", (b * cfg.n_head,), (ATTN_THREADS,))),
            _gemm(f"oproj_{tag}", T, d, d), _gemm(f"fc_{tag}", T, d, 4 * d),
            _gemm(f"proj_{tag}", T, 4 * d, d)]
    head = _gemm(f"lmhead_{tag}", b, d, cfg.vocab)
    kernels = [k for k, _ in rows] + [head[0]]
    launches = [ln for _, ln in rows] * cfg.n_layer + [head[1]]
    return StepKernels(f"iter_{tag}", kernels, launches)


def request_level_generation(cfg: Any, prompts: list[int], outputs: list[int]) -> StepKernels:
    """A request-level batch run to completion: one prefill of every prompt padded to the
    longest, then ``max(outputs)`` decode iterations of the whole batch (finished rows
    keep computing padding, as FasterTransformer's batch does)."""
    b, p = len(prompts), max(prompts)
    parts = [transformer_iteration(cfg, [p] * b, [p] * b)]
    for i in range(1, max(outputs)):
        parts.append(transformer_iteration(cfg, [1] * b, [p + i] * b))
    return concat(f"gen_b{b}_p{p}_o{max(outputs)}", parts)


def concat(name: str, parts: Sequence[StepKernels]) -> StepKernels:
    """One task running ``parts`` one after the other (a padded graph of several cell
    types, a request-level batch's iterations): their kernels once each, every launch.
    Kernels of one name must be the same kernel (:meth:`StepKernels.named` tells others
    apart), and ``name`` must name this list of kernels (the runtime loads one module
    per name)."""
    kernels = {k.name: k for sk in parts for k in sk.kernels}
    return StepKernels(name, list(kernels.values()), [ln for sk in parts for ln in sk.launches])
