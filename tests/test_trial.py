"""The trial record and its pieces."""

from __future__ import annotations

import json

from dsat.trial import SearchRange, TrialKind, TrialRecord, TrialStatus, trial_number


def test_status_groups() -> None:
    assert not TrialStatus.QUEUED.finished and not TrialStatus.RUNNING.finished
    assert TrialStatus.COMPLETED.finished and not TrialStatus.COMPLETED.failed
    assert all(
        s.finished and s.failed for s in (TrialStatus.OOM, TrialStatus.ERROR, TrialStatus.TIMEOUT)
    )


def test_search_range() -> None:
    assert (
        SearchRange(1, 10).midpoint == 5 and not SearchRange(3, 3).empty and SearchRange(4, 3).empty
    )


def test_record_round_trips_through_json() -> None:
    record = TrialRecord(
        request_id="r1",
        index=3,
        kind=TrialKind.SEARCH,
        hparams={"overwrite_deepspeed_args": {"a": 1}},
        ds_config={"train_micro_batch_size_per_gpu": 4},
        zero_stage=2,
        mbs=4,
        gas=1,
        lineage_id="r0",
        parent_id="r0",
        search_range=SearchRange(1, 8),
        rung=1,
        status=TrialStatus.OOM,
        error="x",
    )
    again = TrialRecord.from_json(json.loads(json.dumps(record.to_json())))
    assert again == record
    assert record.name == "z2_mb4"  # DeepSpeed's defaults: nothing more to show
    assert record.replace(status=TrialStatus.COMPLETED).status is TrialStatus.COMPLETED
    assert record.status is TrialStatus.OOM  # frozen: replace made a new one


def test_a_trial_is_numbered_as_its_log_and_directory_are() -> None:
    """With trials at once, "trial 1" on screen (creation order from 0), in trials.jsonl
    (finishing order) and logs/001-* (launch order) were three different trials."""
    assert trial_number(0, "/r/logs/003-bb4b6df8.log") == 3
    assert trial_number(5, "r/logs/012-0a1b2c3d-node1.log") == 12
    assert trial_number(0, None) == 1  # no log (the simulator): its place in the search
    assert trial_number(4, "/elsewhere/train.log") == 5
