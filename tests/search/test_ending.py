"""How a search ends when its trials fail for something no configuration causes."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from dsat.search.ending import (
    no_search_trial_succeeded,
    profile_failure,
    repeated_script_failure,
    repeated_unknown_failure,
    rungs_left_out,
)
from dsat.trial import TrialKind, TrialOutcome, TrialRecord, TrialStatus
from dsat.trial_failure import (
    FROM_OUTSIDE,
    MACHINE_FAILURES_TO_STOP,
    OP_NOT_BUILT,
    SCRIPT_FAILURES_TO_STOP,
    UNKNOWN_FAILURES_TO_STOP,
    WHO_ELSE,
    FailureCause,
)
from tests.search.helpers import finish, method, start_profile, suggested
from tests.search.test_tracker import record

TOO_SHORT = "training ended after 3 optimizer steps; dsat needs 15 to measure this configuration"


def fail(m: Any, record: TrialRecord, error: str, cause: FailureCause) -> None:
    m.observe(
        TrialOutcome(
            record.request_id, TrialStatus.ERROR, {}, f"{error}\ntail", 0.0, 1.0, cause, "x.log"
        )
    )


@pytest.mark.parametrize("name", ["binary", "random", "guided", "asha"])
def test_trials_failing_alike_for_the_script_stop_the_search_early(name: str) -> None:
    m = method(name, max_trials=40)
    running = start_profile(m)
    failed = 0
    while running and not m.finished:  # one at a time, as trials end
        fail(m, running.pop(0), TOO_SHORT, FailureCause.SCRIPT)
        failed += 1
        running += suggested(m)
    assert failed == SCRIPT_FAILURES_TO_STOP  # not the 40 trials of its budget
    assert m.finished and m.search_failed
    reason = m.shutdown_reason or ""
    assert reason.startswith(f"the last {SCRIPT_FAILURES_TO_STOP} trials failed alike")
    assert TOO_SHORT in reason and "(log: x.log)" in reason


@pytest.mark.parametrize("name", ["binary", "guided"])
def test_an_epoch_too_short_at_every_micro_batch_stops_the_search(name: str) -> None:
    """A loop over one epoch runs fewer steps at a larger micro-batch: each trial's reason
    counts its own steps, and they are still alike."""
    m = method(name, max_trials=40)
    running = start_profile(m)
    failed = 0
    while running and not m.finished:
        record = running.pop(0)
        fail(m, record, TOO_SHORT.replace(" 3 ", f" {3 + failed} "), FailureCause.SCRIPT)
        failed += 1
        running += suggested(m)
    assert failed == SCRIPT_FAILURES_TO_STOP
    assert (m.shutdown_reason or "").startswith("the last 3 trials failed alike")


ILLEGAL_ACCESS = "RuntimeError: CUDA error: an illegal memory access was encountered"


@pytest.mark.parametrize("name", ["binary", "random", "guided", "asha"])
@pytest.mark.parametrize("one_completed", [False, True])
def test_crashes_of_no_known_kind_alike_whatever_the_config_stop_a_search_with_no_success(
    name: str, one_completed: bool
) -> None:
    """Before any configuration has succeeded, five trials crashing alike over several stages
    and micro-batches stop the search; once one has, such crashes are configurations' (a stage or
    a size that breaks something), and the search goes on."""
    m = method(name, max_trials=40)
    running = start_profile(m)
    if one_completed:
        running += finish(m, running.pop(0).request_id)
    failed = 0
    while running and not m.finished and failed < 3 * UNKNOWN_FAILURES_TO_STOP:
        fail(m, running.pop(0), ILLEGAL_ACCESS, FailureCause.UNKNOWN)
        failed += 1
        running += suggested(m)
    reason = m.shutdown_reason or ""
    if one_completed:
        assert "failed alike" not in reason and failed > UNKNOWN_FAILURES_TO_STOP
        return
    assert failed == UNKNOWN_FAILURES_TO_STOP and m.search_failed
    assert reason.startswith(f"the last {UNKNOWN_FAILURES_TO_STOP} trials failed alike over ZeRO")
    assert ILLEGAL_ACCESS in reason and "fix the training script" in reason


@pytest.mark.parametrize(
    ("name", "why", "remedy"),
    [
        ("binary", "the GPU is failing", "fix the machine"),
        ("guided", "the GPU is failing", "fix the machine"),
        # dsat cannot tell another process's signal from the script's own: it says so
        (
            "guided",
            f"killed by SIGKILL {FROM_OUTSIDE}: {WHO_ELSE}",
            f"find what stops them ({WHO_ELSE})",
        ),
    ],
)
def test_trials_the_machine_fails_on_every_attempt_stop_the_search(
    name: str, why: str, remedy: str
) -> None:
    """A GPU gone mid-search: each later trial took its three attempts and counted as its
    configuration's failure, to the end of the budget."""
    m = method(name, max_trials=40)
    running = start_profile(m)
    gone = f"the machine failed this trial 3 time(s), not its configuration: {why}"
    failed = 0
    while running and not m.finished:
        fail(m, running.pop(0), gone, FailureCause.MACHINE)
        failed += 1
        running += suggested(m)
    assert failed == MACHINE_FAILURES_TO_STOP
    reason = m.shutdown_reason or ""
    assert reason.startswith(
        f"the machine failed the last {MACHINE_FAILURES_TO_STOP} trials on every attempt, not "
        f"their configurations: {why} (log: x.log); {remedy} and start again"
    ), reason


