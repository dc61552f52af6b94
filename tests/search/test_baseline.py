"""The user's own configuration, run once as submitted: on top of the budget, never handed over,
and the summary says how much faster the hand-over is, or why it did not run."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dsat.constants import STATE_FILE
from dsat.results.directory import SUMMARY_FILE, TRIALS_FILE
from dsat.runners.simulated.performance_model import optimum
from dsat.runners.simulated.performance_models import BUILTIN_MODELS
from dsat.runners.simulated.runner import SimulatedRunner
from dsat.search.baseline import (
    baseline_line,
    described_with_knobs,
    speedup_over_yours,
    times,
    yours_clearly_faster,
    yours_handed_over,
    yours_measured,
)
from dsat.search.method import DsatSearchMethod
from dsat.search.trial_builder import SearchSpec
from dsat.search_launch import closing_lines
from dsat.search_run import run_search
from dsat.trial import TrialKind, TrialStatus
from tests.search.helpers import cliff_function, search_settings

MODEL = BUILTIN_MODELS["gpt_1b_knobs_16xethernet"]
SLOTS = MODEL.gpus
USER = {
    "train_micro_batch_size_per_gpu": 2,
    "zero_optimization": {"stage": 1},
    **MODEL.base_ds_config,
}


def search(
    results: Path,
    ds_config: dict[str, Any],
    max_events: int | None = None,
    entrypoint: str | None = None,
    **flags: Any,
) -> DsatSearchMethod:
    spec = SearchSpec({"deepspeed_config": "ds.json"}, ds_config, SLOTS, entrypoint)
    settings = search_settings("binary", **{"max_trials": 10, "baseline": True, **flags})
    return run_search(settings, spec, SimulatedRunner(MODEL, SLOTS), results, max_events)


def rows(results: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (results / TRIALS_FILE).read_text().splitlines()]


def test_the_users_config_runs_once_after_the_profile_and_the_summary_compares(
    tmp_path: Path,
) -> None:
    method = search(tmp_path, USER)
    found = rows(tmp_path)
    assert [row["kind"] for row in found[:2]] == ["model_profile", "baseline"]
    baseline = found[1]
    assert (baseline["zero_stage"], baseline["mbs"]) == (1, 2)  # as submitted
    assert "zero_optimization" not in baseline["overwrites"]  # the user's own section
    # On top of --max-trials: the search still ran its 9 trials after the profile.
    assert sum(row["kind"] == "search" for row in found) == 9
    handed = method.tracker.best()
    assert handed is not None and handed.kind is TrialKind.SEARCH  # never the baseline
    mine = baseline["metrics"]["FLOPS_per_gpu"]
    theirs = method.tracker.metric_value(handed)
    assert theirs is not None and theirs > mine
    summary = (tmp_path / SUMMARY_FILE).read_text()
    line = next(x for x in summary.splitlines() if "your config" in x)
    assert line.startswith(f"{theirs / mine:.2f}x your config (FLOPS_per_gpu {mine:.4g}): ")
    assert line.endswith(f"ZeRO-1 micro-batch 2 -> {described_with_knobs(handed)}")
    assert "1 baseline" in summary  # and in the cost


def baseline_measured_at(method: DsatSearchMethod, ratio: float, **metrics: float) -> str:
    """The summary's line once the user's config's run measured ``ratio`` times the mean of the
    hand-over's runs (with ``metrics`` besides)."""
    tracker = method.tracker
    (baseline,) = [r for r in tracker.records if r.kind is TrialKind.BASELINE]
    handed = tracker.best()
    assert handed is not None
    theirs = tracker.mean_of_runs(handed)
    assert theirs is not None
    flops = float(baseline.metrics["FLOPS_per_gpu"])
    scale = ratio * theirs / flops
    rate = float(baseline.metrics["throughput"]) * scale
    measured = {**baseline.metrics, "FLOPS_per_gpu": flops * scale, "throughput": rate, **metrics}
    tracker.mark_finished(baseline.request_id, baseline.status, measured)
    return baseline_line(method)


