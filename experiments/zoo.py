"""The compiled zoo as the experiments use it: bundles on disk, and kernels for the sim.

``ensure_bundles`` compiles what is missing (``paella compile`` caches on a content
hash, so a second run costs seconds); ``module_image`` and ``plan_ops`` turn a bundle
into what :class:`~paella.dispatcher.devices.sim.SimDevice` runs.
"""
from __future__ import annotations

from pathlib import Path

from paella.bundle import DEFAULT_ZOO_DIR, Bundle, load_bundle  # noqa: F401 (re-exported)
from paella.dispatcher.devices.base import KernelInfo, ModuleImage

#: The paper's Table 2: TVM execution time on a T4, in ms.
TABLE2_MS = {"resnet18": 1.58, "mobilenetv2": 1.67, "resnet34": 2.55, "squeezenet1_1": 4.79,
             "resnet50": 5.76, "densenet121": 6.08, "googlenet": 7.86, "inceptionv3": 31.2}


def ensure_bundles(names: list[str], root: Path = DEFAULT_ZOO_DIR, arch: str = "sm_75",
                   progress: bool = True) -> dict[str, Bundle]:
    """Load the zoo bundles ``names`` from ``root``, compiling any that are missing."""
    from paella.compiler_pass.build import compile_bundle
    from paella.models import zoo
    root.mkdir(parents=True, exist_ok=True)
    out = {}
    for i, name in enumerate(names):
        path = root / name
        if not _current(path):
            if progress:
                print(f"[zoo {i + 1}/{len(names)}] compiling {name} (cached after the first time)", flush=True)
            compile_bundle(zoo.get(name), path, arch=arch,
                           progress=(lambda m: print(f"  {m}", flush=True)) if progress else (lambda m: None))
        out[name] = load_bundle(path)
    return out


def _current(path: Path) -> bool:
    """A bundle of this version's format is there (an older one is compiled again)."""
    import json

    from paella.bundle import FORMAT_VERSION
    try:
        return json.loads((path / "manifest.json").read_text()).get("format_version") == FORMAT_VERSION
    except (OSError, ValueError, AttributeError):
        return False


def module_image(bundle: Bundle, variant: int = 0) -> ModuleImage:
    v = bundle.variants[variant]
    return ModuleImage(bundle.model, [KernelInfo(k.name, k.registers, k.static_smem, float(k.flops),
                                                 float(k.bytes)) for k in v.kernels])