@pytest.mark.parametrize("name", ["binary", "random", "guided", "asha"])
def test_a_trial_the_machine_failed_runs_again_and_only_a_second_failure_counts(name: str) -> None:
    """A trial the machine failed on every attempt (a GPU that came back) is not its
    configuration's failure: it runs once more, and its micro-batch is not taken for too large
    until the machine fails that run too."""
    m = method(name, max_trials=40)
    running = start_profile(m)
    first = running.pop(0)
    gone = "the machine failed this trial 3 time(s), not its configuration: the GPU is failing"
    fail(m, first, gone, FailureCause.MACHINE)
    assert not m.tracker.too_large(m.tracker.get(first.request_id))
    again = [r for r in suggested(m) if r.parent_id == first.request_id]
    assert [(r.hparams, r.mbs, r.lineage_id) for r in again] == [
        (first.hparams, first.mbs, first.lineage_id)
    ]
    (rerun,) = again
    if name == "guided":  # its own plan does not propose the micro-batch again beside it
        keys = [(r.zero_key, r.mbs) for r in m.tracker.records if not r.status.finished]
        assert keys.count((first.zero_key, first.mbs)) == 1
    # Saved and loaded, the state says the same (a resume between the two runs).
    loaded = method(name, max_trials=40)
    loaded.load_state_json(json.loads(json.dumps(m.state_json())))
    assert loaded.tracker.is_repeat(rerun) and not loaded.tracker.too_large(first)
    if running:  # a success between the two: the machine's failures are not in a row
        finish(m, running.pop(0).request_id)
    fail(m, rerun, gone, FailureCause.MACHINE)
    assert m.tracker.too_large(m.tracker.get(rerun.request_id))
    assert not any(r.parent_id == rerun.request_id and r.mbs == rerun.mbs for r in suggested(m))


def test_failures_that_differ_or_may_be_the_configs_do_not_stop_it() -> None:
    records = [
        TrialRecord("a", 1, "search", {}, {}, 1, 1, 1, "a", status=TrialStatus.ERROR),  # type: ignore[arg-type]
    ]
    assert repeated_script_failure(records) is None  # too few
    alike = [
        r.replace(request_id=str(i), error=TOO_SHORT, cause=FailureCause.SCRIPT)
        for i, r in enumerate(records * SCRIPT_FAILURES_TO_STOP)
    ]
    assert repeated_script_failure(alike) is not None
    crash = alike[-1].replace(error="ValueError: bad", cause=FailureCause.UNKNOWN)
    assert repeated_script_failure([*alike[:-1], crash]) is None
    other = alike[-1].replace(error="ModuleNotFoundError: No module named 'x'")
    assert repeated_script_failure([*alike[:-1], other]) is None


