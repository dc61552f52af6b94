"""What every method shares: the search protocol, limits, failures, determinism and resuming."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from dsat.experiment.settings import SEARCH_METHODS
from dsat.memory import Precision
from dsat.runners.driver import SearchDriver
from dsat.runners.simulated.runner import SimulatedRunner
from dsat.search import METHODS as REGISTERED
from dsat.search import make_search_method
from dsat.training.step_clock import MEASURED_STEPS, WARMUP_STEPS, measured_window
from dsat.trial import TrialKind, TrialRecord, TrialStatus
from tests.search.helpers import (
    BASE_DS,
    PROFILE,
    cliff_function,
    history,
    method,
    outcome,
    run,
    settings,
    spec,
    start_profile,
    suggested,
)

METHODS = ["guided", "asha", "binary", "random"]
REFERENCE_METHODS = ["asha", "binary", "random"]  # the reference's: they spend every trial


def max_overlap(driver: SearchDriver) -> int:
    """The most trials running at one virtual instant."""
    events = sorted(
        [(f.outcome.start, 1) for f in driver.history]
        + [(f.outcome.end, -1) for f in driver.history]
    )
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    return peak


@pytest.mark.parametrize("name", REFERENCE_METHODS)
def test_trial_limit(name: str) -> None:
    m = method(name, max_trials=20, zero_stages=(1, 2, 3))
    driver = run(m, cliff_function(40))
    assert len(driver.history) == 20 == len(m.tracker.finished)
    assert m.shutdown_reason == "--max-trials used up (20)"
    assert sum(1 for f in driver.history if f.outcome.status is TrialStatus.COMPLETED) > 10


@pytest.mark.parametrize("name", METHODS)
def test_concurrency_limit(name: str) -> None:
    driver = run(method(name, max_concurrent_trials=3, zero_stages=(1, 2)), cliff_function(40))
    assert max_overlap(driver) == 3


@pytest.mark.parametrize("name", METHODS)
def test_slot_limit(name: str) -> None:
    m = method(name, slots=4, max_slots=8, max_concurrent_trials=16, zero_stages=(1, 2))
    driver = run(m, cliff_function(40), slots=4)
    assert max_overlap(driver) == 2  # 8 slots / 4 per trial


@pytest.mark.parametrize("name", METHODS)
def test_oom_lowers_the_ceiling(name: str) -> None:
    m = method(name, zero_stages=(1, 2), max_concurrent_trials=4)
    run(m, cliff_function(13))
    records = m.tracker.records
    assert any(r.status is TrialStatus.OOM for r in records)
    for r in records:
        if r.kind is TrialKind.SEARCH and r.status.finished:
            assert (r.status is TrialStatus.OOM) == (r.mbs > 13)
        if r.parent_id is not None and m.tracker.get(r.parent_id).status is TrialStatus.OOM:
            assert r.search_range is not None and r.search_range.hi < m.tracker.get(r.parent_id).mbs
    best = m.tracker.best()
    assert best is not None and best.mbs == 13


@pytest.mark.parametrize("name", METHODS)
def test_every_trial_failing_is_a_failed_search(name: str) -> None:
    def broken(ds_config: dict[str, Any], slots: int) -> dict[str, Any]:
        if ds_config["autotuning"].get("model_info"):
            return dict(PROFILE)
        raise RuntimeError("CUDA error: illegal memory access")

    m = method(name, max_trials=10)
    driver = run(m, broken)
    assert driver.shutdown is not None and driver.shutdown.failure
    assert m.search_failed
    assert {r.status for r in m.tracker.finished if r.kind is TrialKind.SEARCH} == {
        TrialStatus.ERROR
    }


@pytest.mark.parametrize("name", METHODS)
def test_a_single_failure_does_not_fail_the_search(name: str) -> None:
    healthy = cliff_function(40)
    calls = {"n": 0}

    def flaky(ds_config: dict[str, Any], slots: int) -> dict[str, Any]:
        calls["n"] += 1
        if calls["n"] == 2:  # the first search trial
            raise RuntimeError("NCCL timeout")
        return healthy(ds_config, slots)

    m = method(name, max_trials=16)
    driver = run(m, flaky)
    assert driver.shutdown is not None and not driver.shutdown.failure
    assert sum(r.status is TrialStatus.ERROR for r in m.tracker.records) == 1
    assert not m.search_failed and m.tracker.best() is not None


@pytest.mark.parametrize("name", METHODS)
def test_failed_model_profile_stops_with_advice(name: str) -> None:
    def no_memory(ds_config: dict[str, Any], slots: int) -> dict[str, Any]:
        raise MemoryError("even micro-batch 1 does not fit")

    m = method(name, zero_stages=(0,))  # nothing to climb to: no ZeRO stage with offload
    driver = run(m, no_memory)
    assert len(driver.history) == 1 and driver.shutdown is not None and driver.shutdown.failure
    reason = m.shutdown_reason
    assert reason is not None and "ran out of memory at micro-batch 1" in reason
    assert "even micro-batch 1 does not fit" in reason and "fix the config" in reason


@pytest.mark.parametrize("name", METHODS)
def test_a_model_that_fits_no_way_climbs_every_rung_then_says_what_it_tried(name: str) -> None:
    def no_memory(ds_config: dict[str, Any], slots: int) -> dict[str, Any]:
        raise MemoryError("does not fit")

    m = method(name)
    driver = run(m, no_memory)
    rungs = [rung.name for rung in m.fit_rungs]
    assert rungs == [
        "as submitted",
        "ZeRO-3",
        "ZeRO-3, optimizer states on the CPU",
        "ZeRO-3, optimizer states and parameters on the CPU",
    ]
    assert len(driver.history) == len(rungs) and driver.shutdown is not None
    assert driver.shutdown.failure
    profiles = [r for r in m.tracker.records if r.kind is TrialKind.MODEL_PROFILE]
    assert profiles[0].zero_stage < 3 and [r.zero_stage for r in profiles[1:]] == [3, 3, 3]
    assert "offload_param" in profiles[-1].ds_config["zero_optimization"]
    reason = m.shutdown_reason
    assert reason is not None and "in any way dsat tried" in reason
    assert all(rung in reason for rung in rungs) and "--offload-nvme" in reason


def test_profile_without_model_info_fails_the_same_way() -> None:
    m = method("binary")
    driver = run(m, lambda ds_config, slots: {"throughput": 1.0})
    assert driver.shutdown is not None and driver.shutdown.failure and m.model_profile_failed()


@pytest.mark.parametrize("name", REFERENCE_METHODS)
def test_same_seed_same_trials(name: str) -> None:
    runs = [
        history(run(method(name, random_seed=seed), cliff_function(21, {2: 0.2})))
        for seed in (5, 5, 6)
    ]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


@pytest.mark.parametrize("name", METHODS)
def test_smaller_is_better_metric(name: str) -> None:
    m = method(name, metric="latency", zero_stages=(1,), max_concurrent_trials=4)
    run(m, cliff_function(17))
    best = m.tracker.best()
    assert best is not None and best.mbs == 17  # latency = 1000 / throughput: largest batch wins
    values = [m.tracker.metric_value(r) for r in m.tracker.records]
    assert m.tracker.metric_value(best) == min(v for v in values if v is not None)


@pytest.mark.parametrize("name", METHODS)
def test_resumed_search_proposes_the_same_trials(name: str) -> None:
    """Interrupt after event k, rebuild the method from its JSON state, carry on: same trials."""
    function = cliff_function(19, {1: 0.3, 2: 0.1})
    # guided ends once nothing can beat its best (here after 30 trials, so it gets 40, and the
    # resumed search must end by itself too); the others spend every trial
    max_trials = 30 if name in REFERENCE_METHODS else 40
    overrides = {"max_trials": max_trials, "max_concurrent_trials": 4, "random_seed": 11}
    baseline = history(run(method(name, **overrides), function))
    assert len(baseline) == 30 if name in REFERENCE_METHODS else 15 < len(baseline) < max_trials
    for k in range(1, 30, 3):
        first = method(name, **overrides)
        driver = SearchDriver(first, SimulatedRunner(function, 1), max_events=k)
        driver.run()
        saved = json.loads(json.dumps(first.state_json()))  # only JSON survives the crash
        second = method(name, **overrides)
        second.load_state_json(saved)
        driver.method, driver.max_events = second, None
        driver.loop()
        assert history(driver) == baseline, f"diverged after resuming at event {k}"


class StateAfterEachOutcome:
    """The method's state as saved after each outcome, before the trials it lets start: where
    Determined checkpoints the search runner between two events."""

    def __init__(self, method: Any) -> None:
        self.method = method
        self.saved: list[dict[str, Any]] = []

    def trial_started(self, request_id: str) -> None:
        pass

    def trial_finished(self, request_id: str, outcome: object) -> None:
        self.saved.append(json.loads(json.dumps(self.method.state_json())))

    def trial_retried(self, request_id: str, outcome: object, attempt: int) -> None:
        pass


@pytest.mark.parametrize("name", METHODS)
def test_a_state_saved_between_an_outcome_and_what_follows_it_carries_on_alike(name: str) -> None:
    """A search runner restarted there loads its state without a resume (its trials run on in
    the cluster): the stop rules that outcome was owed were lost, and after the last search
    trial's outcome no confirmation round and no end came (the search waited for ever)."""
    function = cliff_function(19, {1: 0.3, 2: 0.1})
    overrides = {"max_trials": 12, "max_concurrent_trials": 1, "random_seed": 11, "confirm_top": 2}
    first = method(name, **overrides)
    states = StateAfterEachOutcome(first)
    driver = SearchDriver(first, SimulatedRunner(function, 1), [states])
    driver.run()
    whole = history(driver)
    assert any(r.kind is TrialKind.CONFIRM for r in first.tracker.records)  # the round came
    for k, saved in enumerate(states.saved):
        restarted = method(name, **overrides)
        restarted.load_state_json(saved)
        rest = SearchDriver(restarted, SimulatedRunner(function, 1))
        rest.start_suggested()
        rest.loop()
        assert whole[: k + 1] + history(rest) == whole, f"diverged after outcome {k + 1}"


