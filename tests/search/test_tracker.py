"""The tracker: registration without repeats, the global limits, best trials, lineages."""

from __future__ import annotations

import math

import pytest

from dsat.experiment.metric import Metric
from dsat.search.short_batches import short_batches_line
from dsat.search.tracker import TrialTracker
from dsat.trial import SearchRange, TrialKind, TrialRecord, TrialStatus


def record(
    rid: str,
    mbs: int,
    stage: int = 1,
    lineage: str | None = None,
    parent: str | None = None,
    kind: TrialKind = TrialKind.SEARCH,
) -> TrialRecord:
    overwrites = {"train_micro_batch_size_per_gpu": mbs, "zero_optimization": {"stage": stage}}
    return TrialRecord(
        request_id=rid,
        index=0,
        kind=kind,
        hparams={"overwrite_deepspeed_args": overwrites},
        ds_config=overwrites,
        zero_stage=stage,
        mbs=mbs,
        gas=1,
        lineage_id=lineage or rid,
        parent_id=parent,
        search_range=SearchRange(1, 16),
    )


def tracker(
    metric: Metric = Metric.THROUGHPUT,
    max_trials: int = 10,
    concurrent: int = 4,
    max_slots: int | None = None,
    slots: int = 1,
) -> TrialTracker:
    return TrialTracker(metric, max_trials, concurrent, max_slots, slots)


def test_never_registers_a_configuration_twice() -> None:
    t = tracker()
    assert t.add(record("a", 4))
    assert not t.add(record("b", 4))  # same overrides, another id
    assert "b" not in t and t.queue == ["a"]
    t.mark_running(t.dequeue("a").request_id)
    t.mark_finished("a", TrialStatus.COMPLETED, {"throughput": 1.0})
    assert not t.add(record("c", 4))  # it already ran
    assert t.add(record("d", 4, stage=2))


def test_concurrency_and_trial_limits() -> None:
    t = tracker(max_trials=3, concurrent=2)
    for i in range(5):
        t.add(record(f"r{i}", i + 1))
    started = []
    while t.can_start_more():
        started.append(t.dequeue(t.queue[0]).request_id)
        t.mark_running(started[-1])
    assert started == ["r0", "r1"]  # concurrency 2
    t.mark_finished("r0", TrialStatus.COMPLETED, {"throughput": 1.0})
    assert t.can_start_more()
    t.mark_running(t.dequeue("r2").request_id)
    t.mark_finished("r1", TrialStatus.OOM)
    assert not t.can_start_more()  # three started: max_trials reached, though one slot is free
    assert t.num_started == 3


def test_slot_limit() -> None:
    t = tracker(concurrent=16, max_slots=8, slots=4)
    for i in range(4):
        t.add(record(f"r{i}", i + 1))
    count = 0
    while t.can_start_more():
        t.mark_running(t.dequeue(t.queue[0]).request_id)
        count += 1
    assert count == 2  # 2 trials x 4 slots = the 8 allowed


def test_best_per_stage_and_overall() -> None:
    t = tracker(Metric.THROUGHPUT)
    values = {"a": (1, 10.0), "b": (1, 30.0), "c": (2, 20.0), "d": (3, 50.0)}
    for rid, (stage, value) in values.items():
        t.add(record(rid, int(value), stage))
        t.mark_finished(rid, TrialStatus.COMPLETED, {"throughput": value})
    t.add(record("e", 99, 3))
    t.mark_finished("e", TrialStatus.OOM)
    profile = record("p", 1, kind=TrialKind.MODEL_PROFILE)
    t.add(profile, queue=False)
    t.mark_finished("p", TrialStatus.COMPLETED, {"throughput": 1e9})  # never counts as best
    assert (
        t.best(1).request_id == "b" and t.best(2).request_id == "c" and t.best(3).request_id == "d"
    )
    assert t.best().request_id == "d"
    assert t.best(0) is None
    assert t.successful_stages == {1, 2, 3}


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_metric_that_is_no_finite_number_is_none_and_never_the_best(bad: float) -> None:
    t = tracker(Metric.THROUGHPUT)
    for rid, value in {"a": 10.0, "b": bad, "c": 20.0}.items():
        t.add(record(rid, len(rid) + int(value if math.isfinite(value) else 7)))
        t.mark_finished(rid, TrialStatus.COMPLETED, {"throughput": value})
    assert t.best().request_id == "c"
    assert t.metric_value(t.get("b")) is None


def test_smaller_is_better_and_deepspeed_key_names() -> None:
    t = tracker(Metric.FORWARD)
    for rid, fwd in {"a": 3.0, "b": 1.0, "c": 2.0}.items():
        t.add(record(rid, int(fwd * 10)))
        t.mark_finished(rid, TrialStatus.COMPLETED, {"fwd": fwd})  # DeepSpeed writes "fwd"
    assert t.best().request_id == "b"
    assert t.metric_value(t.get("c")) == 2.0


