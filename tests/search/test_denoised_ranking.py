"""Every method ranks what it may hand over by the denoised estimate, not the single measurement."""

from __future__ import annotations

from typing import Any

import pytest

from dsat.search.confirmation import leaders
from dsat.search.denoised_ranking import denoised_score
from dsat.trial import TrialKind, TrialRecord, TrialStatus
from tests.search.helpers import method

GiB = 2**30


def ran(m: Any, bucket: int, mbs: int, value: float) -> TrialRecord:
    """A finished stage-1 search trial with ``bucket`` as its reduce bucket."""
    section = {"stage": 1, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket}
    record = m.make_trial(TrialKind.SEARCH, section, mbs)
    record = record.replace(request_id=f"{bucket}-{mbs}")
    m.tracker.add(record, queue=False)
    metrics = {
        "throughput": value,
        "latency": value,
        "memory_peak_bytes": GiB // 2,
        "memory_total_bytes": GiB,
    }
    m.tracker.mark_finished(record.request_id, TrialStatus.COMPLETED, metrics)
    return m.tracker.get(record.request_id)


@pytest.mark.parametrize("name", ["asha", "binary", "random", "guided"])
def test_a_single_lucky_measurement_ranks_below_a_level_several_trials_support(
    name: str,
) -> None:
    m = method(name, metric="throughput")
    # One configuration measured at four micro-batches along a smooth curve, another once, 0.8%
    # above the first's level at the same micro-batch: as likely the lucky one as the faster.
    for mbs in (28, 30, 31, 32):
        supported = ran(m, 50_000_000, mbs, float(mbs))
    lucky = ran(m, 10_000_000, 32, 32 * 1.008)
    assert leaders(m.tracker, 1)[0] is lucky  # by the measurement alone
    assert leaders(m.tracker, 1, m.leader_score())[0].request_id == supported.request_id


def test_the_estimate_keeps_the_order_of_clearly_different_trials() -> None:
    m = method("asha", metric="throughput")
    for mbs in (8, 16, 24, 32):
        ran(m, 50_000_000, mbs, float(mbs))
    score = denoised_score(m.tracker)
    ranked = sorted(m.tracker.records, key=score, reverse=True)
    assert [r.mbs for r in ranked] == [32, 24, 16, 8]


def test_latency_ranks_the_other_way() -> None:
    m = method("random", metric="latency")
    fast = ran(m, 50_000_000, 8, 1.0)  # the metric is latency: smaller is better
    slow = ran(m, 50_000_000, 16, 3.0)
    score = denoised_score(m.tracker)
    assert score(fast) < score(slow)  # in the metric's own direction
    assert leaders(m.tracker, 1, score)[0] is fast
