"""Binary search over the micro-batch."""

from __future__ import annotations

import math
from typing import Any

import pytest

from dsat.search.binary import range_after
from dsat.trial import SearchRange, TrialStatus
from tests.search.helpers import cliff_function, created_ids, finish, method, run, start_profile


@pytest.mark.parametrize("cliff", [1, 2, 7, 31, 32, 33, 50, 64])
def test_finds_the_largest_fitting_micro_batch_in_log_steps(cliff: int) -> None:
    m = method("binary", zero_stages=(0,), max_concurrent_trials=1)
    run(m, cliff_function(cliff))
    lineage = m.tracker.lineage(m.tracker.lineage_ids()[0])
    hi = lineage[0].search_range.hi
    assert hi == 63  # the reference's estimate keeps one sample of activations free
    assert len(lineage) <= math.floor(math.log2(hi)) + 1
    best = m.tracker.best_of(lineage)
    assert best is not None and best.mbs == min(cliff, hi)
    assert all((r.status is TrialStatus.OOM) == (r.mbs > cliff) for r in lineage)


def test_success_raises_the_floor_and_failure_lowers_the_ceiling() -> None:
    m = method("binary", zero_stages=(1,), max_concurrent_trials=1)
    (first,) = created_ids(start_profile(m))
    record = m.tracker.get(first)
    assert record.search_range == SearchRange(1, 63) and record.mbs == 32
    (second,) = created_ids(finish(m, first, ok=True))
    assert (
        m.tracker.get(second).search_range == SearchRange(33, 63)
        and m.tracker.get(second).mbs == 48
    )
    (third,) = created_ids(finish(m, second, ok=False))
    assert (
        m.tracker.get(third).search_range == SearchRange(33, 47) and m.tracker.get(third).mbs == 40
    )
    assert m.tracker.get(third).lineage_id == first and m.tracker.get(third).parent_id == second


def test_a_success_over_the_memory_margin_lowers_the_ceiling() -> None:
    """A trial that ran but left less than --memory-margin free cannot be handed over: the
    binary search goes below it, as after an OOM, and ends on the largest micro-batch that
    leaves the margin."""
    m = method("binary", zero_stages=(1,), max_concurrent_trials=1, memory_margin=0.05)
    (first,) = created_ids(start_profile(m))
    memory = {"memory_total_bytes": 100}
    (second,) = created_ids(
        finish(m, first, metrics={"FLOPS_per_gpu": 32.0, "memory_peak_bytes": 96, **memory})
    )
    assert m.tracker.get(second).search_range == SearchRange(1, 31)  # as after an OOM
    m = method("binary", zero_stages=(1,), max_concurrent_trials=1, memory_margin=0.05)

    def tight_above_40(ds_config: dict[str, Any], slots: int) -> dict[str, Any]:
        result = cliff_function(60)(ds_config, slots)
        mbs = ds_config["train_micro_batch_size_per_gpu"]
        return {**result, "memory_peak_bytes": 96 if mbs > 40 else 80, **memory}

    run(m, tight_above_40)
    lineage = m.tracker.lineage(m.tracker.lineage_ids()[0])
    assert {r.mbs for r in lineage} >= {40, 41}
    best = m.tracker.best_of(lineage)
    assert best is not None and best.mbs == 40


def test_range_too_small_to_search() -> None:
    """With a ceiling of 1 there is nothing to search: one trial, then the lineage is done."""
    m = method("binary", zero_stages=(0,), search_range_factor=1 / 64)
    driver = run(m, cliff_function(10))
    searched = [r for r in m.tracker.records if r.kind.value == "search"]
    assert [r.mbs for r in searched] == [1]
    assert searched[0].search_range == SearchRange(1, 1)
    record = m.tracker.get(searched[0].request_id)
    assert range_after(record, m.tracker.too_large(record)).empty
    assert driver.shutdown is not None and m.shutdown_reason == "no configuration left to try"


def test_search_range_factor_scales_the_ceiling() -> None:
    m = method("binary", zero_stages=(1,), search_range_factor=0.5)
    (first, *_) = created_ids(start_profile(m))
    assert m.tracker.get(first).search_range == SearchRange(1, 31)  # int(63 * 0.5)


def test_used_up_range_starts_a_new_configuration() -> None:
    m = method("binary", zero_stages=(1,), max_concurrent_trials=1, search_range_factor=2 / 63)
    (first,) = created_ids(start_profile(m))  # range [1, 2], mbs 1
    (second,) = created_ids(finish(m, first, ok=True))  # [2, 2]
    (third,) = created_ids(finish(m, second, ok=True))  # used up -> a new lineage
    assert m.tracker.get(third).lineage_id == third and m.tracker.get(third).parent_id is None
