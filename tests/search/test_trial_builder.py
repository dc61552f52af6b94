"""A method's choice turned into a complete trial: overrides, batch sizes, autotuning block, ids."""

from __future__ import annotations

from dsat.constants import AUTOTUNING_KEY, OVERWRITE_KEY
from dsat.runners.determined.configs import custom_experiment_config
from dsat.search.trial_builder import TrialBuilder
from dsat.trial import TrialKind
from tests.search.helpers import search_settings, spec


def builder(seed: int = 42) -> TrialBuilder:
    return TrialBuilder(spec(slots=2), seed, start_profile_step=3, end_profile_step=5)


def test_a_search_trial_carries_a_consistent_batch_and_the_autotuning_block() -> None:
    record = builder().make(1, TrialKind.SEARCH, {"stage": 2}, mbs=4)
    overrides = record.hparams[OVERWRITE_KEY]
    assert (record.zero_stage, record.mbs, record.gas) == (2, 4, 1)
    assert overrides["train_batch_size"] == 4 * 1 * 2  # micro-batch x accumulation x slots
    block = overrides[AUTOTUNING_KEY]
    assert block["enabled"] and block["start_profile_step"] == 3
    assert block["end_profile_step"] == builder().last_measured_step > 5
    assert record.ds_config[AUTOTUNING_KEY] == block


def test_the_custom_experiment_and_the_trials_share_one_autotuning_block() -> None:
    """On a cluster the experiment-wide block is the reference's; each trial's replaces it and
    differs only where it must: the end of the measured window and where metrics go."""
    settings = search_settings("asha", start_profile_step=3, end_profile_step=5)
    config = custom_experiment_config({"hyperparameters": {}}, settings, 7)
    experiment_block = config["hyperparameters"][OVERWRITE_KEY][AUTOTUNING_KEY]
    assert experiment_block == {"enabled": True, "start_profile_step": 3, "end_profile_step": 5}
    trial_block = builder().autotuning_block(TrialKind.SEARCH)
    differs = {k for k in trial_block if trial_block[k] != experiment_block.get(k)}
    assert differs == {"end_profile_step", "metric_path"}


def test_the_model_profile_trial_asks_for_the_profile_only() -> None:
    block = builder().autotuning_block(TrialKind.MODEL_PROFILE)
    assert block["model_info"] == {"profile": True} and "start_profile_step" not in block


def test_request_ids_follow_the_seed_and_the_index() -> None:
    assert builder(1).request_id(3) == builder(1).request_id(3)
    assert builder(1).request_id(3) != builder(1).request_id(4)
    assert builder(1).request_id(3) != builder(2).request_id(3)
