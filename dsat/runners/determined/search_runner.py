"""dsat's search on a Determined cluster: the entrypoint of the search-runner experiment.

``python3 -m dsat.runners.determined.search_runner`` runs in the zero-slot experiment that
``dsat ... --runner determined`` submits. It reads the uploaded settings (JSON), creates the
trials' custom experiment from the user's YAML and drives dsat's search method through
Determined's ``RemoteSearchRunner`` (as ``searcher_adapter.DsatSearcher``). Every checkpoint
holds JSON only: Determined's searcher state, the method's state, the last operations, and the
results files (``trials.jsonl``, ``best_ds_config.json``, ``best_ds_metrics.json``), so a
restarted search runner resumes.

It imports only what a Determined task image has (determined and its dependencies, numpy, pyyaml):
no DeepSpeed, no torch, no terminal UI.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

from determined import searcher
from determined.common.api import bindings
from determined.common.api import errors as api_errors

from dsat.constants import REPORTED_AT_KEY
from dsat.experiment.config import load_experiment
from dsat.experiment.settings import SearchSettings
from dsat.results.directory import (
    BEST_CONFIG_FILE,
    BEST_METRICS_FILE,
    SUMMARY_FILE,
    TRIALS_FILE,
    ResultsWriter,
    TrialTiming,
)
from dsat.results.utilization import Utilization
from dsat.runners.determined.configs import (
    DSAT_PACKAGE,
    SETTINGS_UPLOAD,
    custom_experiment_config,
    full_experiment_config,
    full_run_label,
)
from dsat.runners.determined.searcher_adapter import DsatSearcher
from dsat.runners.determined.searcher_operations import operations_from_text, operations_to_text
from dsat.runners.determined.submit import said_by
from dsat.search import MethodSettings, make_search_method
from dsat.search.method import DsatSearchMethod
from dsat.search.trial_builder import SearchSpec

logger = logging.getLogger(__name__)

OPERATIONS_FILE = "searcher_operations.json"
FULL_EXPERIMENT_FILE = "full_experiment_id.txt"
# When each trial still running started (wall-clock seconds): its cost, once it ends after a
# restart of the search runner, is counted from there.
TRIAL_STARTS_FILE = "trial_starts.json"
RESULT_FILES = (TRIALS_FILE, BEST_CONFIG_FILE, BEST_METRICS_FILE, SUMMARY_FILE)


def reported_end(event: bindings.v1SearcherEvent, start: float, now: float) -> float:
    """When a finished trial ended: when it reported its outcome, on its own clock (kept
    between its start and now), where it did; else now. An outcome read after a restart of the
    search runner was timed to the restart: minutes of a rescheduled runner in every such row."""
    metric = event.validationCompleted.metric if event.validationCompleted else None
    reported = metric.get(REPORTED_AT_KEY) if isinstance(metric, dict) else None
    if not isinstance(reported, (int, float)) or isinstance(reported, bool):
        return now
    return min(now, max(start, float(reported)))


class CheckpointedSearchRunner(searcher.RemoteSearchRunner):  # type: ignore[misc]
    """Determined's RemoteSearchRunner, checkpointing JSON instead of pickle, and keeping dsat's
    results files current in the working directory and in every checkpoint."""

    def __init__(
        self,
        method: DsatSearchMethod,
        context: Any,
        results_dir: Path,
        utilization: Utilization | None = None,
    ) -> None:
        with warnings.catch_warnings():  # Determined marks custom searchers deprecated in 0.37
            warnings.simplefilter("ignore", FutureWarning)
            super().__init__(DsatSearcher(method), context)
        self.method = method
        self.results_dir = results_dir
        self.utilization = utilization
        self.writer = self._results_writer()
        self.started: dict[str, float] = {}
        self.last_operations: list[searcher.Operation] = []
        self.full_experiment_id: int | None = None

    def _results_writer(self) -> ResultsWriter:
        # Trials keep running on the cluster while the search runner restarts: the wall clock
        # carries on, and a row's times are its own.
        return ResultsWriter(
            self.results_dir,
            utilization=self.utilization,
            continued_clock=True,
            user_config=self.method.spec.ds_config,
        )

    # ------------------------------------------------------------------ events

    def _get_operations(self, event: bindings.v1SearcherEvent) -> list[searcher.Operation]:
        ops: list[searcher.Operation] = super()._get_operations(event)
        now = time.time()
        finished = event.validationCompleted or event.trialExitedEarly
        if finished:
            record = self.method.tracker.get(finished.requestId)
            start = self.started.pop(record.request_id, now)
            end = reported_end(event, start, now)
            if not any(line["request_id"] == record.request_id for line in self.writer.lines):
                self.writer.trial_finished(record, TrialTiming(start, end), self.method.tracker)
        for op in ops:
            if isinstance(op, searcher.Create):
                self.started[str(op.request_id)] = now
            elif isinstance(op, searcher.Shutdown):
                self.writer.write_summary(self.method)
        self.last_operations = ops
        return ops

    # ------------------------------------------------------------------ checkpoints

    def save_state(self, experiment_id: int, operations: list[searcher.Operation]) -> None:
        metadata = {"steps_completed": self.state.last_event_id}
        with self.context.checkpoint.store_path(metadata) as (path, _storage_id):
            self.search_method.save(self.state, path, experiment_id=experiment_id)
            (path / OPERATIONS_FILE).write_text(operations_to_text(operations))
            (path / TRIAL_STARTS_FILE).write_text(json.dumps(self.started, sort_keys=True))
            for name in RESULT_FILES:
                if (self.results_dir / name).is_file():
                    shutil.copyfile(self.results_dir / name, path / name)
            if self.full_experiment_id is not None:
                (path / FULL_EXPERIMENT_FILE).write_text(f"{self.full_experiment_id}\n")

    def load_state(self, storage_id: str) -> tuple[int, list[searcher.Operation]]:
        with self.context.checkpoint.restore_path(storage_id) as path:
            self.state, experiment_id = self.search_method.load(path)
            operations = operations_from_text((path / OPERATIONS_FILE).read_text())
            for name in RESULT_FILES:
                if (path / name).is_file():
                    shutil.copyfile(path / name, self.results_dir / name)
            if (path / FULL_EXPERIMENT_FILE).is_file():
                self.full_experiment_id = int((path / FULL_EXPERIMENT_FILE).read_text())
            if (path / TRIAL_STARTS_FILE).is_file():  # none in a checkpoint of an older dsat
                starts = json.loads((path / TRIAL_STARTS_FILE).read_text())
                self.started = {str(k): float(v) for k, v in starts.items()}
        self.writer = self._results_writer()
        self.last_operations = operations
        return int(experiment_id), operations


def cluster_settings(workdir: Path) -> SearchSettings:
    """The uploaded settings with every path made relative to the uploaded context."""
    settings = SearchSettings.from_json((workdir / SETTINGS_UPLOAD).read_text())
    return settings.on_cluster()


def refused_for_good(err: Exception) -> bool:
    """Whether the master said no to a request for good (a 4xx: the config, a permission, a
    resource pool), which would fail again on every restart of the search runner; not one it
    could not answer now (unreachable, a 5xx), which a restart may get past."""
    status = getattr(err, "status_code", None)
    return isinstance(err, api_errors.ForbiddenException) or (
        isinstance(status, int) and 400 <= status < 500
    )


def run(core_context: Any, workdir: Path, runner_experiment_id: int) -> DsatSearchMethod:
    """The whole cluster-side search; returns the method (its tracker holds every trial)."""
    from determined.experimental import client

    settings = cluster_settings(workdir)
    experiment = load_experiment(
        workdir / settings.config_path,
        workdir / settings.model_dir,
        [workdir / p for p in settings.include],
        settings.global_batch,
    )
    exp_config = custom_experiment_config(experiment.config, settings, runner_experiment_id)
    spec = SearchSpec(
        exp_config["hyperparameters"],
        experiment.ds_config,
        experiment.slots_per_trial,
        experiment.config.get("entrypoint"),
    )
    method = make_search_method(MethodSettings.from_settings(settings), spec)
    utilization = Utilization.of(
        spec.hparams, settings.seq_len, settings.peak_tflops, spec.entrypoint
    )
    runner = CheckpointedSearchRunner(method, core_context, workdir / "dsat-results", utilization)
    includes = [*experiment.includes, workdir / DSAT_PACKAGE]  # trials `import dsat` too
    try:
        runner.run(exp_config, model_dir=str(experiment.model_dir), includes=includes)
    except api_errors.BadRequestException as err:
        if getattr(runner.state, "experiment_id", None) is not None or not refused_for_good(err):
            raise  # the master out of reach for now: Determined restarts the search runner
        logger.error(
            "dsat: the Determined master refused the trials' experiment: %s; the trials take "
            "their resources, workspace and project from %s: fix it there, then submit the "
            "search again",
            said_by(err),
            settings.config_path,
        )
        return method
    # The trials' experiment ended without the search ending it (killed or canceled by a user),
    # or a user stopped one of its trials: what ran is summed up, in the summary and in the last
    # checkpoint (what a user downloads), and nothing more is started on the cluster.
    stopped = (
        f"the trials' experiment {runner.state.experiment_id} was stopped from outside the search"
        if not (runner.state.experiment_completed or method.finished)
        else f"a trial was stopped from outside the search ({method.shutdown_reason})"
        if method.ending.stopped_from_outside
        else None
    )
    summary = runner.results_dir / SUMMARY_FILE
    if stopped is not None:
        unconfirmed = "" if method.ending.handed_over(method) else ", unconfirmed"
        runner.writer.write_summary(
            method, [f"search stopped: {stopped}; what ran is summed up{unconfirmed}"]
        )
        runner.save_state(runner.state.experiment_id, runner.last_operations)
    if summary.is_file():
        logger.info("dsat summary:\n%s", summary.read_text())
    if stopped is not None:
        logger.info("dsat: search stopped: %s; no full experiment is created", stopped)
        return method
    logger.info("dsat: search ended: %s", method.shutdown_reason)
    best = method.tracker.best()
    if best is None:
        logger.error("dsat: no trial succeeded; %s", method.shutdown_reason)
        return method
    logger.info("dsat: best trial %s, metrics %s", best.name, best.metrics)
    if settings.run_full_experiment and runner.full_experiment_id is None:
        label = full_run_label(runner_experiment_id)
        earlier = client.list_experiments(labels=[label])
        if earlier:  # created before a restart of this runner, which its checkpoint missed
            runner.full_experiment_id = int(earlier[0].id)
            runner.save_state(runner.state.experiment_id, runner.last_operations)
            logger.info(
                "dsat: the full experiment %s with the best config was created before the "
                "search runner restarted",
                earlier[0].id,
            )
            return method
        config = full_experiment_config(experiment.config, best.hparams, label)
        try:
            created = client.create_experiment(config, str(experiment.model_dir), includes)
        except api_errors.BadRequestException as err:
            if not refused_for_good(err):
                raise
            logger.error(
                "dsat: the Determined master refused the full experiment: %s; the search's "
                "%s is in its checkpoint: train with it by hand",
                said_by(err),
                BEST_CONFIG_FILE,
            )
            return method
        runner.full_experiment_id = int(created.id)
        runner.save_state(runner.state.experiment_id, runner.last_operations)
        logger.info("dsat: created the full experiment %s with the best config", created.id)
    return method


def main() -> int:
    import determined as det

    logging.basicConfig(level=logging.INFO, format=det.LOG_FORMAT)
    info = det.get_cluster_info()
    if info is None or info.task_type != "TRIAL":
        logger.error(
            "dsat's search runner runs inside a Determined trial; submit it with "
            "`python3 -m dsat <method> CONFIG MODEL_DIR --runner determined`"
        )
        return 2
    with det.core.init() as core_context:
        run(core_context, Path.cwd(), info.trial.experiment_id)
    # Even a search with no working configuration ends with 0: a failing exit would only make
    # Determined restart the search runner, which would find the same finished search. The
    # trials' experiment itself ends in the ERROR state then (Shutdown with failure).
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
