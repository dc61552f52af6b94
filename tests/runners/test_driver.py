"""The search loop runs again a trial the machine failed, on any runner, and the method never
learns of it; only a trial the machine keeps failing is an error, and it says so."""

from __future__ import annotations

import collections
import json
from collections.abc import Callable
from typing import Any

import pytest

from dsat.runners.driver import SearchDriver
from dsat.runners.simulated.runner import SimulatedRunner
from dsat.trial import TrialOutcome, TrialStatus
from dsat.trial_failure import MACHINE_ATTEMPTS, MACHINE_FAILURES_TO_STOP, FailureCause
from tests.search.helpers import cliff_function, method


class Retries:
    """A listener that keeps what the loop tells it."""

    def __init__(self) -> None:
        self.retried: list[tuple[str, int, str | None]] = []
        self.finished: list[str] = []

    def trial_started(self, request_id: str) -> None:
        pass

    def trial_finished(self, request_id: str, outcome: TrialOutcome) -> None:
        self.finished.append(request_id)

    def trial_retried(self, request_id: str, outcome: TrialOutcome, attempt: int) -> None:
        self.retried.append((request_id, attempt, outcome.error))


def flaky(function: Callable[..., dict[str, Any]], failures: int) -> Callable[..., dict[str, Any]]:
    """``function``, but each configuration's first ``failures`` runs fail as a taken port."""
    runs: dict[str, int] = {}

    def perform(ds_config: dict[str, Any], slots: int) -> dict[str, Any]:
        key = json.dumps(ds_config, sort_keys=True)
        runs[key] = runs.get(key, 0) + 1
        if runs[key] <= failures:
            raise ConnectionError("EADDRINUSE: port 29500 taken")
        return function(ds_config, slots)

    return perform


def search(name: str, function: Callable[..., dict[str, Any]]) -> tuple[Any, SearchDriver, Retries]:
    m = method(name, max_trials=8)
    listener = Retries()
    driver = SearchDriver(m, SimulatedRunner(function, 1), [listener])
    driver.run()
    return m, driver, listener


@pytest.mark.parametrize("name", ["binary", "random", "guided"])
def test_a_fault_of_the_machine_changes_nothing_the_search_decides(name: str) -> None:
    clean, _, _ = search(name, cliff_function(12))
    m, driver, listener = search(name, flaky(cliff_function(12), MACHINE_ATTEMPTS - 1))
    assert [(r.name, r.status, r.metrics) for r in m.tracker.records] == [
        (r.name, r.status, r.metrics) for r in clean.tracker.records
    ]
    assert m.shutdown_reason == clean.shutdown_reason
    # Every trial ran MACHINE_ATTEMPTS times: each failed run was told, as attempt 1, 2, ...
    assert len(listener.retried) == (MACHINE_ATTEMPTS - 1) * len(m.tracker.finished)
    assert {attempt for _, attempt, _ in listener.retried} == set(range(1, MACHINE_ATTEMPTS))
    assert listener.finished == [o.outcome.request_id for o in driver.history]


def test_a_trial_the_machine_keeps_failing_is_an_error_that_blames_the_machine() -> None:
    def broken_above_4(ds_config: dict[str, Any], slots: int) -> dict[str, Any]:
        if ds_config["train_micro_batch_size_per_gpu"] > 4:
            raise ConnectionError("EADDRINUSE: port 29500 taken")
        return cliff_function(12)(ds_config, slots)

    m, _, listener = search("binary", broken_above_4)
    failed = [r for r in m.tracker.finished if r.status is TrialStatus.ERROR]
    assert failed and all(r.cause is FailureCause.MACHINE for r in failed)
    for record in failed:
        assert record.error is not None and record.error.startswith(
            f"the machine failed this trial {MACHINE_ATTEMPTS} time(s), not its configuration: "
            "ConnectionError: EADDRINUSE"
        )
    retries = collections.Counter(request_id for request_id, *_ in listener.retried)
    assert all(retries[r.request_id] == MACHINE_ATTEMPTS - 1 for r in failed)
    # Two trials in a row that the machine failed on every attempt end the search (whatever
    # else ran then is stopped): the budget is not spent on a machine that fails everything.
    assert len(failed) == MACHINE_FAILURES_TO_STOP
    assert (m.shutdown_reason or "").startswith(
        f"the machine failed the last {MACHINE_FAILURES_TO_STOP} trials on every attempt"
    )


def test_a_profile_the_machine_keeps_failing_ends_the_search_without_blaming_the_config() -> None:
    def no_network(ds_config: dict[str, Any], slots: int) -> dict[str, Any]:
        raise ConnectionError("rendezvous timed out")

    m, driver, _ = search("binary", no_network)
    assert driver.shutdown is not None and driver.shutdown.failure
    reason = m.shutdown_reason or ""
    assert reason.startswith("the model-profile trial failed: the machine failed this trial")
    assert "not to blame" in reason and "fix the" not in reason