def test_state_belongs_to_its_method() -> None:
    state = method("asha").state_json()
    with pytest.raises(ValueError, match="asha"):
        method("binary").load_state_json(state)


def test_the_model_profile_runs_alone_then_search_trials_run_the_measured_window() -> None:
    m = method("binary", max_trials=10)
    (profile,) = suggested(m)
    assert profile.kind is TrialKind.MODEL_PROFILE and m.trial_length(profile) == 1
    assert m.suggest() is None  # nothing else runs before the profile's outcome
    m.observe(outcome(profile.request_id, TrialStatus.COMPLETED, metrics=dict(PROFILE)))
    started = suggested(m)
    assert started and all(r.status is TrialStatus.RUNNING for r in started)
    # A search trial runs through dsat's measured window, DeepSpeed then ends it.
    _, last = measured_window(m.settings.start_profile_step, m.settings.end_profile_step)
    assert {m.trial_length(r) for r in started} == {last + 1}
    assert last + 1 >= WARMUP_STEPS + MEASURED_STEPS


def test_a_second_outcome_for_a_finished_trial_changes_nothing() -> None:
    """On a cluster a trial that reported its metrics can still be marked errored afterwards
    (DeepSpeed's exit racing the Close); the first outcome stands."""
    m = method("binary", max_trials=10)
    (first, *_) = start_profile(m)
    metrics = {"FLOPS_per_gpu": 5e9, "throughput": 5.0}
    m.observe(outcome(first.request_id, TrialStatus.COMPLETED, metrics=metrics))
    queued = list(m.tracker.queue)
    m.observe(outcome(first.request_id, TrialStatus.ERROR, error="exit 1"))
    m.observe(outcome(first.request_id, TrialStatus.COMPLETED, metrics={"FLOPS_per_gpu": 1.0}))
    record = m.tracker.get(first.request_id)
    assert record.status is TrialStatus.COMPLETED and record.metrics == metrics
    assert m.tracker.queue == queued  # no failure follow-ups were queued


