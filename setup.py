"""The compiled modules: the dispatcher's per-kernel data structures, in C, one per
``dispatcher/<name>.c`` (the occupancy tracker's hot half, the policies' indexed heap),
the simulated GPU's engine (``dispatcher/devices/sim/_engine.c``) and its comparisons on a
worker thread (``dispatcher/devices/sim/_offload.c``);
``paella.dispatcher.native.MODULES`` names them for ``paella doctor``. Everything else
is configured in pyproject.toml."""
from pathlib import Path

from setuptools import Extension, setup

_FLAGS = ["-O2", "-Wall", "-Werror"]
#: The C-to-C interfaces every module may include: a change rebuilds them all (without
#: it, an in-place rebuild kept an engine built against the old struct, and the kernel
#: core read another function's pointer).
_HEADERS = ["dispatcher/capi.h"]

setup(ext_modules=[Extension(f"paella.dispatcher.{c.stem}", [f"dispatcher/{c.name}"],
                             extra_compile_args=_FLAGS, depends=_HEADERS)
                   for c in sorted(Path(__file__).parent.joinpath("dispatcher").glob("*.c"))]
      + [Extension(f"paella.dispatcher.devices.sim.{name}", [f"dispatcher/devices/sim/{name}.c"],
                   extra_compile_args=_FLAGS, depends=_HEADERS)
         for name in ("_engine", "_offload")])
