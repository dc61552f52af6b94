"""The results directory of a search: trials.jsonl, best config and metrics, summary, resume."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

from dsat.constants import SETTINGS_FILE, STATE_FILE
from dsat.experiment.ds_config_check import deepspeed_config_error
from dsat.experiment.metric import Metric
from dsat.results.cost import search_cost
from dsat.results.directory import (
    BEST_CONFIG_FILE,
    BEST_METRICS_FILE,
    SUMMARY_FILE,
    TRIALS_FILE,
    VALUE_KEY,
    ResultsWriter,
    TrialTiming,
    full_experiment_hparams,
    summary_table,
)
from dsat.results.report import load_results
from dsat.results.utilization import Utilization
from dsat.runners.simulated.performance_models import gpt2_large_16xv100
from dsat.runners.simulated.runner import SimulatedRunner
from dsat.search.method import DsatSearchMethod
from dsat.search.trial_builder import SearchSpec
from dsat.search_run import run_search
from dsat.trial import TrialStatus
from tests.search.helpers import cliff_function, search_settings
from tests.search.test_tracker import record, tracker

SPEC = SearchSpec(
    hparams={"deepspeed_config": "ds.json", "lr": 0.1},
    ds_config={
        "train_micro_batch_size_per_gpu": 1,
        "fp16": {"enabled": True},
        "optimizer": {"type": "Adam"},
    },
    slots_per_trial=16,
)


def search(results: Path, max_events: int | None = None, method: str = "asha") -> DsatSearchMethod:
    return run_search(
        search_settings(method, max_trials=24, random_seed=3, search_range_factor=2.0),
        SPEC,
        SimulatedRunner(gpt2_large_16xv100, 16),
        results,
        max_events=max_events,
    )


def lines(results: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (results / TRIALS_FILE).read_text().splitlines()]


def test_results_files(tmp_path: Path) -> None:
    method = search(tmp_path)
    rows = lines(tmp_path)
    # Without a log to number it by (the simulator keeps none), a trial's place in the search
    # from 1, as on screen: one number per trial, the profile's 1.
    numbers = [row["trial"] for row in rows]
    assert len(set(numbers)) == 24 and numbers[0] == 1
    assert numbers == [method.tracker.get(row["request_id"]).index + 1 for row in rows]
    assert rows[0]["kind"] == "model_profile" and rows[0]["status"] == "completed"
    expected_keys = {
        "trial",
        "request_id",
        "status",
        "zero_stage",
        "mbs",
        "gas",
        "overwrites",
        "metrics",
        "start",
        "end",
        "slots",
        "slot_kind",
    }
    for row in rows:
        assert expected_keys <= set(row)
        assert row["status"] in {"completed", "oom", "error", "timeout"}
        assert isinstance(row["trial"], int) and row["end"] >= row["start"]
        assert row["slots"] == 16 and row["slot_kind"] == "GPU"  # its cost: 16 GPUs x its time
    assert {row["status"] for row in rows} >= {"completed", "oom"}
    best = method.tracker.best()  # type: ignore[attr-defined]
    config = json.loads((tmp_path / BEST_CONFIG_FILE).read_text())
    assert "autotuning" not in config
    assert config["train_micro_batch_size_per_gpu"] == best.mbs and config["optimizer"] == {
        "type": "Adam"
    }
    assert deepspeed_config_error(config, world_size=16) is None  # ready for deepspeed.initialize
    # The hand-over's metrics, with MFU worked out (the simulated GPU reports its peak).
    derived = Utilization().derived(best.metrics)
    assert set(derived) == {"mfu", "mfu_peak_flops"}
    value = {VALUE_KEY: method.tracker.measured_value(best)}  # type: ignore[attr-defined]
    assert json.loads((tmp_path / BEST_METRICS_FILE).read_text()) == {
        **best.metrics,
        **derived,
        **value,
    }
    assert (tmp_path / STATE_FILE).is_file() and (tmp_path / SETTINGS_FILE).is_file()
    summary = (tmp_path / SUMMARY_FILE).read_text()
    table = summary_table(method.tracker)  # type: ignore[attr-defined]
    batch = SPEC.batch_line(best)  # the batch was free: what it became
    assert batch == (
        f"global batch: {16 * best.mbs} (micro-batch {best.mbs} x accumulation 1 x 16 ranks), "
        "free: set train_batch_size or --global-batch N to keep yours"
    )
    # The simulated GPUs report their peak, so the hand-over's MFU is known (no sequence length
    # is, so no tokens/s).
    rate = Utilization().line(best.metrics)
    assert rate.startswith("handed-over throughput: MFU ") and "tokens/s" not in rate
    why = (
        f"handed over: {best.name}: the best of the search (--confirm-top 0: no confirmation round)"
    )
    expected = [table, why, batch, rate, search_cost(rows).line()]
    assert summary == "\n".join(expected) + "\n"
    assert summary.startswith("| tuning_space | num_experiments | best_metric_val | best_exp_name")
    assert re.search(r"^\| global +\| +23 \|", summary, re.MULTILINE)  # the 23 search trials
    assert best.name in table.splitlines()[-2]
    assert table.splitlines()[-1].startswith(
        "best_metric_val: FLOPS_per_gpu, in FLOP/s per GPU, a stage's best trial within the "
        "memory margin"
    )


def test_the_users_own_autotuning_block_is_handed_back_as_they_wrote_it(tmp_path: Path) -> None:
    """dsat merges its block into the user's for the trials; removing the merged block for the
    hand-over dropped the user's own settings in it (results_dir, metric) without a word."""
    theirs = {"enabled": False, "metric": "latency", "results_dir": "my_autotuning_results"}
    spec = dataclasses.replace(SPEC, ds_config={**SPEC.ds_config, "autotuning": theirs})
    run_search(
        search_settings("binary", max_trials=8, random_seed=3, search_range_factor=2.0),
        spec,
        SimulatedRunner(gpt2_large_16xv100, 16),
        tmp_path,
    )
    assert json.loads((tmp_path / BEST_CONFIG_FILE).read_text())["autotuning"] == theirs


