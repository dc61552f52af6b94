"""The fit ladder: what dsat climbs when the model does not run at micro-batch 1 as submitted."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from dsat.memory import Offload
from dsat.runners.driver import SearchDriver
from dsat.runners.simulated.performance_models import OFFLOAD_MODELS, PerformanceModel
from dsat.runners.simulated.runner import SimulatedRunner
from dsat.search import make_search_method
from dsat.search.baseline import baseline_line
from dsat.search.fit_ladder import (
    CHECKPOINTING_HPARAM,
    ladder,
    offload_choices,
    offload_level,
    what_it_takes,
)
from dsat.search.method import DsatSearchMethod
from dsat.search.trial_builder import SearchSpec
from dsat.search_launch import closing_lines
from dsat.trial import TrialKind, TrialStatus
from tests.search.helpers import PROFILE, cliff_function, settings

CPU = {"device": "cpu", "pin_memory": True}


def names(user: dict[str, Any], hparams: dict[str, Any] | None = None, **kw: Any) -> list[str]:
    stages = kw.pop("zero_stages", (1, 2, 3))
    return [r.name for r in ladder(user, hparams or {}, stages, **kw)]


def test_the_ladder_climbs_zero3_then_the_optimizer_then_the_parameters_then_nvme() -> None:
    assert names({}) == [
        "as submitted",
        "ZeRO-3",
        "ZeRO-3, optimizer states on the CPU",
        "ZeRO-3, optimizer states and parameters on the CPU",
    ]
    with_nvme = names({}, nvme_path="/local_nvme")
    assert with_nvme[-1] == "ZeRO-3, optimizer states and parameters on NVMe (/local_nvme)"
    rungs = ladder({}, {}, (1, 2, 3), "/local_nvme")
    assert [offload_level(r.zero) for r in rungs] == [0, 0, 1, 2, 3]
    assert [r.profile_stage for r in rungs] == [None, 3, 3, 3, 3]
    assert rungs[-1].zero["offload_param"]["nvme_path"] == "/local_nvme"


def test_activation_checkpointing_is_a_rung_where_the_script_has_the_switch() -> None:
    rungs = ladder({}, {CHECKPOINTING_HPARAM: False}, (1, 2, 3))
    assert [r.name for r in rungs][1:3] == ["ZeRO-3", "ZeRO-3, activation checkpointing"]
    assert all(r.hparams == {CHECKPOINTING_HPARAM: True} for r in rungs[2:])
    assert rungs[-1].name.endswith(", activation checkpointing")
    # A script whose switch is already on, or that has none, gets no such rung.
    assert "ZeRO-3, activation checkpointing" not in names({}, {CHECKPOINTING_HPARAM: True})


def test_rungs_that_keep_no_more_off_the_gpu_than_the_users_config_are_left_out() -> None:
    user = {"zero_optimization": {"stage": 3, "offload_optimizer": CPU}}
    assert names(user) == ["as submitted", "ZeRO-3, optimizer states and parameters on the CPU"]
    # Without stage 3 the highest stage allowed comes first, plain, then only the optimizer can go.
    assert names({}, zero_stages=(1, 2)) == [
        "as submitted",
        "ZeRO-2",
        "ZeRO-2, optimizer states on the CPU",
    ]
    at_two = {"zero_optimization": {"stage": 2}}
    assert names(at_two, zero_stages=(1, 2)) == [
        "as submitted",
        "ZeRO-2, optimizer states on the CPU",
    ]
    assert names({}, zero_stages=(0,)) == ["as submitted"]


def test_offload_choices_keep_at_least_the_rungs_and_fit_the_stage() -> None:
    assert offload_choices(0, 0) == [{}]
    assert [offload_level(c) for c in offload_choices(3, 1)] == [1, 2]
    assert [offload_level(c) for c in offload_choices(3, 0, "/nvme")] == [0, 1, 2, 3]
    assert [offload_level(c) for c in offload_choices(2, 1)] == [1]


def search_on(model: PerformanceModel, method: str, seed: int = 0, **kw: Any) -> DsatSearchMethod:
    spec = SearchSpec(
        {"deepspeed_config": "ds.json"},
        {"train_micro_batch_size_per_gpu": 1, **model.base_ds_config},
        model.gpus,
    )
    kw.setdefault("max_trials", 24)
    m = make_search_method(settings(method, random_seed=seed, **kw), spec)
    SearchDriver(m, SimulatedRunner(model, model.gpus)).run()
    return m


@pytest.mark.parametrize("method", ["guided", "asha", "random"])
def test_a_model_that_needs_offload_is_searched_with_it_and_handed_over_with_it(
    method: str,
) -> None:
    model = OFFLOAD_MODELS["llama_70b_offload_8xh100"]
    m = search_on(model, method)
    profiles = [r for r in m.tracker.records if r.kind is TrialKind.MODEL_PROFILE]
    assert [r.status for r in profiles] == [TrialStatus.OOM, TrialStatus.OOM, TrialStatus.COMPLETED]
    assert m.fit_rung.name == "ZeRO-3, optimizer states on the CPU"
    searched = [r for r in m.tracker.records if r.kind is TrialKind.SEARCH]
    assert searched and all(Offload.of(r.zero_section).optimizer for r in searched)
    best = m.tracker.best()
    assert best is not None and Offload.of(best.ds_config["zero_optimization"]).optimizer
    assert model.is_safe(best.ds_config, model.gpus, m.settings.memory_margin)
    line = m.fit_line(best)
    assert line.startswith(f"to fit: {what_it_takes(best.zero_section, best.hparams)} (at ")
    assert line.endswith("ran out of memory as submitted and with ZeRO-3)")
    assert "optimizer states" in line


def test_on_the_zero3_rung_a_lower_stage_the_profile_shows_fits_is_searched_too() -> None:
    model = OFFLOAD_MODELS["gpt_13b_no_zero0_8xa100"]
    m = search_on(model, "guided")
    assert m.fit_rung.name == "ZeRO-3"
    assert m.zero_stages == (1, 2, 3)  # each fits at micro-batch 1 by the ZeRO-3 profile
    best = m.tracker.best()
    assert best is not None and best.zero_stage == 2
    assert not Offload.of(best.ds_config["zero_optimization"]).optimizer


def test_without_stage_3_plain_zero2_is_tried_before_offload() -> None:
    """A model that runs out of memory at ZeRO-1 but fits at ZeRO-2 is handed over without the
    offload that would slow every step (the ladder used to go straight to offload)."""
    model = OFFLOAD_MODELS["gpt_13b_no_zero0_8xa100"]
    m = search_on(model, "guided", zero_stages=(1, 2))
    profiles = [r for r in m.tracker.records if r.kind is TrialKind.MODEL_PROFILE]
    assert [(r.zero_stage, r.status) for r in profiles] == [
        (0, TrialStatus.OOM),
        (2, TrialStatus.COMPLETED),
    ]
    assert m.fit_rung.name == "ZeRO-2"
    best = m.tracker.best()
    assert best is not None and best.zero_stage == 2
    assert not Offload.of(best.ds_config["zero_optimization"]).optimizer
    assert model.is_safe(best.ds_config, model.gpus, m.settings.memory_margin)


def test_offload_puts_offload_in_the_space_when_the_model_fits() -> None:
    spec = SearchSpec({"deepspeed_config": "ds.json"}, {"train_micro_batch_size_per_gpu": 1}, 1)
    m = make_search_method(settings("guided", offload=True, max_trials=30), spec)
    SearchDriver(m, SimulatedRunner(cliff_function(8), 1)).run()
    tried = {offload_level(r.zero_section) for r in m.tracker.records if r.kind is TrialKind.SEARCH}
    assert tried >= {0, 1, 2}
    assert m.fit_rung.profile_stage is None  # it fitted as submitted


def test_the_ladders_switch_reaches_the_scripts_hyperparameters() -> None:
    calls = {"profiles": 0}

    def fits_with_checkpointing(ds_config: dict[str, Any], slots: int) -> dict[str, Any]:
        if ds_config.get("autotuning", {}).get("model_info", {}).get("profile"):
            calls["profiles"] += 1
            if calls["profiles"] <= 2:  # as submitted, and ZeRO-3 alone
                raise MemoryError("out of memory")
            return dict(PROFILE)
        return cliff_function(64)(ds_config, slots)

    spec = SearchSpec(
        {"deepspeed_config": "ds.json", CHECKPOINTING_HPARAM: False},
        {"train_micro_batch_size_per_gpu": 1},
        1,
    )
    m = make_search_method(settings("binary", max_trials=8, baseline=True), spec)
    SearchDriver(m, SimulatedRunner(fits_with_checkpointing, 1)).run()
    assert m.fit_rung.name == "ZeRO-3, activation checkpointing"
    searched = [r for r in m.tracker.records if r.kind is TrialKind.SEARCH]
    assert searched and all(r.hparams[CHECKPOINTING_HPARAM] is True for r in searched)
    # ZeRO-3 without checkpointing ran out: that says nothing of a lower stage with it (on one
    # GPU it holds as much, and trains faster), which was left out.
    assert {r.zero_stage for r in searched} > {3}
    # The user's own config ran out of memory in the profile: no baseline, and the summary
    # says why.
    assert not any(r.kind is TrialKind.BASELINE for r in m.tracker.records)
    assert "ran out of memory at micro-batch 1" in baseline_line(m)
    # The last lines, which best_ds_config.json alone cannot carry it in, name the switch: a
    # user who trained with them ran without it, as the profile that ran out of memory did.
    found, _, nxt = closing_lines(m, Path("r"), full_run=False)
    assert found.endswith(", with activation checkpointing")
    assert "with activation checkpointing on (hyperparameter gradient_checkpointing: true)" in nxt
    hf = dataclasses.replace(spec, entrypoint="python3 train.py --deepspeed ds.json")
    m.spec = hf
    assert " --gradient_checkpointing true (HF refuses" in closing_lines(m, Path("r"), False)[2]


@pytest.mark.parametrize("method", ["guided", "binary"])
def test_a_search_interrupted_on_the_ladder_resumes_on_the_same_rung(method: str) -> None:
    """The rung is how many model profiles ran: a search rebuilt from its JSON state at any
    point of the climb proposes the same trials as one never interrupted."""
    model = OFFLOAD_MODELS["llama_70b_offload_8xh100"]
    spec = SearchSpec(
        {"deepspeed_config": "ds.json"},
        {"train_micro_batch_size_per_gpu": 1, **model.base_ds_config},
        model.gpus,
    )

    def fresh() -> DsatSearchMethod:
        return make_search_method(settings(method, random_seed=3, max_trials=12), spec)

    def names_of(driver: SearchDriver) -> list[tuple[str, str]]:
        return [
            (t.outcome.request_id, json.dumps(t.ds_config, sort_keys=True)) for t in driver.history
        ]

    whole = SearchDriver(fresh(), SimulatedRunner(model, model.gpus))
    whole.run()
    for k in (1, 2, 3, 5):
        first = fresh()
        driver = SearchDriver(first, SimulatedRunner(model, model.gpus), max_events=k)
        driver.run()
        saved = json.loads(json.dumps(first.state_json()))
        second = fresh()
        second.load_state_json(saved)
        assert second.fit_rung == first.fit_rung
        driver.method, driver.max_events = second, None
        driver.loop()
        assert names_of(driver) == names_of(whole), f"diverged after resuming at event {k}"


def test_guided_starts_each_offload_family_nvme_apart_from_the_cpu() -> None:
    """With --offload-nvme, on an offload rung, keeping both on NVMe is a family of its own
    (fit_ladder.offload_level), not the CPU one: both keep the same state off the GPU, but guided
    once took them for one family and never ran the NVMe one."""
    model = OFFLOAD_MODELS["llama_70b_offload_8xh100"]
    m = search_on(model, "guided", max_trials=30, offload_nvme="/local_nvme")
    searched = [r for r in m.tracker.records if r.kind is TrialKind.SEARCH]
    assert {offload_level(r.zero_section) for r in searched} == {1, 2, 3}
    nvme = [r for r in searched if offload_level(r.zero_section) == 3]
    assert nvme[0].zero_section["offload_param"]["nvme_path"] == "/local_nvme"


def test_an_offload_the_user_set_keeps_their_settings_of_it() -> None:
    """dsat's whole choice replaced it: the user's pin_memory false (hosts where pinning fails)
    became true in every trial and the hand-over, and fast_init was dropped."""
    from dsat.search.fit_ladder import with_offload

    mine = {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "pin_memory": False, "fast_init": True},
    }
    cpu = {"device": "cpu", "pin_memory": True}
    both = with_offload(mine, {"offload_optimizer": cpu, "offload_param": cpu})
    assert both["offload_optimizer"] == {"device": "cpu", "pin_memory": False, "fast_init": True}
    assert both["offload_param"] == cpu  # nothing of the user's to keep there
    nvme = {"device": "nvme", "nvme_path": "/nvme", "pin_memory": True}
    assert with_offload(mine, {"offload_optimizer": nvme})["offload_optimizer"] == nvme


USERS_ZERO3 = {
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": False},
        "offload_param": {"device": "cpu", "pin_memory": False},
    }
}


def test_a_trial_turns_off_the_users_offloads_its_stage_does_not_use() -> None:
    """The user's section merges into every trial's: their ZeRO-3 parameter offload read as
    offloaded in a ZeRO-2 trial (DeepSpeed ignores it there; the summary said "parameters on the
    CPU"), and their optimizer offload went into ZeRO-0 trials, whose CPU optimizer fails at
    the first step on a GPU."""
    from dsat.search.trial_builder import TrialBuilder

    spec = SearchSpec({"deepspeed_config": "ds.json"}, USERS_ZERO3, 1)
    make = TrialBuilder(spec, 1, 3, 5).make
    sections = {
        stage: make(stage, TrialKind.SEARCH, {"stage": stage}, mbs=2).ds_config["zero_optimization"]
        for stage in (0, 2, 3)
    }
    none = {"device": "none", "pin_memory": False}
    assert sections[3]["offload_param"]["device"] == "cpu"
    assert (sections[2]["offload_optimizer"]["device"], sections[2]["offload_param"]) == (
        "cpu",
        none,
    )
    assert sections[0]["offload_optimizer"] == sections[0]["offload_param"] == none
    assert [offload_level(sections[s]) for s in (0, 2, 3)] == [0, 1, 2]
    assert what_it_takes(sections[2], {}) == "ZeRO-2, optimizer states on the CPU"
    # The user's own config, as submitted, is theirs: the baseline runs it unchanged.
    baseline = make(9, TrialKind.BASELINE, None, None).ds_config["zero_optimization"]
    assert baseline == USERS_ZERO3["zero_optimization"]


@pytest.mark.parametrize("method", ["guided", "asha", "binary", "random"])
def test_no_trial_carries_an_offload_its_stage_does_not_use(method: str) -> None:
    spec = SearchSpec({"deepspeed_config": "ds.json"}, USERS_ZERO3, 1)
    m = make_search_method(settings(method, max_trials=12, zero_stages=(0, 1, 2, 3)), spec)
    SearchDriver(m, SimulatedRunner(cliff_function(8), 1)).run()
    searched = [r for r in m.tracker.records if r.kind is TrialKind.SEARCH]
    assert {r.zero_stage for r in searched} - {3}, "the search tried no lower stage"
    for record in searched:
        section = record.ds_config["zero_optimization"]
        assert offload_level(section) == {0: 0, 1: 1, 2: 1, 3: 2}[record.zero_stage]
        assert "offload-param" not in record.name or record.zero_stage == 3