def test_a_hand_over_slower_than_the_users_config_says_whether_that_is_the_noise(
    tmp_path: Path,
) -> None:
    """ "0.83x your config" alone reads as "dsat made it worse": where the user's config measured
    faster, the summary and the last lines say whether by more than the noise the search's runs
    showed (then: keep yours), or level within it; so does a hand-over ahead within the noise.
    Here the baseline's run is set 1% below, then 1% and 30% above the mean of the hand-over's
    runs."""
    method = search(tmp_path, USER)
    assert baseline_line(method).count(";") == 0  # faster than the user's: nothing to add

    def measured_at(ratio: float) -> str:
        return baseline_measured_at(method, ratio)

    # "1.01x your config" read as a gain the runs did not show.
    ahead = measured_at(0.99)
    assert ahead.startswith("1.01x your config") and "; level with your config within" in ahead
    assert not yours_clearly_faster(method)
    level = measured_at(1.01)
    assert level.startswith("0.99x your config") and "; level with your config within" in level
    assert not yours_clearly_faster(method)  # a full run with the hand-over says nothing more
    slower = measured_at(1.3)
    assert yours_clearly_faster(method)  # ... here it says so before it trains
    assert slower.startswith("0.77x your config")
    assert "; your config measured faster, by more than the noise" in slower
    assert "keep it, or start a longer search (--max-trials, 10 here)" in slower
    found, _, nxt = closing_lines(method, tmp_path, False)
    assert "your config measured faster" in found
    # It then said "next: pass it as your DeepSpeed config", of the file that measured slower.
    assert nxt.startswith("dsat: next: keep training with your own config") and "pass it" not in nxt
    # As its run measured it: with --global-batch replacing the user's batch, "your own config"
    # named a batch that never ran.
    assert "as its run measured them (ZeRO-1 micro-batch 2), which measured faster" in nxt
    measured_at(1.01)
    assert "pass it as your DeepSpeed config" in closing_lines(method, tmp_path, False)[2]


def test_an_unsteady_run_of_the_users_config_is_said_and_widens_the_noise(tmp_path: Path) -> None:
    """A baseline measured while another job shared the cores read 700x slower than the
    hand-over, its step time known to +/-42%, and was compared as if exact."""
    method = search(tmp_path, USER)

    def measured_at(ratio: float, stderr: float) -> str:
        return baseline_measured_at(method, ratio, step_time_stderr=stderr)

    steady = measured_at(1 / 1.3, 0.01)  # 1.30x, the steps steady: a gain, nothing to add
    assert steady.startswith("1.30x your config") and ";" not in steady
    unsteady = measured_at(1 / 1.3, 0.42)
    assert unsteady.startswith("1.30x your config")
    # Not "level within the noise (1.5% a run)": that one run is what cannot tell them apart.
    assert unsteady.endswith(
        "no-reduce-scatter); your config's run was unsteady (its mean step time known only to "
        "+/-42%: was the machine busy?), so this ratio is too rough to tell the two apart"
    ), unsteady
    found = closing_lines(method, tmp_path, False)[0]
    assert "your config's run was unsteady" in found
    far = measured_at(1 / 700, 0.42)  # beyond even that noise: the gain stands, said as rough
    assert far.startswith("700.00x your config") and "level with" not in far
    assert far.endswith("so this ratio is rough")