def test_the_global_row_names_what_is_handed_over(tmp_path: Path) -> None:
    method = search(tmp_path)
    tracker = method.tracker
    best = tracker.best()
    assert best is not None
    other = min(
        (r for r in tracker.records if tracker.metric_value(r) is not None and r.name != best.name),
        key=lambda r: tracker.metric_value(r) or 0.0,
    )
    tracker.confirmed_id = other.request_id  # as a confirmation round that chose it would
    *_, global_row, note = summary_table(tracker).splitlines()
    assert other.name in global_row and best.name not in global_row
    assert f"{tracker.metric_value(other):.6g}" in global_row
    assert note.endswith("global: the mean of every run of the handed-over configuration")


def test_an_interrupted_search_resumes_from_its_results(tmp_path: Path) -> None:
    search(tmp_path, max_events=9)
    assert len(lines(tmp_path)) == 9 and not (tmp_path / SUMMARY_FILE).exists()
    method = search(tmp_path)  # picks up the saved state
    rows = lines(tmp_path)
    assert len(rows) == 24 and len({row["trial"] for row in rows}) == 24
    assert [row["trial"] for row in rows] == [
        method.tracker.get(row["request_id"]).number for row in rows
    ]
    finished_ids = [row["request_id"] for row in rows]
    assert len(set(finished_ids)) == 24  # nothing finished twice
    assert (tmp_path / SUMMARY_FILE).is_file()
    assert method.tracker.best() is not None  # type: ignore[attr-defined]


def test_runs_the_machine_failed_before_a_stop_count_after_the_resume(tmp_path: Path) -> None:
    """A trial the machine failed, then the search stopped (a Ray cluster that lost a node):
    the resume ran it again as a first attempt, its row had no machine_failed, and the cost
    left the failed run out."""
    calls = {"count": 0}

    def port_taken_at_the_fifth_run(ds_config: dict[str, Any], slots: int) -> dict[str, Any]:
        calls["count"] += 1
        if calls["count"] == 5:
            raise ConnectionError("EADDRINUSE: port 29500 taken")
        return gpt2_large_16xv100(ds_config, slots)

    def run(max_events: int | None = None) -> DsatSearchMethod:
        return run_search(
            search_settings("binary", max_trials=12, random_seed=3, max_concurrent_trials=1),
            SPEC,
            SimulatedRunner(port_taken_at_the_fifth_run, 16),
            tmp_path,
            max_events=max_events,
        )

    run(max_events=5)  # stopped just after the fifth run failed and its trial started again
    assert len(lines(tmp_path)) == 4
    state = json.loads((tmp_path / STATE_FILE).read_text())
    [(failed_id, [before])] = state["machine_failed"].items()
    assert before["error"] == "ConnectionError: EADDRINUSE: port 29500 taken"
    run()
    rows = {row["request_id"]: row for row in lines(tmp_path)}
    row = rows[failed_id]
    assert row["status"] == "completed" and row["machine_failed"] == [before]
    assert before["end"] <= row["start"]  # seconds of search, on one clock
    assert [r for r in rows.values() if r.get("machine_failed")] == [row]
    assert "machine_failed" not in json.loads((tmp_path / STATE_FILE).read_text())


def test_full_experiment_hparams_keep_the_overrides_but_not_the_tuning(tmp_path: Path) -> None:
    method = search(tmp_path)
    best = method.tracker.best()
    assert best is not None and "autotuning" in best.hparams["overwrite_deepspeed_args"]
    hparams = full_experiment_hparams(best)
    overwrites = hparams["overwrite_deepspeed_args"]
    assert "autotuning" not in overwrites and "_use_dsat_mode" not in overwrites
    assert overwrites["train_micro_batch_size_per_gpu"] == best.mbs
    assert (
        overwrites["zero_optimization"]
        == best.hparams["overwrite_deepspeed_args"]["zero_optimization"]
    )
    assert hparams["lr"] == 0.1
    assert "autotuning" in best.hparams["overwrite_deepspeed_args"]  # the record is untouched
    # A cluster trial's top-level dsat-mode switch does not follow into the real run.
    on_cluster = best.replace(hparams={**best.hparams, "_use_dsat_mode": True})
    assert "_use_dsat_mode" not in full_experiment_hparams(on_cluster)
    assert on_cluster.hparams["_use_dsat_mode"] is True


