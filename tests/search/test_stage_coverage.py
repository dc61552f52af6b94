"""No trials wasted on the basics: every stage is tried, and a stage's later configurations start
from what its earlier ones proved."""

from __future__ import annotations

import pytest

from dsat.search.trial import SearchRange, TrialKind, TrialStatus
from tests.search.helpers import cliff_function, created_ids, finish, method, run, start_profile


@pytest.mark.parametrize("name", ["asha", "binary", "random"])
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