def test_a_hook_must_return_every_trial_it_built() -> None:
    """What a hook returns is what is queued: a trial built and left out would be counted as
    proposed and never run, so the protocol refuses it."""
    m = method("binary", max_trials=50, max_concurrent_trials=2)
    (first, *_) = start_profile(m)

    def forgets_what_it_built(record: TrialRecord) -> list[TrialRecord]:
        m.new_lineage()  # registered, not returned
        return []

    m.after_success = forgets_what_it_built  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="did not return"):
        m.observe(outcome(first.request_id, TrialStatus.COMPLETED, metrics={"FLOPS_per_gpu": 1.0}))


def test_the_search_core_imports_nothing_from_determined() -> None:
    """dsat/search/ runs with no cluster platform at all: checked in a fresh interpreter."""
    code = (
        "import sys, dsat.search, dsat.runners.driver, dsat.runners.simulated.runner;"
        "print([m for m in sys.modules if m.split('.')[0] == 'determined'])"
    )
    printed = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert printed.strip() == "[]"


def test_every_method_the_cli_names_is_registered_under_its_own_name() -> None:
    assert list(REGISTERED) == list(SEARCH_METHODS)
    assert all(REGISTERED[name].name == name for name in SEARCH_METHODS)


@pytest.mark.parametrize("name", METHODS)
def test_the_memory_model_counts_at_the_precision_the_profile_ran(name: str) -> None:
    """A JSON that leaves mixed precision to HF's Trainer ("auto") reads as fp32; the profile's
    report of bf16 makes the model count 20 bytes a parameter, not 16, and lowers the ceiling."""
    auto = {**BASE_DS, "bf16": {"enabled": "auto"}}
    profile = {**PROFILE, "num_params": 10**6, "trainable_num_params": 10**6}
    ceilings = {}
    for reported in ({}, {"precision": "bf16"}):
        m = make_search_method(settings(name), spec(ds_config=auto))
        (first,) = suggested(m)
        m.observe(outcome(first.request_id, TrialStatus.COMPLETED, metrics={**profile, **reported}))
        ceilings[bool(reported)] = (m.precision, m.micro_batch_ceiling(1))
    assert ceilings[False][0] is Precision.FP32
    assert ceilings[True][0] is Precision.BF16
    # fp32: 16e6 bytes of states at ZeRO-1 on one GPU; bf16: 20e6, 4 samples of 1e6 fewer.
    assert ceilings[False][1] - ceilings[True][1] == 4