def flops_trials(tmp_path: Path, trials: list[tuple[str, int, float, float]]) -> None:
    """Trials (id, stage, samples/s, FLOPs a sample as DeepSpeed counted them) written in turn
    into tmp_path, ranked by FLOPS_per_gpu on a device of 1 GFLOP/s."""
    t = tracker(Metric.FLOPS_PER_GPU)
    writer = ResultsWriter(tmp_path, "CPU", Utilization(peak_flops=1e9))
    for n, (rid, stage, throughput, per_sample) in enumerate(trials):
        t.add(record(rid, 48, stage=stage))
        t.mark_running(t.dequeue(rid).request_id)
        metrics = {"throughput": throughput, "FLOPS_per_gpu": throughput * per_sample}
        t.mark_finished(rid, TrialStatus.COMPLETED, metrics)
        writer.trial_finished(t.get(rid), TrialTiming(n, n + 1.0), t)


def test_each_row_has_the_value_the_search_ranked_it_by_and_the_report_draws_that(
    tmp_path: Path,
) -> None:
    """DeepSpeed's profiler counts ZeRO-3's FLOPs about twice; the search counts every trial at
    the least FLOPs a sample any trial gave, and the report drew the trials' own figures: ZeRO-3
    far above the configuration handed over (make demo). A later trial that lowers the least
    changes an earlier row's value too."""
    flops_trials(tmp_path, [("z3", 3, 300.0, 2e6), ("z1", 1, 340.0, 1e6)])
    rows = {row["request_id"]: row for row in lines(tmp_path)}
    assert rows["z3"]["metrics"]["FLOPS_per_gpu"] == 600e6  # the trial's own figure, kept
    assert rows["z3"][VALUE_KEY] == 300e6 and rows["z1"][VALUE_KEY] == 340e6
    # Its MFU follows: counted at the z3 trial's own figure when its row was written (0.6).
    assert rows["z3"]["metrics"]["mfu"] == 0.3 and rows["z1"]["metrics"]["mfu"] == 0.34
    results = load_results(tmp_path)
    assert [results.value(row) for row in results.rows] == [300e6, 340e6]
    # A results directory written before rows had the value: drawn by the trials' own figures.
    assert results.value({"status": "completed", "metrics": {"FLOPS_per_gpu": 5.0}}) == 5.0


def test_best_ds_metrics_json_has_the_value_the_hand_over_was_ranked_by(tmp_path: Path) -> None:
    """A ZeRO-3 hand-over's file said twice the FLOPS the terminal, the summary and its row
    gave (DeepSpeed's count), with no figure as the search counted it."""
    flops_trials(tmp_path, [("z1", 1, 300.0, 1e6), ("z3", 3, 400.0, 2e6)])
    best = json.loads((tmp_path / BEST_METRICS_FILE).read_text())
    assert best["FLOPS_per_gpu"] == 800e6 and best[VALUE_KEY] == 400e6
    assert best[VALUE_KEY] == {row["request_id"]: row for row in lines(tmp_path)}["z3"][VALUE_KEY]


def test_a_search_that_hands_nothing_over_leaves_no_best_config(tmp_path: Path) -> None:
    """Trials that ran safely wrote best_ds_config.json as they ended; the machine's OOMs after
    them showed every configuration over the memory limit, and the search said "none is handed
    over" beside a best_ds_config.json a user would train with."""
    fits = cliff_function(64)
    runs = 0

    def shrinking(ds_config: dict[str, Any], slots: int) -> dict[str, Any]:
        nonlocal runs
        metrics = fits(ds_config, slots)
        if "throughput" in metrics:
            runs += 1
            if runs > 3:
                raise MemoryError("CUDA out of memory")
            metrics.update(memory_peak_bytes=50 * 2**30, memory_total_bytes=100 * 2**30)
        return metrics

    settings = search_settings("guided", max_trials=8, random_seed=3)
    method = run_search(settings, SPEC, SimulatedRunner(shrinking, 16), tmp_path)
    assert method.search_failed and "none is handed over" in str(method.shutdown_reason)
    assert [row["status"] for row in lines(tmp_path)][1:4] == ["completed"] * 3
    assert not (tmp_path / BEST_CONFIG_FILE).exists()
    assert not (tmp_path / BEST_METRICS_FILE).exists()
    summary = (tmp_path / SUMMARY_FILE).read_text()
    assert "(handed over)" not in summary
    assert f"handed over: nothing: {method.shutdown_reason}\n" in summary  # why, said there too
