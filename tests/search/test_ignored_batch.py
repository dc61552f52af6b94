"""A training script that feeds every trial a batch size of its own."""

from __future__ import annotations

from dsat.constants import INPUT_SHAPE
from dsat.search.ignored_batch import same_inputs_line, script_batch_ignored
from dsat.trial import TrialKind, TrialRecord, TrialStatus
from tests.search.test_tracker import record


def ran(
    rid: str, mbs: int, shape: list[int] | None, kind: TrialKind = TrialKind.SEARCH
) -> TrialRecord:
    metrics = {"throughput": 1.0, **({INPUT_SHAPE: shape} if shape is not None else {})}
    return record(rid, mbs, kind=kind).replace(status=TrialStatus.COMPLETED, metrics=metrics)


def test_three_micro_batches_fed_one_batch_of_one_of_theirs_stop_the_search() -> None:
    yours = ran("b", 16, [16, 64], TrialKind.BASELINE)
    larger = ran("s", 24, [16, 64])
    # Two could be a coincidence: a first input that is no batch, as long as one micro-batch.
    assert script_batch_ignored([yours, larger]) is None
    third = ran("t", 20, [16, 64])
    reason = script_batch_ignored([yours, larger, third])
    assert reason is not None and reason.startswith(
        "the training script feeds every trial batches of 16 whatever its micro-batch: "
        f"{third.name} ran the same inputs as {yours.name} (shape [16, 64])"
    )
    assert same_inputs_line([yours, larger]) == ""  # led by one of theirs: not "neither"


def test_inputs_that_follow_the_micro_batch_are_nothing_to_say() -> None:
    batch_first = [ran("a", 8, [8, 64]), ran("b", 16, [16, 64])]
    sequence_first = [ran("a", 8, [64, 8]), ran("b", 16, [64, 16])]
    varied = [ran("a", 8, None), ran("b", 16, None)]  # shapes that differed within a trial
    one_size = [ran("a", 8, [8, 64]), ran("b", 8, [8, 64])]
    for records in (batch_first, sequence_first, varied, one_size):
        assert script_batch_ignored(records) is None and same_inputs_line(records) == ""
    failed = [ran("a", 16, [16, 64]), ran("b", 24, [16, 64]).replace(status=TrialStatus.OOM)]
    assert script_batch_ignored(failed) is None


def test_one_shape_holding_neither_micro_batch_is_a_note() -> None:
    """A first input that is no batch (a buffer of positions) looks the same: said, not fatal."""
    records = [ran("a", 12, [16, 64]), ran("b", 24, [16, 64])]
    assert script_batch_ignored(records) is None
    line = same_inputs_line(records)
    assert line.startswith(f"same inputs: {records[0].name} and {records[1].name} were fed")
