"""Determined's master played here: any ``determined.searcher.SearchMethod`` run on a trial runner.

Create and ValidateAfter start a trial; a finished trial becomes ``on_validation_completed`` or
``on_trial_exited_early`` ('errored', all Determined can say of a failure) followed by
``on_trial_closed``; Shutdown ends the loop. The benchmarks run the reference's methods
(``determined.pytorch.dsat``) this way, and the tests run dsat's ``DsatSearcher`` adapter through
it to check that the cluster path proposes what the plain loop does.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

from determined import searcher

from dsat.constants import OOM_METRIC_KEY, OVERWRITE_KEY
from dsat.experiment.config import deep_merge
from dsat.runners.driver import FinishedTrial, SearchEnd, TrialListener
from dsat.runners.trial_runner import TrialRunner
from dsat.trial import TrialOutcome, TrialStatus


class DeterminedEventLoop:
    def __init__(
        self,
        method: searcher.SearchMethod,
        runner: TrialRunner,
        base_ds_config: dict[str, Any],
        listeners: Sequence[TrialListener] = (),
        oom_as_metric: bool = False,
    ) -> None:
        """``oom_as_metric``: an OOM reaches the method as a reported metric, as dsat's trials
        report one on a cluster (``dsat_reporting_context``); otherwise as 'errored'."""
        self.method = method
        self.oom_as_metric = oom_as_metric
        self.runner = runner
        self.base_ds_config = base_ds_config  # a Determined method sends only hyperparameters
        self.listeners = list(listeners)
        self.state = searcher.SearcherState()
        self.hparams: dict[str, dict[str, Any]] = {}
        self.history: list[FinishedTrial] = []
        self.shutdown: SearchEnd | None = None

    def ds_config(self, request_id: str) -> dict[str, Any]:
        return deep_merge(self.base_ds_config, self.hparams[request_id].get(OVERWRITE_KEY) or {})

    def apply(self, ops: Sequence[searcher.Operation]) -> None:
        for op in ops:
            if isinstance(op, searcher.Create):
                self.hparams[str(op.request_id)] = json.loads(op.hparams)
                self.state.trials_created.add(op.request_id)
                self.apply(self.method.on_trial_created(self.state, op.request_id))
            elif isinstance(op, searcher.ValidateAfter):
                request_id = str(op.request_id)
                for listener in self.listeners:
                    listener.trial_started(request_id)
                self.runner.start(
                    request_id, self.hparams[request_id], self.ds_config(request_id), op.length
                )
            elif isinstance(op, searcher.Close):
                self.state.trials_closed.add(op.request_id)
                self.apply(self.method.on_trial_closed(self.state, op.request_id))
            elif isinstance(op, searcher.Shutdown):
                self.shutdown = SearchEnd(bool(op.failure))
            # Progress operations carry nothing a local loop needs.

    def finish(self, outcome: TrialOutcome) -> None:
        request_id = uuid.UUID(outcome.request_id)
        self.state.trial_progress[request_id] = 1.0
        reported: dict[str, Any] | None = None
        if outcome.status is TrialStatus.COMPLETED:
            reported = outcome.metrics
        elif outcome.status is TrialStatus.OOM and self.oom_as_metric:
            reported = {OOM_METRIC_KEY: outcome.error or "out of memory"}
        if reported is not None:
            ops = self.method.on_validation_completed(self.state, request_id, reported, 0)
            self._tell_finished(outcome)
            self.apply(ops)
            return
        self.state.failures.add(request_id)
        ops = self.method.on_trial_exited_early(
            self.state, request_id, searcher.ExitedReason.ERRORED
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

    def run(self) -> None:
        self.apply(self.method.initial_operations(self.state))
        while self.shutdown is None and self.runner.running_count():
            self.finish(self.runner.wait())
        if self.runner.running_count():
            self.runner.stop_all()