def unsteady_first_run(stderr: float) -> Callable[..., dict[str, Any]]:
    """The simulated model, with the user's config's first run measured on a busy machine: as
    fast as the best configuration there is (a lucky window) and with ``stderr`` over its steps;
    every later run of that config measures it as it is, steadily."""
    best, _ = optimum(MODEL, SLOTS, "FLOPS_per_gpu", False, base=MODEL.base_ds_config)
    runs: list[dict[str, Any]] = []

    def perform(ds_config: dict[str, Any], slots: int, run_id: str) -> dict[str, Any]:
        result = MODEL(ds_config, slots, run_id=run_id)
        if ds_config.get("autotuning", {}).get("model_info", {}).get("profile"):
            return result
        if not runs:  # the first trial after the profile: the user's config
            runs.append(ds_config)
            scale = best / result["FLOPS_per_gpu"]
            return {
                **result,
                "FLOPS_per_gpu": best,
                "throughput": result["throughput"] * scale,
                "latency": result["latency"] / scale,
                "step_time_stderr": stderr,
            }
        return {**result, "step_time_stderr": 0.01} if ds_config == runs[0] else result

    return perform


def test_an_unsteady_run_of_the_users_config_level_with_the_hand_over_runs_again(
    tmp_path: Path,
) -> None:
    """ "0.76x your config; your config's run was unsteady (+/-21%), so this ratio is too rough
    to tell the two apart" (examples/hf_trainer on a busy machine) left the user nothing to act
    on. Where the one run of their config was that unsteady and level with the hand-over, the
    round ends with one more run of it (on top of the budget), which decides; a steady run
    level with it is not run again, nor is one told apart from it."""
    spec = SearchSpec({"deepspeed_config": "ds.json"}, USER, SLOTS)

    def searched(stderr: float, results: Path) -> tuple[DsatSearchMethod, list[dict[str, Any]]]:
        chosen = search_settings("binary", max_trials=10, baseline=True, confirm_top=3)
        runner = SimulatedRunner(unsteady_first_run(stderr), SLOTS)
        method = run_search(chosen, spec, runner, results)
        return method, [row for row in rows(results) if row["kind"] == "baseline"]

    method, ran = searched(0.3, tmp_path / "busy")
    first, again = (r for r in method.tracker.records if r.kind is TrialKind.BASELINE)
    assert len(ran) == 2 and again.parent_id == first.request_id
    assert [row["kind"] for row in rows(tmp_path / "busy")][-1] == "baseline"  # the round's end
    # Its run again is steady (+/-1%), and pooled by steadiness it all but decides.
    steady = ran[1]["metrics"]["FLOPS_per_gpu"]
    speedup = speedup_over_yours(method)
    handed = method.tracker.best()
    assert speedup is not None and handed is not None
    assert speedup == pytest.approx(method.tracker.mean_of_runs(handed) / steady, rel=0.01)
    line = baseline_line(method)
    assert line.startswith(f"{speedup:.2f}x your config (FLOPS_per_gpu ")
    assert (
        "over 2 runs, weighted by how steady each was: the first, unsteady (+/-30%), ran again"
        in line
    )
    assert "too rough" not in line and "level with" not in line and speedup > 1.1
    assert not yours_clearly_faster(method)
    summary = (tmp_path / "busy" / SUMMARY_FILE).read_text()
    assert "2 baselines" in summary
    state = json.loads((tmp_path / "busy" / STATE_FILE).read_text())
    assert state["added_trials"] >= 2  # both runs of the user's config on top of --max-trials

    # Stopped before its run again ended, the search resumes to the same trials and verdict.
    function = unsteady_first_run(0.3)
    chosen = search_settings("binary", max_trials=10, baseline=True, confirm_top=3)
    parts = tmp_path / "parts"
    run_search(chosen, spec, SimulatedRunner(function, SLOTS), parts, len(method.tracker) - 1)
    resumed = run_search(chosen, spec, SimulatedRunner(function, SLOTS), parts)
    assert [r.name for r in resumed.tracker.records] == [r.name for r in method.tracker.records]
    assert baseline_line(resumed) == line

    # A steady run level with the hand-over: the noise says "level", and nothing runs again.
    _, once = searched(0.01, tmp_path / "quiet")
    assert len(once) == 1


