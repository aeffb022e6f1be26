"""Compile one model into a bundle directory (the body of ``paella compile``).

Stages, each reported to ``progress``:

1. Relax CUDA pipeline (legalize, fuse, DLight schedules, static memory plan);
2. TIR lowering with the Paella pipeline; the host functions are captured right
   after ``SplitHostDevice`` (they say which kernels each PrimFunc launches);
3. device finalization + instrumentation, CUDA codegen with the header prepended;
4. nvcc: PTX, cubin, and ptxas's registers / static shared memory per kernel;
5. the launch plan (:mod:`.plan`), kernel records, manifest;
6. the CPU (llvm) build for reference outputs; params.

Everything is written into a temporary sibling directory and renamed into place at
the end, so a failure never leaves a half-written bundle. Bundles are cached by a
content hash of the model, the options and the compiler's own sources.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Callable

import numpy as np
import tvm
from tvm import relax, tirx

from paella.bundle import (FORMAT_VERSION, MANIFEST, KernelArg, KernelSpec, Manifest, Variant, check_variant,
                           manifest_from_dict)
from paella.models.base import ModelDef

from . import nvcc
from .instrument import (INSTRUMENTED_ATTR, LAUNCH_ID_PARAM, NOTIFQ_PARAM, InstrumentOptions,
                         is_device_kernel, override_global_func,
                         paella_tir_pipeline, postproc_hook)
from .kernels import HostPlan, PlanError, host_plan, kernel_params
from .plan import PlanResult, build_plan
from .safe_ops import make_safe

Progress = Callable[[str], None]
FILES = {"cuda_source": "kernels.cu", "ptx": "kernels.ptx", "cubin": "kernels.cubin",
         "params": "params.npz", "cpu_lib": "cpu.so", "cpu_params": "cpu_params.json",
         "fused_cpu": "fused_cpu.so"}
#: a __global__ function *definition* (TVM also emits forward declarations ending in ';')
_GLOBAL_FN = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\s*\([^)]*\)\s*\{")


#: What TVM raises when it cannot lower or build a model.
_TVM_ERRORS = (tvm.error.InternalError, tvm.error.OpError, tvm.error.DiagnosticError)


class CompileError(Exception):
    """The model cannot be compiled into a bundle; the message says why and what to do."""


@dataclass
class GpuBuild:
    source: str
    device_funcs: dict[str, tirx.PrimFunc]
    host_plans: dict[str, HostPlan]
    flops: dict[str, float]                  # per PrimFunc


def gpu_target(arch: str) -> tvm.target.Target:
    return tvm.target.Target({"kind": "cuda", "arch": nvcc.check_arch(arch)}, host={"kind": "llvm"})


def _used_primfuncs(lowered: tvm.IRModule, entry: relax.Function) -> tvm.IRModule:
    """Only the PrimFuncs the entry calls: an unused kernel must not be in the source."""
    used: dict[str, tvm.ir.GlobalVar] = {}

    def visit(e):
        if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.GlobalVar):
            used[e.op.name_hint] = e.op
    relax.analysis.post_order_visit(entry, visit)
    funcs = {gv: lowered[gv] for gv in used.values() if isinstance(lowered[gv], tirx.PrimFunc)}
    return tvm.IRModule(funcs)


def _flops(tir_mod: tvm.IRModule, progress: Progress) -> dict[str, float]:
    """TVM's FLOP estimate per PrimFunc; 0 (with a warning) where it cannot estimate.

    Call it on *unscheduled* PrimFuncs: after DLight's schedules, the estimate counts
    the arithmetic of every thread of a cross-thread reduction and inflates many
    kernels by orders of magnitude (a 1x1 convolution scheduled one block per output
    element came out 30x too large)."""
    from tvm.s_tir.analysis import estimate_tir_flops
    out = {}
    for gv, f in tir_mod.functions.items():
        if not isinstance(f, tirx.PrimFunc):
            continue
        try:
            out[gv.name_hint] = float(estimate_tir_flops(tvm.IRModule({"main": f})))
        except _TVM_ERRORS as e:
            progress(f"warning: no FLOP estimate for {gv.name_hint} ({str(e).splitlines()[0]}); recorded as 0")
            out[gv.name_hint] = 0.0
    return out


def cuda_relax_pipeline(target: tvm.target.Target) -> tvm.transform.Pass:
    """TVM's default Relax CUDA pipeline (``tvm/relax/backend/cuda/pipeline.py``) with one
    change: DLight's ``ApplyDefaultSchedule`` runs our rule list
    (:func:`.schedules.cuda_schedule_rules`: :class:`.schedules.SmallReduction`, then TVM's
    default rules in TVM's order). Every other pass is taken from TVM's own lists, in order."""
    from tvm.relax.backend.cuda import pipeline as cuda
    from tvm.s_tir import dlight as dl

    from .schedules import cuda_schedule_rules

    legalize = list(cuda.legalize_passes(target))
    at = [i for i, p in enumerate(legalize) if p.info.name == "ApplyDefaultSchedule"]
    if len(at) != 1:
        raise CompileError(f"internal: TVM's CUDA legalize passes have {len(at)} ApplyDefaultSchedule "
                           f"passes ({[p.info.name for p in legalize]}), expected one "
                           "(TVM version mismatch? paella needs apache-tvm 0.27)")
    legalize[at[0]] = dl.ApplyDefaultSchedule(*cuda_schedule_rules())
    passes = (cuda.library_dispatch_passes(target) + legalize + cuda.dataflow_lower_passes(target)
              + cuda.finalize_passes(target))

    @tvm.transform.module_pass(opt_level=0, name="PaellaRelaxCUDAPipeline")
    def _pipeline(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        with target:
            return tvm.transform.Sequential(passes)(mod)
    return _pipeline


def relax_pipeline(mod: tvm.IRModule, target: tvm.target.Target,
                   progress: Progress) -> tuple[tvm.IRModule, dict[str, float], tvm.IRModule]:
    """:func:`cuda_relax_pipeline`, plus the FLOPs of each fused PrimFunc taken just
    before DLight schedules it (see :func:`_flops`), and the module at that point (its
    fused, unscheduled PrimFuncs: what the CPU replay of a plan calls)."""
    flops: dict[str, float] = {}
    fused: dict[str, tvm.IRModule] = {}

    @tvm.instrument.pass_instrument
    class FlopsBeforeSchedule:
        def run_before_pass(self, m, info):
            if "ApplyDefaultSchedule" in info.name and not flops:
                flops.update(_flops(m, progress))
                fused["mod"] = tvm.IRModule({gv: f for gv, f in m.functions.items()
                                             if isinstance(f, tirx.PrimFunc)})

    with target, tvm.transform.PassContext(instruments=[FlopsBeforeSchedule()]):
        lowered = cuda_relax_pipeline(target)(mod)
    if not flops:
        raise CompileError("internal: the Relax pipeline ran no DLight ApplyDefaultSchedule pass "
                           "(TVM version mismatch? paella needs apache-tvm 0.27)")
    return lowered, flops, fused["mod"]


def _build_fused_cpu(fused: tvm.IRModule, calls, path: Path) -> None:
    """The llvm build of the unscheduled fused PrimFuncs the plan calls, each exported
    under its name (DLight keeps the names), for the CPU replay of the plan
    (:meth:`paella.bundle.Bundle.run_stage_cpu`). Unoptimized: 7x quicker to build (0.4 s against 3 s for the
    small ResNet-152-like net), and LLVM's vectorizer sometimes emits IR its own
    verifier rejects ("Instruction does not dominate all uses", a batch-4 conv)."""
    names = {c.primfunc for c in calls}
    mod = tvm.IRModule({gv: f.with_attr("global_symbol", gv.name_hint)
                        for gv, f in fused.functions.items() if gv.name_hint in names})
    tvm.compile(mod, target=tvm.target.Target({"kind": "llvm", "opt-level": 0})).export_library(str(path))


def lower_gpu(tir_mod: tvm.IRModule, target: tvm.target.Target, options: InstrumentOptions,
              flops: dict[str, float], progress: Progress = lambda _m: None) -> GpuBuild:
    """TIR lowering + codegen of the model's PrimFuncs; no host code is compiled."""
    from tvm.tirx.build import split_host_device_mods
    snapshot: dict[str, tvm.IRModule] = {}

    @tvm.instrument.pass_instrument
    class CaptureHost:
        def run_after_pass(self, mod, info):
            if info.name.endswith("SplitHostDevice"):
                snapshot["mod"] = mod

    lower, _host, finalize_device = paella_tir_pipeline(options.enabled)
    mod = tirx.transform.BindTarget(target)(tir_mod)
    with tvm.transform.PassContext(opt_level=3, instruments=[CaptureHost()]):
        with target:
            mod = lower(mod)
    if "mod" not in snapshot:
        raise CompileError("internal: the TIR pipeline has no SplitHostDevice pass to capture "
                           "(TVM version mismatch? paella needs apache-tvm 0.27)")
    split = snapshot["mod"]
    host_plans = {gv.name_hint: host_plan(f, gv.name_hint) for gv, f in split.functions.items()
                  if not is_device_kernel(f) and gv.name_hint in {g.name_hint for g in tir_mod.functions}}
    _host_mod, device_mods = split_host_device_mods(mod)
    if len(device_mods) != 1:
        raise CompileError(f"expected one CUDA device module, got {len(device_mods)}")
    (dev_target, dev_mod), = device_mods.items()
    with tvm.transform.PassContext(opt_level=3):
        dev_mod = finalize_device()(dev_mod)
    # We compile with nvcc ourselves; stop TVM from invoking NVRTC on this machine.
    with postproc_hook(options), override_global_func(
            "tvm_callback_cuda_compile", lambda _prev: (lambda code, *a: b"")):
        rt = tvm.get_global_func("target.build.cuda")(dev_mod, dev_target)
    device_funcs = {gv.name_hint: f for gv, f in dev_mod.functions.items() if is_device_kernel(f)}
    return GpuBuild(rt.inspect_source(), device_funcs, host_plans, flops)


def global_functions(source: str) -> list[str]:
    """Names of the ``__global__`` functions in a CUDA source."""
    return _GLOBAL_FN.findall(source)


def _kernel_specs(gpu: GpuBuild, plan: PlanResult, resources_: dict[str, nvcc.KernelResources],
                  instrumented: bool) -> list[KernelSpec]:
    specs: dict[str, KernelSpec] = {}
    # A PrimFunc's FLOPs are shared among the kernels *one call* of it launches, by
    # threads; a PrimFunc called several times (repeated layers) is not divided by
    # its call count, so each distinct kernel is counted once.
    threads_per_func: dict[str, int] = {}
    seen: set[str] = set()
    for ln in plan.launches:
        if ln.kernel not in seen:
            seen.add(ln.kernel)
            threads_per_func[ln.primfunc] = threads_per_func.get(ln.primfunc, 0) + thread_count_of(ln)
    for ln in plan.launches:
        if ln.kernel in specs:
            continue
        func = gpu.device_funcs[ln.kernel]
        params = [p for p in kernel_params(func) if p.name not in (NOTIFQ_PARAM, LAUNCH_ID_PARAM)]
        res = resources_.get(ln.kernel)
        if res is None:
            raise CompileError(f"ptxas reported nothing for kernel {ln.kernel}")
        share = thread_count_of(ln) / max(1, threads_per_func[ln.primfunc])
        nbytes = sum(v.nbytes for v in ln.views if v is not None)
        specs[ln.kernel] = KernelSpec(
            name=ln.kernel, grid=list(ln.grid), block=list(ln.block), dyn_smem=ln.dyn_smem,
            static_smem=res.static_smem, registers=res.registers,
            flops=gpu.flops.get(ln.primfunc, 0.0) * share, bytes=int(nbytes),
            params=[{"name": p.name, "kind": p.kind, "dtype": p.dtype, "access": p.access} for p in params],
            instrumented=bool(func.attrs.get(INSTRUMENTED_ATTR, False)) and instrumented)
    return list(specs.values())


def thread_count_of(ln) -> int:
    return int(np.prod(ln.grid)) * int(np.prod(ln.block))


def cache_key(model: ModelDef, arch: str, options: InstrumentOptions) -> str:
    """Content hash: model IR + weights, options, TVM version, and our own sources."""
    h = hashlib.sha256()
    h.update(json.dumps({"format": FORMAT_VERSION, "arch": arch, "instrument": options.enabled,
                         "group": options.group, "tvm": tvm.__version__}).encode())
    h.update(model.fingerprint().encode())
    pkg = resources.files("paella.compiler_pass")
    # streams.py and the stage cutting are applied after the cache (the cache holds
    # single-stream whole-model bundles): such a bundle has its own key, see _post_key.
    for name in sorted(p.name for p in pkg.iterdir() if p.name.endswith(".py") and p.name not in POST_PASSES):
        h.update(pkg.joinpath(name).read_bytes())
    h.update(pkg.joinpath("include", "paella_notif.cuh").read_bytes())
    h.update(resources.files("paella").joinpath("bundle.py").read_bytes())
    return h.hexdigest()[:24]


#: Modules that rewrite a compiled bundle after the cache (their own part of the key).
POST_PASSES = ("streams.py", "stages.py", "stage_variants.py")


#: The files of a timing-only bundle (``compile_bundle(timing_only=True)``).
TIMING_FILES = ("cuda_source", "ptx", "cubin")


def _write_bundle(model: ModelDef, tmp: Path, arch: str, options: InstrumentOptions,
                  key: str, progress: Progress, timing_only: bool = False) -> Manifest:
    t0 = time.perf_counter()
    target = gpu_target(arch)
    step = _stepper(progress, 4 if timing_only else 6)

    _require_static_inputs(model)
    mod = make_safe(model.mod)     # a client's values cannot fault a kernel (safe_ops)
    step("Relax CUDA pipeline (legalize, fuse, schedule, plan memory)")
    lowered, flops, fused = relax_pipeline(mod, target, progress)
    entry = lowered["main"]

    step("TIR lowering" + (f" + instrumentation (group={options.group})" if options.enabled else " (plain)"))
    gpu = lower_gpu(_used_primfuncs(lowered, entry), target, options, flops, progress)
    (tmp / FILES["cuda_source"]).write_text(gpu.source)
    globals_ = global_functions(gpu.source)
    if sorted(globals_) != sorted(gpu.device_funcs):
        raise CompileError(f"generated source has kernels {sorted(globals_)}, the lowered module "
                           f"{sorted(gpu.device_funcs)}")

    step(f"nvcc -arch={arch}: PTX + cubin for {len(globals_)} kernels")
    _ptx, _cubin, res = nvcc.build(tmp / FILES["cuda_source"], arch, tmp)

    step("launch plan + manifest")
    plan = build_plan(entry, gpu.host_plans, model.params)
    if options.enabled:
        _pass_block_offsets(plan)
    _name_outputs(plan, model)
    kernels = _kernel_specs(gpu, plan, res, options.enabled)
    if len(kernels) != len(globals_):
        raise CompileError(f"the plan launches {len(kernels)} distinct kernels, the source defines "
                           f"{len(globals_)}")
    variant = Variant("default", plan.inputs, plan.outputs, plan.buffers, kernels, plan.plan,
                      plan.io_bytes, batch=model.batch, seq_len=model.seq_len, calls=plan.calls)
    check_variant(variant)
    if timing_only:
        return Manifest(model=model.name, arch=arch, instrumented=options.enabled, group=options.group,
                        variants=[variant], files={f: FILES[f] for f in TIMING_FILES}, cache_key=key,
                        tvm_version=tvm.__version__, compile_seconds=time.perf_counter() - t0)
    _build_fused_cpu(fused, plan.calls, tmp / FILES["fused_cpu"])

    step("CPU (llvm) reference build")
    cpu_exec = tvm.compile(mod, target="llvm")
    cpu_exec.export_library(str(tmp / FILES["cpu_lib"]))
    n_in = int(entry.attrs["num_input"])
    cpu_order = [b.name for b in plan.buffers if b.kind == "param"][:len(entry.params) - n_in]
    (tmp / FILES["cpu_params"]).write_text(json.dumps(cpu_order))

    step("params")
    np.savez(tmp / FILES["params"], **plan.params)
    return Manifest(model=model.name, arch=arch, instrumented=options.enabled, group=options.group,
                    variants=[variant], files=dict(FILES), cache_key=key, tvm_version=tvm.__version__,
                    compile_seconds=time.perf_counter() - t0)


def _pass_block_offsets(plan: PlanResult) -> None:
    """Every instrumented kernel takes ``paella_block_offset`` as its last own parameter
    (instrument.py, slicing); the plan passes 0, the whole grid. The dispatcher's slicer
    rewrites it for a slice (paella.dispatcher.slicing)."""
    seen: set[int] = set()
    for ln in plan.launches:
        if id(ln.args) not in seen:
            ln.args.append(KernelArg(scalar=0, dtype="uint32"))
            seen.add(id(ln.args))
    for op in plan.plan:
        if op.op == "launch" and id(op.args) not in seen:
            op.args.append(KernelArg(scalar=0, dtype="uint32"))
            seen.add(id(op.args))


def _name_outputs(plan: PlanResult, model: ModelDef) -> None:
    """Keep the model's own output names (ONNX graph outputs) where it has them."""
    names = model.output_names
    if names and len(names) == len(plan.outputs) and len(set(names)) == len(names):
        for t, name in zip(plan.outputs, names):
            t.name = name


def variant_name(model: ModelDef) -> str:
    """``b4``, ``b4_l64``: a variant's name from its batch size and length bucket."""
    return f"b{model.batch}" + (f"_l{model.seq_len}" if model.seq_len else "")


def _write_variants(models: list[ModelDef], tmp: Path, arch: str, options: InstrumentOptions,
                    key: str, progress: Progress, timing_only: bool = False) -> Manifest:
    """One bundle of several variants: variant 0's files at the top (as in a bundle of
    one), each other's in ``variants/<name>/`` (its own kernels, plan, params and CPU
    build: TVM names kernels after the operators, so two shapes' kernels collide)."""
    t0 = time.perf_counter()
    first = None
    for k, model in enumerate(models):
        progress(f"-- variant {variant_name(model)} ({k + 1}/{len(models)})")
        sub = tmp if k == 0 else tmp / "variants" / variant_name(model)
        sub.mkdir(parents=True, exist_ok=True)
        m = _write_bundle(model, sub, arch, options, key, progress, timing_only)
        v = m.variants[0]
        v.name = variant_name(model)
        if k == 0:
            first = m
        else:
            v.files = {f: f"variants/{v.name}/{name}" for f, name in m.files.items()}
            if "params" in v.files and _same_params(tmp / FILES["params"], sub / FILES["params"]):
                (sub / FILES["params"]).unlink()     # variant 0's serve: one copy of the weights
                del v.files["params"]
            first.variants.append(v)
    first.compile_seconds = time.perf_counter() - t0
    return first


def _same_params(a: Path, b: Path) -> bool:
    """Whether two params files hold the same arrays. The variants of one model share
    its weights (a BERT-base's are 340 MB: one copy, not one per variant); a model
    whose constants change with the shape keeps its own file."""
    with np.load(a, allow_pickle=False) as za, np.load(b, allow_pickle=False) as zb:
        if sorted(za.files) != sorted(zb.files):
            return False
        return all(za[k].dtype == zb[k].dtype and np.array_equal(za[k], zb[k]) for k in za.files)


def _require_static_inputs(model: ModelDef) -> None:
    main = model.mod["main"]
    for var in main.params:
        shape = getattr(var.ty, "shape", None)
        values = getattr(shape, "values", None)
        if values is None or not all(isinstance(d, tirx.IntImm) for d in values):
            raise PlanError(f"input/param {var.name} has shape {shape} with symbolic dimensions; the "
                            "launch plan needs static shapes: compile one variant per fixed shape")


def _stepper(progress: Progress, total: int) -> Callable[[str], None]:
    state = {"i": 0, "t": time.perf_counter()}

    def step(msg: str) -> None:
        now = time.perf_counter()
        state["i"] += 1
        progress(f"[{state['i']}/{total}] {msg}  (+{now - state['t']:.1f}s)")
        state["t"] = now
    return step


def default_cache_dir() -> Path:
    return Path(os.environ.get("PAELLA_CACHE_DIR", Path.home() / ".cache" / "paella" / "bundles"))


def _check_writable(out: Path) -> None:
    """Refuse an unusable ``out`` before compiling; make its missing parents (``-o
    bundles/resnet18`` on a fresh checkout)."""
    parent = out.resolve().parent
    if out.exists() and not out.is_dir():
        raise CompileError(f"output {out} exists and is not a directory; choose another -o path")
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CompileError(f"cannot create the output's parent directory {parent} "
                           f"({e.strerror}); choose another -o path") from None
    if not os.access(parent, os.W_OK):
        raise CompileError(f"cannot write into {parent} (permission denied); choose a writable -o path")


def _install(src: Path, out: Path, copy: bool) -> None:
    """Put ``src`` at ``out`` atomically (rename within the parent; old bundle removed)."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.resolve().parent))
    try:
        staged = tmp / "b"
        (shutil.copytree if copy else shutil.move)(str(src), str(staged))
        old = tmp / "old"
        if out.exists():
            os.rename(out, old)
        os.rename(staged, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def bundle_key(model: ModelDef | list[ModelDef], arch: str = "sm_75",
               options: InstrumentOptions = InstrumentOptions(), timing_only: bool = False) -> str:
    """The compile cache's key of the bundle :func:`compile_bundle` makes of ``model``
    (a list: one bundle with a variant each)."""
    if isinstance(model, list):
        key = hashlib.sha256("".join(cache_key(m, arch, options) + variant_name(m)
                                     for m in model).encode()).hexdigest()[:24]
    else:
        key = cache_key(model, arch, options)
    return key + "-timing" if timing_only else key


def is_cached(model: ModelDef | list[ModelDef], cache_dir: str | Path | None = None,
              arch: str = "sm_75", timing_only: bool = False) -> bool:
    """Whether the compile cache holds the bundle of ``model`` (then :func:`compile_bundle`
    only copies it: no compiling)."""
    key = bundle_key(model, arch, InstrumentOptions(), timing_only)
    return (Path(cache_dir or default_cache_dir()) / key / MANIFEST).is_file()


def compile_bundle(model: ModelDef | list[ModelDef], out: str | Path, arch: str = "sm_75",
                   options: InstrumentOptions = InstrumentOptions(), progress: Progress = lambda _m: None,
                   cache_dir: str | Path | None = None, force: bool = False,
                   streams: str = "single", stages: int = 0, stage_gpu: str = "t4",
                   timing_only: bool = False) -> Path:
    """Build (or fetch from cache) the bundle of ``model`` into directory ``out``. A
    list of models (one model at several batch sizes / length buckets, each with its
    ``batch`` and ``seq_len``) makes one bundle with one variant each, in that order.
    ``streams``: the launch plan's streams (:data:`.streams.MODES`; ``nimble`` assigns
    them by Nimble's algorithm, :mod:`.streams`, to every variant). ``stages``: cut
    the variants into that many DVABatch stages, profiled on the simulated
    ``stage_gpu`` (:mod:`.stage_variants`; 0: no cut). ``timing_only``: only the
    kernels and the plan (no CPU build, no params file): enough for the simulator's
    timing, a third quicker to build and without a copy of the weights (BERT-base: 340 MB)
    -- such a bundle cannot be served or checked against a reference."""
    from .streams import MODES
    out = Path(out)
    nvcc.check_arch(arch)
    if streams not in MODES:
        raise CompileError(f"unknown stream mode {streams!r}; use one of {', '.join(MODES)}")
    _check_writable(out)
    models = model if isinstance(model, list) else None
    if models is not None:
        if not models:
            raise CompileError("no variant to compile")
        model = models[0]
    key = bundle_key(models if models is not None else model, arch, options, timing_only)
    out_key = _post_key(key, streams, stages, stage_gpu)
    existing = out / MANIFEST
    if not force and existing.is_file():
        try:
            if json.loads(existing.read_text()).get("cache_key") == out_key:
                progress(f"{out} is up to date (cache key {out_key})")
                _name_bundle(out, model.name)
                return out
        except (json.JSONDecodeError, OSError):
            pass  # unreadable old bundle: rebuild over it
    cache = Path(cache_dir or default_cache_dir()) / key
    if not force and (cache / MANIFEST).is_file():
        progress(f"cached bundle {key} found in {cache.parent}")
        _install(cache, out, copy=True)
        _name_bundle(out, model.name)
        _apply_post(out, streams, stages, stage_gpu, out_key, progress)
        return out
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.build.", dir=out.resolve().parent))
    except OSError as e:
        raise CompileError(f"cannot write into {out.resolve().parent} ({e.strerror}); choose a writable -o path") from None
    try:
        try:
            manifest = (_write_variants(models, tmp, arch, options, key, progress, timing_only)
                        if models is not None else
                        _write_bundle(model, tmp, arch, options, key, progress, timing_only))
        except (PlanError, nvcc.NvccError) as e:
            raise CompileError(f"{model.name}: {e}") from None
        except _TVM_ERRORS as e:
            first = str(e).strip().splitlines()[-1]
            raise CompileError(f"{model.name}: TVM could not compile the model: {first}") from None
        (tmp / MANIFEST).write_text(json.dumps(manifest.to_dict(), indent=1))
        _store_in_cache(tmp, cache, progress)
        _install(tmp, out, copy=False)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    progress(f"wrote {out} in {manifest.compile_seconds:.1f}s: {len(manifest.variants[0].kernels)} kernels, "
             f"{len(manifest.variants[0].launches())} launches")
    _apply_post(out, streams, stages, stage_gpu, out_key, progress)
    return out


def _name_bundle(out: Path, name: str) -> None:
    """The cache key hashes the model's content, not its name: the same ONNX file
    compiled under a new name hits the entry of the old one, whose manifest names the
    old model. Rename it in the installed copy (the cache entry stays as it is)."""
    path = out / MANIFEST
    data = json.loads(path.read_text())
    if data.get("model") != name:
        data["model"] = name
        path.write_text(json.dumps(data, indent=1))


def _post_key(key: str, streams: str, stages: int = 0, stage_gpu: str = "t4") -> str:
    """The cache key of a bundle cut into ``stages`` and on ``streams``: the
    single-stream whole-model key, plus the options and a hash of the passes applied."""
    if streams == "single" and not stages:
        return key
    pkg = resources.files("paella.compiler_pass")
    src = b"".join(pkg.joinpath(p).read_bytes() for p in POST_PASSES)
    tag = (f"-stages{stages}-{stage_gpu}" if stages else "") + (f"-{streams}" if streams != "single" else "")
    return f"{key}{tag}-{hashlib.sha256(src).hexdigest()[:8]}"


def _apply_post(out: Path, streams: str, stages: int, stage_gpu: str, out_key: str,
                progress: Progress) -> None:
    """The passes after the cache: cut into stages, then assign streams; the result
    carries ``out_key``."""
    if stages:
        from .stage_variants import StageError, slice_bundle
        try:
            slice_bundle(out, stages, stage_gpu, progress)
        except StageError as e:
            shutil.rmtree(out, ignore_errors=True)       # no half-made bundle at -o
            raise CompileError(str(e)) from None
    _apply_streams(out, streams, progress)
    if streams != "single" or stages:
        mpath = out / MANIFEST
        data = json.loads(mpath.read_text())
        data["cache_key"] = out_key
        mpath.write_text(json.dumps(data, indent=1))


def _apply_streams(out: Path, streams: str, progress: Progress) -> None:
    """Rewrite the single-stream bundle at ``out`` onto ``streams`` (every variant)."""
    if streams == "single":
        return
    from .streams import nimble
    mpath = out / MANIFEST
    manifest = manifest_from_dict(json.loads(mpath.read_text()))
    for i, v in enumerate(manifest.variants):
        manifest.variants[i], a = nimble(v)
        check_variant(manifest.variants[i])
        progress(f"{streams} streams ({v.name}): {a.n_streams} streams, {len(a.syncs)} "
                 f"synchronizations (|E'| = {len(a.meg)}, |M| = {len(a.matched)})")
    mpath.write_text(json.dumps(manifest.to_dict(), indent=1))


def _store_in_cache(src: Path, cache: Path, progress: Progress) -> None:
    """Keep a copy for later compiles; an unwritable cache only costs a warning."""
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        if not cache.exists():
            _install(src, cache, copy=True)
    except OSError as e:
        progress(f"warning: cannot store the bundle in the cache {cache.parent} ({e}); "
                 "set PAELLA_CACHE_DIR to a writable directory to enable caching")
