"""Run a checked search with its runner and keep the results directory current."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import threading
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

from dsat.constants import RUN_ALONE, SETTINGS_FILE, STATE_FILE
from dsat.errors import DsatError
from dsat.experiment.settings import SearchSettings
from dsat.paths import logs_where_they_are, shown
from dsat.results.directory import BEST_CONFIG_FILE, ResultsWriter, TrialTiming
from dsat.results.progress import SearchProgress
from dsat.results.resume import refuse_changed_experiment, write_settings
from dsat.results.utilization import Utilization
from dsat.runners.driver import SearchDriver, TrialListener
from dsat.runners.trial_runner import RunnerStopped, StoppedRun, TrialRunner
from dsat.search import MethodSettings, make_search_method
from dsat.search.method import DsatSearchMethod
from dsat.search.method_state import (
    INTERRUPTED_STATE_KEY,
    MACHINE_FAILED_STATE_KEY,
    load_state_json,
    save_state,
)
from dsat.search.trial_builder import SearchSpec
from dsat.trial import TrialOutcome, TrialStatus
from dsat.trial_failure import FailureCause

# Ctrl-C, ``kill`` (a scheduler's preemption) and the terminal closing: each stops a search as
# Ctrl-C does (dsat.cli), and none may come between what is written as one.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def stops_held(replay: bool = True, signals: Collection[int] = STOP_SIGNALS) -> Iterator[None]:
    """Ctrl-C, SIGTERM and SIGHUP (``signals``) wait until the block is done, then act as they
    would have; without ``replay``, they are ignored. (Not by the signal mask: a signal sent to
    the process goes to any thread that does not block it.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []

    def hold(signum: int, frame: object) -> None:
        caught.append(signum)

    previous = {sig: signal.signal(sig, hold) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        for signum in caught[:1] if replay else ():
            signal.raise_signal(signum)


class ResultsRecorder:
    """Writes each finished trial and the method's state, so nothing finished is ever lost; and
    the runs of the trials still running that the machine failed (``machine_failed``) or a stop
    of the search cut short (``interrupted``), by request id, in seconds of search, so that a
    resume counts them."""

    def __init__(self, method: DsatSearchMethod, writer: ResultsWriter) -> None:
        self.method = method
        self.writer = writer
        # A resume loads its own.
        self.machine_failed: dict[str, list[dict[str, Any]]] = {}
        self.interrupted: dict[str, list[dict[str, Any]]] = {}

    def save(self) -> None:
        save_state(self.method, self.writer.directory, self.machine_failed, self.interrupted)

    def trial_started(self, request_id: str) -> None:
        # From the first trial on, an interrupted search (a Ctrl-C in its first minute included)
        # can be resumed: the state names the trial as running, and a resume re-runs it.
        self.save()

    def trial_finished(self, request_id: str, outcome: TrialOutcome) -> None:
        record = self.method.tracker.get(request_id)
        self.machine_failed.pop(request_id, None)  # its row keeps them now
        interrupted = self.interrupted.pop(request_id, [])
        # The row and the state that says the trial finished are written as one: a Ctrl-C
        # between them left a row whose state still said "running", and the resume ran the
        # trial again, losing its first measurement.
        with stops_held():
            self.writer.trial_finished(
                record, TrialTiming.of(outcome), self.method.tracker, interrupted
            )
            self.save()

    def trial_retried(self, request_id: str, outcome: TrialOutcome, attempt: int) -> None:
        """The trial still runs (the state says so); the run the machine failed is kept."""
        timing = TrialTiming.of(dataclasses.replace(outcome, machine_failed=(outcome,)))
        runs = timing.shifted(self.writer.clock_offset).machine_failed  # as its row keeps them
        self.machine_failed.setdefault(request_id, []).extend(runs)
        self.save()

    def trials_stopped(self, runs: Sequence[StoppedRun]) -> None:
        """The runs a stop of the search cut short (their trials run again on the resume): kept
        in the state, so that the resume's rows count the time they held their slots."""
        offset = self.writer.clock_offset
        for run in runs:
            kept = {"start": run.start + offset, "end": run.end + offset, "log": run.log}
            self.interrupted.setdefault(run.request_id, []).append(kept)
        if runs:
            self.save()

    def carried_on_from(self) -> float:
        """When the last run without a row ended, in seconds of search."""
        runs = [
            run
            for kept in (self.machine_failed, self.interrupted)
            for earlier in kept.values()
            for run in earlier
        ]
        return max((float(run["end"]) for run in runs), default=0.0)

    def carried_over(self) -> dict[str, list[TrialOutcome]]:
        """The runs the machine failed before a resume, as the driver keeps them: on this
        runner's clock, which ``writer`` shifts back into seconds of search."""
        offset = self.writer.clock_offset
        return {
            request_id: [
                TrialOutcome(
                    request_id,
                    TrialStatus.ERROR,
                    {RUN_ALONE: True} if run.get(RUN_ALONE) else {},
                    run.get("error"),
                    float(run["start"]) - offset,
                    float(run["end"]) - offset,
                    FailureCause.MACHINE,
                    run.get("log"),
                )
                for run in runs
            ]
            for request_id, runs in self.machine_failed.items()
        }


def run_search(
    settings: SearchSettings,
    spec: SearchSpec,
    runner: TrialRunner,
    results_dir: Path,
    max_events: int | None = None,
) -> DsatSearchMethod:
    """Drive the search to its end (or ``max_events``); resumes when ``results_dir`` has state.

    A runner whose trials take real time gets a line per finished trial (and live counts on a
    terminal). The runner's slot limit (the machine's) caps the slots trials use at once, without
    changing the settings saved for a resume.
    """
    method = make_search_method(MethodSettings.from_settings(settings, runner.slot_limit), spec)
    utilization = Utilization.of(
        spec.hparams, settings.seq_len, settings.peak_tflops, spec.entrypoint
    )
    writer = ResultsWriter(results_dir, runner.slot_kind, utilization, user_config=spec.ds_config)
    recorder = ResultsRecorder(method, writer)
    listeners: list[TrialListener] = [recorder]
    progress = (
        SearchProgress(method.tracker, planned=method.planned_trials)
        if runner.takes_real_time
        else None
    )
    if progress is not None:
        listeners.append(progress)
    driver = SearchDriver(method, runner, listeners, max_events, held=stops_held)
    resuming = (results_dir / STATE_FILE).is_file()
    if resuming:
        try:
            state = logs_where_they_are(
                json.loads((results_dir / STATE_FILE).read_text()), results_dir
            )
            refuse_changed_experiment(results_dir, spec, state)
            load_state_json(method, state)
            writer.runs_again(
                {r.request_id for r in method.tracker.records if not r.status.finished}
            )
            recorder.machine_failed = dict(state.get(MACHINE_FAILED_STATE_KEY, {}))
            recorder.interrupted = dict(state.get(INTERRUPTED_STATE_KEY, {}))
            writer.carry_on_after(recorder.carried_on_from())
            driver.carried_over = recorder.carried_over()
        except (KeyError, TypeError, ValueError) as err:
            raise DsatError(
                f"{shown(results_dir / STATE_FILE)}: damaged search state ({err}); this search "
                "cannot be resumed, start a new one"
            ) from None
        # What a kill -9 left mid-write of a file (atomic_file's temporaries): the files
        # themselves are whole, the old or the new.
        for leftover in results_dir.glob(".*.tmp"):
            leftover.unlink(missing_ok=True)
    if progress is not None:
        # Its lines' elapsed time as the rows count it: from the runner's start (its slots
        # claimed, its ops built), not the display's, which read 2 s behind the rows.
        now = getattr(runner, "now", None)
        progress.carry_on(writer.clock_offset + (float(now()) if callable(now) else 0.0))
    # Once the resume is known to go ahead: a refused one leaves the settings it would resume.
    write_settings(settings, results_dir)
    writer.keep_best_config = method.ending.handed_over(method)
    with progress or contextlib.nullcontext():
        try:
            driver.run(resume=resuming)
        except KeyboardInterrupt:
            # The trials it stopped run again on the resume, which counts what these ran.
            recorder.trials_stopped(runner.stop_all())
            raise
        except RunnerStopped as err:
            recorder.trials_stopped(err.stopped)
            raise
    if not (results_dir / SETTINGS_FILE).is_file():
        # The results dir was removed while the search ran: its other files are written again
        # as trials end, and the resume command the last lines give needs these too.
        write_settings(settings, results_dir)
    if driver.shutdown is not None or not runner.running_count():
        writer.write_summary(method)
        save_state(method, results_dir)
    return method


def resumes_without_trials(settings: SearchSettings, spec: SearchSpec, results_dir: Path) -> bool:
    """Whether resuming the search in ``results_dir`` starts no trial: it had ended, and a
    resume only writes its summary and report again (``EndedSearchRunner``)."""
    method = make_search_method(MethodSettings.from_settings(settings, None), spec)
    try:
        load_state_json(method, json.loads((results_dir / STATE_FILE).read_text()))
    except (OSError, KeyError, TypeError, ValueError):
        return False  # run_search says what is wrong with it
    method.resume()
    return method.suggest() is None and method.finished


def best_config_path(results_dir: Path) -> Path:
    return results_dir / BEST_CONFIG_FILE
