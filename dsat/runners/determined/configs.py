"""The experiment configs dsat submits to a Determined cluster, built from the user's own YAML.

Three experiments, as in the reference: the *search runner* (a zero-slot ``single`` experiment
whose entrypoint runs dsat's search on the cluster), the trials' *custom* experiment (the user's
experiment with a ``custom`` searcher and the autotuning overrides), and optionally the *full*
experiment (the user's experiment with the best overrides). Pure functions of their inputs, so
every field is checked by tests without a cluster.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

from dsat.constants import AUTOTUNING_KEY, DSAT_MODE_KEY, OVERWRITE_KEY
from dsat.experiment.config import deep_merge
from dsat.experiment.settings import SearchSettings
from dsat.results.directory import without_tuning
from dsat.search.trial_builder import search_trial_autotuning

# What the search runner's entrypoint runs on the cluster (dsat's package travels with it).
SEARCH_RUNNER_ENTRYPOINT = "python3 -m dsat.runners.determined.search_runner"
SEARCH_RUNNER_NAME_PREFIX = "(DSAT) "
# The uploaded settings file the search runner reads: JSON, never pickle.
SETTINGS_UPLOAD = "dsat_settings.json"
# dsat's own package, uploaded beside them (task images have determined, not dsat).
DSAT_PACKAGE = "dsat"


def experiment_name(config: Mapping[str, Any], fallback: str) -> str:
    name = config.get("name")
    return name if isinstance(name, str) and name.strip() else fallback


def settings_hparams(settings: SearchSettings) -> dict[str, Any]:
    """The settings as the search runner's hyperparameters, for the web UI (nulls left out)."""
    data = dataclasses.asdict(settings)
    data["metric"] = settings.metric.value
    return {
        key: list(value) if isinstance(value, tuple) else value
        for key, value in data.items()
        if value is not None
    }


def search_runner_config(
    user_config: Mapping[str, Any], settings: SearchSettings, fallback_name: str
) -> dict[str, Any]:
    """The user's experiment turned into dsat's search runner: same workspace, project,
    environment and checkpoint storage; no slots; ``single`` searcher; dsat's entrypoint."""
    config = deep_merge(
        user_config,
        {
            "resources": {"slots_per_trial": 0},
            "max_restarts": settings.search_runner_restarts,
            "entrypoint": SEARCH_RUNNER_ENTRYPOINT,
        },
    )
    # Replaced, not merged: the user's searcher keys (max_trials, ...) are not valid for `single`.
    config["searcher"] = {
        "name": "single",
        "metric": settings.metric.value,
        "smaller_is_better": settings.smaller_is_better,
        "max_length": 0,
    }
    config["name"] = SEARCH_RUNNER_NAME_PREFIX + experiment_name(user_config, fallback_name)
    config["hyperparameters"] = settings_hparams(settings)
    return config


def autotuning_overwrites(settings: SearchSettings) -> dict[str, Any]:
    """The experiment-wide block, as the reference sets it; each trial's own replaces it (its end
    step is the end of dsat's measured window)."""
    block = search_trial_autotuning(settings.start_profile_step, settings.end_profile_step)
    return {AUTOTUNING_KEY: block}


def custom_experiment_config(
    user_config: Mapping[str, Any], settings: SearchSettings, runner_experiment_id: int
) -> dict[str, Any]:
    """The trials' experiment: the user's, driven by dsat through a ``custom`` searcher."""
    config = copy.deepcopy(dict(user_config))
    tag = f"(#{runner_experiment_id}) generated"
    description = config.get("description")
    config["description"] = f"{tag} - {description}" if description else tag
    config["searcher"] = {
        "name": "custom",
        "metric": settings.metric.value,
        "smaller_is_better": settings.smaller_is_better,
    }
    # A trial that runs out of memory or crashes is a result for the search; Determined would
    # otherwise run it again up to 5 times (its default) before reporting it.
    config["max_restarts"] = 0
    hparams = deep_merge(
        config.get("hyperparameters") or {}, {OVERWRITE_KEY: autotuning_overwrites(settings)}
    )
    # Top level, where Determined's DeepSpeedTrial looks for it.
    hparams[DSAT_MODE_KEY] = True
    config["hyperparameters"] = hparams
    return config


def full_run_label(runner_experiment_id: int) -> str:
    """The label the full experiment of the search run by ``runner_experiment_id`` carries: a
    search runner restarted between creating it and its next checkpoint finds it by that,
    rather than create a second one."""
    return f"dsat-full-run-of-{runner_experiment_id}"


def full_experiment_config(
    user_config: Mapping[str, Any], best_hparams: Mapping[str, Any], label: str = ""
) -> dict[str, Any]:
    """The user's experiment, searcher and all, run with the best trial's overrides (and
    ``label`` beside the user's labels)."""
    config = copy.deepcopy(dict(user_config))
    config["hyperparameters"] = without_tuning(
        deep_merge(config.get("hyperparameters") or {}, best_hparams)
    )
    if label:
        config["labels"] = [*(config.get("labels") or []), label]
    return config