def test_failures_alike_but_for_the_trial_directory_they_name_stop_it() -> None:
    """Each trial runs in its own copy, which an ImportError names: never "alike" before."""
    record = TrialRecord("a", 1, "search", {}, {}, 1, 1, 1, "a", status=TrialStatus.ERROR)  # type: ignore[arg-type]
    alike = [
        record.replace(
            request_id=str(i),
            error=f"ImportError: cannot import name 'collate' from 'utils' "
            f"(/r/trials/00{i}-{i}abcdef0/utils.py)",
            cause=FailureCause.SCRIPT,
        )
        for i in range(1, SCRIPT_FAILURES_TO_STOP + 1)
    ]
    reason = repeated_script_failure(alike)
    assert reason is not None and "cannot import name 'collate'" in reason


def test_a_stop_reason_keeps_the_fix_a_short_reason_would_cut_off() -> None:
    """The last line and the summary ended in "an HF Trainer's ...": the fix was cut at 200."""
    advice = "training ended after 4 optimizer steps; " + "let it run longer, " * 20 + "cycle it"
    record = TrialRecord("a", 1, "search", {}, {}, 1, 1, 1, "a", status=TrialStatus.ERROR)  # type: ignore[arg-type]
    alike = [
        record.replace(request_id=str(i), error=f"{advice}\ntail", cause=FailureCause.SCRIPT)
        for i in range(SCRIPT_FAILURES_TO_STOP)
    ]
    reason = repeated_script_failure(alike)
    assert len(advice) > 200 and reason is not None and advice in reason


@pytest.mark.parametrize(
    ("status", "cause", "says", "fix_the_config"),
    [
        (TrialStatus.OOM, FailureCause.CONFIG, "ran out of memory at micro-batch 1", True),
        (TrialStatus.ERROR, FailureCause.CONFIG, "DeepSpeed rejected", True),
        (TrialStatus.ERROR, FailureCause.SCRIPT, "until the training script is fixed", False),
        (TrialStatus.ERROR, FailureCause.MACHINE, "the configuration is not to blame", False),
        (TrialStatus.ERROR, FailureCause.UNKNOWN, "failed (micro-batch 1): ", False),
    ],
)
def test_a_failed_profile_quotes_its_reason_and_blames_the_config_only_when_it_is(
    status: TrialStatus, cause: FailureCause, says: str, fix_the_config: bool
) -> None:
    (profile,) = suggested(method("binary"))
    error = (
        "DeepSpeed rejected the configuration: DeepSpeedConfigError: bad"
        if cause is FailureCause.CONFIG and status is TrialStatus.ERROR
        else "SomeError: the reason"
    )
    record = profile.replace(status=status, error=f"{error}\ntail", cause=cause, log="l.log")
    reason = profile_failure(record)
    assert says in reason and error in reason and "(log: l.log)" in reason
    assert ("fix the" in reason and "config" in reason.split("fix the")[1]) is fix_the_config


def test_a_profile_whose_op_this_machine_cannot_build_blames_the_build_not_the_config() -> None:
    """It said "fix the DeepSpeed config" of a valid config whose fused Adam the machine's
    compiler could not build."""
    (profile,) = suggested(method("binary"))
    error = f"{OP_NOT_BUILT}: RuntimeError: Error building extension 'fused_adam'"
    record = profile.replace(
        status=TrialStatus.ERROR, error=error, cause=FailureCause.CONFIG, log="l.log"
    )
    reason = profile_failure(record)
    assert error in reason and "fix the DeepSpeed config" not in reason
    assert "fix the build" in reason and '"torch_adam": true' in reason


def test_a_profile_that_ran_but_reported_too_little_says_what_it_lacked() -> None:
    """It said "the model-profile trial failed at micro-batch 1: " and nothing after."""
    (profile,) = suggested(method("binary"))
    record = profile.replace(status=TrialStatus.COMPLETED, metrics={"num_params": 7}, log="l.log")
    reason = profile_failure(record)
    assert reason.startswith("the model-profile trial reported no trainable_num_params, ")
    assert "(log: l.log)" in reason and "dsat sizes the search from them" in reason


