"""Aligned micro-batches: where a probe lands, what aligned trials showed, what is worth a trial."""

from __future__ import annotations

import math

from dsat.search import aligned_micro_batches as aligned


def test_alignment_is_the_largest_tile() -> None:
    assert [aligned.alignment(m) for m in (7, 8, 24, 48, 64, 128)] == [1, 8, 8, 16, 64, 64]


def test_a_probe_moves_to_the_most_aligned_micro_batch_in_the_middle_of_its_gap() -> None:
    assert aligned.snap(100, 140) == 128  # the middle, 120, is aligned to 8 only
    assert aligned.snap(1, 5) == 3  # nothing aligned: the middle
    assert aligned.snap(41, 47) == 44  # no multiple of 8 in the middle half
    low, high = 90, 100
    assert low <= aligned.snap(low, high) <= high


def test_gains_compare_an_aligned_trial_with_its_unaligned_neighbours() -> None:
    values = {60: 1.0, 63: 1.0, 64: 1.06, 65: 1.0, 70: 1.0}
    (gain,) = aligned.gains({"a": values})
    assert gain == math.log(1.06)
    # Without an unaligned neighbour on both sides, it shows nothing.
    assert aligned.gains({"a": {64: 1.06, 65: 1.0}}) == []


def test_the_optimism_shrinks_with_evidence_of_no_gain() -> None:
    before = aligned.optimism([])
    after = aligned.optimism([0.0, 0.0, 0.0])
    shown = aligned.optimism([0.05, 0.04])
    assert before == aligned.ALIGNED_OPTIMISM
    assert after < before / 1.9
    assert shown > before


def test_candidates_lie_next_to_the_best_and_within_reach() -> None:
    found = aligned.candidates(100, 130)
    assert {96, 104, 112, 128} <= set(found)
    assert all(80 <= m <= 130 and m != 100 for m in found)
    assert aligned.candidates(3, 5) == []  # small micro-batches: nothing aligned in reach
