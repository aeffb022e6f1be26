"""``paella profile``: a compiled bundle's isolated times, per variant and per kernel."""
from __future__ import annotations

import json

import pytest

from paella.cli import main
from paella.compiler_pass.build import compile_bundle
from paella.models import tiny


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("profile") / "tiny_cnn"
    compile_bundle(tiny.tiny_cnn(), out)
    return out


def test_profile_reports_every_launch_and_its_bound(bundle_dir, tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["profile", str(bundle_dir), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    data = json.loads(out.read_text())
    (v,) = data["variants"]
    launches = v["launches"]
    assert len(launches) == sum(1 for line in text.splitlines() if line.strip().split(" ")[0].isdigit())
    for r in launches:
        assert r["isolated_us"] > 0 and 1 <= r["sms"] <= 40 and r["waves"] >= 1
        assert r["bound"] in ("compute", "memory", "latency")
        assert r["sms"] == min(r["blocks"], 40)       # breadth-first: one block per SM first
        assert 0 < r["achieved_occupancy"] <= r["theoretical_occupancy"] + 1e-9
        assert sum(r["bound_split"].values()) == pytest.approx(1.0)
    # one request alone: its kernels in sequence plus its copies, so more than the kernels
    assert v["isolated_us"] > v["kernels_isolated_us"] > 0
    assert sum(v["time_by_bound_us"].values()) == pytest.approx(v["kernels_isolated_us"])


def test_another_preset_keeps_the_registers_and_says_so(bundle_dir, capsys):
    assert main(["profile", str(bundle_dir), "--gpu", "a100"]) == 0
    assert "compiled for sm_75" in capsys.readouterr().out


@pytest.mark.parametrize("args,msg", [(["/nonexistent/bundle"], "not a bundle"),
                                      (["{dir}", "--gpu", "k80"], "unknown GPU preset")])
def test_bad_input_is_a_clear_error(bundle_dir, args, msg, capsys):
    args = [a.format(dir=bundle_dir) for a in args]
    assert main(["profile", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("paella: error:") and msg in err
