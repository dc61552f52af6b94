"""The simulated runner: virtual time with real overlap, outcomes from the performance function."""

from __future__ import annotations

from typing import Any

from dsat.runners.simulated.runner import (
    DEFAULT_TRIAL_SECONDS,
    FAILED_TRIAL_SECONDS,
    SimulatedRunner,
)
from dsat.trial import TrialStatus


def function(ds_config: dict[str, Any], slots: int) -> dict[str, Any]:
    mbs = ds_config["train_micro_batch_size_per_gpu"]
    if mbs == 99:
        raise MemoryError("no room")
    if mbs == 13:
        raise ValueError("unlucky")
    if mbs == 7:
        return {"throughput": 7.0 * slots}  # no "seconds": the default applies
    return {"throughput": float(mbs * slots), "seconds": float(mbs)}


def test_trials_overlap_and_finish_in_virtual_time_order() -> None:
    executor = SimulatedRunner(function, slots_per_trial=2)
    executor.start("a", {}, {"train_micro_batch_size_per_gpu": 30}, 6)
    executor.start("b", {}, {"train_micro_batch_size_per_gpu": 10}, 6)
    first = executor.wait()
    assert (first.request_id, first.start, first.end, executor.now) == ("b", 0.0, 10.0, 10.0)
    executor.start("c", {}, {"train_micro_batch_size_per_gpu": 5}, 6)  # starts at t=10, ends at 15
    assert [executor.wait().request_id, executor.wait().request_id] == ["c", "a"]
    assert executor.now == 30.0  # a ran alongside b and c: 30 s, not 45


def test_outcomes() -> None:
    executor = SimulatedRunner(function, slots_per_trial=4)
    for rid, mbs in [("oom", 99), ("err", 13), ("ok", 2), ("default", 7)]:
        executor.start(rid, {}, {"train_micro_batch_size_per_gpu": mbs}, 6)
    outcomes = {o.request_id: o for o in (executor.wait() for _ in range(4))}
    assert (
        outcomes["oom"].status is TrialStatus.OOM
        and outcomes["oom"].error == "MemoryError: no room"
    )
    assert (
        outcomes["err"].status is TrialStatus.ERROR
        and outcomes["err"].error == "ValueError: unlucky"
    )
    assert outcomes["oom"].end == FAILED_TRIAL_SECONDS
    assert outcomes["ok"].status is TrialStatus.COMPLETED and outcomes["ok"].metrics == {
        "throughput": 8.0
    }
    assert outcomes["default"].end == DEFAULT_TRIAL_SECONDS


def test_function_gets_a_copy() -> None:
    seen: list[dict[str, Any]] = []

    def mutating(ds_config: dict[str, Any], slots: int) -> dict[str, Any]:
        ds_config["zero_optimization"]["stage"] = 99
        seen.append(ds_config)
        return {"throughput": 1.0}

    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1}}
    SimulatedRunner(mutating, 1).start("x", {}, config, 6)
    assert config["zero_optimization"]["stage"] == 1 and seen


def test_a_function_that_exits_or_returns_no_number_fails_its_trial_only() -> None:
    """``sys.exit()`` in the function ended the whole search (exit status 3, no word); a NaN
    was searched as a measurement, compared as neither better nor worse than any."""

    def bad(ds_config: dict[str, Any], slots: int) -> dict[str, Any]:
        mbs = ds_config["train_micro_batch_size_per_gpu"]
        if mbs == 1:
            raise SystemExit(3)
        return {"throughput": float("nan") if mbs == 2 else float("inf"), "memory": 1.0}

    executor = SimulatedRunner(bad, slots_per_trial=1)
    for mbs in (1, 2, 3):
        executor.start(str(mbs), {}, {"train_micro_batch_size_per_gpu": mbs}, 6)
    outcomes = {o.request_id: o for o in (executor.wait() for _ in range(3))}
    assert all(o.status is TrialStatus.ERROR and not o.metrics for o in outcomes.values())
    assert outcomes["1"].error == "SystemExit: 3"
    assert outcomes["2"].error == "ValueError: the function returned throughput=nan"
    assert outcomes["3"].error == "ValueError: the function returned throughput=inf"
