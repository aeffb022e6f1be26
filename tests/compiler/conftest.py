"""Shared fixtures: tiny bundles compiled once per session into a private cache."""
from __future__ import annotations

import pytest

from paella.bundle import load_bundle
from paella.compiler_pass.build import compile_bundle
from paella.compiler_pass.instrument import InstrumentOptions
from paella.models import tiny


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("bundle-cache")


@pytest.fixture(scope="session")
def cnn_bundle(tmp_path_factory, cache_dir):
    out = tmp_path_factory.mktemp("b") / "tiny_cnn"
    compile_bundle(tiny.tiny_cnn(), out, cache_dir=cache_dir)
    return load_bundle(out)


@pytest.fixture(scope="session")
def mlp_bundle(tmp_path_factory, cache_dir):
    out = tmp_path_factory.mktemp("b") / "tiny_mlp"
    compile_bundle(tiny.tiny_mlp(), out, cache_dir=cache_dir, options=InstrumentOptions(group=1))
    return load_bundle(out)


@pytest.fixture(scope="session")
def plain_bundle(tmp_path_factory, cache_dir):
    out = tmp_path_factory.mktemp("b") / "tiny_cnn_plain"
    compile_bundle(tiny.tiny_cnn(), out, cache_dir=cache_dir, options=InstrumentOptions(enabled=False))
    return load_bundle(out)
