"""The experiment configs dsat submits to Determined, field by field against the reference's."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import yaml

from dsat.experiment.settings import SearchSettings
from dsat.runners.determined.configs import (
    SEARCH_RUNNER_ENTRYPOINT,
    custom_experiment_config,
    full_experiment_config,
    search_runner_config,
    settings_hparams,
)

USER_CONFIG: dict[str, Any] = {
    "name": "gpt2-finetune",
    "description": "my run",
    "workspace": "research",
    "project": "llm",
    "entrypoint": "python3 -m determined.launch.deepspeed python3 train.py",
    "environment": {"image": "determinedai/pytorch-ngc:0.37.0"},
    "checkpoint_storage": {"type": "shared_fs", "host_path": "/ckpt"},
    "resources": {"slots_per_trial": 4, "resource_pool": "a100"},
    "max_restarts": 0,
    "searcher": {"name": "random", "max_trials": 8, "metric": "loss", "max_length": 100},
    "hyperparameters": {
        "deepspeed_config": "ds_config.json",
        "lr": 0.001,
        "overwrite_deepspeed_args": {"gradient_clipping": 1.0},
    },
}


def settings(**changes: Any) -> SearchSettings:
    base: dict[str, Any] = {
        "method": "asha",
        "config_path": "/home/me/gpt2/deepspeed.yaml",
        "model_dir": "/home/me/gpt2",
    }
    return SearchSettings(**{**base, **changes})


def test_search_runner_keeps_the_users_place_and_environment() -> None:
    config = search_runner_config(USER_CONFIG, settings(), "fallback")
    for key in ("workspace", "project", "environment", "checkpoint_storage", "description"):
        assert config[key] == USER_CONFIG[key]
    assert config["resources"] == {"slots_per_trial": 0, "resource_pool": "a100"}


def test_search_runner_is_a_zero_slot_single_experiment_running_dsat() -> None:
    config = search_runner_config(USER_CONFIG, settings(max_search_runner_restarts=7), "x")
    assert config["name"] == "(DSAT) gpt2-finetune"
    assert config["searcher"] == {
        "name": "single",
        "metric": "FLOPS_per_gpu",
        "smaller_is_better": False,
        "max_length": 0,
    }
    assert config["max_restarts"] == 7
    assert config["entrypoint"] == SEARCH_RUNNER_ENTRYPOINT
    assert config["hyperparameters"]["method"] == "asha"
    assert config["hyperparameters"]["zero_stages"] == [1, 2, 3]
    assert None not in config["hyperparameters"].values()
    yaml.safe_dump(config)  # what the client sends must be plain YAML


def test_search_runner_name_falls_back_to_the_config_file_name() -> None:
    unnamed = {k: v for k, v in USER_CONFIG.items() if k != "name"}
    assert search_runner_config(unnamed, settings(), "deepspeed")["name"] == "(DSAT) deepspeed"


@pytest.fixture
def reference(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The reference's config helpers, reading USER_CONFIG; its shared defaults are restored."""
    import copy

    from determined.pytorch import dsat as reference_dsat
    from determined.pytorch.dsat import _utils, defaults

    def load(_: str) -> dict[str, Any]:
        return copy.deepcopy(USER_CONFIG)

    monkeypatch.setattr(_utils, "get_dict_from_yaml_or_json_path", load)
    monkeypatch.setattr(reference_dsat, "get_dict_from_yaml_or_json_path", load)
    # The reference writes into these module-level dicts; give it copies to spoil.
    monkeypatch.setattr(defaults, "AUTOTUNING_DICT", copy.deepcopy(defaults.AUTOTUNING_DICT))
    monkeypatch.setattr(
        defaults,
        "DEFAULT_SEARCH_RUNNER_CONFIG",
        copy.deepcopy(defaults.DEFAULT_SEARCH_RUNNER_CONFIG),
    )
    return reference_dsat


