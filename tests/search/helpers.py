"""Building and driving search methods in tests."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from determined import searcher

from dsat.experiment.settings import SearchSettings
from dsat.runners.driver import SearchDriver
from dsat.runners.simulated.runner import SimulatedRunner
from dsat.search import MethodSettings, make_search_method
from dsat.search.method import DsatSearchMethod
from dsat.search.trial_builder import SearchSpec
from dsat.trial import TrialFailure, TrialStatus

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
    """The settings of a whole search (for ``run_search``, which saves them for a resume)."""
    overrides.setdefault("confirm_top", 0)
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
    driver = SearchDriver(m, SimulatedRunner(function, slots), m.spec.ds_config)
    driver.run()
    return driver


def start_profile(m: DsatSearchMethod) -> list[searcher.Operation]:
    """Run the model-profile trial to completion; returns the operations that start the search."""
    state = searcher.SearcherState()
    (create, _) = m.initial_operations(state)
    m.on_validation_completed(state, create.request_id, dict(PROFILE), 1)
    return list(m.on_trial_closed(state, create.request_id))


def finish(
    m: DsatSearchMethod,
    request_id: str,
    ok: bool = True,
    metrics: dict[str, Any] | None = None,
    status: TrialStatus = TrialStatus.OOM,
) -> list[searcher.Operation]:
    state = searcher.SearcherState()
    rid = uuid.UUID(request_id)
    if ok:
        record = m.tracker.get(request_id)
        ops = m.on_validation_completed(
            state, rid, metrics or {"FLOPS_per_gpu": float(record.mbs)}, 6
        )
    else:
        ops = m.on_trial_exited_early(
            state, rid, searcher.ExitedReason.ERRORED, TrialFailure(status, "boom")
        )
    return list(ops) + list(m.on_trial_closed(state, rid))


def created_ids(ops: list[searcher.Operation]) -> list[str]:
    return [str(op.request_id) for op in ops if isinstance(op, searcher.Create)]


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
