"""The loop of a search run here: suggestions out to a trial runner, outcomes back to the method.

suggest, start, wait, observe: the method (``dsat.search.protocol.SearchMethod``) says what to run
and when the search is over; the runner (``trial_runner.TrialRunner``) says how each trial ended.
Listeners (the results files, the progress display) hear of every trial started and finished.

A trial the machine failed (``dsat.trial_failure``: a taken port, a lost node, a signal from
outside) says nothing of its configuration, so the method never sees it: the loop runs it again,
up to ``MACHINE_ATTEMPTS`` times in all, on every runner alike. Only then is it an error, one that
says it was the machine. One the host's memory failed while other trials shared it (``RUN_ALONE``)
runs again alone: no trial starts beside it, nor while it waits for the running ones to end.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from dsat.constants import RUN_ALONE
from dsat.runners.trial_runner import TrialRunner
from dsat.search.protocol import SearchMethod
from dsat.trial import TrialOutcome
from dsat.trial_failure import MACHINE_ATTEMPTS, FailureCause, first_line


@dataclasses.dataclass(frozen=True)
class FinishedTrial:
    """What the loop saw of one trial (for benchmarks and tests, which compare searches)."""

    hparams: dict[str, Any]
    ds_config: dict[str, Any]
    outcome: TrialOutcome


@dataclasses.dataclass
class StartedTrial:
    """What the loop needs to run a trial again."""

    hparams: dict[str, Any]
    ds_config: dict[str, Any]
    length: int
    attempts: int = 1
    machine_failed: list[TrialOutcome] = dataclasses.field(default_factory=list)

    @property
    def runs_alone(self) -> bool:
        """A run of it failed for the host's memory beside other trials: it runs alone."""
        return any(run.metrics.get(RUN_ALONE) for run in self.machine_failed)


@dataclasses.dataclass(frozen=True)
class SearchEnd:
    """The method ended the search (it did not just run out of running trials)."""

    failure: bool  # nothing to hand over


class TrialListener(Protocol):
    """Told about every trial the loop starts (just before) and finishes (results files,
    progress display)."""

    def trial_started(self, request_id: str) -> None: ...

    def trial_finished(self, request_id: str, outcome: TrialOutcome) -> None: ...

    def trial_retried(self, request_id: str, outcome: TrialOutcome, attempt: int) -> None:
        """The machine failed the trial's ``attempt``-th run (``outcome``); it runs again."""


class SearchDriver:
    def __init__(
        self,
        method: SearchMethod,
        runner: TrialRunner,
        listeners: Sequence[TrialListener] = (),
        max_events: int | None = None,
        held: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext,
    ) -> None:
        """``held``: a block in which a stop of the search (Ctrl-C) waits for its end: what the
        method decides as it suggests a trial, and the listeners' record of it, are one."""
        self.method = method
        self.runner = runner
        self.listeners = list(listeners)
        self.held = held
        self.max_events = max_events  # stop early, as an interruption would (for tests)
        self.started: dict[str, StartedTrial] = {}
        # The runs the machine failed of trials a resumed search runs again (search_run).
        self.carried_over: dict[str, list[TrialOutcome]] = {}
        self.history: list[FinishedTrial] = []
        self.shutdown: SearchEnd | None = None
        self.events = 0
        # Trials to run alone, in order, once nothing runs (StartedTrial.runs_alone); the one
        # that runs alone now is the last taken from it.
        self.waiting_alone: list[str] = []
        self.alone: str | None = None

    def start_suggested(self) -> None:
        """Start every trial the method suggests now; note the end of the search. Nothing new
        starts while a trial runs alone or waits to."""
        while not self.holding_for_alone():
            # A Ctrl-C between the method's decision (the search ends: its confirmation round)
            # and the state saved with the trial left the state without it; the resume then took
            # more --max-trials, and ran none of them.
            with self.held():
                record = self.method.suggest()
                if record is None:
                    break
                before = self.carried_over.pop(record.request_id, [])
                self.started[record.request_id] = StartedTrial(
                    record.hparams,
                    record.ds_config,
                    self.method.trial_length(record),
                    attempts=1 + len(before),
                    machine_failed=before,
                )
                for listener in self.listeners:  # first, so the state on disk includes the trial
                    listener.trial_started(record.request_id)
            self._start(record.request_id)
        if self.method.finished and self.shutdown is None:
            self.shutdown = SearchEnd(self.method.search_failed)

    def holding_for_alone(self) -> bool:
        return bool(self.waiting_alone) or self.alone is not None

    def _start(self, request_id: str) -> None:
        trial = self.started[request_id]
        if trial.runs_alone:
            self.waiting_alone.append(request_id)
            self.start_alone()
            return
        self.runner.start(request_id, trial.hparams, trial.ds_config, trial.length)

    def start_alone(self) -> None:
        """Start the first trial waiting to run alone, once nothing runs."""
        if self.alone is None and self.waiting_alone and not self.runner.running_count():
            self.alone = self.waiting_alone.pop(0)
            trial = self.started[self.alone]
            self.runner.start(self.alone, trial.hparams, trial.ds_config, trial.length)

    def retried(self, outcome: TrialOutcome) -> bool:
        """Run the trial again if the machine failed it and it has attempts left."""
        if outcome.cause is not FailureCause.MACHINE:
            return False
        trial = self.started[outcome.request_id]
        if trial.attempts >= MACHINE_ATTEMPTS:
            return False
        for listener in self.listeners:
            listener.trial_retried(outcome.request_id, outcome, trial.attempts)
        trial.machine_failed.append(outcome)
        trial.attempts += 1
        self._start(outcome.request_id)
        return True

    def blame_the_machine(self, outcome: TrialOutcome) -> TrialOutcome:
        """A trial the machine failed on every attempt: an error that says so."""
        if outcome.cause is not FailureCause.MACHINE:
            return outcome
        attempts = self.started[outcome.request_id].attempts
        rest = (outcome.error or "").partition("\n")[2]
        error = (
            f"the machine failed this trial {attempts} time(s), not its configuration: "
            f"{first_line(outcome.error)}\n{rest}"
        )
        return dataclasses.replace(outcome, error=error)

    def finish(self, outcome: TrialOutcome) -> None:
        """Feed ``outcome`` to the method, tell the listeners, then start what follows.

        The listeners (the results files, the saved state) hear of the outcome before any trial
        the method starts next, so an interruption while that one starts loses nothing."""
        trial = self.started[outcome.request_id]
        outcome = self.blame_the_machine(outcome)
        outcome = dataclasses.replace(outcome, machine_failed=tuple(trial.machine_failed))
        self.method.observe(outcome)
        del self.started[outcome.request_id]
        self.history.append(FinishedTrial(trial.hparams, trial.ds_config, outcome))
        for listener in self.listeners:
            listener.trial_finished(outcome.request_id, outcome)
        self.start_suggested()

    def run(self, resume: bool = False) -> None:
        """Start the search (or, with ``resume``, carry on a loaded one) and run it to its end."""
        if resume:
            self.method.resume()
        self.start_suggested()
        self.loop()

    def loop(self) -> None:
        """Feed outcomes back until the method ends the search, nothing runs, or max_events."""
        while self.shutdown is None and self.runner.running_count():
            if self.max_events is not None and self.events >= self.max_events:
                return
            outcome = self.runner.wait()
            if outcome.request_id == self.alone:
                self.alone = None
            if not self.retried(outcome):
                self.finish(outcome)
            self.start_alone()
            self.events += 1
        if self.runner.running_count():  # the search ended with trials out: not needed any more
            self.runner.stop_all()
