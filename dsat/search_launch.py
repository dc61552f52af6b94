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
from dsat.runners import Backend, resolve_backend
from dsat.settings import SearchSettings


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
    elif settings.results_dir is not None:
        results_dir = Path(settings.results_dir)
    else:
        results_dir = default_results_dir(
            experiment.name, now or datetime.datetime.now(datetime.timezone.utc)
        )
    return LaunchPlan(settings, experiment, backend, reason, results_dir, simulator)


def launch(settings: SearchSettings, environ: Mapping[str, str]) -> None:
    plan = plan_search(settings, environ)
    print(f"dsat: backend {plan.backend.value} ({plan.backend_reason})")
    print(
        f"dsat: experiment {plan.experiment.name!r}: DeepSpeed config "
        f"{plan.experiment.ds_config_path}, {plan.experiment.slots_per_trial} slot(s) per trial"
    )
    raise DsatError(
        f"the {plan.backend.value} runner is not implemented yet; the experiment passed every "
        "check, and the runners arrive in later dsat releases"
    )