def test_the_memory_estimates_name_only_the_stages_searched(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With -z 1 the launch printed estimates for ZeRO-0, 2 and 3 too, as if they would run."""
    m = method("binary", zero_stages=(1, 3))
    with caplog.at_level("INFO", logger="dsat"):
        start_profile(m)
    said = [r.getMessage().split(":")[0] for r in caplog.records if "approx. max" in r.message]
    assert said == ["ZeRO-1", "ZeRO-3"]


def test_a_stage_over_the_device_at_micro_batch_1_is_not_said_to_fit_at_1(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """ "ZeRO-0: 263 GiB per GPU at micro-batch 1, approx. max micro-batch 1" on an 80 GiB
    device read as "fits at 1"."""
    m = method("binary", zero_stages=(0, 1))
    (profile,) = suggested(m)
    small = {**PROFILE, "gpu_mem": int(PROFILE["num_params"]) * 4}  # less than ZeRO-0's state
    with caplog.at_level("INFO", logger="dsat"):
        m.observe(outcome(profile.request_id, TrialStatus.COMPLETED, metrics=small))
    (zero_0,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ZeRO-0")]
    assert "does not fit by this estimate" in zero_0 and "approx. max" not in zero_0


@pytest.mark.parametrize("how", ["its rules", "a user's stop"])
def test_a_finished_search_loads_as_finished(how: str) -> None:
    """A Determined search runner restarted after it posted Shutdown loaded the search as
    unfinished, and said the trials' experiment "was stopped from outside the search"."""
    m = method("binary", max_trials=6)
    if how == "its rules":
        run(m, cliff_function(64))
    else:
        (profile,) = suggested(m)
        m.abandon(profile.request_id, "trial exited early: USER_CANCELED")
    assert m.finished
    loaded = method("binary", max_trials=6)
    loaded.load_state_json(json.loads(json.dumps(m.state_json())))
    assert loaded.finished and loaded.suggest() is None
    assert loaded.ending.stopped_from_outside is (how == "a user's stop")
    assert loaded.shutdown_reason == m.shutdown_reason


@pytest.mark.parametrize("name", METHODS)
def test_the_trials_planned_never_grow_with_a_baseline_and_a_confirmation_round(name: str) -> None:
    """The progress line's "5 of at most 5 trials" went on to "6 of at most 8": the user's
    baseline and the confirmation round were added as they came."""
    m = make_search_method(
        settings(name, max_trials=8, confirm_top=3, baseline=True),
        spec(1, {**BASE_DS, "zero_optimization": {"stage": 1}}),
    )
    planned: list[int] = []

    class Watch:
        def trial_started(self, request_id: str) -> None:
            planned.append(m.planned_trials())

        def trial_finished(self, request_id: str, outcome: Any) -> None:
            planned.append(m.planned_trials())

        def trial_retried(self, request_id: str, outcome: Any, attempt: int) -> None:
            pass

    SearchDriver(m, SimulatedRunner(cliff_function(64), 1), listeners=[Watch()]).run()
    kinds = [r.kind for r in m.tracker.finished]
    assert TrialKind.BASELINE in kinds and TrialKind.CONFIRM in kinds
    assert planned[0] == 8 + 1 + 3 and planned == sorted(planned, reverse=True)
    assert planned[-1] >= len(m.tracker.finished)
