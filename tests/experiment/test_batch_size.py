"""The batch triple: consistent for any micro-batch, accumulation and slots, by DeepSpeed's check."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsat.errors import DsatError
from dsat.experiment.batch_size import (
    LARGEST_BATCH_PER_RANK,
    consistent_batch_sizes,
    fixed_global_batch,
    micro_batches_for,
    replaced_batch,
    with_global_batch,
)
from dsat.experiment.ds_config_check import deepspeed_config_error
from dsat.training.trial_config import get_ds_config_from_hparams


@pytest.mark.parametrize(
    ("config", "slots", "expected"),
    [
        ({"train_micro_batch_size_per_gpu": 4}, 2, (8, 4, 1)),
        (
            {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": "auto"},
            1,
            (4, 4, 1),
        ),
        ({"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto"}, 3, (3, 1, 1)),
        ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
        ({"train_batch_size": 16}, 8, (16, 2, 1)),
        # Two of the three, as DeepSpeed allows: the accumulation is derived.
        ({"train_batch_size": 512, "train_micro_batch_size_per_gpu": 8}, 8, (512, 8, 8)),
        (
            {
                "train_batch_size": 96,
                "train_micro_batch_size_per_gpu": 4,
                "gradient_accumulation_steps": "auto",
            },
            2,
            (96, 4, 12),
        ),
        ({}, 1, (1, 1, 1)),
        (
            {
                "train_batch_size": 12,
                "train_micro_batch_size_per_gpu": 3,
                "gradient_accumulation_steps": 2,
            },
            2,
            (12, 3, 2),
        ),
    ],
)
def test_consistent_batch_sizes(
    config: dict[str, Any], slots: int, expected: tuple[int, int, int]
) -> None:
    result = consistent_batch_sizes(config, slots)
    assert (
        result["train_batch_size"],
        result["train_micro_batch_size_per_gpu"],
        result["gradient_accumulation_steps"],
    ) == expected


def test_tried_micro_batch_replaces_the_configs() -> None:
    result = consistent_batch_sizes(
        {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, 2, micro_batch=7
    )
    assert result == {
        "train_batch_size": 42,
        "train_micro_batch_size_per_gpu": 7,
        "gradient_accumulation_steps": 3,
    }


@pytest.mark.parametrize(
    ("config", "slots", "message"),
    [
        ({"train_batch_size": 10, "gradient_accumulation_steps": 3}, 1, "not divisible"),
        ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 3}, 1, "not divisible"),
        (
            {
                "train_batch_size": 12,
                "train_micro_batch_size_per_gpu": 3,
                "gradient_accumulation_steps": 2,
            },
            1,
            "!=",
        ),
        # "set train_micro_batch_size_per_gpu instead", followed, failed again (three values
        # that disagree): the way out is named whole.
        (
            {"train_batch_size": 12, "gradient_accumulation_steps": 4},
            2,
            "a multiple of 8, or drop gradient_accumulation_steps and set train_micro_batch",
        ),
        ({"gradient_accumulation_steps": 0}, 1, "positive integer"),
        ({"train_micro_batch_size_per_gpu": 2.5}, 1, "positive integer"),
        ({"train_micro_batch_size_per_gpu": True}, 1, "positive integer"),
    ],
)
def test_inconsistent_configs_are_user_errors(
    config: dict[str, Any], slots: int, message: str
) -> None:
    with pytest.raises(DsatError, match=message):
        consistent_batch_sizes(config, slots, source="ds.json")


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    micro_batch=st.integers(1, 512),
    gas=st.one_of(st.integers(1, 64), st.just("auto"), st.none()),
    slots=st.integers(1, 64),
    user_train_batch=st.one_of(st.none(), st.just("auto")),
)
def test_trial_config_passes_deepspeeds_batch_check(
    tmp_path: Path, micro_batch: int, gas: Any, slots: int, user_train_batch: Any
) -> None:
    """With a free batch, for any tried micro-batch, the config a trial gets from its
    hyperparameters satisfies DeepSpeed's own train_batch == micro * gas * world_size check, and
    keeps the user's accumulation."""
    base: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}
    if gas is not None:
        base["gradient_accumulation_steps"] = gas
    if user_train_batch is not None:
        base["train_batch_size"] = user_train_batch
    (tmp_path / "ds.json").write_text(json.dumps(base))
    overwrites = consistent_batch_sizes(base, slots, micro_batch=micro_batch)
    hparams = {"deepspeed_config": "ds.json", "overwrite_deepspeed_args": overwrites}
    config = get_ds_config_from_hparams(hparams, base_dir=tmp_path)
    assert deepspeed_config_error(config, world_size=slots) is None
    expected_gas = gas if isinstance(gas, int) else 1
    assert config["train_batch_size"] == micro_batch * expected_gas * slots
    assert config["train_micro_batch_size_per_gpu"] == micro_batch


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    per_rank=st.integers(1, 4096),
    slots=st.integers(1, 64),
    gas=st.one_of(st.integers(1, 64), st.just("auto"), st.none()),
    choice=st.integers(0, 10_000),
)
def test_a_fixed_global_batch_is_kept_by_every_micro_batch_allowed(
    tmp_path: Path, per_rank: int, slots: int, gas: Any, choice: int
) -> None:
    """With a numeric train_batch_size, every micro-batch the search may run keeps it exactly
    (accumulation makes up the rest) and passes DeepSpeed's own check; every micro-batch that
    keeps it is allowed."""
    global_batch = per_rank * slots
    base: dict[str, Any] = {"train_batch_size": global_batch, "zero_optimization": {"stage": 2}}
    if gas is not None:
        base["gradient_accumulation_steps"] = gas  # the user's, replaced where it must be
    allowed = micro_batches_for(global_batch, slots)
    assert allowed == [m for m in range(1, per_rank + 1) if per_rank % m == 0]
    micro_batch = allowed[choice % len(allowed)]
    (tmp_path / "ds.json").write_text(json.dumps(base))
    overwrites = consistent_batch_sizes(base, slots, micro_batch=micro_batch)
    hparams = {"deepspeed_config": "ds.json", "overwrite_deepspeed_args": overwrites}
    config = get_ds_config_from_hparams(hparams, base_dir=tmp_path)
    assert deepspeed_config_error(config, world_size=slots) is None
    assert config["train_batch_size"] == global_batch
    assert config["train_micro_batch_size_per_gpu"] == micro_batch
    assert config["gradient_accumulation_steps"] == per_rank // micro_batch