def test_a_hand_over_that_is_the_users_own_config_says_so(tmp_path: Path) -> None:
    """Where the search hands over the user's own configuration, "1.00x your config: ZeRO-1
    micro-batch 8 -> ZeRO-1 micro-batch 8" reads as a different configuration found; the lines
    say it is theirs. One knob apart, the knob is named (``rb5e7``), as in the last line."""
    user = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 1}}
    spec = SearchSpec({"deepspeed_config": "ds.json"}, user, 1)

    def searched(max_trials: int, results: Path) -> DsatSearchMethod:
        chosen = search_settings("guided", max_trials=max_trials, baseline=True, zero_stages=(1,))
        return run_search(chosen, spec, SimulatedRunner(cliff_function(8), 1), results)

    # Seven trials: micro-batches only, and 8 (the largest that fits) with DeepSpeed's defaults.
    own = searched(7, tmp_path / "own")
    assert own.tracker.best() is not None and own.tracker.best().name == "z1_mb8"
    assert yours_handed_over(own)
    assert baseline_line(own).startswith(
        "your config is the one handed over (ZeRO-1 micro-batch 8): nothing faster that this "
        "search could hand over ran (1.00x is its runs against your config's runs"
    )
    found = closing_lines(own, tmp_path / "own", False)[0]
    assert (
        found
        == "dsat: found ZeRO-1 micro-batch 8: your own config; nothing faster that this search "
        "could hand over ran"
    )
    # Its own baseline run faster than its search runs: "next: keep training with your own
    # config, which measured faster" of the very config handed over.
    (yours,) = [r for r in own.tracker.records if r.kind is TrialKind.BASELINE]
    faster = {k: 3 * float(yours.metrics[k]) for k in ("FLOPS_per_gpu", "throughput")}
    own.tracker.mark_finished(yours.request_id, yours.status, {**yours.metrics, **faster})
    assert not yours_clearly_faster(own)
    assert "keep training" not in closing_lines(own, tmp_path / "own", False)[2]
    # Twenty: knob steps, all level here; the first found among equals, a knob away, is handed over.
    other = searched(20, tmp_path / "other")
    handed = other.tracker.best()
    assert handed is not None and handed.mbs == 8 and handed.name != "z1_mb8"
    assert not yours_handed_over(other)
    tags = described_with_knobs(handed)
    line = baseline_line(other)
    assert tags.startswith("ZeRO-1 micro-batch 8 (")
    assert f"ZeRO-1 micro-batch 8 -> {tags}; level with your config within the noise" in line


def test_the_baseline_takes_nothing_from_the_searchs_budget(tmp_path: Path) -> None:
    """With --max-trials 2 the search still runs its one search trial (it once ran none: the
    room for the first lineage was counted against --max-trials alone, the baseline queued)."""
    method = search(tmp_path, USER, max_trials=2)
    kinds = [r.kind for r in method.tracker.records]
    assert kinds == [TrialKind.MODEL_PROFILE, TrialKind.BASELINE, TrialKind.SEARCH]
    assert method.tracker.best() is not None and not method.search_failed
    # No confirmation round (--confirm-top 0 here); the summary still says why it was handed
    # over, as it does where one search trial left nothing to compare.
    handed = method.tracker.best()
    said = (tmp_path / SUMMARY_FILE).read_text()
    assert f"handed over: {handed.name}: the best of the search (--confirm-top 0: no " in said
    alone = search(tmp_path / "alone", USER, max_trials=2, confirm_top=3).tracker.best()
    assert alone is not None
    said = (tmp_path / "alone" / SUMMARY_FILE).read_text()
    assert f"handed over: {alone.name}: the only configuration this search ran" in said


def test_a_search_stopped_after_the_baseline_resumes_to_the_same_trials(tmp_path: Path) -> None:
    whole = search(tmp_path / "whole", USER)
    search(tmp_path / "parts", USER, max_events=3)
    resumed = search(tmp_path / "parts", USER)
    assert [r.name for r in resumed.tracker.records] == [r.name for r in whole.tracker.records]


