"""ASHA over binary-search lineages: rungs, promotion, scheduling, the resource cap."""

from __future__ import annotations

from typing import Any

from dsat.search.asha import AshaSearch
from dsat.trial import SearchRange, TrialStatus
from tests.search.helpers import cliff_function, created_ids, finish, method, run, start_profile


def asha(**overrides: Any) -> AshaSearch:
    m = method("asha", **overrides)
    assert isinstance(m, AshaSearch)
    return m


def test_trials_per_rung() -> None:
    assert [asha().trials_for_rung(r) for r in range(4)] == [3, 6, 12, 24]
    assert [asha(asha_early_stopping=1, divisor=3).trials_for_rung(r) for r in range(3)] == [
        9,
        27,
        81,
    ]


def test_highest_rung_first_then_longest_lineage() -> None:
    m = asha(zero_stages=(1,), max_concurrent_trials=2)
    first, second = created_ids(start_profile(m))
    m.tracker.mark_finished(first, TrialStatus.COMPLETED, {"FLOPS_per_gpu": 1.0})
    m.tracker.mark_finished(second, TrialStatus.COMPLETED, {"FLOPS_per_gpu": 2.0})
    a, b = m.tracker.get(first), m.tracker.get(second)
    a1 = m.continue_lineage(a, SearchRange(a.mbs + 1, 64), a.mbs + 1)
    assert a1 is not None
    m.tracker.enqueue([a1.request_id])
    m.tracker.mark_finished(
        m.tracker.dequeue(a1.request_id).request_id, TrialStatus.COMPLETED, {"FLOPS_per_gpu": 1.5}
    )
    fresh = m.new_lineage()
    b1 = m.continue_lineage(b, SearchRange(b.mbs + 1, 64), b.mbs + 1)
    a2 = m.continue_lineage(m.tracker.get(a1.request_id), SearchRange(a1.mbs + 1, 64), a1.mbs + 1)
    assert fresh and b1 and a2
    m.tracker.enqueue([fresh.request_id, b1.request_id, a2.request_id])
    assert m.choose_next() == a2.request_id  # rung 0 everywhere: the longest lineage (a) first
    promoted = m.continue_lineage(
        m.tracker.get(second), SearchRange(b.mbs + 2, 64), b.mbs + 2, rung=1
    )
    assert promoted is not None
    m.tracker.enqueue([promoted.request_id])
    assert m.choose_next() == promoted.request_id  # a higher rung beats any lineage length


def test_top_one_over_divisor_of_a_rung_is_promoted() -> None:
    m = asha(zero_stages=(1,), max_concurrent_trials=4, min_binary_search_trials=1, divisor=2)
    ids = created_ids(start_profile(m))
    for value, rid in zip([1.0, 4.0, 2.0, 3.0], ids, strict=True):
        m.tracker.mark_finished(rid, TrialStatus.COMPLETED, {"FLOPS_per_gpu": value})
    assert all(m.completed_rung(rid, 0) for rid in ids)  # each used its 1 trial of rung 0
    assert m.promotable(0) == [ids[1], ids[3]]  # the best half, best first
    assert m.promotable(1) == []


def test_smaller_is_better_ranks_promotions_the_other_way() -> None:
    m = asha(
        zero_stages=(1,), max_concurrent_trials=4, min_binary_search_trials=1, metric="latency"
    )
    ids = created_ids(start_profile(m))
    for value, rid in zip([1.0, 4.0, 2.0, 3.0], ids, strict=True):
        m.tracker.mark_finished(rid, TrialStatus.COMPLETED, {"latency": value})
    assert m.promotable(0) == [ids[0], ids[2]]


def test_rung_completes_when_the_binary_search_ends_early() -> None:
    m = asha(zero_stages=(1,), max_concurrent_trials=2, search_range_factor=1 / 64)  # range [1, 1]
    first = created_ids(start_profile(m))[0]
    assert m.tracker.get(first).search_range == SearchRange(1, 1)
    assert not m.completed_rung(first, 0)
    m.tracker.mark_finished(first, TrialStatus.COMPLETED, {"FLOPS_per_gpu": 1.0})
    assert m.completed_rung(first, 0)  # 1 trial < 3, but nothing is left to search


def test_rung_completes_when_a_lineage_fails_at_its_floor() -> None:
    m = asha(zero_stages=(1,), max_concurrent_trials=1)
    (first,) = created_ids(start_profile(m))  # [1, 64] at 32
    (child,) = created_ids(finish(m, first, ok=False))  # [1, 31] at 16
    assert m.tracker.get(child).rung == 0 and not m.completed_rung(first, 0)
    tight = asha(zero_stages=(1,), max_concurrent_trials=1, search_range_factor=1 / 64)
    (only,) = created_ids(start_profile(tight))  # [1, 1] at 1
    tight.tracker.mark_finished(only, TrialStatus.OOM)
    assert tight.completed_rung(only, 0)  # failed at the floor: its search is over


def test_promotions_never_pass_the_top_rung() -> None:
    m = asha(zero_stages=(1, 2), max_rungs=2, min_binary_search_trials=2, max_trials=64)
    run(m, cliff_function(45, {1: 0.1}))
    rungs = {r.rung for r in m.tracker.records}
    assert rungs == {0, 1}  # promotions happened, and none past rung max_rungs - 1
    for lineage_id in m.tracker.lineage_ids():
        assert m.tracker.finished_in_lineage(lineage_id) <= m.trials_for_rung(1)
        lineage = m.tracker.lineage(lineage_id)
        assert [r.rung for r in lineage] == sorted(r.rung for r in lineage)  # rungs only go up