def ended(
    index: int,
    stage: int,
    mbs: int,
    status: TrialStatus = TrialStatus.ERROR,
    cause: FailureCause | None = FailureCause.UNKNOWN,
    error: str | None = "RuntimeError: the same bug",
    kind: TrialKind = TrialKind.SEARCH,
) -> TrialRecord:
    """A finished trial of ZeRO ``stage`` at micro-batch ``mbs``, as the tracker keeps it."""
    made = record(f"t{index}", mbs, stage=stage, kind=kind)
    return made.replace(index=index, status=status, error=error, cause=cause)


PROFILED = ended(0, 0, 1, TrialStatus.COMPLETED, None, None, TrialKind.MODEL_PROFILE)
# Five crashes alike over stages 1 and 2 at micro-batches 2 to 8: five configurations.
ALIKE = [ended(i, 1 + i % 2, 2 * (i + 1) if i < 4 else 2) for i in range(5)]


def test_crashes_alike_stop_a_search_only_over_several_stages_and_configurations() -> None:
    reason = repeated_unknown_failure([PROFILED, *ALIKE])
    assert reason is not None and "over ZeRO stages 1, 2 at micro-batches 2 to 8" in reason
    one_batch = repeated_unknown_failure([PROFILED, *[ended(i, 1 + i % 3, 4) for i in range(5)]])
    assert one_batch is not None and "at micro-batch 4, and" in one_batch
    for spoiled in (
        [*ALIKE[:4], ended(4, 2, 2, cause=FailureCause.CONFIG)],  # one is the config's
        [*ALIKE[:4], ended(4, 2, 2, TrialStatus.TIMEOUT)],  # one hung: slow, not the same bug
        [*ALIKE[:4], ended(4, 2, 2, error="ValueError: another")],  # two reasons
        [ended(i, 1, 2 * (i + 1)) for i in range(5)],  # one stage: its micro-batches may be why
        [ended(i, 1, 8 + i) for i in range(10)],  # ten, but over 8 to 17 only
        [ended(i, 1 + i % 2, 2 + 2 * (i % 2)) for i in range(5)],  # two configurations
        [ended(9, 1, 16, TrialStatus.COMPLETED, None, None), *ALIKE],  # one succeeded
        ALIKE[:4],  # too few yet
    ):
        assert repeated_unknown_failure([PROFILED, *spoiled]) is None


def test_with_one_stage_searched_twice_as_many_crashes_over_a_wide_range_stop_a_search() -> None:
    """--zero-stages 1: nine of nine trials crashed alike, micro-batch 410 down to 1, and the
    search ran its whole budget."""
    walk = [ended(i, 1, mbs) for i, mbs in enumerate((410, 192, 64, 32, 16, 8, 4, 2, 1, 3))]
    assert repeated_unknown_failure([PROFILED, *walk[:9]]) is None  # five are not enough
    reason = repeated_unknown_failure([PROFILED, *walk])
    assert reason is not None
    assert reason.startswith(
        "the last 10 trials failed alike over ZeRO stage 1 at micro-batches 1 to 410"
    )


def test_where_no_search_trial_succeeded_the_most_common_reason_is_said() -> None:
    assert no_search_trial_succeeded([PROFILED]) is None  # none ran
    oom = [ended(i, 1, 8 + i, TrialStatus.OOM, FailureCause.CONFIG, None) for i in range(2)]
    failed = [PROFILED, *oom, ended(3, 2, 4)]
    assert no_search_trial_succeeded(failed) == (
        "none of the 3 search trials succeeded; 2 ended with: oom"
    )
    assert no_search_trial_succeeded([*failed, ended(4, 1, 2, TrialStatus.COMPLETED)]) is None
    # One trial: not "none of the 1 search trials succeeded; 1 ended with".
    assert no_search_trial_succeeded([PROFILED, oom[0]]) == (
        "the one search trial did not succeed; it ended with: oom"
    )
    # Reasons that differ only in a number (a port, a step count) are one reason.
    refused = "ConnectionRefusedError: Connect call failed ('127.0.0.1', {port})"
    ports = [ended(i, 1, 2 + i, error=refused.format(port=29500 + i)) for i in range(3)]
    said = no_search_trial_succeeded([PROFILED, *ports, ended(5, 2, 4, error="ValueError: x")])
    assert said == (
        "none of the 4 search trials succeeded; 3 ended with: " + refused.format(port=29502)
    )