def test_search_runner_matches_the_reference_where_the_reference_is_right(
    reference: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from determined.pytorch.dsat import _utils

    # The reference refuses `--deepspeed` entrypoints it cannot match; ours has none.
    monkeypatch.setattr(_utils, "get_split_entrypoint", lambda _: ["python3", "train.py"])
    args = argparse.Namespace(
        search_runner_config=None, config_path="deepspeed.yaml", max_search_runner_restarts=5
    )
    theirs = _utils.get_search_runner_config_from_args(args)
    ours = search_runner_config(USER_CONFIG, settings(), "x")
    for key in ("name", "max_restarts", "workspace", "project", "environment"):
        assert ours[key] == theirs[key], key
    assert ours["resources"]["slots_per_trial"] == theirs["resources"]["slots_per_trial"] == 0
    assert ours["searcher"]["name"] == theirs["searcher"]["name"] == "single"
    assert ours["searcher"]["max_length"] == theirs["searcher"]["max_length"] == 0
    # The reference merges the user's searcher in, leaving `max_trials` under `single`, which a
    # master rejects; dsat replaces it.
    assert "max_trials" in theirs["searcher"] and "max_trials" not in ours["searcher"]


@pytest.mark.parametrize("metric", ["throughput", "latency"])
def test_custom_experiment_matches_the_reference(reference: Any, metric: str) -> None:
    from determined.pytorch.dsat import _run_dsat

    args = argparse.Namespace(
        config_path="deepspeed.yaml",
        experiment_id=42,
        metric=metric,
        start_profile_step=4,
        end_profile_step=9,
    )
    theirs = _run_dsat.get_custom_dsat_exp_conf_from_args(args)
    ours = custom_experiment_config(
        USER_CONFIG, settings(metric=metric, start_profile_step=4, end_profile_step=9), 42
    )
    # The one deliberate difference: failed trials are results, not retried (the reference keeps
    # the user's max_restarts, 0 in this config, Determined's default of 5 when absent).
    assert ours["max_restarts"] == 0
    assert {**ours, "max_restarts": USER_CONFIG["max_restarts"]} == theirs
    assert ours["description"] == "(#42) generated - my run"
    assert ours["searcher"]["name"] == "custom"
    assert ours["hyperparameters"]["_use_dsat_mode"] is True
    overwrites = ours["hyperparameters"]["overwrite_deepspeed_args"]
    assert overwrites["gradient_clipping"] == 1.0  # the user's own overrides survive
    assert overwrites["autotuning"] == {
        "enabled": True,
        "start_profile_step": 4,
        "end_profile_step": 9,
    }
    assert USER_CONFIG["searcher"]["name"] == "random"  # the input is not modified


def test_custom_experiment_without_a_description_is_tagged() -> None:
    bare = {k: v for k, v in USER_CONFIG.items() if k != "description"}
    assert custom_experiment_config(bare, settings(), 7)["description"] == "(#7) generated"


def test_full_experiment_runs_the_users_experiment_with_the_best_overrides() -> None:
    best = {
        "deepspeed_config": "ds_config.json",
        "lr": 0.001,
        "_use_dsat_mode": True,
        "overwrite_deepspeed_args": {
            "gradient_clipping": 1.0,
            "train_micro_batch_size_per_gpu": 12,
            "zero_optimization": {"stage": 2, "overlap_comm": True},
            "autotuning": {"enabled": True, "metric_path": "autotuning_metric.json"},
        },
    }
    config = full_experiment_config(USER_CONFIG, best)
    assert config["searcher"] == USER_CONFIG["searcher"]
    assert config["name"] == USER_CONFIG["name"]
    hparams = config["hyperparameters"]
    assert "_use_dsat_mode" not in hparams
    assert hparams["overwrite_deepspeed_args"] == {
        "gradient_clipping": 1.0,
        "train_micro_batch_size_per_gpu": 12,
        "zero_optimization": {"stage": 2, "overlap_comm": True},
    }
    assert "autotuning" in best["overwrite_deepspeed_args"]  # the input is not modified


def test_settings_travel_as_json_friendly_hyperparameters(tmp_path: Path) -> None:
    hparams = settings_hparams(settings(include=("data",), early_stopping=None))
    assert hparams["include"] == ["data"] and "early_stopping" not in hparams
    assert hparams["metric"] == "FLOPS_per_gpu"


def test_custom_experiment_never_retries_a_failed_trial() -> None:
    restarting = {**USER_CONFIG, "max_restarts": 3}
    unset = {k: v for k, v in USER_CONFIG.items() if k != "max_restarts"}
    for config in (restarting, unset):
        assert custom_experiment_config(config, settings(), 1)["max_restarts"] == 0
    # The full run is the user's own experiment again: their restarts apply.
    assert full_experiment_config(restarting, {})["max_restarts"] == 3
