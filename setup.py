"""The one compiled module: the occupancy tracker's per-kernel half (dispatcher/_tracker.c).
Everything else is configured in pyproject.toml."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("paella.dispatcher._tracker", ["dispatcher/_tracker.c"],
                             extra_compile_args=["-O2", "-Wall", "-Werror"])])