def test_trials_since_best() -> None:
    t = tracker()
    for rid, value in [("a", 1.0), ("b", 0.5), ("c", 2.0), ("d", 0.1)]:
        t.add(record(rid, int(value * 10) + 1))
        t.mark_finished(rid, TrialStatus.COMPLETED, {"throughput": value})
    assert t.trials_since_best == 1  # "c" was best, "d" did not beat it
    t.add(record("e", 77))
    t.mark_finished("e", TrialStatus.ERROR)
    assert t.trials_since_best == 2


def test_lineage_and_error_history() -> None:
    t = tracker()
    t.add(record("a", 8))
    t.add(record("b", 12, lineage="a", parent="a"))
    t.add(record("c", 10, lineage="a", parent="b"))
    t.add(record("x", 3, stage=2))
    t.mark_finished("a", TrialStatus.COMPLETED, {"throughput": 8.0})
    t.mark_finished("b", TrialStatus.OOM)
    assert [r.request_id for r in t.lineage("a")] == ["a", "b", "c"]
    assert t.latest_in_lineage("a").request_id == "c"
    assert t.finished_in_lineage("a") == 2
    assert t.lineage_ids() == ["a", "x"]
    assert t.error_in_history(t.get("c")) and t.error_in_history(t.get("b"))
    assert not t.error_in_history(t.get("a")) and not t.error_in_history(t.get("x"))


def test_state_round_trip() -> None:
    t = tracker()
    t.add(record("a", 8))
    t.add(record("b", 9))
    t.mark_running(t.dequeue("a").request_id)
    again = tracker()
    again.load_json(t.to_json())
    assert again.records == t.records and again.queue == ["b"]
    assert not again.add(record("z", 8))  # repeat detection survives the round trip


def test_a_trial_over_the_memory_margin_is_too_large_and_never_the_best() -> None:
    """One that ran but left less than --memory-margin free counts, for the search, as a
    micro-batch too large (as an OOM does), and is never the best there is."""
    t = TrialTracker(Metric.THROUGHPUT, 10, 4, None, 1, memory_margin=0.05)
    for rid, mbs, used in (("roomy", 4, 0.80), ("tight", 8, 0.96), ("unmeasured", 2, None)):
        t.add(record(rid, mbs), queue=False)
        memory = (
            {} if used is None else {"memory_peak_bytes": used * 100, "memory_total_bytes": 100}
        )
        t.mark_finished(rid, TrialStatus.COMPLETED, {"throughput": float(mbs), **memory})
    t.add(record("oom", 9), queue=False)
    t.mark_finished("oom", TrialStatus.OOM)
    tight, roomy, unmeasured = t.get("tight"), t.get("roomy"), t.get("unmeasured")
    assert tight.memory_fraction == 0.96 and unmeasured.memory_fraction is None
    assert not t.leaves_margin(tight) and t.leaves_margin(roomy) and t.leaves_margin(unmeasured)
    assert t.too_large(tight) and t.too_large(t.get("oom"))
    assert not t.too_large(roomy) and not t.too_large(unmeasured)
    assert t.metric_value(tight) == 8.0  # what it measured stays in the record
    best = t.best()
    assert best is not None and best.request_id == "roomy"  # 8.0 is faster, but too tight
    assert TrialTracker(Metric.THROUGHPUT, 10, 4, None, 1).leaves_margin(tight)  # no margin


def test_flops_count_the_model_once_so_zero3_does_not_win_on_a_double_count() -> None:
    """DeepSpeed's profiler counted a small GPT's ZeRO-3 trials at 365.5 MFLOPs a sample and its
    ZeRO-0/1/2 trials at 189.4 (a new user's search handed over a ZeRO-3 configuration 25%
    slower). Ranked by FLOPS_per_gpu, a trial counts the least FLOPs a sample any trial gave."""
    t = tracker(Metric.FLOPS_PER_GPU)
    figures = {
        "z1": (1, 48, 345.0, 189.4e6),
        "z3": (3, 48, 306.0, 365.5e6),
        "z3b": (3, 40, 290.0, 365.5e6),
    }
    for rid, (stage, mbs, throughput, per_sample) in figures.items():
        t.add(record(rid, mbs, stage=stage))
        t.mark_running(t.dequeue(rid).request_id)
        metrics = {"throughput": throughput, "FLOPS_per_gpu": throughput * per_sample}
        t.mark_finished(rid, TrialStatus.COMPLETED, metrics)
    assert t.best() is t.get("z1")
    assert t.metric_value(t.get("z3")) == 306.0 * 189.4e6
    assert t.metric_value(t.get("z1")) == 345.0 * 189.4e6  # its own figure, untouched
    # Among configurations that count alike, the ranking is the trials' own figures'.
    assert t.best_of([t.get("z3"), t.get("z3b")]) is t.get("z3")
    # A resumed search counts alike.
    again = tracker(Metric.FLOPS_PER_GPU)
    again.load_json(t.to_json())
    assert again.metric_value(again.get("z3")) == 306.0 * 189.4e6