def test_an_hf_config_of_auto_values_runs_with_what_the_entrypoint_passes(
    tmp_path: Path,
) -> None:
    auto = {**USER, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}
    hf = "python3 train.py --deepspeed ds.json --per_device_train_batch_size 4 --gradient_accumulation_steps 2"
    search(tmp_path, auto, entrypoint=hf)
    baseline = next(row for row in rows(tmp_path) if row["kind"] == "baseline")
    assert (baseline["mbs"], baseline["gas"]) == (4, 2)
    assert baseline["overwrites"]["train_batch_size"] == 4 * 2 * SLOTS


def test_with_a_fixed_global_batch_the_baseline_keeps_it_with_the_scripts_micro_batch(
    tmp_path: Path,
) -> None:
    """The batch is kept (a numeric train_batch_size here; --global-batch writes the same): the
    user's micro-batch runs with the accumulation that makes up the batch, as every trial does,
    whatever accumulation the script passes; a micro-batch that cannot make it up is no
    baseline, said in the summary, and the search goes on."""
    fixed = {**USER, "train_micro_batch_size_per_gpu": "auto", "train_batch_size": 64 * SLOTS}
    hf = "python3 train.py --deepspeed ds.json --per_device_train_batch_size 4 --gradient_accumulation_steps 2"
    search(tmp_path / "kept", fixed, entrypoint=hf)
    baseline = next(row for row in rows(tmp_path / "kept") if row["kind"] == "baseline")
    assert (baseline["mbs"], baseline["gas"]) == (4, 16)
    assert baseline["overwrites"]["train_batch_size"] == 64 * SLOTS

    odd = hf.replace("batch_size 4", "batch_size 5")
    method = search(tmp_path / "odd", fixed, entrypoint=odd)
    assert "baseline" not in {row["kind"] for row in rows(tmp_path / "odd")}
    summary = (tmp_path / "odd" / SUMMARY_FILE).read_text()
    assert "your config: not run (its batch sizes do not add up: " in summary
    # In the user's terms: the micro-batch is the flag's; the config named none ("auto").
    assert (
        "its micro-batch 5 (your entrypoint's --per_device_train_batch_size) does not divide the "
        f"global batch {64 * SLOTS} over {SLOTS} slot(s)"
    ) in summary
    assert method.tracker.best() is not None and not method.search_failed


def test_no_baseline_when_neither_config_nor_entrypoint_sets_the_micro_batch(
    tmp_path: Path,
) -> None:
    auto = {**USER, "train_micro_batch_size_per_gpu": "auto"}
    search(tmp_path, auto, entrypoint="python3 train.py --deepspeed ds.json")
    assert "baseline" not in {row["kind"] for row in rows(tmp_path)}
    summary = (tmp_path / SUMMARY_FILE).read_text()
    assert "your config: not run (neither your DeepSpeed config nor your entrypoint" in summary


def test_no_baseline_when_it_cannot_fit_or_when_asked(tmp_path: Path) -> None:
    huge = {**USER, "train_micro_batch_size_per_gpu": 4096}
    search(tmp_path / "huge", huge)
    assert "baseline" not in {row["kind"] for row in rows(tmp_path / "huge")}
    summary = (tmp_path / "huge" / SUMMARY_FILE).read_text()
    assert "your config: not run (ZeRO-1 at micro-batch 4096 does not fit by the memory" in summary
    search(tmp_path / "off", USER, baseline=False)
    assert "baseline" not in {row["kind"] for row in rows(tmp_path / "off")}
    assert "your config" not in (tmp_path / "off" / SUMMARY_FILE).read_text()


