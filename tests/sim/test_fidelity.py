"""The fidelity experiment's arithmetic: knees (Nimble's stream assignment is tested with the
compiler, tests/compiler/test_streams.py)."""
from __future__ import annotations

from paella.experiments import fidelity


def test_knee_is_the_last_batch_within_tolerance_of_the_first():
    assert fidelity.knee([1, 2, 4, 8, 16], [10, 11, 12, 12.4, 20]) == 8
    assert fidelity.knee([1, 2, 4], [10, 20, 40]) == 1                 # grows at once
    assert fidelity.knee([1, 2, 4], [10, 8, 30]) == 2                  # a faster schedule counts
