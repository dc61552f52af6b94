"""From parsed settings to a running search: check everything, pick the runner, start it.

All checks that can fail on a user mistake run here, before a single trial starts.
"""

from __future__ import annotations

import dataclasses
import datetime
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from dsat.callable_spec import load_callable
from dsat.config import Experiment, load_experiment, load_yaml_mapping, validate_with_deepspeed
from dsat.constants import RESULTS_ROOT
from dsat.errors import DsatError
from dsat.results import SUMMARY_FILE
from dsat.runners import Backend, resolve_backend
from dsat.runners.simulated import SimulatedExecutor
from dsat.search.base import STATE_FILE, DsatSearchMethod, SearchSpec
from dsat.search_run import best_config_path, run_search
from dsat.settings import SearchSettings


class SearchFailed(Exception):
    """The search ran but found no working configuration (not a user mistake: exit status 1)."""


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """A checked search, ready for its runner."""

    settings: SearchSettings
    experiment: Experiment
    backend: Backend
    backend_reason: str
    results_dir: Path
    simulator: Callable[..., Any] | None = None


def default_results_dir(experiment_name: str, now: datetime.datetime) -> Path:
    safe_name = re.sub(r"[^A-Za-z0-9._-]+", "-", experiment_name).strip("-.") or "experiment"
    stamp = now.astimezone(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return Path(RESULTS_ROOT) / f"{safe_name}-{stamp}"


def plan_search(
    settings: SearchSettings, environ: Mapping[str, str], now: datetime.datetime | None = None
) -> LaunchPlan:
    experiment = load_experiment(settings.config_path, settings.model_dir, settings.include)
    slots = experiment.slots_per_trial
    if settings.max_slots is not None and settings.max_slots < slots:
        raise DsatError(
            f"--max-slots {settings.max_slots} is less than resources.slots_per_trial {slots} in "
            f"{settings.config_path}; no trial could start"
        )
    validate_with_deepspeed(experiment.ds_config, slots, str(experiment.ds_config_path))
    if settings.search_runner_config is not None:
        load_yaml_mapping(Path(settings.search_runner_config))
    backend, reason = resolve_backend(settings.backend, environ)
    simulator = None
    if backend is Backend.SIMULATED:
        if settings.simulator is None:
            raise DsatError("--backend simulated needs --simulator MODULE_OR_FILE:FUNCTION")
        simulator = load_callable(settings.simulator, "--simulator")
    elif settings.simulator is not None:
        raise DsatError(
            f"--simulator only applies to --backend simulated (the backend is {backend.value})"
        )
    if settings.resume is not None:
        results_dir = Path(settings.resume)
        if not results_dir.is_dir():
            raise DsatError(f"--resume {results_dir}: no such results directory")
        if not (results_dir / STATE_FILE).is_file():
            raise DsatError(
                f"--resume {results_dir}: no saved search there ({STATE_FILE} is missing)"
            )
    elif settings.results_dir is not None:
        results_dir = Path(settings.results_dir)
        if (results_dir / STATE_FILE).is_file():
            raise DsatError(
                f"--results-dir {results_dir} already holds a search; continue it with "
                f"--resume {results_dir} or choose another directory"
            )
    else:
        results_dir = default_results_dir(
            experiment.name, now or datetime.datetime.now(datetime.timezone.utc)
        )
    return LaunchPlan(settings, experiment, backend, reason, results_dir, simulator)


def launch(settings: SearchSettings, environ: Mapping[str, str]) -> None:
    plan = plan_search(settings, environ)
    experiment = plan.experiment
    print(f"dsat: backend {plan.backend.value} ({plan.backend_reason})")
    print(
        f"dsat: experiment {experiment.name!r}: DeepSpeed config {experiment.ds_config_path}, "
        f"{experiment.slots_per_trial} slot(s) per trial, results in {plan.results_dir}"
    )
    if plan.backend is not Backend.SIMULATED:
        raise DsatError(
            f"the {plan.backend.value} runner is not implemented yet; the experiment passed every "
            "check, and the runners arrive in later dsat releases"
        )
    assert plan.simulator is not None  # plan_search loads it for this backend
    spec = SearchSpec(experiment.hparams, experiment.ds_config, experiment.slots_per_trial)
    executor = SimulatedExecutor(plan.simulator, experiment.slots_per_trial)
    method = run_search(settings, spec, executor, plan.results_dir)
    report_end(method, plan.results_dir)


def report_end(method: DsatSearchMethod, results_dir: Path) -> None:
    """Print the summary; a search with no successful trial is an error for the caller."""
    summary = results_dir / SUMMARY_FILE
    if summary.is_file():
        print(summary.read_text(), end="")
    print(f"dsat: {len(method.tracker.finished)} trials; search ended: {method.shutdown_reason}")
    if method.search_failed:
        raise SearchFailed(method.shutdown_reason or "no trial succeeded")
    print(f"dsat: best DeepSpeed config: {best_config_path(results_dir)}")
