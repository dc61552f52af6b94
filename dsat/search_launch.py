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
from dsat.results import SUMMARY_FILE, full_experiment_hparams
from dsat.runners import Backend, resolve_backend
from dsat.runners.determined_submit import submit
from dsat.runners.driver import TrialExecutor
from dsat.runners.launch import entrypoint_tokens, require_command
from dsat.runners.local import LocalExecutor, SlotPool
from dsat.runners.local_full_run import run_full_experiment
from dsat.runners.simulated import SimulatedExecutor
from dsat.search.base import STATE_FILE, DsatSearchMethod, SearchSpec
from dsat.search_run import best_config_path, run_search
from dsat.settings import SearchSettings


class SearchFailed(Exception):
    """The search ran but found no working configuration (not a user mistake: exit status 1)."""


class SearchInterrupted(Exception):
    """Ctrl-C or SIGTERM: every trial was stopped and the state is saved for --resume."""

    def __init__(self, results_dir: Path) -> None:
        super().__init__(
            f"interrupted; every trial was stopped. Resume with --resume {results_dir}"
        )
        self.results_dir = results_dir


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """A checked search, ready for its runner."""

    settings: SearchSettings
    experiment: Experiment
    backend: Backend
    backend_reason: str
    results_dir: Path
    simulator: Callable[..., Any] | None = None
    entrypoint: tuple[str, ...] = ()
    slot_pool: SlotPool | None = None


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
    entrypoint: tuple[str, ...] = ()
    pool = None
    if backend is Backend.LOCAL:
        config_path = str(experiment.config_path)
        entrypoint = tuple(entrypoint_tokens(experiment.config.get("entrypoint"), config_path))
        require_command(entrypoint, config_path)
        pool = SlotPool.for_machine(slots, settings.max_slots, dict(environ))
    simulator = None
    if backend is Backend.SIMULATED:
        if settings.run_full_experiment:
            raise DsatError(
                "--run-full-experiment needs a runner that trains for real; drop it with "
                "--backend simulated"
            )
        if settings.simulator is None:
            raise DsatError("--backend simulated needs --simulator MODULE_OR_FILE:FUNCTION")
        simulator = load_callable(settings.simulator, "--simulator")
    elif settings.simulator is not None:
        raise DsatError(
            f"--simulator only applies to --backend simulated (the backend is {backend.value})"
        )
    if backend is Backend.DETERMINED and (settings.resume or settings.results_dir):
        flag = "--resume" if settings.resume else "--results-dir"
        raise DsatError(
            f"{flag} applies to the local and simulated runners; on Determined the results live "
            "in the search runner's checkpoints and a restarted search runner resumes by itself"
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
    return LaunchPlan(
        settings, experiment, backend, reason, results_dir, simulator, entrypoint, pool
    )


def launch(settings: SearchSettings, environ: Mapping[str, str]) -> None:
    plan = plan_search(settings, environ)
    experiment = plan.experiment
    print(f"dsat: backend {plan.backend.value} ({plan.backend_reason})")
    where = (
        "results in the search runner's checkpoints"
        if plan.backend is Backend.DETERMINED
        else f"results in {plan.results_dir}"
    )
    print(
        f"dsat: experiment {experiment.name!r}: DeepSpeed config {experiment.ds_config_path}, "
        f"{experiment.slots_per_trial} slot(s) per trial, {where}"
    )
    if plan.backend is Backend.DETERMINED:
        submit(settings, experiment, environ)
        return
    spec = SearchSpec(experiment.hparams, experiment.ds_config, experiment.slots_per_trial)
    if plan.backend is Backend.SIMULATED:
        assert plan.simulator is not None  # plan_search loads it for this backend
        executor: TrialExecutor = SimulatedExecutor(plan.simulator, experiment.slots_per_trial)
    elif plan.backend is Backend.LOCAL:
        assert plan.slot_pool is not None  # plan_search sizes it for this backend
        pool = plan.slot_pool
        kind = "GPU" if pool.on_gpu else "CPU"
        print(f"dsat: {pool.size} {kind} slot(s) on this machine: {', '.join(pool.slots)}")
        # The pool bounds how many trials run at once.
        settings = dataclasses.replace(settings, max_slots=pool.size)
        executor = LocalExecutor(
            list(plan.entrypoint),
            experiment.model_dir,
            experiment.includes,
            plan.results_dir,
            pool,
            experiment.slots_per_trial,
            settings.trial_timeout,
        )
    else:
        raise AssertionError(f"unhandled backend {plan.backend}")
    try:
        method = run_search(
            settings,
            spec,
            executor,
            plan.results_dir,
            show_progress=plan.backend is not Backend.SIMULATED,
        )
    except KeyboardInterrupt:
        executor.stop_all()
        raise SearchInterrupted(plan.results_dir) from None
    report_end(method, plan.results_dir)
    if settings.run_full_experiment and isinstance(executor, LocalExecutor):
        best = method.tracker.best()
        assert best is not None  # report_end raised SearchFailed otherwise
        run_full_experiment(executor, full_experiment_hparams(best))


def report_end(method: DsatSearchMethod, results_dir: Path) -> None:
    """Print the summary; a search with no successful trial is an error for the caller."""
    summary = results_dir / SUMMARY_FILE
    if summary.is_file():
        print(summary.read_text(), end="")
    print(f"dsat: {len(method.tracker.finished)} trials; search ended: {method.shutdown_reason}")
    if method.search_failed:
        raise SearchFailed(method.shutdown_reason or "no trial succeeded")
    print(f"dsat: best DeepSpeed config: {best_config_path(results_dir)}")
