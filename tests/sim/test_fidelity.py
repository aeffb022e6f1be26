"""The fidelity experiment's arithmetic: knees, and Nimble's stream assignment."""
from __future__ import annotations

from paella.experiments import fidelity


def test_knee_is_the_last_batch_within_tolerance_of_the_first():
    assert fidelity.knee([1, 2, 4, 8, 16], [10, 11, 12, 12.4, 20]) == 8
    assert fidelity.knee([1, 2, 4], [10, 20, 40]) == 1                 # grows at once
    assert fidelity.knee([1, 2, 4], [10, 8, 30]) == 2                  # a faster schedule counts


def test_stream_assignment_is_a_minimum_chain_cover():
    # 0 -> {1, 2, 3} -> 4, and 1 -> 5: {1, 2, 3} are independent (width 3), and 5 can
    # follow 1 on its stream
    deps = [set(), {0}, {0}, {0}, {1, 2, 3}, {1}]
    stream, n = fidelity.stream_assignment(deps)
    assert n == 3
    # every stream is a chain: its kernels are ordered by dependency
    anc = [set(), {0}, {0}, {0}, {0, 1, 2, 3}, {0, 1}]
    for s in range(n):
        members = [i for i in range(6) if stream[i] == s]
        for a, b in zip(members, members[1:]):
            assert a in anc[b]
    # a chain needs one stream
    assert fidelity.stream_assignment([set(), {0}, {1}, {2}])[1] == 1
