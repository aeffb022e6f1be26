"""The buffer-set benchmarks run and say what they compare (tiny sizes: a smoke test,
not a measurement; docs/benchmarks.md round 16 has the figures)."""
from __future__ import annotations

from paella.benchmarks import bench_buffer_sets, bench_hol_knee


def test_bench_buffer_sets_prints_each_part_beside_its_reference(capsys):
    assert bench_buffer_sets.main(["--sets", "20", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    for name in ("make", "bind", "bind_reference", "operands", "operands_reference"):
        assert f"  {name} " in out
    assert "a set with the core's operands" in out


def test_bench_hol_knee_compares_sets_ahead_and_on_demand(capsys):
    assert bench_hol_knee.main(["--rates", "10", "--seeds", "1", "--jobs", "300"]) == 0
    out = capsys.readouterr().out
    import re
    assert "sets ahead" in out and "sets on demand" in out
    assert len(re.findall(r"10\.0k: +[0-9.]+ \([01]/1\)", out)) == 2       # one row per setting
