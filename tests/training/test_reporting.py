"""dsat_reporting_context with Determined's real off-cluster Core API context."""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import determined as det
import psutil
import pytest
import torch

import dsat
from dsat import dsat_reporting_context
from dsat.constants import (
    AUTOTUNING_KEY,
    CONFIG_NOT_TAKEN,
    ENV_HPARAMS_FILE,
    ERROR_CAUSE_METRIC_KEY,
    ERROR_METRIC_KEY,
    METRICS_FILE,
    MODEL_INFO_FILE,
    OOM_MARKER,
    OOM_METRIC_KEY,
    OVERWRITE_KEY,
    PRECISION_KEY,
    REPORTED_AT_KEY,
    TRIAL_OUTCOME_FILE,
)
from dsat.memory import Precision
from dsat.training.step_clock import note_engine_step, start_clock, stop_clock

METRICS = {
    "fwd": 1.5,
    "bwd": 3.0,
    "step": 2.0,
    "latency": 6.5,
    "FLOPS_per_gpu": 1e9,
    "throughput": 120.0,
}
MODEL_INFO = {"num_params": 2145, "trainable_num_params": 2145, "activation_mem_per_gpu": 4096}


@pytest.fixture
def trial_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _outcome(directory: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((directory / TRIAL_OUTCOME_FILE).read_text())
    return data


def test_metrics_are_reported_off_cluster(
    trial_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (trial_dir / METRICS_FILE).write_text(json.dumps(METRICS))
    caplog.set_level(logging.INFO)
    with det.core.init(checkpoint_storage=str(trial_dir / "ckpt")) as core_context:
        op = next(core_context.searcher.operations())
        with pytest.raises(SystemExit), dsat_reporting_context(core_context, op):
            raise SystemExit()  # what DeepSpeed's engine does after end_profile_step
        with pytest.raises(RuntimeError, match="only call op.report_completed\\(\\) once"):
            op.report_completed(0.0)  # proves dsat completed the operation
    assert _outcome(trial_dir) == {"status": "completed", "kind": "metrics", "values": METRICS}
    assert "report_validation_metrics(steps_completed=1" in caplog.text  # op.length off-cluster
    assert "FLOPS_per_gpu" in caplog.text


def test_model_info_gets_device_memory(trial_dir: Path) -> None:
    (trial_dir / MODEL_INFO_FILE).write_text(json.dumps(MODEL_INFO))
    with det.core.init(checkpoint_storage=str(trial_dir / "ckpt")) as core_context:
        op = next(core_context.searcher.operations())
        with pytest.raises(SystemExit), dsat_reporting_context(core_context, op, steps_completed=7):
            raise SystemExit()
    outcome = _outcome(trial_dir)
    assert outcome["kind"] == "model_info"
    expected_mem = (
        torch.cuda.get_device_properties(0).total_memory
        if torch.cuda.is_available()
        else psutil.virtual_memory().total
    )
    assert outcome["values"] == {**MODEL_INFO, "gpu_mem": expected_mem}


def test_model_info_says_the_precision_the_trial_ran_at(trial_dir: Path) -> None:
    """What the memory model counts by when the JSON leaves the precision to HF ("auto")."""
    start_clock({}, Precision.BF16)  # as the trial's config helpers do; a profile has no clock
    (trial_dir / MODEL_INFO_FILE).write_text(json.dumps(MODEL_INFO))
    with det.core.init(checkpoint_storage=str(trial_dir / "ckpt")) as core_context:
        op = next(core_context.searcher.operations())
        with pytest.raises(SystemExit), dsat_reporting_context(core_context, op):
            raise SystemExit()
    assert _outcome(trial_dir)["values"][PRECISION_KEY] == "bf16"


def test_newest_result_file_wins(trial_dir: Path) -> None:
    import os

    (trial_dir / MODEL_INFO_FILE).write_text(json.dumps(MODEL_INFO))
    os.utime(trial_dir / MODEL_INFO_FILE, (1, 1))  # a stale profile left from an earlier run
    (trial_dir / METRICS_FILE).write_text(json.dumps(METRICS))
    with det.core.init(checkpoint_storage=str(trial_dir / "ckpt")) as core_context:
        op = next(core_context.searcher.operations())
        with pytest.raises(SystemExit), dsat_reporting_context(core_context, op):
            raise SystemExit()
    assert _outcome(trial_dir)["kind"] == "metrics"


def test_exit_without_results_reports_nothing(trial_dir: Path) -> None:
    with det.core.init(checkpoint_storage=str(trial_dir / "ckpt")) as core_context:
        op = next(core_context.searcher.operations())
        with pytest.raises(SystemExit) as info, dsat_reporting_context(core_context, op):
            raise SystemExit(3)
        assert info.value.code == 3
        op.report_completed(1.0)  # still open: dsat did not complete it
    assert not (trial_dir / TRIAL_OUTCOME_FILE).exists()


def test_a_result_file_from_an_earlier_run_is_not_this_runs(trial_dir: Path) -> None:
    """A run by hand in the same folder leaves DeepSpeed's files; a trial that then exits
    without measuring (its own exit(), or one on a path DeepSpeed did not take) reports nothing."""
    import os

    (trial_dir / METRICS_FILE).write_text(json.dumps(METRICS))
    os.utime(trial_dir / METRICS_FILE, (1, 1))
    with det.core.init(checkpoint_storage=str(trial_dir / "ckpt")) as core_context:
        op = next(core_context.searcher.operations())
        with pytest.raises(SystemExit), dsat_reporting_context(core_context, op):
            raise SystemExit()
        op.report_completed(1.0)  # still open: dsat did not complete it
    assert not (trial_dir / TRIAL_OUTCOME_FILE).exists()


def test_a_scripts_own_failing_exit_is_no_result(trial_dir: Path) -> None:
    """DeepSpeed ends a measured trial with exit(): a sys.exit(3) is the script failing, whatever
    files lie about."""
    with det.core.init(checkpoint_storage=str(trial_dir / "ckpt")) as core_context:
        op = next(core_context.searcher.operations())
        with pytest.raises(SystemExit), dsat_reporting_context(core_context, op):
            (trial_dir / METRICS_FILE).write_text(json.dumps(METRICS))
            raise SystemExit(3)
    assert not (trial_dir / TRIAL_OUTCOME_FILE).exists()


class _Recorder:
    """The parts of a Core API context the reporting touches, for a non-chief rank."""

    def __init__(self, rank: int, size: int = 2) -> None:
        self.calls: list[str] = []
        self.distributed = self
        self.train = self
        self._rank = rank
        self._size = size

    def get_rank(self) -> int:
        return self._rank

    def get_size(self) -> int:
        return self._size

    def report_validation_metrics(self, steps_completed: int, metrics: dict[str, Any]) -> None:
        self.calls.append("report_validation_metrics")


def test_only_rank_zero_reports(trial_dir: Path) -> None:
    (trial_dir / METRICS_FILE).write_text(json.dumps(METRICS))
    worker = _Recorder(rank=1)
    with pytest.raises(SystemExit), dsat_reporting_context(worker, None):
        raise SystemExit()
    assert worker.calls == []
    assert not (trial_dir / TRIAL_OUTCOME_FILE).exists()
    chief = _Recorder(rank=0)
    with pytest.raises(SystemExit), dsat_reporting_context(chief, None):
        raise SystemExit()
    assert chief.calls == ["report_validation_metrics"]


def test_other_exceptions_pass_through_untouched(trial_dir: Path) -> None:
    err = ValueError("bad batch")
    with pytest.raises(ValueError) as info, dsat_reporting_context(_Recorder(0), None):
        raise err
    assert info.value is err
    assert not (trial_dir / TRIAL_OUTCOME_FILE).exists()


def test_out_of_memory_is_recorded_and_reraised(
    trial_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB\nmore detail")
    with pytest.raises(torch.OutOfMemoryError) as info, dsat_reporting_context(_Recorder(0), None):
        raise err
    assert info.value is err
    assert _outcome(trial_dir) == {
        "status": "oom",
        "error": "OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB",
    }
    assert f"{OOM_MARKER}: OutOfMemoryError" in capsys.readouterr().err


class _Operation:
    """A searcher operation that keeps what the trial reports, or fails to report it."""

    def __init__(self, fails: bool = False) -> None:
        self.fails = fails
        self.reported: list[Any] = []

    def report_completed(self, metric: Any) -> None:
        if self.fails:
            raise ConnectionError("master unreachable")
        # When it reported, on its clock: a restarted search runner's end of the trial.
        assert abs(metric.pop(REPORTED_AT_KEY) - time.time()) < 60
        self.reported.append(metric)


def test_out_of_memory_is_reported_to_the_search_by_the_chief_only(trial_dir: Path) -> None:
    # On a cluster the master only says "errored" of a failed trial; the OOM travels as the
    # operation's reported metric, which dsat's search method reads as an OOM.
    for rank, expected in ((1, []), (0, [{OOM_METRIC_KEY: "MemoryError: CUDA out of memory"}])):
        op = _Operation()
        with pytest.raises(MemoryError), dsat_reporting_context(_Recorder(rank), op):
            raise MemoryError("CUDA out of memory")
        assert op.reported == expected


def test_a_failed_oom_report_does_not_hide_the_oom(
    trial_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(MemoryError), dsat_reporting_context(_Recorder(0), _Operation(fails=True)):
        raise MemoryError("CUDA out of memory")
    assert "could not report the out-of-memory outcome" in caplog.text
    assert _outcome(trial_dir)["status"] == "oom"


def test_another_error_is_reported_with_its_cause_by_the_chief_only(trial_dir: Path) -> None:
    """Determined says only "errored": the search could not say why a trial failed, nor stop
    when a script's bug failed every trial alike."""
    said = {ERROR_METRIC_KEY: "KeyError: 'labels'", ERROR_CAUSE_METRIC_KEY: "unknown"}
    for rank, expected in ((1, []), (0, [said])):
        op = _Operation()
        with pytest.raises(KeyError), dsat_reporting_context(_Recorder(rank), op):
            raise KeyError("labels")
        assert op.reported == expected


@pytest.mark.parametrize(
    "error",
    [
        KeyboardInterrupt(),  # the task stopped, not the trial failing
        RuntimeError("NCCL error: remote process exited or there was a network error"),
        ConnectionResetError("Connection reset by peer"),
    ],
)
def test_a_lost_peer_or_a_stop_is_left_to_the_master(trial_dir: Path, error: BaseException) -> None:
    """A rank that lost its peer says nothing of the rank that failed first, which may be out
    of this one's sight: reported, it would be blamed on what this rank saw."""
    op = _Operation()
    with pytest.raises(type(error)), dsat_reporting_context(_Recorder(0), op):
        raise error
    assert op.reported == []


@pytest.mark.parametrize(
    ("error", "size", "said"),
    [
        (RuntimeError("CUDA error: uncorrectable ECC error encountered"), 2, "GPU is failing"),
        (OSError(28, "No space left on device"), 2, "the disk is full"),
        (RuntimeError("NCCL error in: x, unhandled system error"), 1, "NCCL could not connect"),
        (RuntimeError("NCCL error in: x, unhandled system error"), 2, None),  # a peer's end?
    ],
)
def test_a_fault_of_the_machine_rank_zero_saw_is_reported_as_the_machines(
    trial_dir: Path, error: BaseException, size: int, said: str | None
) -> None:
    """It was left to Determined's 'errored', which the search reads as the configuration's:
    a failing GPU capped the micro-batch it failed at, and the trial never ran again."""
    op = _Operation()
    with pytest.raises(type(error)), dsat_reporting_context(_Recorder(0, size), op):
        raise error
    if said is None:
        assert op.reported == []
        return
    (reported,) = op.reported
    assert reported[ERROR_CAUSE_METRIC_KEY] == "machine"
    assert said in reported[ERROR_METRIC_KEY]


@pytest.fixture
def fresh_trial() -> Iterator[None]:
    """The process as a new trial: nothing asked for a config yet (a test before may have)."""
    stop_clock()
    yield
    stop_clock()


def hparams_file(directory: Path, overwrites: dict[str, Any]) -> Path:
    path = directory / "hparams.json"
    (directory / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 1}))
    path.write_text(json.dumps({"deepspeed_config": "ds.json", OVERWRITE_KEY: overwrites}))
    return path


@pytest.mark.usefixtures("fresh_trial")
def test_a_loop_that_never_took_the_trials_config_says_so(
    trial_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A script that built its engine from its own JSON got "train inside
    dsat.dsat_reporting_context" while it did: its engine never had the autotuning block."""
    trial = {AUTOTUNING_KEY: {"enabled": True}, "train_micro_batch_size_per_gpu": 64}
    monkeypatch.setenv(ENV_HPARAMS_FILE, str(hparams_file(trial_dir, trial)))
    with dsat_reporting_context(_Recorder(0), None):
        pass  # trained with json.load(open("ds.json"))
    assert _outcome(trial_dir) == {"status": CONFIG_NOT_TAKEN, "taken": False, "hf": False}
    # An HF script (given --deepspeed) that never called dsat's helper is told the HF fix.
    (trial_dir / TRIAL_OUTCOME_FILE).unlink()
    monkeypatch.setattr(sys, "argv", ["train.py", "--deepspeed=ds.json"])
    with dsat_reporting_context(_Recorder(0), None):
        pass
    assert _outcome(trial_dir) == {"status": CONFIG_NOT_TAKEN, "taken": False, "hf": True}


@pytest.mark.usefixtures("fresh_trial")
def test_hf_arguments_asked_for_and_not_parsed_say_so(
    trial_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It called dsat.get_hf_args_with_overwrites, threw the result away and parsed sys.argv:
    the Trainer's engine stepped without the autotuning block, and it was told "train inside
    dsat.dsat_reporting_context", which it did."""
    trial = {AUTOTUNING_KEY: {"enabled": True, "model_info": {"profile": True}}}
    monkeypatch.setenv(ENV_HPARAMS_FILE, str(hparams_file(trial_dir, trial)))
    monkeypatch.chdir(trial_dir)
    dsat.get_hf_args_with_overwrites(["--deepspeed", "ds.json"], {OVERWRITE_KEY: trial})
    with dsat_reporting_context(_Recorder(0), None):
        note_engine_step(autotuning_enabled=False)  # the Trainer's engine, from ds.json
    assert _outcome(trial_dir) == {"status": CONFIG_NOT_TAKEN, "taken": True, "hf": True}


@pytest.mark.usefixtures("fresh_trial")
def test_a_loop_that_took_the_trials_config_or_is_no_trial_leaves_no_such_outcome(
    trial_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trial = {AUTOTUNING_KEY: {"enabled": True}, "train_micro_batch_size_per_gpu": 64}
    path = hparams_file(trial_dir, trial)
    monkeypatch.setenv(ENV_HPARAMS_FILE, str(path))
    dsat.get_ds_config_from_hparams(json.loads(path.read_text()))
    with dsat_reporting_context(_Recorder(0), None):
        pass
    assert not (trial_dir / TRIAL_OUTCOME_FILE).exists()
    stop_clock()  # Determined's helper, as a ported script calls it, takes it too
    dsat.overwrite_deepspeed_config(str(trial_dir / "ds.json"), trial)
    with dsat_reporting_context(_Recorder(0), None):
        pass
    assert not (trial_dir / TRIAL_OUTCOME_FILE).exists()
    stop_clock()
    # A full run (no autotuning block) and another rank write nothing either.
    monkeypatch.setenv(ENV_HPARAMS_FILE, str(hparams_file(trial_dir, {"zero_optimization": {}})))
    with dsat_reporting_context(_Recorder(0), None):
        pass
    monkeypatch.setenv(ENV_HPARAMS_FILE, str(hparams_file(trial_dir, trial)))
    with dsat_reporting_context(_Recorder(1), None):
        pass
    assert not (trial_dir / TRIAL_OUTCOME_FILE).exists()
