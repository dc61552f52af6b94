"""Where a trial's result files go when its script changes directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsat.constants import ENV_HPARAMS_FILE
from dsat.training.trial_directory import anchored_result_paths, trial_directory


def test_the_trial_directory_is_the_hyperparameters_files_not_the_working_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_HPARAMS_FILE, str(tmp_path / "trial" / "dsat_hparams.json"))
    monkeypatch.chdir(tmp_path)
    assert trial_directory() == tmp_path / "trial"
    monkeypatch.setenv(ENV_HPARAMS_FILE, "relative/dsat_hparams.json")  # not a runner's
    assert trial_directory() == tmp_path
    monkeypatch.delenv(ENV_HPARAMS_FILE)
    assert trial_directory() == tmp_path


def test_relative_result_paths_are_anchored_and_the_rest_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_HPARAMS_FILE, str(tmp_path / "dsat_hparams.json"))
    overwrites = {
        "train_micro_batch_size_per_gpu": 4,
        "autotuning": {"enabled": True, "metric_path": "m.json", "model_info_path": "/abs/i.json"},
    }
    anchored = anchored_result_paths(overwrites)
    assert anchored["autotuning"] == {
        "enabled": True,
        "metric_path": str(tmp_path / "m.json"),
        "model_info_path": "/abs/i.json",
    }
    assert anchored["train_micro_batch_size_per_gpu"] == 4
    assert overwrites["autotuning"]["metric_path"] == "m.json"  # the caller's mapping is untouched
    assert anchored_result_paths({"train_batch_size": 8}) == {"train_batch_size": 8}
