"""The search loop runs again a trial the machine failed, on any runner, and the method never
learns of it; only a trial the machine keeps failing is an error, and it says so."""

from __future__ import annotations

import collections
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dsat.constants import MICRO_BATCH_SIZE, RUN_ALONE, STATE_FILE
from dsat.experiment.settings import SearchSettings
from dsat.runners.driver import SearchDriver
from dsat.runners.simulated.runner import SimulatedRunner
from dsat.search import MethodSettings, make_search_method
from dsat.search_run import run_search
from dsat.trial import TrialOutcome, TrialStatus
from dsat.trial_failure import MACHINE_ATTEMPTS, MACHINE_FAILURES_TO_STOP, FailureCause
from tests.search.helpers import cliff_function, method, search_settings, spec


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


class SharedHost(SimulatedRunner):
    """A host whose memory runs out under the configuration ``victim`` while any other trial
    runs beside it, as the local runner reports it (``RUN_ALONE``); alone, it fits."""

    def __init__(self, function: Callable[..., dict[str, Any]], victim: str) -> None:
        super().__init__(function, 1)
        self.victim = victim
        self.events: list[tuple[str, str, int]] = []  # ("start"/"end", request id, running)
        self.running: set[str] = set()
        self.shared: set[str] = set()
        self.configs: dict[str, str] = {}  # as JSON

    def start(
        self, request_id: str, hparams: dict[str, Any], ds_config: dict[str, Any], length: int
    ) -> None:
        self.events.append(("start", request_id, len(self.running)))
        if self.running:
            self.shared |= self.running | {request_id}
        self.running.add(request_id)
        self.configs[request_id] = json.dumps(ds_config, sort_keys=True)
        super().start(request_id, hparams, ds_config, length)

    def wait(self) -> TrialOutcome:
        outcome = super().wait()
        request_id = outcome.request_id
        self.running.discard(request_id)
        self.events.append(("end", request_id, len(self.running)))
        shared = request_id in self.shared
        self.shared.discard(request_id)
        if self.configs[request_id] == self.victim and shared:
            return dataclasses.replace(
                outcome,
                status=TrialStatus.ERROR,
                metrics={RUN_ALONE: True},
                error="the host's memory ran out while other trials shared this machine",
                cause=FailureCause.MACHINE,
            )
        return outcome


def first_shared_fitting_config() -> str:
    """The first configuration a search with 3 trials at once starts beside another, that fits."""
    clean = SharedHost(cliff_function(12), victim="")
    SearchDriver(method("binary", max_trials=12, max_concurrent_trials=3), clean).run()
    return next(
        clean.configs[rid]
        for kind, rid, running in clean.events
        if kind == "start" and running and json.loads(clean.configs[rid])[MICRO_BATCH_SIZE] <= 12
    )


def assert_ran_alone(runner: SharedHost, request_id: str) -> None:
    """Its last run started once every other trial had ended, and none started beside it."""
    *_, again, last_end = [i for i, (_, rid, _) in enumerate(runner.events) if rid == request_id]
    assert runner.events[again] == ("start", request_id, 0)
    assert last_end == again + 1


def test_a_trial_the_hosts_memory_failed_beside_others_runs_again_alone() -> None:
    """Nothing starts beside it, nor while it waits for the running trials to end; then the
    search goes on, and the configuration is judged by its run alone."""
    victim = first_shared_fitting_config()
    runner = SharedHost(cliff_function(12), victim)
    m = method("binary", max_trials=12, max_concurrent_trials=3)
    listener = Retries()
    SearchDriver(m, runner, [listener]).run()
    retried = [rid for rid, *_ in listener.retried]
    assert len(retried) == 1 and runner.configs[retried[0]] == victim
    assert_ran_alone(runner, retried[0])
    mine = [i for i, (_, rid, _) in enumerate(runner.events) if rid == retried[0]]
    first_end, again, last_end = mine[1], mine[2], mine[3]
    between = runner.events[first_end + 1 : again]
    assert between and not [e for e in between if e[0] == "start"]  # none started meanwhile
    assert any(kind == "start" for kind, *_ in runner.events[last_end + 1 :])  # then on again
    record = m.tracker.get(retried[0])
    assert record.status is TrialStatus.COMPLETED and record.cause is None


def test_a_resumed_search_runs_alone_what_the_hosts_memory_failed_beside_others(
    tmp_path: Path,
) -> None:
    """Stopped just after the failure, the resume knows from the saved state to run it alone."""
    victim = first_shared_fitting_config()
    first = SharedHost(cliff_function(12), victim)
    settings = search_settings("binary", max_trials=12, max_concurrent_trials=3)
    run_search(settings, spec(), first, tmp_path, max_events=first_failure(first, settings))
    [failed_id] = json.loads((tmp_path / STATE_FILE).read_text())["machine_failed"]
    again = SharedHost(cliff_function(12), victim)
    m = run_search(settings, spec(), again, tmp_path)
    assert_ran_alone(again, failed_id)  # beside others, it would have failed again
    assert m.tracker.get(failed_id).status is TrialStatus.COMPLETED
    [row] = [
        r
        for r in map(json.loads, (tmp_path / "trials.jsonl").read_text().splitlines())
        if r["request_id"] == failed_id
    ]
    assert [run.get(RUN_ALONE) for run in row["machine_failed"]] == [True]


def first_failure(runner: SharedHost, settings: SearchSettings) -> int:
    """How many outcomes a search reads up to the victim's failure beside other trials."""
    probe = SharedHost(runner.function, runner.victim)
    listener = Retries()
    driver = SearchDriver(
        make_search_method(MethodSettings.from_settings(settings, None), spec()), probe, [listener]
    )
    driver.run()
    [(failed_id, _, _)] = listener.retried
    ends = [rid for kind, rid, _ in probe.events if kind == "end"]
    return ends.index(failed_id) + 1
