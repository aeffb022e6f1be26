"""The compiled modules: the dispatcher's per-kernel data structures, in C (the occupancy
tracker's hot half, dispatcher/_tracker.c, and the policies' indexed heap,
dispatcher/_pqueue.c). Everything else is configured in pyproject.toml."""
from setuptools import Extension, setup

_FLAGS = ["-O2", "-Wall", "-Werror"]

setup(ext_modules=[Extension(f"paella.dispatcher.{name}", [f"dispatcher/{name}.c"],
                             extra_compile_args=_FLAGS)
                   for name in ("_tracker", "_pqueue")])