def test_a_time_metrics_ratio_reads_the_right_way_round(tmp_path: Path) -> None:
    """ "found ...: 1.71x your config's latency" read as 1.71 times the step time, where the
    latency fell from 83.7 to 49.1 ms."""
    from dsat.search_launch import closing_lines

    spec = SearchSpec({"deepspeed_config": "ds.json"}, USER, SLOTS)
    settings = search_settings("guided", max_trials=10, baseline=True, metric="latency")
    method = run_search(settings, spec, SimulatedRunner(MODEL, SLOTS), tmp_path)
    handed, yours = method.tracker.best(), yours_measured(method)
    assert handed is not None and yours is not None
    theirs, mine = method.tracker.mean_of_runs(handed), yours[0]
    assert theirs is not None and theirs < mine
    summary = (tmp_path / SUMMARY_FILE).read_text()
    line = next(x for x in summary.splitlines() if "your config" in x)
    assert line.startswith(f"{mine / theirs:.2f}x as fast as your config (latency {mine:.4g}): ")
    found = closing_lines(method, tmp_path, full_run=False)[0]
    assert f": {mine / theirs:.2f}x as fast as your config by latency" in found  # as the summary


def test_the_searchs_own_runs_of_the_users_config_count_in_the_comparison(
    tmp_path: Path,
) -> None:
    """With two slots the baseline ran beside the other slot's start-up and measured 2.4x below
    the search's own run of the same configuration: "11.28x your config" of a 5.5x."""
    method = search(tmp_path, USER)
    (baseline,) = [r for r in method.tracker.records if r.kind is TrialKind.BASELINE]
    alone = yours_measured(method)
    assert alone is not None and alone[2] == 1
    again = method.register(
        method.make_trial(TrialKind.SEARCH, dict(baseline.zero_section), baseline.mbs)
    )
    assert again is not None and again.zero_key == baseline.zero_key
    method.tracker.mark_running(again.request_id)
    faster = {
        **baseline.metrics,
        **{key: 3 * float(baseline.metrics[key]) for key in ("FLOPS_per_gpu", "throughput")},
    }
    method.tracker.mark_finished(again.request_id, TrialStatus.COMPLETED, faster)
    pooled = yours_measured(method)
    assert pooled is not None and pooled[2] == 2
    # The mean of the two, as the hand-over's runs are counted, not weighted by each run's own
    # steadiness (which let a steady, slow baseline outweigh the rest); the noise between
    # runs, not their own, judges it.
    assert (pooled[0], pooled[1]) == (pytest.approx(2 * alone[0], rel=0.05), 0.0)
    speedup, before = speedup_over_yours(method), alone
    handed = method.tracker.best()
    assert speedup is not None and handed is not None
    assert speedup == pytest.approx(method.tracker.mean_of_runs(handed) / pooled[0])
    assert speedup < method.tracker.mean_of_runs(handed) / before[0]
    assert f"(FLOPS_per_gpu {pooled[0]:.4g}, with the search's run of it ({again.name})): " in (
        baseline_line(method)
    )


def test_a_speed_up_below_a_tenth_keeps_its_figures() -> None:
    """A time metric's 0.0047 read "0.00x your config"."""
    assert [times(r) for r in (2.4, 1.0, 0.25, 0.0047)] == ["2.40x", "1.00x", "0.25x", "0.0047x"]


def test_a_run_of_your_config_the_searchs_end_stopped_is_not_said_to_be_running(
    tmp_path: Path,
) -> None:
    """The trials failing alike ended the search while the user's config ran: the summary,
    written after dsat exited, said "your config: running"."""
    m = search(tmp_path, USER, max_events=1)  # the profile done, the user's config running
    baseline = next(r for r in m.tracker.records if r.kind is TrialKind.BASELINE)
    assert baseline.status is TrialStatus.RUNNING
    assert baseline_line(m).endswith(": running")  # as it is while the search runs
    m._finished = True  # as a stop rule ends it
    assert baseline_line(m).endswith(": not run to its end (the search ended first)")
