"""No trials wasted on the basics: every stage is tried (guided, random), and a stage whose model
states cannot fit stops being drawn."""

from __future__ import annotations

import pytest

from dsat.trial import SearchRange, TrialKind, TrialStatus
from tests.search.helpers import cliff_function, method, run, start_profile


@pytest.mark.parametrize("name", ["guided", "random"])
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


def test_a_stage_that_never_fits_stops_being_drawn() -> None:
    m = method("asha", zero_stages=(1, 2), max_concurrent_trials=1)
    start_profile(m)
    assert m.live_stages() == [1, 2]
    for reduce_bucket in (10**6, 10**7):
        section = {"stage": 1, "reduce_bucket_size": reduce_bucket, "allgather_bucket_size": 10**6}
        record = m.make_trial(TrialKind.SEARCH, section, 1, search_range=SearchRange(1, 1))
        assert m.register(record) is not None
        m.tracker.mark_running(record.request_id)
        m.tracker.mark_finished(record.request_id, TrialStatus.OOM)
    assert m.live_stages() == [2]
    assert {m.choose_stage() for _ in range(20)} == {2}
