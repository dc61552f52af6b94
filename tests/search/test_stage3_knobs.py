"""ZeRO-3's own knobs: where guided starts them, the steps it takes, and what it hands over."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from dsat.runners.driver import SearchDriver
from dsat.runners.simulated.performance_models import (
    ZERO3_KNOB_MODELS,
    PerformanceModel,
    optimum,
)
from dsat.runners.simulated.runner import SimulatedRunner
from dsat.search import make_search_method
from dsat.search.stage3_knobs import hidden_size, stage3_start
from dsat.search.trial_builder import SearchSpec
from dsat.zero_space import explicit_zero_config, knob_steps, stage3_ladders
from tests.search.helpers import settings

PREFETCH, PERSISTENCE = "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"


@pytest.mark.parametrize(
    ("params", "true_hidden"),
    [(6.7e9, 4096), (13e9, 5120), (20e9, 6144), (70e9, 8192), (175e9, 12288)],
)
def test_the_hidden_size_estimated_from_the_parameters_is_within_30_percent(
    params: float, true_hidden: int
) -> None:
    estimate = hidden_size({}, int(params))
    assert 0.7 * true_hidden <= estimate <= 1.3 * true_hidden
    assert hidden_size({"hidden_size": 4096}, int(params)) == 4096  # a script's own word wins
    assert hidden_size({"n_embd": 1600}, int(params)) == 1600


def test_knobs_start_from_the_hidden_size_rules_on_their_ladders() -> None:
    start = stage3_start(4096)
    assert start[PERSISTENCE] == 40_960  # HF's 10 h, a rung of its own ladder
    assert start[PREFETCH] == 10_000_000  # the rung nearest 0.9 h^2 = 1.5e7
    assert start[PERSISTENCE] in stage3_ladders(4096)[PERSISTENCE]


def test_zero3_knobs_are_stepped_only_where_the_section_carries_them() -> None:
    section = {**explicit_zero_config({}, 3), **stage3_start(4096)}
    ladders = stage3_ladders(4096)
    stepped = {knob for knob, _ in knob_steps(section, ladders)}
    assert {PREFETCH, PERSISTENCE} <= stepped
    persistence = sorted(v for k, v in knob_steps(section, ladders) if k == PERSISTENCE)
    assert persistence == [1_000, 2 * 4096**2, 8 * 4096**2]  # past the tensor sizes it crosses
    assert not {PREFETCH, PERSISTENCE} & {k for k, _ in knob_steps(section)}
    assert not {PREFETCH, PERSISTENCE} & {
        k for k, _ in knob_steps(explicit_zero_config({}, 2), ladders)
    }


def value(model: PerformanceModel, zero: dict[str, Any], mbs: int) -> float:
    config = {**model.base_ds_config, "train_micro_batch_size_per_gpu": mbs}
    return model.metrics({**config, "zero_optimization": zero}, model.gpus, noisy=False)[
        "FLOPS_per_gpu"
    ]


def test_the_simulators_zero3_knobs_change_nothing_at_deepspeeds_defaults() -> None:
    model = ZERO3_KNOB_MODELS["gpt_20b_zero3_knobs_32xa100"]
    plain = dataclasses.replace(model, hidden=0)
    defaults = {"stage": 3, PREFETCH: 50_000_000, PERSISTENCE: 100_000}
    assert value(model, defaults, 4) == pytest.approx(value(plain, {"stage": 3}, 4))
    config = {**model.base_ds_config, "train_micro_batch_size_per_gpu": 4}
    assert model.memory_bytes({**config, "zero_optimization": defaults}, 32) == (
        plain.memory_bytes({**config, "zero_optimization": {"stage": 3}}, 32)
    )


def test_the_simulators_zero3_knobs_act_with_either_sign() -> None:
    """Persisting the attention matrices pays on the 4.5B surface and costs on the 20B one,
    each at its largest safe micro-batch."""
    gains = {}
    for name, model in ZERO3_KNOB_MODELS.items():
        ladder = stage3_ladders(model.hidden)[PERSISTENCE]
        results = []
        for threshold in ladder[1:3]:
            zero = {"stage": 3, "reduce_bucket_size": 10**7, "allgather_bucket_size": 10**7}
            zero = {**zero, PREFETCH: 50_000_000, PERSISTENCE: threshold}
            config = {**model.base_ds_config, "zero_optimization": zero}
            largest = model.max_micro_batch(config, model.gpus, 0.05)
            results.append(value(model, zero, largest))
        gains[name] = results[1] / results[0] - 1
    assert gains["gpt_4b_zero3_persistence_64xv100"] > 0.03
    assert gains["gpt_20b_zero3_knobs_32xa100"] < -0.03


@pytest.mark.parametrize("name", list(ZERO3_KNOB_MODELS))
def test_guided_steps_zero3_knobs_to_a_hand_over_within_2_percent(name: str) -> None:
    model = ZERO3_KNOB_MODELS[name]
    spec = SearchSpec(
        {"deepspeed_config": "ds.json"},
        {"train_micro_batch_size_per_gpu": 1, **model.base_ds_config},
        model.gpus,
    )
    m = make_search_method(settings("guided", random_seed=1, confirm_top=3), spec)
    SearchDriver(m, SimulatedRunner(model, model.gpus)).run()
    best = m.tracker.best()
    assert best is not None and best.zero_stage == 3
    zero = best.ds_config["zero_optimization"]
    start = m.stage3_start()  # type: ignore[attr-defined]
    assert PREFETCH in zero and PERSISTENCE in zero  # they reach the handed-over config
    assert (zero[PREFETCH], zero[PERSISTENCE]) != (start[PREFETCH], start[PERSISTENCE])
    top, _ = optimum(
        model, model.gpus, "FLOPS_per_gpu", False, (1, 2, 3), model.base_ds_config, 0.05
    )
    assert value(model, zero, best.mbs) >= 0.98 * top


def test_the_users_own_zero3_values_are_where_guided_starts_and_auto_is_replaced() -> None:
    model = ZERO3_KNOB_MODELS["gpt_20b_zero3_knobs_32xa100"]

    def first_stage3(zero: dict[str, Any]) -> dict[str, Any]:
        spec = SearchSpec(
            {"deepspeed_config": "ds.json"},
            {
                "train_micro_batch_size_per_gpu": 1,
                **model.base_ds_config,
                "zero_optimization": zero,
            },
            model.gpus,
        )
        m = make_search_method(settings("guided", zero_stages=(3,), max_trials=3), spec)
        SearchDriver(m, SimulatedRunner(model, model.gpus)).run()
        searched = [r for r in m.tracker.records if r.kind.value == "search"]
        section: dict[str, Any] = searched[0].ds_config["zero_optimization"]
        return section

    mine = first_stage3({"stage": 3, PREFETCH: 100_000_000})
    assert mine[PREFETCH] == 100_000_000
    auto = first_stage3({"stage": 3, PREFETCH: "auto", PERSISTENCE: "auto"})
    assert auto[PREFETCH] == stage3_start(hidden_size({}, model.num_params))[PREFETCH]
    assert isinstance(auto[PERSISTENCE], int)
