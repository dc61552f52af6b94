"""The memory model: bytes per parameter by precision, ZeRO partitioning, micro-batch ceilings."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from dsat.memory import (
    MAX_MICRO_BATCH,
    ModelProfile,
    ModelProfileError,
    Precision,
    approx_max_micro_batch,
    determined_max_micro_batch,
    memory_per_gpu_per_stage,
)

GIB = 2**30


def test_precision_from_config() -> None:
    assert Precision.of({}) is Precision.FP32
    assert Precision.of({"fp16": {"enabled": True}}) is Precision.FP16
    assert Precision.of({"bf16": {"enabled": True}}) is Precision.BF16
    assert Precision.of({"bf16": {"enabled": "auto"}}) is Precision.FP32  # HF fills it in later
    assert Precision.BF16.bytes_per_param == Precision.FP16.bytes_per_param == (2, 2, 16)
    assert Precision.FP32.bytes_per_param == (4, 4, 8)


def test_precision_a_run_reported_wins_over_the_configs() -> None:
    auto = {"bf16": {"enabled": "auto"}}
    assert Precision.of_run({"precision": "bf16"}, auto) is Precision.BF16
    assert Precision.of_run({"precision": "fp16"}, {"bf16": {"enabled": True}}) is Precision.FP16
    assert Precision.of_run({}, {"bf16": {"enabled": True}}) is Precision.BF16
    assert Precision.of_run({"precision": "int8"}, auto) is Precision.FP32  # not one it knows


@pytest.mark.parametrize("precision", list(Precision))
def test_stages_partition_model_states(precision: Precision) -> None:
    profile = ModelProfile(
        num_params=10**9, trainable_num_params=10**9, activation_mem_per_gpu=GIB, gpu_mem=80 * GIB
    )
    p, g, o = (b * 10**9 for b in precision.bytes_per_param)
    slots = 8
    memory = memory_per_gpu_per_stage(profile, precision, slots)
    assert memory == {
        0: p + g + o + GIB,
        1: p + g + o // slots + GIB,
        2: p + (g + o) // slots + GIB,
        3: (p + g + o) // slots + GIB,
    }
    assert memory[0] > memory[1] > memory[2] > memory[3]
    expected = 16 if precision is Precision.FP32 else 20  # as DeepSpeed's autotuner counts
    assert memory[0] - GIB == expected * 10**9


def test_frozen_parameters_have_no_gradients_or_optimizer_states() -> None:
    frozen = ModelProfile(
        num_params=10**9, trainable_num_params=0, activation_mem_per_gpu=0, gpu_mem=GIB
    )
    assert memory_per_gpu_per_stage(frozen, Precision.BF16, 4)[0] == 2 * 10**9


def test_approx_max_micro_batch() -> None:
    profile = ModelProfile(
        num_params=10**9, trainable_num_params=10**9, activation_mem_per_gpu=GIB, gpu_mem=32 * GIB
    )
    ceilings = approx_max_micro_batch(profile, Precision.FP16, slots=8)
    states = {s: m - GIB for s, m in memory_per_gpu_per_stage(profile, Precision.FP16, 8).items()}
    assert ceilings == {s: (32 * GIB - states[s]) // GIB for s in range(4)}
    assert ceilings[3] > ceilings[0]
    too_big = ModelProfile(
        num_params=10**10, trainable_num_params=10**10, activation_mem_per_gpu=GIB, gpu_mem=32 * GIB
    )
    assert approx_max_micro_batch(too_big, Precision.FP16, 1)[0] == 1  # never below 1
    no_activations = ModelProfile(10, 10, 0, 32 * GIB)
    assert approx_max_micro_batch(no_activations, Precision.FP32, 1)[0] == MAX_MICRO_BATCH


def test_profile_from_metrics() -> None:
    metrics = {
        "num_params": 5,
        "trainable_num_params": 4,
        "activation_mem_per_gpu": 3.0,
        "gpu_mem": 2,
        "rank": 0,
    }
    assert ModelProfile.from_metrics(metrics) == ModelProfile(5, 4, 3, 2)
    with pytest.raises(ModelProfileError, match="gpu_mem"):
        ModelProfile.from_metrics(
            {"num_params": 5, "trainable_num_params": 4, "activation_mem_per_gpu": 3}
        )


@pytest.mark.parametrize(
    ("section", "precision"),
    [
        ({"fp16": {"enabled": True}}, Precision.FP16),
        ({"bf16": {"enabled": True}}, Precision.BF16),
        ({}, Precision.FP32),
    ],
)
def test_determined_estimate_matches_the_reference(
    tmp_path: Path, section: dict[str, Any], precision: Precision
) -> None:
    """asha and binary start where the reference does: its own tracker computes the ceilings."""
    from determined.pytorch.dsat import _dsat_search_method as reference
    from determined.pytorch.dsat import defaults

    profile = {
        "num_params": 700_000_000,
        "trainable_num_params": 600_000_000,
        "activation_mem_per_gpu": 400 * 2**20,
        "gpu_mem": 24 * 2**30,
    }
    (tmp_path / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, **section}))
    args = argparse.Namespace(
        **{k.replace("-", "_"): v for k, v in defaults.AUTOTUNING_ARG_DEFAULTS.items()},
        max_slots=None,
        model_dir=str(tmp_path),
        early_stopping=None,
        include=None,
    )
    exp_config = {
        "resources": {"slots_per_trial": 8},
        "hyperparameters": {"deepspeed_config": "ds.json"},
    }
    tracker = reference.ASHADSATSearchMethod(args, exp_config).trial_tracker
    tracker.create_model_profile_info_trial()
    assert tracker.model_profile_info_trial is not None
    tracker.model_profile_info_trial.metric = dict(profile)
    ours = determined_max_micro_batch(ModelProfile(**profile), precision, 8)
    assert ours == dict(tracker.approx_max_mbs_per_stage)
    assert ours != approx_max_micro_batch(ModelProfile(**profile), precision, 8)