def test_a_whole_float_batch_is_taken_as_the_integer() -> None:
    """JSON writers give 256.0 or 2.56e2; DeepSpeed takes it beside an integer micro-batch, and
    every trial and the hand-over write the integer (it was refused as no integer)."""
    config = {"train_batch_size": 2.56e2, "gradient_accumulation_steps": 2.0}
    assert fixed_global_batch(config) == 256
    assert consistent_batch_sizes(config, 4) == {
        "train_batch_size": 256,
        "train_micro_batch_size_per_gpu": 32,
        "gradient_accumulation_steps": 2,
    }
    assert all(type(v) is int for v in consistent_batch_sizes(config, 4).values())


def test_a_micro_batch_that_breaks_a_fixed_batch_is_refused() -> None:
    """The search never asks for one (SearchSpec.allowed_micro_batch); if it did, nothing runs."""
    with pytest.raises(ValueError, match="does not divide"):
        consistent_batch_sizes({"train_batch_size": 64}, 2, micro_batch=3)


@pytest.mark.parametrize(
    ("global_batch", "slots", "fix"),
    [(10, 4, "make it a multiple of 4"), (2, 8, "raise it to 8")],
)
def test_a_global_batch_no_configuration_can_keep_is_one_clear_error(
    global_batch: int, slots: int, fix: str
) -> None:
    with pytest.raises(DsatError, match=f"train_batch_size {global_batch} cannot be split.*{fix}"):
        consistent_batch_sizes({"train_batch_size": global_batch}, slots, source="ds.json")


def test_a_global_batch_beyond_any_training_is_one_line_not_a_search_for_its_divisors() -> None:
    """10^20 took hours listing its divisors before any trial."""
    with pytest.raises(
        DsatError, match=f"train_batch_size {10**20} is {5 * 10**19} samples per rank"
    ):
        consistent_batch_sizes({"train_batch_size": 10**20}, 2, source="ds.json")
    with pytest.raises(DsatError, match="more than any training takes in one step"):
        with_global_batch({}, 10**20, 2, "--global-batch")
    largest = 2 * LARGEST_BATCH_PER_RANK  # listed at once
    assert micro_batches_for(largest, 2)[-1] == LARGEST_BATCH_PER_RANK
    assert consistent_batch_sizes({"train_batch_size": largest}, 2)["train_batch_size"] == largest


def test_the_global_batch_flag_keeps_the_users_micro_batch_where_it_divides() -> None:
    user = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 3}
    kept = with_global_batch(user, 64, 2, "--global-batch")
    assert consistent_batch_sizes(kept, 2) == {
        "train_batch_size": 64,
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 4,
    }
    dropped = with_global_batch({"train_micro_batch_size_per_gpu": 5}, 64, 2, "--global-batch")
    assert consistent_batch_sizes(dropped, 2)["train_batch_size"] == 64
    with pytest.raises(DsatError, match="--global-batch: train_batch_size 63 cannot be split"):
        with_global_batch(user, 63, 2, "--global-batch")


def test_what_the_global_batch_flag_replaces_is_named() -> None:
    """A config's train_batch_size 48 under --global-batch 40 became 40 without a word, and the
    baseline labelled "your config" ran at micro-batch 20, not the file's 24."""
    assert replaced_batch({"train_batch_size": 48}, 40, 2, "c") == "train_batch_size 48"
    assert replaced_batch({"train_batch_size": 40}, 40, 2, "c") is None
    assert replaced_batch({"train_batch_size": "auto"}, 40, 2, "c") is None
    assert replaced_batch({}, 40, 2, "c") is None
    user = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1}
    assert replaced_batch(user, 12, 2, "c") == "micro-batch 8 x accumulation 1 x 2 slot(s) = 16"
    assert replaced_batch(user, 16, 2, "c") is None


def test_deepspeed_check_catches_an_inconsistent_triple() -> None:
    """The oracle of the property above can fail."""
    config = {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
    }
    assert deepspeed_config_error(config, world_size=4) is None
    assert "train_batch_size is not equal" in str(deepspeed_config_error(config, world_size=2))
