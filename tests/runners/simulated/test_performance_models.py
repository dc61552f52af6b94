"""The built-in performance models behave like DeepSpeed training does, where the search relies on it."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from dsat.memory import Precision, approx_max_micro_batch
from dsat.runners.simulated.performance_models import (
    BUILTIN_MODELS,
    HARDWARE_MODELS,
    STRESS_MODELS,
    PerformanceModel,
    configurations,
    optimum,
)
from dsat.zero_space import random_zero_config

SLOTS = {name: model.gpus for name, model in BUILTIN_MODELS.items()}
# Where throughput only grows with the micro-batch: no memory pressure, no aligned micro-batches.
MONOTONE = sorted(
    n for n, m in BUILTIN_MODELS.items() if not m.pressure_slowdown and not m.aligned_speedups
)


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
        above = largest + 1
        while model.memory_bytes(config(section, above), slots) <= model.oom_bytes:
            above += 1  # runs out of memory only by chance, in the flaky band below the limit
        with pytest.raises(MemoryError):
            model(config(section, above), slots)


@pytest.mark.parametrize("name", sorted(BUILTIN_MODELS))
def test_memory_model_overestimates_the_ceiling(name: str) -> None:
    """The profile under-reports activations, so the search must correct the memory model."""
    model, slots = BUILTIN_MODELS[name], SLOTS[name]
    estimate = approx_max_micro_batch(model.profile(), model.precision, slots)
    for stage in (1, 2, 3):
        assert estimate[stage] > model.max_micro_batch(config({"stage": stage}, 1), slots)


@pytest.mark.parametrize("name", MONOTONE)
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


def test_a_pass_is_in_microseconds_and_the_step_in_milliseconds_as_deepspeed_reports() -> None:
    """The simulator gave a pass in ms under the summary's "µs a pass": forward 68 beside a
    220 ms step."""
    model, slots = BUILTIN_MODELS["bert_base_16xv100"], SLOTS["bert_base_16xv100"]
    row = model.metrics(config({"stage": 1}, 8), slots, noisy=False)
    passes_ms = (row["fwd"] + row["bwd"]) / 1000
    assert 0.5 * row["latency"] < passes_ms < row["latency"]


def test_zero3_and_small_buckets_pay_for_communication() -> None:
    model, slots = BUILTIN_MODELS["bert_base_16xv100"], 16

    def throughput(section: dict[str, Any]) -> float:
        return model.metrics(config(section, 64), slots, noisy=False)["throughput"]

    assert throughput({"stage": 3}) < throughput({"stage": 2}) < throughput({"stage": 1})
    small = {"stage": 1, "reduce_bucket_size": 10**6, "allgather_bucket_size": 10**6}
    large = {"stage": 1, "reduce_bucket_size": 5 * 10**8, "allgather_bucket_size": 5 * 10**8}
    assert throughput(small) < 0.97 * throughput(large)


@pytest.mark.parametrize(("stage", "reduced_every_micro_step"), [(1, False), (2, True), (3, True)])
def test_accumulation_computes_every_micro_step_and_reduces_as_deepspeed_does(
    stage: int, reduced_every_micro_step: bool
) -> None:
    """An optimizer step of 4 micro-steps: 4 forward and backward passes, one optimizer step;
    ZeRO-1 reduces the gradients once, ZeRO-2 and -3 at every micro-step. Memory is unchanged."""
    model, slots = BUILTIN_MODELS["gpt_1b_knobs_16xethernet"], 16
    one = config({"stage": stage}, 8)
    four = {**one, "gradient_accumulation_steps": 4}
    forward, backward, exposed, _ = model.step_times(one, slots)
    assert exposed > 0  # this surface's network shows
    latency_one = model.metrics(one, slots, noisy=False)["latency"] / 1000
    latency_four = model.metrics(four, slots, noisy=False)["latency"] / 1000
    per_micro_step = forward + backward + (exposed if reduced_every_micro_step else 0.0)
    assert latency_four - latency_one == pytest.approx(3 * per_micro_step)
    assert model.memory_bytes(four, slots) == model.memory_bytes(one, slots)
    samples = model.metrics(four, slots, noisy=False)["throughput"] * latency_four
    assert samples == pytest.approx(8 * 4 * slots)


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


def test_a_configurations_own_deviation_is_what_every_run_measures_beyond_the_noise_free() -> None:
    model = HARDWARE_MODELS["gpt_1b_run_noise_8xa100"]
    deviations = []
    for s in range(40):
        cfg = config(random_zero_config(2, np.random.default_rng(s)), 32)
        clean = model.metrics(cfg, 8, noisy=False)["throughput"]
        # Without a run id, a call measures the configuration's own figure.
        assert model.metrics(cfg, 8)["throughput"] == pytest.approx(
            clean * (1 + model.own_deviation(cfg, 8))
        )
        runs = [model.metrics(cfg, 8, run_id=f"run-{i}")["throughput"] for i in range(400)]
        # Averaged over many runs, the run noise goes and the own deviation stays.
        assert float(np.mean(runs)) / clean - 1 == pytest.approx(
            model.own_deviation(cfg, 8), abs=3 * model.run_noise / 20
        )
        deviations.append(model.own_deviation(cfg, 8))
    assert 0 < float(np.std(deviations)) <= 2.5 * model.noise * 1.1


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
    assert large["memory_peak_bytes"] > model.never_oom_bytes - (
        model.activation_per_sample
    )  # the largest that never runs out of memory leaves less than one sample's activations


@pytest.mark.parametrize("name", sorted(BUILTIN_MODELS))
def test_the_optimum_within_a_memory_margin_leaves_it_free(name: str) -> None:
    model, slots = BUILTIN_MODELS[name], SLOTS[name]
    base = model.base_ds_config
    unbounded, _ = optimum(model, slots, "FLOPS_per_gpu", False, (1, 2, 3), base)
    value, best = optimum(model, slots, "FLOPS_per_gpu", False, (1, 2, 3), base, 0.05)
    assert value <= unbounded
    limit = model.safe_bytes(0.05)  # leaves the margin and never runs out of memory
    assert limit <= 0.95 * model.gpu_mem
    assert model.memory_bytes(best, slots) <= limit
    larger = {**best, "train_micro_batch_size_per_gpu": best["train_micro_batch_size_per_gpu"] + 1}
    assert model.memory_bytes(larger, slots) > limit or model.pressure_slowdown


# ---------------------------------------------------------------- the hardware-like surfaces


def test_run_to_run_noise_is_drawn_per_run_and_reproducible() -> None:
    model = HARDWARE_MODELS["gpt_1b_run_noise_8xa100"]
    cfg = config({"stage": 1}, 64)
    runs = [model(cfg, 8, run_id=f"run-{i}")["FLOPS_per_gpu"] for i in range(200)]
    again = [model(cfg, 8, run_id=f"run-{i}")["FLOPS_per_gpu"] for i in range(200)]
    assert runs == again  # the same run of the same seed measures the same
    spread = float(np.std(runs) / np.mean(runs))
    assert 0.7 * model.run_noise < spread < 1.3 * model.run_noise
    # Without a run id (a direct call), one figure: the configuration's own, as before.
    assert model(cfg, 8)["FLOPS_per_gpu"] == model(cfg, 8)["FLOPS_per_gpu"]
    other_seed = dataclasses.replace(model, noise_seed=model.noise_seed + 1)
    assert other_seed(cfg, 8, run_id="run-0")["FLOPS_per_gpu"] != runs[0]


def test_out_of_memory_near_the_limit_comes_and_goes() -> None:
    model = HARDWARE_MODELS["llama_8b_flaky_oom_8xh100"]
    section = {"stage": 2}
    safe = model.max_micro_batch(config(section, 1), 8)
    band = [
        mbs
        for mbs in range(safe + 1, safe + 10)
        if model.never_oom_bytes < model.memory_bytes(config(section, mbs), 8) <= model.oom_bytes
    ]
    assert band, "some micro-batch lies in the flaky band"

    def failures(mbs: int) -> int:
        count = 0
        for run in range(100):
            try:
                model(config(section, mbs), 8, run_id=str(run))
            except MemoryError:
                count += 1
        return count

    assert failures(safe) == 0  # below the band: never
    rates = [failures(mbs) for mbs in band]
    assert all(0 < rate < 100 for rate in rates)  # in the band: sometimes
    assert rates == sorted(rates)  # more often nearer the limit
    # What is safe to hand over never runs out of memory and leaves the margin.
    _, best = optimum(model, 8, "FLOPS_per_gpu", False, (1, 2, 3), model.base_ds_config, 0.05)
    assert model.is_safe(best, 8, 0.05)
    assert model.memory_bytes(best, 8) <= model.never_oom_bytes


def test_aligned_micro_batches_compute_faster_than_their_neighbours() -> None:
    model = HARDWARE_MODELS["gpt_760m_aligned_8xa100"]
    section = {"stage": 1}

    def flops(mbs: int) -> float:
        return model.metrics(config(section, mbs), 8, noisy=False)["FLOPS_per_gpu"]

    for at in (120, 112, 128):  # divisible by 8, by 16, by 64
        assert flops(at) > 1.03 * max(flops(at - 1), flops(at + 1))
    # Not concave: the optimum's micro-batch is aligned, its neighbours well below it.
    _, best = optimum(model, 8, "FLOPS_per_gpu", False, (1, 2, 3), model.base_ds_config, 0.05)
    mbs = best["train_micro_batch_size_per_gpu"]
    assert mbs % 8 == 0
    neighbour = {**best, "train_micro_batch_size_per_gpu": mbs + 1}
    assert model.metrics(neighbour, 8, noisy=False)["FLOPS_per_gpu"] < 0.97 * flops(mbs)


def test_knob_effects_of_either_sign() -> None:
    pcie = HARDWARE_MODELS["gpt_2b_pcie_knobs_8xl40"]
    both = HARDWARE_MODELS["gpt_3b_hardware_4xa100"]

    def flops(model: PerformanceModel, section: dict[str, Any], mbs: int) -> float:
        return model.metrics(config(section, mbs), model.gpus, noisy=False)["FLOPS_per_gpu"]

    # On PCIe, overlap slows training (copy contention): at stage 2 and at stage 3's default.
    for stage in (2, 3):
        on, off = {"stage": stage, "overlap_comm": True}, {"stage": stage, "overlap_comm": False}
        assert flops(pcie, on, 20) < 0.98 * flops(pcie, off, 20)
    # Elsewhere overlap helps, but only with a reduce bucket of middle size: U-shaped.
    ladder = [10**6, 10**7, 10**8, 10**9, 5 * 10**9]
    values = [
        flops(both, {"stage": 2, "overlap_comm": True, "reduce_bucket_size": b}, 16) for b in ladder
    ]
    best = values.index(max(values))
    assert 0 < best < len(ladder) - 1
    assert max(values) > 1.02 * max(values[0], values[-1])
    no_overlap = flops(both, {"stage": 2, "overlap_comm": False}, 16)
    assert max(values) > no_overlap


def test_the_simulated_runner_gives_each_run_its_own_draw() -> None:
    from dsat.runners.simulated.runner import SimulatedRunner

    model = HARDWARE_MODELS["gpt_1b_run_noise_8xa100"]
    runner = SimulatedRunner(model, 8)
    cfg = config({"stage": 1}, 64)
    runner.start("a", {}, cfg, 6)
    runner.start("b", {}, cfg, 6)
    first, second = runner.wait(), runner.wait()
    assert first.metrics["FLOPS_per_gpu"] != second.metrics["FLOPS_per_gpu"]
    expected = {"a": model(cfg, 8, run_id="a"), "b": model(cfg, 8, run_id="b")}
    for outcome in (first, second):
        assert outcome.metrics["FLOPS_per_gpu"] == expected[outcome.request_id]["FLOPS_per_gpu"]
