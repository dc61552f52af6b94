"""The built-in performance models behave like DeepSpeed training does, where the search relies on it."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from dsat.memory import Precision, approx_max_micro_batch
from dsat.runners.simulated.performance_models import (
    BUILTIN_MODELS,
    STRESS_MODELS,
    PerformanceModel,
    configurations,
    optimum,
)
from dsat.zero_space import random_zero_config

SLOTS = {name: model.gpus for name, model in BUILTIN_MODELS.items()}
WITHOUT_PRESSURE = sorted(n for n, m in BUILTIN_MODELS.items() if not m.pressure_slowdown)


def config(section: dict[str, Any], mbs: int) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": mbs, "zero_optimization": section}


@pytest.mark.parametrize("name", sorted(BUILTIN_MODELS))
def test_memory_cliff(name: str) -> None:
    model, slots = BUILTIN_MODELS[name], SLOTS[name]
    for stage in (1, 2, 3):
        section = {"stage": stage}
        largest = model.max_micro_batch(config(section, 1), slots)
        if largest == 0:  # the stage does not fit at all (a stress surface says so)
            with pytest.raises(MemoryError):
                model(config(section, 1), slots)
            continue
        model(config(section, largest), slots)  # fits
        with pytest.raises(MemoryError):
            model(config(section, largest + 1), slots)


@pytest.mark.parametrize("name", sorted(BUILTIN_MODELS))
def test_memory_model_overestimates_the_ceiling(name: str) -> None:
    """The profile under-reports activations, so the search must correct the memory model."""
    model, slots = BUILTIN_MODELS[name], SLOTS[name]
    estimate = approx_max_micro_batch(model.profile(), model.precision, slots)
    for stage in (1, 2, 3):
        assert estimate[stage] > model.max_micro_batch(config({"stage": stage}, 1), slots)


@pytest.mark.parametrize("name", WITHOUT_PRESSURE)
def test_throughput_grows_with_micro_batch_and_latency_with_it(name: str) -> None:
    """What lets `optimum` check only the smallest and largest micro-batch of each config."""
    model, slots = BUILTIN_MODELS[name], SLOTS[name]
    rng = np.random.default_rng(0)
    for _ in range(25):
        section = random_zero_config(int(rng.integers(1, 4)), rng)
        largest = model.max_micro_batch(config(section, 1), slots)
        rows = [
            model.metrics(config(section, mbs), slots, noisy=False) for mbs in range(1, largest + 1)
        ]
        throughputs = [r["throughput"] for r in rows]
        latencies = [r["latency"] for r in rows]
        assert throughputs == sorted(throughputs) and latencies == sorted(latencies)


def test_zero3_and_small_buckets_pay_for_communication() -> None:
    model, slots = BUILTIN_MODELS["bert_base_16xv100"], 16

    def throughput(section: dict[str, Any]) -> float:
        return model.metrics(config(section, 64), slots, noisy=False)["throughput"]

    assert throughput({"stage": 3}) < throughput({"stage": 2}) < throughput({"stage": 1})
    small = {"stage": 1, "reduce_bucket_size": 10**6, "allgather_bucket_size": 10**6}
    large = {"stage": 1, "reduce_bucket_size": 5 * 10**8, "allgather_bucket_size": 5 * 10**8}
    assert throughput(small) < 0.97 * throughput(large)


def test_noise_is_seeded_and_small() -> None:
    model = BUILTIN_MODELS["gpt2_large_16xv100"]
    cfg = config({"stage": 1}, 2)
    assert model.metrics(cfg, 16) == model.metrics(cfg, 16)
    clean = model.metrics(cfg, 16, noisy=False)["latency"]
    ratios = [
        model.metrics(config(random_zero_config(2, np.random.default_rng(s)), 2), 16)["latency"]
        / model.metrics(
            config(random_zero_config(2, np.random.default_rng(s)), 2), 16, noisy=False
        )["latency"]
        for s in range(200)
    ]
    assert (
        0.005 < float(np.std(ratios)) < 0.03
        and max(abs(r - 1) for r in ratios) <= 2.5 * model.noise + 1e-12
    )
    assert clean > 0


def test_profile_trial_reports_model_info() -> None:
    model: PerformanceModel = BUILTIN_MODELS["llama_7b_8xa100"]
    info = model(
        {"train_micro_batch_size_per_gpu": 1, "autotuning": {"model_info": {"profile": True}}}, 8
    )
    assert info["num_params"] == info["trainable_num_params"] == 6_740_000_000
    assert (
        info["gpu_mem"] == 80 * 2**30 and info["activation_mem_per_gpu"] > 0 and info["seconds"] > 0
    )


def test_optimum_is_the_best_of_every_configuration() -> None:
    model, slots = BUILTIN_MODELS["gpt2_large_16xv100"], 16
    value, best = optimum(model, slots, "throughput", False, (1, 2), {"fp16": {"enabled": True}})
    every = [
        model.metrics(config(section, mbs), slots, noisy=False)["throughput"]
        for section in configurations((1, 2))
        for mbs in range(1, model.max_micro_batch(config(section, 1), slots) + 1)
    ]
    assert value == pytest.approx(max(every))
    assert best["zero_optimization"]["stage"] in (1, 2)
    assert len(configurations((1, 2, 3))) == 64 + 512 + 1024


# ---------------------------------------------------------------- the stress surfaces


def best_micro_batch(model: PerformanceModel, section: dict[str, Any], slots: int) -> int:
    largest = model.max_micro_batch(config(section, 1), slots)
    return max(
        range(1, largest + 1),
        key=lambda mbs: model.metrics(config(section, mbs), slots, noisy=False)["throughput"],
    )


def test_stress_surfaces_each_break_their_assumption() -> None:
    models = STRESS_MODELS
    # Activations under-reported by a third: the memory model's ceiling is 1.5x the real one.
    under = models["gpt_1b_underreported_4xa10"]
    assert under.activation_reported_fraction <= 0.67
    estimate = approx_max_micro_batch(under.profile(), under.precision, under.gpus)
    assert estimate[2] >= 1.5 * under.max_micro_batch(config({"stage": 2}, 1), under.gpus)
    # Bucket memory moves the cliff by several samples.
    buckets = models["gpt_2b_bucket_memory_8xa100"]
    cliffs = {
        buckets.max_micro_batch(config(section, 1), buckets.gpus)
        for section in configurations((2,))
    }
    assert max(cliffs) - min(cliffs) >= 10
    # Memory pressure: throughput peaks well below the largest micro-batch that fits.
    pressure = models["gpt_350m_pressure_2x4090"]
    largest = pressure.max_micro_batch(config({"stage": 2}, 1), pressure.gpus)
    assert best_micro_batch(pressure, {"stage": 2}, pressure.gpus) <= 0.8 * largest
    # Knobs worth 5-15% at the optimum's stage and micro-batch.
    knobs = models["gpt_1b_knobs_16xethernet"]
    _, best = optimum(knobs, knobs.gpus, "throughput", False, (1, 2, 3), knobs.base_ds_config)
    stage, mbs = best["zero_optimization"]["stage"], best["train_micro_batch_size_per_gpu"]
    values = [
        knobs.metrics(config(section, mbs), knobs.gpus, noisy=False)["throughput"]
        for section in configurations((stage,))
        if knobs.max_micro_batch(config(section, 1), knobs.gpus) >= mbs
    ]
    default = knobs.metrics(config({"stage": stage}, mbs), knobs.gpus, noisy=False)["throughput"]
    assert 1.05 <= max(values) / default <= 1.15
    # Stages 0 and 1 do not fit at any micro-batch, whatever the buckets.
    large = models["llama_14b_no_low_stages_8xa100"]
    for section in configurations((0, 1)):
        assert large.max_micro_batch(config(section, 1), large.gpus) == 0
    # fp32, and 2 to 16 GPUs across the suite; ZeRO-3 wins on one.
    assert models["bert_large_fp32_2xv100"].precision is Precision.FP32
    assert {m.gpus for m in models.values()} >= {2, 4, 8, 16}
    wins = models["gpt_6b_zero3_wins_16xa100"]
    _, best = optimum(wins, wins.gpus, "throughput", False, (1, 2, 3), wins.base_ds_config)
    assert best["zero_optimization"]["stage"] == 3


def test_a_surfaces_noise_is_a_function_of_its_seed() -> None:
    model = STRESS_MODELS["gpt_1b_knobs_16xethernet"]
    cfg = config({"stage": 2}, 8)
    again = dataclasses.replace(model, noise_seed=model.noise_seed)
    other = dataclasses.replace(model, noise_seed=model.noise_seed + 1)
    assert model.metrics(cfg, 16) == again.metrics(cfg, 16)
    assert model.metrics(cfg, 16) != other.metrics(cfg, 16)


@pytest.mark.parametrize("name", sorted(BUILTIN_MODELS))
def test_a_trial_reports_its_memory_as_a_real_one_does(name: str) -> None:
    """The hand-over reads it (--memory-margin): a surface that did not report it let a search
    hand over configurations a real run never would."""
    model, slots = BUILTIN_MODELS[name], SLOTS[name]
    section = {"stage": 2}
    largest = model.max_micro_batch(config(section, 1), slots)
    small, large = model(config(section, 1), slots), model(config(section, largest), slots)
    assert small["memory_total_bytes"] == large["memory_total_bytes"] == model.gpu_mem
    assert 0 < small["memory_peak_bytes"] < large["memory_peak_bytes"] <= model.gpu_mem
    assert large["memory_peak_bytes"] > model.usable_memory_fraction * model.gpu_mem - (
        model.activation_per_sample
    )  # the largest that fits leaves less than one sample's activations


@pytest.mark.parametrize("name", sorted(BUILTIN_MODELS))
def test_the_optimum_within_a_memory_margin_leaves_it_free(name: str) -> None:
    model, slots = BUILTIN_MODELS[name], SLOTS[name]
    base = model.base_ds_config
    unbounded, _ = optimum(model, slots, "FLOPS_per_gpu", False, (1, 2, 3), base)
    value, best = optimum(model, slots, "FLOPS_per_gpu", False, (1, 2, 3), base, 0.05)
    assert value <= unbounded
    assert model.memory_bytes(best, slots) <= 0.95 * model.gpu_mem
    larger = {**best, "train_micro_batch_size_per_gpu": best["train_micro_batch_size_per_gpu"] + 1}
    assert model.memory_bytes(larger, slots) > 0.95 * model.gpu_mem or model.pressure_slowdown