def test_a_trial_fed_short_batches_sets_no_flops_a_sample() -> None:
    """Its FLOPs come from one profiled step and its samples from the window: with the HF
    example at 4096 samples, micro-batches in the thousands gave 0.68x the others' FLOPs a
    sample, which would have counted every other trial at 0.68x of itself."""
    t = tracker(Metric.FLOPS_PER_GPU)
    figures = {
        "full": (64, 300.0, 189.4e6, {}),
        "short": (1632, 360.0, 0.68 * 189.4e6, {"full_batch_share": 0.83}),
    }
    for rid, (mbs, throughput, per_sample, extra) in figures.items():
        t.add(record(rid, mbs))
        t.mark_running(t.dequeue(rid).request_id)
        metrics = {"throughput": throughput, "FLOPS_per_gpu": throughput * per_sample, **extra}
        t.mark_finished(rid, TrialStatus.COMPLETED, metrics)
    assert t.metric_value(t.get("full")) == 300.0 * 189.4e6  # not 0.68x of itself
    assert t.metric_value(t.get("short")) == pytest.approx(360.0 * 0.68 * 189.4e6)
    line = short_batches_line(t.finished)
    assert "1 trial(s) (z1_mb1632)" in line and "83% of a full batch" in line
    assert "--dataloader_drop_last true" in line and "drop_last=True" in line  # not HF's alone
    t.mark_finished("full", TrialStatus.COMPLETED, {"throughput": 300.0})
    assert short_batches_line([t.get("full")]) == ""


def test_confirmation_runs_are_found_after_a_round_trip_and_forgotten_when_discarded() -> None:
    t = tracker()
    t.add(record("a", 4))
    t.add(record("a-confirm-0", 4, stage=2, parent="a", kind=TrialKind.CONFIRM))
    t.add(record("a-confirm-1", 4, stage=3, parent="a", kind=TrialKind.CONFIRM))
    t.add(record("b", 8, parent="a"))  # a search trial of its lineage is no confirmation run
    assert [r.request_id for r in t.confirmation_runs("a")] == ["a-confirm-0", "a-confirm-1"]
    again = tracker()
    again.load_json(t.to_json())
    assert [r.request_id for r in again.confirmation_runs("a")] == ["a-confirm-0", "a-confirm-1"]
    again.discard("a-confirm-0")
    assert [r.request_id for r in again.confirmation_runs("a")] == ["a-confirm-1"]
    assert again.confirmation_runs("b") == []


def test_each_kind_of_run_measures_only_what_it_is() -> None:
    """A profile's figures are no measurement of a configuration the search compares; the
    global row is the mean of a search trial's runs, a failed run left out."""
    t = tracker()
    runs = {
        "s": (record("s", 8), TrialStatus.COMPLETED, 100.0),
        "c1": (record("s", 8, kind=TrialKind.CONFIRM, parent="s"), TrialStatus.COMPLETED, 110.0),
        "c2": (record("s", 8, kind=TrialKind.CONFIRM, parent="s"), TrialStatus.COMPLETED, 120.0),
        "c3": (record("s", 8, kind=TrialKind.CONFIRM, parent="s"), TrialStatus.ERROR, 0.0),
        "p": (record("p", 1, kind=TrialKind.MODEL_PROFILE), TrialStatus.COMPLETED, 5.0),
        "b": (record("b", 2, kind=TrialKind.BASELINE), TrialStatus.COMPLETED, 50.0),
    }
    for rid, (made, status, value) in runs.items():
        t.add(made.replace(request_id=rid), queue=False)
        t.mark_finished(rid, status, {"throughput": value} if value else {})
    s, c1, p, b = t.get("s"), t.get("c1"), t.get("p"), t.get("b")
    assert t.mean_of_runs(s) == 110.0
    assert t.measured_value(p) is None and t.measured_value(b) == 50.0
    assert t.measured_value(c1) == 110.0 and t.measured_value(s) == 100.0
    assert t.baseline_value(b) == 50.0 and t.baseline_value(s) is None
    assert t.confirmed_value(c1) == 110.0 and t.confirmed_value(s) is None
    assert t.metric_value(c1) is None and t.metric_value(b) is None


def test_a_trial_that_reports_no_throughput_or_no_device_total_breaks_nothing() -> None:
    """A throughput of 0 beside FLOPS (a broken step timer) gives no FLOPs a sample to divide
    by; a device total of 0 says nothing of the memory the trial left free."""
    t = tracker(Metric.FLOPS_PER_GPU)
    t.add(record("zero", 4), queue=False)
    metrics = {"throughput": 0.0, "FLOPS_per_gpu": 3.0e9, "memory_peak_bytes": 10}
    t.mark_finished("zero", TrialStatus.COMPLETED, {**metrics, "memory_total_bytes": 0})
    assert t.metric_value(t.get("zero")) == 3.0e9
    assert t.leaves_margin(t.get("zero")) and t.best() is t.get("zero")
