"""No trials wasted on the basics: every stage is tried, and a stage's later configurations start
from what its earlier ones proved."""

from __future__ import annotations

import pytest

from dsat.trial import SearchRange, TrialKind, TrialStatus
from dsat.zero_space import explicit_zero_config
from tests.search.helpers import cliff_function, created_ids, finish, method, run, start_profile


@pytest.mark.parametrize("name", ["guided", "asha", "binary", "random"])
@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_every_stage_gets_a_trial_before_any_gets_a_second_configuration(
    name: str, seed: int
) -> None:
    m = method(name, zero_stages=(0, 1, 2, 3), max_concurrent_trials=1, random_seed=seed)
    run(m, cliff_function(40))
    lineage_stages = [
        m.tracker.get(lineage_id).zero_stage
        for lineage_id in m.tracker.lineage_ids()
        if m.tracker.get(lineage_id).kind is TrialKind.SEARCH
    ]
    assert sorted(lineage_stages[:4]) == [0, 1, 2, 3]


def test_a_new_configuration_starts_between_the_stages_largest_success_and_smallest_oom() -> None:
    # One configuration of stage 1 ran at 30 and ran out of memory at 35: a second configuration
    # of that stage starts in [30, 34], not at the memory model's midpoint again.
    m = method("binary", zero_stages=(1,), max_concurrent_trials=1)
    (first,) = created_ids(start_profile(m))
    ran = m.continue_lineage(m.tracker.get(first), SearchRange(1, 64), 30)
    oom = m.continue_lineage(m.tracker.get(first), SearchRange(1, 64), 35)
    assert ran is not None and oom is not None
    for record, ok in ((ran, True), (oom, False)):
        m.tracker.dequeue(record.request_id)
        m.tracker.mark_running(record.request_id)
        finish(m, record.request_id, ok=ok, status=TrialStatus.OOM)
    assert m.tracker.proven_micro_batches(1) == (30, 35)
    assert m.initial_range(1) == SearchRange(30, 34)
    fresh = m.new_lineage()
    assert fresh is not None and 30 <= fresh.mbs <= 34
    assert m.initial_range(2) == SearchRange(1, 64)  # a stage with no history: the estimate


def test_an_oom_caps_only_configurations_that_need_no_less_memory() -> None:
    m = method("binary", zero_stages=(2,), max_concurrent_trials=1)
    start_profile(m)
    section = explicit_zero_config({}, 2)
    record = m.make_trial(TrialKind.SEARCH, section, 35, search_range=SearchRange(1, 64))
    assert m.register(record) is not None
    m.tracker.dequeue(record.request_id)
    m.tracker.mark_running(record.request_id)
    m.tracker.mark_finished(record.request_id, TrialStatus.OOM)
    bigger = {**section, "reduce_bucket_size": 5 * 10**9, "overlap_comm": True}
    smaller = {**section, "reduce_bucket_size": 10**6}
    assert m.initial_range(2, section).hi == 34
    assert m.initial_range(2, bigger).hi == 34
    assert m.initial_range(2, smaller).hi == 64  # its buckets may leave room: the estimate
    assert m.initial_range(2, {**section, "reduce_scatter": False}).hi == 64  # not comparable


def test_a_stage_that_never_fits_stops_being_drawn() -> None:
    m = method("asha", zero_stages=(1, 2), max_concurrent_trials=1)
    start_profile(m)
    assert m.live_stages() == [1, 2]
    for reduce_bucket in (10**6, 10**7):
        section = {"stage": 1, "reduce_bucket_size": reduce_bucket, "allgather_bucket_size": 10**6}
        record = m.make_trial(TrialKind.SEARCH, section, 1, search_range=SearchRange(1, 1))
        assert m.register(record) is not None
        m.tracker.dequeue(record.request_id)
        m.tracker.mark_running(record.request_id)
        m.tracker.mark_finished(record.request_id, TrialStatus.OOM)
    assert m.live_stages() == [2]
    assert {m.choose_stage() for _ in range(20)} == {2}
