"""The event loop of a search run here: operations out to a trial runner, outcomes back as events.

It plays the part of Determined's master for a ``determined.searcher.SearchMethod``: Create and
ValidateAfter start a trial, a finished trial becomes ``on_validation_completed`` or
``on_trial_exited_early`` followed by ``on_trial_closed``, and Shutdown ends the loop. A failed
trial's event carries what the runner knows of it (OOM, timeout) as a ``TrialFailure``; a method
that speaks only Determined's protocol (the reference's) is wrapped in ``DeterminedOnlyMethod``.
How a trial runs is the trial runner's business (``trial_runner.TrialRunner``).
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Sequence
from typing import Any, Protocol

from determined import searcher

from dsat.constants import OVERWRITE_KEY
from dsat.experiment.config import deep_merge
from dsat.runners.trial_runner import TrialOutcome, TrialRunner
from dsat.trial import TrialFailure, TrialStatus


@dataclasses.dataclass(frozen=True)
class FinishedTrial:
    """What the driver saw of one trial, for methods that keep no records of their own."""

    hparams: dict[str, Any]
    ds_config: dict[str, Any]
    outcome: TrialOutcome


class SearchEvents(Protocol):
    """Determined's custom-searcher events, with the failure's kind on the exited-early one."""

    def initial_operations(
        self, searcher_state: searcher.SearcherState
    ) -> list[searcher.Operation]: ...

    def on_trial_created(
        self, searcher_state: searcher.SearcherState, request_id: uuid.UUID
    ) -> list[searcher.Operation]: ...

    def on_validation_completed(
        self,
        searcher_state: searcher.SearcherState,
        request_id: uuid.UUID,
        metric: Any,
        train_length: int,
    ) -> list[searcher.Operation]: ...

    def on_trial_exited_early(
        self,
        searcher_state: searcher.SearcherState,
        request_id: uuid.UUID,
        exited_reason: searcher.ExitedReason,
        failure: TrialFailure | None = None,
    ) -> list[searcher.Operation]: ...

    def on_trial_closed(
        self, searcher_state: searcher.SearcherState, request_id: uuid.UUID
    ) -> list[searcher.Operation]: ...


class DeterminedOnlyMethod:
    """A method that speaks only Determined's protocol (the reference's, in benchmarks): every
    failure reaches it as Determined reports one, 'errored'."""

    def __init__(self, method: searcher.SearchMethod) -> None:
        self.method = method

    def initial_operations(
        self, searcher_state: searcher.SearcherState
    ) -> list[searcher.Operation]:
        return list(self.method.initial_operations(searcher_state))

    def on_trial_created(
        self, searcher_state: searcher.SearcherState, request_id: uuid.UUID
    ) -> list[searcher.Operation]:
        return list(self.method.on_trial_created(searcher_state, request_id))

    def on_validation_completed(
        self,
        searcher_state: searcher.SearcherState,
        request_id: uuid.UUID,
        metric: Any,
        train_length: int,
    ) -> list[searcher.Operation]:
        return list(
            self.method.on_validation_completed(searcher_state, request_id, metric, train_length)
        )

    def on_trial_exited_early(
        self,
        searcher_state: searcher.SearcherState,
        request_id: uuid.UUID,
        exited_reason: searcher.ExitedReason,
        failure: TrialFailure | None = None,
    ) -> list[searcher.Operation]:
        return list(self.method.on_trial_exited_early(searcher_state, request_id, exited_reason))

    def on_trial_closed(
        self, searcher_state: searcher.SearcherState, request_id: uuid.UUID
    ) -> list[searcher.Operation]:
        return list(self.method.on_trial_closed(searcher_state, request_id))


class TrialListener(Protocol):
    """Told about every trial the driver starts (just before) and finishes (results files,
    progress display)."""

    def trial_started(self, request_id: str) -> None: ...

    def trial_finished(self, request_id: str, outcome: TrialOutcome) -> None: ...


class SearchDriver:
    def __init__(
        self,
        method: SearchEvents,
        runner: TrialRunner,
        base_ds_config: dict[str, Any],
        listeners: Sequence[TrialListener] = (),
        max_events: int | None = None,
    ) -> None:
        self.method = method
        self.runner = runner
        self.base_ds_config = base_ds_config
        self.listeners = list(listeners)
        self.max_events = max_events  # stop early, as an interruption would (for tests)
        self.state = searcher.SearcherState()
        self.hparams: dict[str, dict[str, Any]] = {}
        self.lengths: dict[str, int] = {}
        self.history: list[FinishedTrial] = []
        self.shutdown: searcher.Shutdown | None = None
        self.events = 0

    def ds_config(self, request_id: str) -> dict[str, Any]:
        return deep_merge(self.base_ds_config, self.hparams[request_id].get(OVERWRITE_KEY) or {})

    def apply(self, ops: list[searcher.Operation]) -> None:
        for op in ops:
            if isinstance(op, searcher.Create):
                request_id = str(op.request_id)
                self.hparams[request_id] = json.loads(op.hparams)
                self.state.trials_created.add(op.request_id)
                self.apply(self.method.on_trial_created(self.state, op.request_id))
            elif isinstance(op, searcher.ValidateAfter):
                request_id = str(op.request_id)
                self.lengths[request_id] = op.length
                for listener in self.listeners:  # first, so the state on disk includes the trial
                    listener.trial_started(request_id)
                self.runner.start(
                    request_id, self.hparams[request_id], self.ds_config(request_id), op.length
                )
            elif isinstance(op, searcher.Close):
                self.state.trials_closed.add(op.request_id)
                self.apply(self.method.on_trial_closed(self.state, op.request_id))
            elif isinstance(op, searcher.Shutdown):
                self.shutdown = op
            # Progress operations carry nothing a local driver needs.

    def finish(self, outcome: TrialOutcome) -> None:
        """Feed ``outcome`` to the method, tell the listeners, then apply what the method asks.

        The listeners (the results files, the saved state) hear of the outcome before any trial
        the method starts next, so an interruption while that one starts loses nothing."""
        request_id = uuid.UUID(outcome.request_id)
        self.state.trial_progress[request_id] = 1.0
        if outcome.status is TrialStatus.COMPLETED:
            ops = self.method.on_validation_completed(
                self.state, request_id, outcome.metrics, self.lengths[outcome.request_id]
            )
            self._tell_finished(outcome)
            self.apply(ops)
            return
        self.state.failures.add(request_id)
        ops = self.method.on_trial_exited_early(
            self.state,
            request_id,
            searcher.ExitedReason.ERRORED,
            TrialFailure(outcome.status, outcome.error),
        )
        self._tell_finished(outcome)
        self.apply(ops)
        self.state.trials_closed.add(request_id)
        self.apply(self.method.on_trial_closed(self.state, request_id))

    def _tell_finished(self, outcome: TrialOutcome) -> None:
        hparams = self.hparams[outcome.request_id]
        self.history.append(FinishedTrial(hparams, self.ds_config(outcome.request_id), outcome))
        for listener in self.listeners:
            listener.trial_finished(outcome.request_id, outcome)

    def run(self, initial_ops: list[searcher.Operation] | None = None) -> None:
        """Start the search (or resume it with ``initial_ops``) and run it, see ``loop``."""
        self.apply(
            self.method.initial_operations(self.state) if initial_ops is None else initial_ops
        )
        self.loop()

    def loop(self) -> None:
        """Feed outcomes back until the method shuts down, nothing runs, or max_events."""
        while self.shutdown is None and self.runner.running_count():
            if self.max_events is not None and self.events >= self.max_events:
                return
            self.finish(self.runner.wait())
            self.events += 1
        if self.runner.running_count():  # a shutdown with trials out: they are not needed any more
            self.runner.stop_all()
