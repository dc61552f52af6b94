"""Building and driving search methods in tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dsat.experiment.settings import SearchSettings
from dsat.runners.driver import SearchDriver
from dsat.runners.simulated.runner import SimulatedRunner
from dsat.search import MethodSettings, make_search_method
from dsat.search.method import DsatSearchMethod
from dsat.search.trial_builder import SearchSpec
from dsat.trial import TrialOutcome, TrialRecord, TrialStatus

# A profile whose memory model allows micro-batch 64 at every stage (fp32, 1 slot).
PROFILE = {
    "num_params": 1000,
    "trainable_num_params": 1000,
    "activation_mem_per_gpu": 10**6,
    "gpu_mem": 64 * 10**6 + 16_000,
}
BASE_DS = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1}}


def settings(method: str = "binary", **overrides: Any) -> MethodSettings:
    """Search settings for tests of the search itself: without the confirmation round unless a
    test asks for it (tests/search/test_confirmation.py does)."""
    overrides.setdefault("confirm_top", 0)
    return MethodSettings(method=method, **overrides)


def search_settings(method: str = "binary", **overrides: Any) -> SearchSettings:
    """The settings of a whole search (for ``run_search``, which saves them for a resume):
    without the user's-config baseline unless a test asks for it."""
    overrides.setdefault("confirm_top", 0)
    overrides.setdefault("baseline", False)
    return SearchSettings(method=method, config_path="x.yaml", model_dir=".", **overrides)


def spec(slots: int = 1, ds_config: dict[str, Any] | None = None) -> SearchSpec:
    return SearchSpec({"deepspeed_config": "ds.json"}, dict(ds_config or BASE_DS), slots)


def method(name: str = "binary", slots: int = 1, **overrides: Any) -> DsatSearchMethod:
    return make_search_method(settings(name, **overrides), spec(slots))


def cliff_function(
    cliff: int, stage_bonus: dict[int, float] | None = None
) -> Callable[..., dict[str, Any]]:
    """A performance function: OOM above ``cliff``, throughput rising with the micro-batch."""
    bonus = stage_bonus or {}

    def perform(ds_config: dict[str, Any], slots: int) -> dict[str, Any]:
        autotuning = ds_config.get("autotuning", {})
        if autotuning.get("model_info", {}).get("profile"):
            return dict(PROFILE)
        mbs = ds_config["train_micro_batch_size_per_gpu"]
        if mbs > cliff:
            raise MemoryError("too big")
        stage = ds_config["zero_optimization"]["stage"]
        throughput = mbs * (1 + bonus.get(stage, 0.0)) * slots
        return {
            "throughput": throughput,
            "FLOPS_per_gpu": throughput * 1e9,
            "latency": 1000 / throughput,
            "fwd": 1.0,
            "bwd": 2.0,
            "seconds": 10.0 + mbs,
        }

    return perform


def run(
    m: DsatSearchMethod, function: Callable[..., dict[str, Any]], slots: int = 1
) -> SearchDriver:
    driver = SearchDriver(m, SimulatedRunner(function, slots))
    driver.run()
    return driver


def suggested(m: DsatSearchMethod) -> list[TrialRecord]:
    """Every trial the method would start now."""
    started = []
    while (record := m.suggest()) is not None:
        started.append(record)
    return started


def outcome(request_id: str, status: TrialStatus, **details: Any) -> TrialOutcome:
    return TrialOutcome(
        request_id, status, details.get("metrics") or {}, details.get("error"), 0.0, 1.0
    )


def start_profile(m: DsatSearchMethod) -> list[TrialRecord]:
    """Run the model-profile trial to completion; returns the trials that start the search."""
    (profile,) = suggested(m)
    m.observe(outcome(profile.request_id, TrialStatus.COMPLETED, metrics=dict(PROFILE)))
    return suggested(m)


def finish(
    m: DsatSearchMethod,
    request_id: str,
    ok: bool = True,
    metrics: dict[str, Any] | None = None,
    status: TrialStatus = TrialStatus.OOM,
) -> list[TrialRecord]:
    """Finish a running trial (completed with ``metrics``, or failed with ``status``); returns
    the trials that start next."""
    if ok:
        record = m.tracker.get(request_id)
        values = metrics or {"FLOPS_per_gpu": float(record.mbs)}
        m.observe(outcome(request_id, TrialStatus.COMPLETED, metrics=values))
    else:
        m.observe(outcome(request_id, status, error="boom"))
    return suggested(m)


def created_ids(started: list[TrialRecord]) -> list[str]:
    return [record.request_id for record in started]


def history(driver: SearchDriver) -> list[tuple[str, str]]:
    """(trial overrides, outcome) in the order trials finished: what a search tried."""
    import json

    return [
        (
            json.dumps(f.hparams.get("overwrite_deepspeed_args"), sort_keys=True),
            f.outcome.status.value,
        )
        for f in driver.history
    ]
