"""Benchmarks and hardware checks: what the code costs and whether a machine works.

Each module is a script (``python -m paella.benchmarks.NAME``) that measures one thing
(the dispatcher's CPU per kernel, the simulator's speed, a round trip through the
service, an install's size) or checks a real GPU (``gpu_check``). None is a figure of
the paper (those are :mod:`paella.experiments`) and none is a test: hot-path speed is
measured here, not asserted in the test suite.
"""