def test_a_profile_out_of_memory_names_the_rungs_only_where_the_ladder_climbed() -> None:
    oom = ended(0, 3, 1, TrialStatus.OOM, FailureCause.CONFIG, "CUDA out of memory")
    oom = dataclasses.replace(oom, kind=TrialKind.MODEL_PROFILE)
    climbed = profile_failure(oom, ["z1", "z3_offload_optimizer"])
    assert "in any way dsat tried (z1; z3_offload_optimizer)" in climbed
    assert "in any way dsat tried" not in profile_failure(oom, ["z1"])
    crashed = dataclasses.replace(oom, status=TrialStatus.ERROR, cause=FailureCause.SCRIPT)
    assert "in any way dsat tried" not in profile_failure(crashed, ["z1", "z3"])


def test_where_no_rung_fits_the_advice_names_the_rungs_the_flags_left_out() -> None:
    """Without stage 3 it advised --offload-nvme, which dsat refuses without stage 3, and never
    adding 3, which would have fit the model."""
    assert rungs_left_out((1, 2), None).startswith("add 3 to --zero-stages")
    assert rungs_left_out((1, 2), "/nvme").startswith("add 3 to --zero-stages")
    assert rungs_left_out((1, 2, 3), None).startswith("--offload-nvme PATH")
    assert rungs_left_out((1, 2, 3), "/nvme") == ""
    oom = ended(0, 2, 1, TrialStatus.OOM, FailureCause.CONFIG, "OOM", TrialKind.MODEL_PROFILE)
    reason = profile_failure(oom, ["as submitted", "ZeRO-2"], rungs_left_out((1, 2), None))
    assert "; add 3 to --zero-stages (" in reason and "--offload-nvme" not in reason


def test_an_nvme_rung_this_machine_cannot_load_says_so_after_the_rungs_below_it() -> None:
    """It read "the model-profile trial failed at micro-batch 1" with the cause unknown."""
    error = f"{OP_NOT_BUILT}: RuntimeError: Unable to JIT load the async_io op due to ..."
    failed = ended(0, 3, 1, TrialStatus.ERROR, FailureCause.CONFIG, error, TrialKind.MODEL_PROFILE)
    reason = profile_failure(failed, ["as submitted", "ZeRO-3", "ZeRO-3, both on NVMe (/n)"])
    assert reason.startswith(
        "the model ran out of memory in every other way dsat tried (as submitted; ZeRO-3), and "
        "the model-profile trial with NVMe offload failed: "
    )
    assert reason.endswith("install what it needs, or drop --offload-nvme")


@pytest.mark.parametrize("name", ["guided", "binary"])
def test_a_search_where_nothing_leaves_the_margin_hands_nothing_over_after_a_resume_too(
    name: str,
) -> None:
    """Every configuration that ran fills the device past --memory-margin: nothing is handed
    over, and the state says so (it was not saved, and a loaded search had to work it out)."""
    from tests.search.helpers import cliff_function, run

    fits = cliff_function(64)

    def full(ds_config: dict[str, Any], slots: int) -> dict[str, Any]:
        metrics = fits(ds_config, slots)
        if "memory_peak_bytes" not in metrics and "throughput" in metrics:
            metrics.update(memory_peak_bytes=99 * 2**30, memory_total_bytes=100 * 2**30)
        return metrics

    m = method(name, max_trials=8, memory_margin=0.1, confirm_top=3)
    run(m, full)
    assert m.ending.unsafe_memory and m.tracker.confirmed_id is None
    assert m.shutdown_reason is not None and m.shutdown_reason.endswith("none is handed over")
    assert m.search_failed
    loaded = method(name, max_trials=8, memory_margin=0.1, confirm_top=3)
    loaded.load_state_json(json.loads(json.dumps(m.state_json())))
    assert loaded.ending.unsafe_memory and loaded.search_failed
    assert loaded.ending.should_shutdown(loaded) and loaded.shutdown_reason == m.shutdown_reason
