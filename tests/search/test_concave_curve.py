"""Bounds on a configuration's metric-vs-micro-batch curve, and where to look next."""

from __future__ import annotations

import math

from dsat.search.concave_curve import CurveEvidence, Gap, best_possible, gaps, next_gap
from dsat.search.guided import TOLERANCE


def next_micro_batch(evidence: CurveEvidence, tolerance: float, target: float) -> int | None:
    gap: Gap | None = next_gap(evidence, tolerance, target)
    return None if gap is None else gap.probe


def saturating(mbs: int, overhead: float = 4.0) -> float:
    """Throughput when a step takes overhead + mbs: concave, through the origin."""
    return mbs / (overhead + mbs)


def test_nothing_known_probes_the_middle_of_the_reach() -> None:
    evidence = CurveEvidence(values={}, reach=40)
    assert next_micro_batch(evidence, TOLERANCE, 0.0) == 20
    assert best_possible(evidence) == math.inf


def test_the_bounds_hold_on_a_concave_curve_and_tighten_as_trials_run() -> None:
    tried = {8: saturating(8), 24: saturating(24)}
    evidence = CurveEvidence(values=tried, reach=64)
    for gap in gaps(evidence):
        truth = max(saturating(m) for m in range(gap.lo, gap.hi + 1))
        assert gap.bound >= truth
    looser = best_possible(CurveEvidence(values={24: saturating(24)}, reach=64))
    assert best_possible(evidence) < looser


def test_it_stops_once_nothing_untried_can_beat_the_target_by_the_tolerance() -> None:
    values = {m: saturating(m, overhead=0.2) for m in (10, 20, 30, 40)}
    evidence = CurveEvidence(values=values, reach=41)
    assert next_micro_batch(evidence, TOLERANCE, max(values.values())) is None
    # With room above and a steep curve, the top is still worth a trial.
    steep = CurveEvidence(values={5: saturating(5, 20.0), 10: saturating(10, 20.0)}, reach=60)
    probe = next_micro_batch(steep, TOLERANCE, saturating(10, 20.0))
    assert probe is not None and probe > 10


def test_a_falling_curve_sends_the_search_below_it() -> None:
    # Throughput fell from 16 to 28 (memory pressure): the peak may lie between or below.
    evidence = CurveEvidence(values={16: 1.0, 28: 0.8}, reach=30)
    probe = next_micro_batch(evidence, TOLERANCE, 1.0)
    assert probe is not None and probe < 28


def test_a_borrowed_curve_bounds_the_shape_but_is_not_a_result() -> None:
    borrowed = {m: saturating(m, overhead=0.2) for m in (10, 20, 30)}
    evidence = CurveEvidence(values={}, reach=30, borrowed=borrowed)
    assert evidence.best is None
    assert best_possible(evidence) < 1.1 * max(borrowed.values())
