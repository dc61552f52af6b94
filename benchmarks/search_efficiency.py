"""Search efficiency: dsat's methods vs the reference's (determined.pytorch.dsat, determined 0.37).

Both run side by side on the same simulated runner, the same built-in performance models and the
same seeds. For every search: how many trials, and how many simulated GPU-hours, until the best
configuration found so far is within 2% of the model's true optimum (exhaustive, noise-free), and
the final regret. Prints a markdown table and writes benchmarks/results/search_efficiency.json.

    python3 benchmarks/search_efficiency.py [--seeds 20]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dsat.atomic_file import write_json_atomic
from dsat.experiment.metric import Metric
from dsat.runners.driver import DeterminedOnlyMethod, FinishedTrial, SearchDriver, SearchEvents
from dsat.runners.simulated.executor import SimulatedExecutor
from dsat.runners.simulated.performance_models import (
    BUILTIN_MODELS,
    PerformanceModel,
    is_model_profile,
    optimum,
)
from dsat.search import MethodSettings, make_search_method
from dsat.search.trial_builder import SearchSpec
from dsat.trial import TrialStatus

RESULTS = Path(__file__).resolve().parent / "results" / "search_efficiency.json"
METRIC = Metric.FLOPS_PER_GPU
WITHIN = 0.02
# Every built-in surface, on the GPUs it is built for, with its precision in the user's config.
CASES: dict[str, tuple[int, dict[str, Any]]] = {
    name: (model.gpus, model.base_ds_config) for name, model in BUILTIN_MODELS.items()
}
METHODS = ("guided", "asha", "binary", "random")
# The reference has no guided search: it is compared with the reference's default, asha.
REFERENCE_OF = {"guided": "asha", "asha": "asha", "binary": "binary", "random": "random"}


def dsat_method(
    method: str, seed: int, slots: int, ds_config: dict[str, Any], _: Path
) -> SearchEvents:
    settings = MethodSettings(method=method, random_seed=seed)
    return make_search_method(
        settings, SearchSpec({"deepspeed_config": "ds_config.json"}, ds_config, slots)
    )


def reference_method(
    method: str, seed: int, slots: int, ds_config: dict[str, Any], model_dir: Path
) -> SearchEvents:
    from determined.pytorch.dsat import _dsat_search_method as ref
    from determined.pytorch.dsat import defaults

    args = argparse.Namespace(
        **{k.replace("-", "_"): v for k, v in defaults.AUTOTUNING_ARG_DEFAULTS.items()},
        max_slots=None,
        model_dir=str(model_dir),
        early_stopping=None,
        include=None,
    )
    args.random_seed = seed
    exp_config = {
        "resources": {"slots_per_trial": slots},
        "hyperparameters": {"deepspeed_config": "ds_config.json"},
    }
    (model_dir / "ds_config.json").write_text(json.dumps(ds_config))
    classes = {
        "asha": ref.ASHADSATSearchMethod,
        "binary": ref.BinarySearchDSATSearchMethod,
        "random": ref.RandomDSATSearchMethod,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return DeterminedOnlyMethod(classes[REFERENCE_OF[method]](args, exp_config))


def measure(
    history: list[FinishedTrial], model: PerformanceModel, slots: int, best: float
) -> dict[str, Any]:
    """Trials and GPU-hours until the best-so-far (by measured metric) is within 2% of optimum."""
    best_measured = -math.inf
    best_true = 0.0
    reached_at: int | None = None
    reached_time = math.inf
    for index, trial in enumerate(history):
        outcome = trial.outcome
        if outcome.status is TrialStatus.COMPLETED and not is_model_profile(trial.ds_config):
            measured = float(outcome.metrics[METRIC.file_key])
            if measured > best_measured:
                best_measured = measured
                best_true = model.metrics(trial.ds_config, slots, noisy=False)[METRIC.file_key]
        if reached_at is None and (best - best_true) / best <= WITHIN:
            reached_at, reached_time = index + 1, outcome.end
    until = reached_time if reached_at is not None else max(t.outcome.end for t in history)
    gpu_seconds = sum(
        max(0.0, min(t.outcome.end, until) - t.outcome.start) * slots for t in history
    )
    return {
        "trials_to_2pct": reached_at,
        "gpu_hours_to_2pct": gpu_seconds / 3600 if reached_at is not None else None,
        "final_regret": (best - best_true) / best,
        "trials": len(history),
    }


def run_one(
    factory: Callable[..., SearchEvents],
    method: str,
    model_name: str,
    seed: int,
    best: float,
) -> dict[str, Any]:
    slots, extra = CASES[model_name]
    # Each seed draws the surface's measurement noise afresh, as another run on the same
    # hardware would; the noise stays a deterministic function of the configuration.
    model = dataclasses.replace(
        BUILTIN_MODELS[model_name], noise_seed=BUILTIN_MODELS[model_name].noise_seed * 1000 + seed
    )
    ds_config = {"train_micro_batch_size_per_gpu": 1, **extra}
    with tempfile.TemporaryDirectory() as tmp:
        search = factory(method, seed, slots, ds_config, Path(tmp))
        driver = SearchDriver(search, SimulatedExecutor(model, slots), ds_config)
        driver.run()
    return measure(driver.history, model, slots, best)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else math.inf


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    trials = [r["trials_to_2pct"] if r["trials_to_2pct"] is not None else math.inf for r in runs]
    hours = [
        r["gpu_hours_to_2pct"] if r["gpu_hours_to_2pct"] is not None else math.inf for r in runs
    ]
    return {
        "reached": sum(r["trials_to_2pct"] is not None for r in runs),
        "median_trials_to_2pct": median(trials),
        "median_gpu_hours_to_2pct": median(hours),
        "median_final_regret": median([r["final_regret"] for r in runs]),
    }


def fmt(value: float, digits: int = 1) -> str:
    return "never" if math.isinf(value) else f"{value:.{digits}f}"


def ratio(ours: float, theirs: float) -> str:
    if math.isinf(ours) or math.isinf(theirs):
        return (
            "-"
            if math.isinf(ours) == math.isinf(theirs)
            else ("0" if math.isinf(theirs) else "inf")
        )
    return f"{ours / theirs:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--models", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--output", type=Path, default=RESULTS, help="where the JSON goes")
    parser.add_argument(
        "--summaries-only", action="store_true", help="leave each run's numbers out of the JSON"
    )
    options = parser.parse_args()
    seeds = range(options.seeds)
    started = time.time()
    report: dict[str, Any] = {
        "metric": METRIC.value,
        "within": WITHIN,
        "seeds": options.seeds,
        "cases": {},
    }
    lines = [
        "| model | method | reached 2% (dsat / ref) | median trials to 2% (dsat / ref, ratio) | "
        "median GPU-h to 2% (dsat / ref, ratio) | median final regret (dsat / ref) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for model_name in options.models:
        slots, extra = CASES[model_name]
        best, best_config = optimum(
            BUILTIN_MODELS[model_name], slots, METRIC.file_key, False, (1, 2, 3), extra
        )
        report["cases"][model_name] = {
            "optimum": best,
            "optimum_config": best_config,
            "methods": {},
        }
        for method in options.methods:
            entry: dict[str, Any] = {}
            for label, factory in (("dsat", dsat_method), ("reference", reference_method)):
                runs = [run_one(factory, method, model_name, seed, best) for seed in seeds]
                entry[label] = {"summary": summarise(runs)}
                if not options.summaries_only:
                    entry[label]["runs"] = runs
            report["cases"][model_name]["methods"][method] = entry
            ours, theirs = entry["dsat"]["summary"], entry["reference"]["summary"]
            lines.append(
                f"| {model_name} | {method} | {ours['reached']}/{len(seeds)} / {theirs['reached']}/{len(seeds)} | "
                f"{fmt(ours['median_trials_to_2pct'])} / {fmt(theirs['median_trials_to_2pct'])}, "
                f"{ratio(ours['median_trials_to_2pct'], theirs['median_trials_to_2pct'])} | "
                f"{fmt(ours['median_gpu_hours_to_2pct'])} / {fmt(theirs['median_gpu_hours_to_2pct'])}, "
                f"{ratio(ours['median_gpu_hours_to_2pct'], theirs['median_gpu_hours_to_2pct'])} | "
                f"{ours['median_final_regret']:.2%} / {theirs['median_final_regret']:.2%} |"
            )
            print(lines[-1], flush=True)
    report["seconds"] = time.time() - started
    report["python"] = sys.version.split()[0]
    write_json_atomic(
        options.output, json.loads(json.dumps(report, default=str).replace("Infinity", "null"))
    )
    print("\n".join(lines))
    print(
        f"\n{len(options.models) * len(options.methods) * 2 * len(seeds)} searches in "
        f"{report['seconds']:.0f} s; wrote {options.output}"
    )


if __name__ == "__main__":
    main()
