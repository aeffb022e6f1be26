"""``paella compile``: a zoo name or an .onnx file -> a bundle directory.

``paella compile --zoo -o DIR`` builds every Table 2 model into ``DIR/<name>`` (cached,
so a re-run only rebuilds what changed) and prints the compile-time / kernel-count
table that docs/compiler.md shows.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compile", help="compile a model into a bundle (instrumented CUDA kernels + launch plan)",
                       description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", help="zoo name (e.g. resnet18, tiny_cnn, onnx_resnet50) or path to .onnx")
    p.add_argument("-o", "--out", help="output bundle directory, made with its parents if missing "
                                         "(with --zoo: their parent directory); not needed with --list")
    p.add_argument("--arch", default="sm_75", help="CUDA arch for nvcc (default sm_75, the T4)")
    p.add_argument("--no-instrument", action="store_true", help="compile the plain kernels (no notifQ posts)")
    p.add_argument("--group", type=int, default=16, help="blocks per notification (16 default, 1 = per block)")
    p.add_argument("--zoo", action="store_true", help="compile all Table 2 models into OUT/<name>")
    p.add_argument("--force", action="store_true", help="rebuild even if a cached bundle matches")
    p.add_argument("--cache-dir", help="bundle cache (default $PAELLA_CACHE_DIR or ~/.cache/paella/bundles)")
    p.add_argument("--batch-sizes", type=_sizes, default=None, metavar="1,2,4,8",
                   help="one variant per batch size (zoo models with a batch parameter, ONNX "
                        "models with a dynamic batch axis; default for those: 1,2,4,8)")
    p.add_argument("--seq-lens", type=_sizes, default=None, metavar="32,64,128",
                   help="length buckets: one variant per length (and batch size) for models "
                        "with a length axis (bert_encoder, ONNX with a dynamic axis 1)")
    p.add_argument("--streams", choices=("single", "nimble"), default="single",
                   help="the launch plan's streams: single (default: one stream, plan order) or "
                        "nimble (independent branches on their own streams, ordered by events; "
                        "docs/nimble.md)")
    p.add_argument("--stages", default=None, metavar="N",
                   help="cut the compiled model into N DVABatch stages (after fusion: between fused "
                        "operators, where the preferred batch size changes, then balanced in "
                        "simulated time); one variant per stage and batch size (docs/dvabatch.md)")
    p.add_argument("--stage-gpu", default="t4", metavar="PRESET",
                   help="the simulated GPU preset --stages profiles the kernels on (default t4)")
    p.add_argument("--list", action="store_true", help="list the zoo's model names and exit")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=_compile)


#: The variants an ONNX model with a dynamic batch axis gets without --batch-sizes.
DEFAULT_BATCH_SIZES = (1, 2, 4, 8)
#: The largest batch size or length bucket a variant may have: past it a tensor's element
#: count leaves TVM's 32-bit indices, and a kernel's work the bundle's sanity bounds.
MAX_SIZE = 65536


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        sizes = ()
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas "
                                         f"(e.g. 1,2,4,8), got {text!r:.80}")
    if sizes[-1] > MAX_SIZE:
        raise argparse.ArgumentTypeError(f"{sizes[-1]} is too large: each size must be at most "
                                         f"{MAX_SIZE}")
    return sizes


def _load_model(spec: str, batch_sizes=None, seq_lens=None):
    """The model, or a list of models (one per batch size x length bucket)."""
    from paella.models import zoo
    from paella.models.onnx_models import dynamic_axes, load_onnx
    onnx = spec.endswith(".onnx") or Path(spec).is_file()
    if onnx and batch_sizes is None and 0 in dynamic_axes(spec):
        batch_sizes = DEFAULT_BATCH_SIZES
    if batch_sizes is None and seq_lens is None:
        return load_onnx(spec) if onnx else zoo.get(spec)
    load = (lambda b, s: load_onnx(spec, batch=b, seq_len=s)) if onnx else \
        (lambda b, s: zoo.get(spec, batch=b, seq_len=s))
    return [load(b, s) for s in (seq_lens or (None,)) for b in (batch_sizes or (None,))]


def _stages(args: argparse.Namespace) -> int:
    """``--stages``, checked here (not by argparse) so that a bad value is a
    ``paella: error:`` naming the fix."""
    from paella.cli import CLIError
    from paella.gpus import PRESETS
    if args.stages is None:
        return 0
    try:
        n = int(args.stages)
    except ValueError:
        n = 0
    if n < 1:
        raise CLIError(f"--stages {args.stages!r}: give the number of stages as a positive integer "
                       f"(e.g. --stages 4)")
    if args.zoo:
        raise CLIError("--stages cuts one model: give MODEL instead of --zoo")
    if args.stage_gpu not in PRESETS:
        raise CLIError(f"--stage-gpu {args.stage_gpu!r} is not a GPU preset; use one of {', '.join(PRESETS)}")
    return n


def _compile(args: argparse.Namespace) -> int:
    from paella.bundle import BundleError
    from paella.cli import CLIError
    from paella.models import zoo
    from paella.models.onnx_models import ModelSourceError

    from .build import CompileError, compile_bundle
    from .instrument import InstrumentOptions
    if args.list:
        print("\n".join(zoo.names()))
        return 0
    try:
        options = InstrumentOptions(enabled=not args.no_instrument, group=args.group)
    except ValueError as e:
        raise CLIError(str(e)) from None
    progress = (lambda _m: None) if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    if args.zoo == bool(args.model):
        raise CLIError("give either MODEL or --zoo")
    if not args.out:
        raise CLIError("give the output directory with -o DIR (e.g. -o bundles/"
                       f"{args.model or 'zoo'})")
    stages = _stages(args)
    names = zoo.TABLE2 if args.zoo else [args.model]
    rows = []
    for name in names:
        out = Path(args.out) / name if args.zoo else Path(args.out)
        if args.zoo:
            out.parent.mkdir(parents=True, exist_ok=True)
        progress(f"== {name} -> {out}")
        t0 = time.perf_counter()
        try:
            model = _load_model(name, args.batch_sizes, args.seq_lens)
            compile_bundle(model, out, arch=args.arch, options=options, progress=progress,
                           cache_dir=args.cache_dir, force=args.force, streams=args.streams,
                           stages=stages, stage_gpu=args.stage_gpu)
        except (CompileError, ModelSourceError, zoo.UnknownModel, ValueError, BundleError) as e:
            raise CLIError(str(e)) from None
        manifest = json.loads((out / "manifest.json").read_text())
        for v in manifest["variants"]:
            label = name if len(manifest["variants"]) == 1 else f"{name} {v['name']}"
            rows.append((label, manifest["compile_seconds"], len(v["kernels"]),
                         sum(1 for o in v["plan"] if o["op"] == "launch"), time.perf_counter() - t0))
    if args.zoo or not args.quiet:
        print("| model | compile time (s) | distinct kernels | launches per request |")
        print("|---|---:|---:|---:|")
        for name, secs, kernels, launches, _wall in rows:
            print(f"| {name} | {secs:.1f} | {kernels} | {launches} |")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m paella.compiler_pass.cli``: the compile command alone (no other components)."""
    from paella.cli import CLIError
    parser = argparse.ArgumentParser(prog="paella")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["compile", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args)
    except CLIError as e:
        print(f"paella: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
