"""Request shapes on the wire and in the io region (paella.shapes), shared by client and
daemon: the options word round-trips, layouts are aligned, bad shapes are named."""
from __future__ import annotations

import pytest

from paella import shapes, wire

T = wire.TensorInfo


def variants(sizes, lens=(0,)):
    out = []
    for ln in lens:
        for b in sizes:
            x = T("x", (b, ln, 4) if ln else (b, 4), "float32", 0)
            y = T("y", (b, ln, 4) if ln else (b, 2), "float32", 0)
            out.append(wire.VariantInfo(0, (x,), (y,), b, ln))
    return tuple(out)


def test_options_round_trip_and_stay_out_of_the_variant_bits():
    for rows, ln in [(1, 0), (7, 0), (65535, 32767), (3, 128)]:
        o = shapes.RequestShape(rows, ln).options()
        assert o & shapes.SHAPED and o < 1 << 32
        assert shapes.RequestShape.from_options(o) == shapes.RequestShape(rows, ln)
    assert shapes.RequestShape.from_options(5) is None            # a plain variant index
    for bad in [(0, 0), (65536, 0), (1, 32768), (1, -1)]:
        with pytest.raises(shapes.ShapeError):
            shapes.RequestShape(*bad).options()


def test_layout_is_the_variant_shapes_at_the_request_size_aligned():
    slots, size = shapes.request_layout(variants((1, 4)), 3, 0)
    assert [(s.name, s.shape, s.offset) for s in slots] == [("x", (3, 4), 0), ("y", (3, 2), 64)]
    assert size == 128
    slots, size = shapes.request_layout(variants((1, 2), (4, 8)), 2, 5)
    assert [s.shape for s in slots] == [(2, 5, 4), (2, 5, 4)] and size == 192 + 192   # 160 B each, aligned


@pytest.mark.parametrize("rows,ln,model,match", [
    (5, 0, variants((1, 4)), "5 rows: a request has 1..4 rows"),
    (0, 0, variants((1, 4)), "0 rows: a request has 1..4 rows"),
    (1, 3, variants((1, 4)), "the model has no length axis"),
    (1, 9, variants((1,), (4, 8)), "sequence length 9: the model takes 1..8"),
    (1, 0, variants((1,), (4, 8)), "sequence length 0: the model takes 1..8"),
    (1, 0, (wire.VariantInfo(8, (), ()),), "whole-variant requests only"),
])
def test_bad_shapes_are_named(rows, ln, model, match):
    with pytest.raises(shapes.ShapeError, match=match):
        shapes.request_layout(model, rows, ln)
