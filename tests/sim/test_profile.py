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


def _corrupt(src, dst, edit) -> str:
    import shutil
    shutil.copytree(src, dst)
    m = json.loads((dst / "manifest.json").read_text())
    edit(m)
    (dst / "manifest.json").write_text(json.dumps(m))
    return str(dst)


def test_corrupt_or_huge_bundles_are_clear_errors(bundle_dir, tmp_path, capsys):
    """Found by review: an infinite flops count hung the daemon's profiling run (60 s, at
    start-up and at SIGHUP), a legal grid of 2**31 blocks kept ``paella profile`` busy
    for hours, and a deeply nested manifest was a RecursionError traceback."""
    def kernel(m):
        return m["variants"][0]["kernels"][0]

    def grid(m):
        kernel(m)["grid"] = [2 ** 31 - 1, 1, 1]
        for op in m["variants"][0]["plan"]:
            if op["op"] == "launch" and op["kernel"] == kernel(m)["name"]:
                op["grid"] = [2 ** 31 - 1, 1, 1]
    cases = [(lambda m: kernel(m).update(flops=float("inf")),
              "kernels[0]: flops must be a float, got inf"),
             (lambda m: kernel(m).update(bytes="lots"), "kernels[0]: bytes must be an int"),
             (lambda m: kernel(m).update(flops=1e16), "has flops 1e+16; it must be a number "
                                                      "from 0 to 1e+15"),
             (grid, "notifQ entries exceed the daemon's ring")]
    for i, (edit, msg) in enumerate(cases):
        assert main(["profile", _corrupt(bundle_dir, tmp_path / f"b{i}", edit)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("paella: error:") and msg in err, err
    import shutil
    deep = tmp_path / "deep"
    shutil.copytree(bundle_dir, deep)
    (deep / "manifest.json").write_text("[" * 100000 + "]" * 100000)
    assert main(["profile", str(deep)]) == 2
    assert "nested too deeply" in capsys.readouterr().err
    assert main(["profile", str(bundle_dir), "--json", str(tmp_path / "no" / "x.json")]) == 2
    assert "not a file in an existing directory" in capsys.readouterr().err
