"""A dsat search method as a Determined 0.37 custom searcher (``determined.searcher.SearchMethod``).

Determined's master speaks in events and operations; dsat's methods in suggestions and outcomes
(``dsat.search.protocol``). This adapter translates, so the very object that runs a search here
runs it on a cluster under Determined's ``RemoteSearchRunner``: each suggestion becomes Create and
ValidateAfter, a validation or an exited-early event becomes an outcome, Close asks for the next
suggestions, and Shutdown ends the experiment once the method is finished.
"""

from __future__ import annotations

import uuid
import warnings
from pathlib import Path
from typing import Any

from determined import searcher

from dsat.constants import (
    ERROR_CAUSE_METRIC_KEY,
    ERROR_METRIC_KEY,
    OOM_METRIC_KEY,
    REPORTED_AT_KEY,
)
from dsat.search.method import DsatSearchMethod
from dsat.search.method_state import load_state, save_state
from dsat.trial import TrialKind, TrialOutcome, TrialStatus
from dsat.trial_failure import FailureCause

# Where a trial failed without telling why (before or outside dsat_reporting_context, or a peer
# lost): what the master says of it, and where to look.
UNREPORTED_ERROR = (
    "errored on the cluster with no reason the trial reported (it failed outside "
    "dsat_reporting_context, or lost a peer); its logs are in the Determined web UI, under the "
    "trials' experiment"
)


class DsatSearcher(searcher.SearchMethod):  # type: ignore[misc]
    def __init__(self, method: DsatSearchMethod) -> None:
        with warnings.catch_warnings():  # Determined marks custom searchers deprecated in 0.37
            warnings.simplefilter("ignore", FutureWarning)
            super().__init__()
        self.method = method

    def _suggested(self) -> list[searcher.Operation]:
        ops: list[searcher.Operation] = []
        while (record := self.method.suggest()) is not None:
            request_id = uuid.UUID(record.request_id)
            ops += [
                searcher.Create(request_id=request_id, hparams=record.hparams, checkpoint=None),
                searcher.ValidateAfter(
                    request_id=request_id, length=self.method.trial_length(record)
                ),
            ]
        if self.method.finished:
            ops.append(searcher.Shutdown(failure=self.method.search_failed))
        return ops

    def _observe(
        self,
        request_id: uuid.UUID,
        status: TrialStatus,
        metrics: dict[str, Any] | None = None,
        error: str | None = None,
        cause: FailureCause | None = None,
    ) -> None:
        # The master keeps the trials' times; the method does not read them.
        self.method.observe(
            TrialOutcome(str(request_id), status, metrics or {}, error, 0.0, 0.0, cause)
        )

    def initial_operations(
        self, searcher_state: searcher.SearcherState
    ) -> list[searcher.Operation]:
        return self._suggested()

    def on_trial_created(
        self, searcher_state: searcher.SearcherState, request_id: uuid.UUID
    ) -> list[searcher.Operation]:
        return []

    def on_validation_completed(
        self,
        searcher_state: searcher.SearcherState,
        request_id: uuid.UUID,
        metric: Any,
        train_length: int,
    ) -> list[searcher.Operation]:
        if self.method.tracker.get(str(request_id)).status.finished:
            return []  # a second outcome (see DsatSearchMethod.observe): no second Close
        if isinstance(metric, dict) and OOM_METRIC_KEY in metric:  # reported by the trial
            self._observe(request_id, TrialStatus.OOM, error=str(metric[OOM_METRIC_KEY]))
        elif isinstance(metric, dict) and ERROR_METRIC_KEY in metric:  # likewise
            said = str(metric.get(ERROR_CAUSE_METRIC_KEY))
            cause = next((c for c in FailureCause if c.value == said), FailureCause.UNKNOWN)
            error = str(metric[ERROR_METRIC_KEY])
            self._observe(request_id, TrialStatus.ERROR, error=error, cause=cause)
        else:
            name = self.method.settings.metric.value
            metrics = metric if isinstance(metric, dict) else {name: metric}
            metrics = {k: v for k, v in metrics.items() if k != REPORTED_AT_KEY}
            profile = self.method.tracker.get(str(request_id)).kind is TrialKind.MODEL_PROFILE
            if name in metrics or profile:
                self._observe(request_id, TrialStatus.COMPLETED, metrics=metrics)
            else:  # a script's own report: "completed" with nothing to rank, every trial alike
                said = ", ".join(sorted(metrics)) or "nothing"
                error = (
                    f"the trial reported no {name} (it reported {said}); report through "
                    "dsat.dsat_reporting_context, whose metrics the search ranks trials by"
                )
                self._observe(request_id, TrialStatus.ERROR, error=error, cause=FailureCause.SCRIPT)
        return [searcher.Close(request_id)]

    def on_trial_exited_early(
        self,
        searcher_state: searcher.SearcherState,
        request_id: uuid.UUID,
        exited_reason: searcher.ExitedReason,
    ) -> list[searcher.Operation]:
        """Determined says only 'errored' of a failed trial (an OOM arrives as a reported
        metric); a trial canceled by a user, or whose hyperparameters Determined rejected, ends
        the search."""
        if self.method.tracker.get(str(request_id)).status.finished:
            return []
        if exited_reason is searcher.ExitedReason.ERRORED:
            self._observe(request_id, TrialStatus.ERROR, error=UNREPORTED_ERROR)
            return []
        self.method.abandon(str(request_id), f"trial exited early: {exited_reason.value}")
        return [searcher.Shutdown(failure=self.method.search_failed)]

    def on_trial_closed(
        self, searcher_state: searcher.SearcherState, request_id: uuid.UUID
    ) -> list[searcher.Operation]:
        return self._suggested()

    def progress(self, searcher_state: searcher.SearcherState) -> float:
        # Of every trial the search may run: the user's baseline and the confirmation round
        # come on top of --max-trials (the round's runs once it starts, its most until then),
        # which read 100% with a fifth of the trials still to run.
        planned = self.method.planned_trials()
        return min(len(self.method.tracker.finished) / max(planned, 1), 1.0)

    def save_method_state(self, path: Path) -> None:
        save_state(self.method, Path(path))

    def load_method_state(self, path: Path) -> None:
        """A restarted search runner: the master still runs the trials the state names as
        running, and their outcomes will come (so they are not queued again)."""
        load_state(self.method, Path(path))
