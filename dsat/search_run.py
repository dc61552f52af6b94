"""Run a checked search with its runner and keep the results directory current."""

from __future__ import annotations

import contextlib
from pathlib import Path

from dsat.constants import STATE_FILE
from dsat.errors import DsatError
from dsat.experiment.settings import SearchSettings
from dsat.paths import shown
from dsat.results.directory import BEST_CONFIG_FILE, ResultsWriter, TrialTiming
from dsat.results.progress import SearchProgress
from dsat.results.resume import write_settings
from dsat.runners.driver import SearchDriver, TrialExecutor, TrialListener, TrialOutcome
from dsat.search import MethodSettings, make_search_method
from dsat.search.method import DsatSearchMethod
from dsat.search.trial_builder import SearchSpec


class ResultsRecorder:
    """Writes each finished trial and the method's state, so nothing finished is ever lost."""

    def __init__(self, method: DsatSearchMethod, writer: ResultsWriter) -> None:
        self.method = method
        self.writer = writer

    def trial_started(self, request_id: str) -> None:
        # From the first trial on, an interrupted search (a Ctrl-C in its first minute included)
        # can be resumed: the state names the trial as running, and a resume re-runs it.
        self.method.save_method_state(self.writer.directory)

    def trial_finished(self, request_id: str, outcome: TrialOutcome) -> None:
        record = self.method.tracker.get(request_id)
        self.writer.trial_finished(
            record, TrialTiming(outcome.start, outcome.end), self.method.tracker
        )
        self.method.save_method_state(self.writer.directory)


def run_search(
    settings: SearchSettings,
    spec: SearchSpec,
    executor: TrialExecutor,
    results_dir: Path,
    max_events: int | None = None,
    show_progress: bool = False,
    slot_limit: int | None = None,
) -> DsatSearchMethod:
    """Drive the search to its end (or ``max_events``); resumes when ``results_dir`` has state.

    ``show_progress`` prints a line per finished trial (and live counts on a terminal); it is for
    runners whose trials take real time. ``slot_limit`` caps the slots trials use at once (the
    machine's), without changing the settings saved for a resume.
    """
    write_settings(settings, results_dir)
    method = make_search_method(MethodSettings.from_settings(settings, slot_limit), spec)
    writer = ResultsWriter(results_dir)
    listeners: list[TrialListener] = [ResultsRecorder(method, writer)]
    progress = SearchProgress(method.tracker, settings.metric.value) if show_progress else None
    if progress is not None:
        listeners.append(progress)
    driver = SearchDriver(method, executor, spec.ds_config, listeners, max_events)
    resuming = (results_dir / STATE_FILE).is_file()
    if resuming:
        try:
            method.load_method_state(results_dir)
        except (KeyError, TypeError, ValueError) as err:
            raise DsatError(
                f"{shown(results_dir / STATE_FILE)}: damaged search state ({err}); this search "
                "cannot be resumed, start a new one"
            ) from None
    with progress or contextlib.nullcontext():
        driver.run(initial_ops=method.resume_operations() if resuming else None)
    if driver.shutdown is not None or not driver.running:
        writer.write_summary(method.tracker)
        method.save_method_state(results_dir)
    return method


def best_config_path(results_dir: Path) -> Path:
    return results_dir / BEST_CONFIG_FILE
