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

from dsat.constants import RESULTS_ROOT, STATE_FILE
from dsat.errors import DsatError
from dsat.experiment.config import (
    Experiment,
    load_experiment,
    load_yaml_mapping,
    validate_with_deepspeed,
)
from dsat.experiment.function_path import load_callable
from dsat.experiment.settings import SearchSettings
from dsat.paths import shown
from dsat.results.directory import SUMMARY_FILE, full_experiment_hparams
from dsat.results.report import write_report
from dsat.results.resume import read_saved_state, resume_command
from dsat.runners import Backend, resolve_backend
from dsat.runners.determined.submit import submit
from dsat.runners.driver import TrialExecutor
from dsat.runners.local.deepspeed_ops import build_ops, ops_for_trials
from dsat.runners.local.entrypoint import entrypoint_tokens, require_command
from dsat.runners.local.executor import LocalExecutor, SlotPool
from dsat.runners.local.full_run import run_full_experiment
from dsat.runners.local.trial_processes import stop_leftover_trials
from dsat.runners.local.trial_timeout import TrialTimeout
from dsat.runners.simulated.executor import SimulatedExecutor
from dsat.search.method import DsatSearchMethod
from dsat.search.trial_builder import SearchSpec
from dsat.search_run import best_config_path, run_search

OPS_LOG = "deepspeed-ops.log"


class SearchFailed(Exception):
    """The search ran but found no working configuration (not a user mistake: exit status 1)."""


class SearchInterrupted(Exception):
    """Ctrl-C or SIGTERM: every trial was stopped and the state is saved for --resume."""

    def __init__(self, method: str, results_dir: Path) -> None:
        super().__init__(
            f"interrupted; every trial was stopped. Resume with: {resume_command(method, results_dir)}"
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
    return Path.cwd() / RESULTS_ROOT / f"{safe_name}-{stamp}"


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
        read_saved_state(results_dir, settings.method)
    elif settings.results_dir is not None:
        results_dir = Path(settings.results_dir)
        if (results_dir / STATE_FILE).is_file():
            raise DsatError(
                f"--results-dir {shown(results_dir)} already holds a search; continue it with "
                f"`{resume_command(settings.method, results_dir)}` or choose another directory"
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
        else f"results in {shown(plan.results_dir)}"
    )
    print(
        f"dsat: experiment {experiment.name!r}: DeepSpeed config "
        f"{shown(experiment.ds_config_path)}, {experiment.slots_per_trial} slot(s) per trial, "
        f"{where}"
    )
    if plan.backend is Backend.DETERMINED:
        submit(settings, experiment, environ)
        return
    spec = SearchSpec(experiment.hparams, experiment.ds_config, experiment.slots_per_trial)
    slot_limit = None
    if plan.backend is Backend.SIMULATED:
        assert plan.simulator is not None  # plan_search loads it for this backend
        executor: TrialExecutor = SimulatedExecutor(plan.simulator, experiment.slots_per_trial)
    elif plan.backend is Backend.LOCAL:
        executor = local_executor(plan)
        slot_limit = executor.pool.size  # the pool bounds how many trials run at once
        print(f"dsat: if stopped, resume with: {resume_command(settings.method, plan.results_dir)}")
    else:
        raise AssertionError(f"unhandled backend {plan.backend}")
    try:
        method = run_search(
            settings,
            spec,
            executor,
            plan.results_dir,
            show_progress=plan.backend is not Backend.SIMULATED,
            slot_limit=slot_limit,
        )
    except KeyboardInterrupt:
        executor.stop_all()
        raise SearchInterrupted(settings.method, plan.results_dir) from None
    finally:
        if isinstance(executor, LocalExecutor):
            executor.close()
    report_end(method, plan.results_dir)
    if settings.run_full_experiment and isinstance(executor, LocalExecutor):
        best = method.tracker.best()
        assert best is not None  # report_end raised SearchFailed otherwise
        run_full_experiment(executor, full_experiment_hparams(best))


def local_executor(plan: LaunchPlan) -> LocalExecutor:
    """The local runner for ``plan``, with the machine made ready: nothing left running by an
    earlier dsat for this search, DeepSpeed's ops built once, the trial timeout chosen."""
    assert plan.slot_pool is not None  # plan_search sizes it for this backend
    pool = plan.slot_pool
    settings = plan.settings
    kind = "GPU" if pool.on_gpu else "CPU"
    print(f"dsat: {pool.size} {kind} slot(s) on this machine: {', '.join(pool.slots)}")
    timeout = TrialTimeout(settings.trial_timeout)
    if settings.resume is not None:
        stopped = stop_leftover_trials(plan.results_dir)
        if stopped:
            print(f"dsat: stopped {stopped} process(es) an earlier run left for this search")
        timeout.resume_from(plan.results_dir)
    executor = LocalExecutor(
        list(plan.entrypoint),
        plan.experiment.model_dir,
        plan.experiment.includes,
        plan.results_dir,
        pool,
        plan.experiment.slots_per_trial,
        timeout,
        warm=not settings.fresh_processes,
    )
    build_ops(
        ops_for_trials(plan.experiment.ds_config, pool.on_gpu),
        executor.op_build_environment(),
        plan.results_dir / "logs" / OPS_LOG,
    )
    print(f"dsat: {timeout.describe()}")
    return executor


def report_end(method: DsatSearchMethod, results_dir: Path) -> None:
    """Print the summary; a search with no successful trial is an error for the caller."""
    summary = results_dir / SUMMARY_FILE
    if summary.is_file():
        print(summary.read_text(), end="")
    print(f"dsat: {len(method.tracker.finished)} trials; search ended: {method.shutdown_reason}")
    try:
        png, page = write_report(results_dir)
        print(f"dsat: report: {shown(png)}, {shown(page)}")
    except DsatError as err:  # matplotlib is optional: the search itself is done
        print(f"dsat: no report drawn: {err}")
    if method.search_failed:
        raise SearchFailed(method.shutdown_reason or "no trial succeeded")
    print(f"dsat: best DeepSpeed config: {shown(best_config_path(results_dir))}")
