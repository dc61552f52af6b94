"""Determined's custom-searcher events, in terms of a dsat method's records, hooks and ending.

The very same object is driven by dsat's own event loop (dsat/runners/driver.py) and by
Determined's RemoteSearchRunner on a cluster. Create and ValidateAfter start a trial; a
validation or an exited-early event finishes it and asks the method's hooks what follows; Close
lets the next queued trials start; Shutdown ends the search once `SearchEnding` says so.
"""

from __future__ import annotations

import json
import logging
import uuid
import warnings
from abc import abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from determined import searcher

from dsat.atomic_file import write_json_atomic
from dsat.constants import OOM_METRIC_KEY, STATE_FILE
from dsat.memory import log_estimates
from dsat.search.method_state import load_state_json, state_json
from dsat.trial import TrialFailure, TrialKind, TrialRecord, TrialStatus

if TYPE_CHECKING:
    from dsat.search.method import DsatSearchMethod

logger = logging.getLogger(__name__)


class DeterminedEvents(searcher.SearchMethod):  # type: ignore[misc]
    def __init__(self) -> None:
        with warnings.catch_warnings():  # Determined marks custom searchers deprecated in 0.37
            warnings.simplefilter("ignore", FutureWarning)
            super().__init__()

    @property
    @abstractmethod
    def method(self) -> DsatSearchMethod:
        """The method whose records, hooks and ending these events drive."""

    def _start_ops(self, record: TrialRecord) -> list[searcher.Operation]:
        m = self.method
        m.tracker.mark_running(record.request_id)
        request_id = uuid.UUID(record.request_id)
        length = 1 if record.kind is TrialKind.MODEL_PROFILE else m.builder.last_measured_step + 1
        return [
            searcher.Create(request_id=request_id, hparams=record.hparams, checkpoint=None),
            searcher.ValidateAfter(request_id=request_id, length=length),
        ]

    def initial_operations(
        self, searcher_state: searcher.SearcherState
    ) -> list[searcher.Operation]:
        m = self.method
        record = m.register(m.make_trial(TrialKind.MODEL_PROFILE, None, 1), queue=False)
        assert record is not None  # the first trial cannot be a repeat
        return self._start_ops(record)

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
        m = self.method
        if self._already_finished(request_id):
            return []
        if isinstance(metric, dict) and OOM_METRIC_KEY in metric:  # reported by the trial
            self._failed(request_id, TrialStatus.OOM, str(metric[OOM_METRIC_KEY]))
            return [searcher.Close(request_id)]
        metrics = metric if isinstance(metric, dict) else {m.settings.metric.value: metric}
        record = m.tracker.mark_finished(str(request_id), TrialStatus.COMPLETED, metrics)
        if record.kind is TrialKind.MODEL_PROFILE:
            profile = m.profile
            if profile is not None:
                log_estimates(profile, m.precision, m.spec.slots_per_trial)
                self._follow_up(m.initial_lineages)
        elif record.kind is TrialKind.SEARCH and m.tracker.too_large(record):
            # It ran, but leaves less than --memory-margin free: to the search, too large.
            self._follow_up(lambda: m.after_failure(record))
        elif record.kind is TrialKind.SEARCH:
            self._follow_up(lambda: m.after_success(record))
        return [searcher.Close(request_id)]

    def on_trial_exited_early(
        self,
        searcher_state: searcher.SearcherState,
        request_id: uuid.UUID,
        exited_reason: searcher.ExitedReason,
        failure: TrialFailure | None = None,
    ) -> list[searcher.Operation]:
        """Determined says only 'errored' (an OOM arrives as a reported metric there); dsat's
        runners add what they know (an OOM, a timeout) as ``failure``."""
        m = self.method
        status = failure.status if failure is not None else TrialStatus.ERROR
        error = failure.error if failure is not None else None
        if self._already_finished(request_id):
            return []
        if exited_reason is not searcher.ExitedReason.ERRORED:
            m.tracker.mark_finished(str(request_id), status, error=error)
            m.ending.shutdown_reason = f"trial exited early: {exited_reason.value}"
            return [searcher.Shutdown(failure=m.search_failed)]
        self._failed(request_id, status, error)
        return []

    def _failed(self, request_id: uuid.UUID, status: TrialStatus, error: str | None) -> None:
        m = self.method
        record = m.tracker.mark_finished(str(request_id), status, error=error)
        if record.kind is TrialKind.SEARCH:
            self._follow_up(lambda: m.after_failure(record))

    def _already_finished(self, request_id: uuid.UUID) -> bool:
        """A second outcome for one trial (on a cluster, a trial that reported its metrics can
        still be marked errored while DeepSpeed's exit races the Close) changes nothing."""
        finished = self.method.tracker.get(str(request_id)).status.finished
        if finished:
            logger.info("ignoring a second outcome for finished trial %s", request_id)
        return finished

    def _follow_up(self, make: Callable[[], Any]) -> None:
        m = self.method
        room = len(m.tracker.queue) + m.tracker.num_started < m.settings.max_trials
        if room and m.ending.stop_reason(m) is None:
            make()

    def on_trial_closed(
        self, searcher_state: searcher.SearcherState, request_id: uuid.UUID
    ) -> list[searcher.Operation]:
        return self._start_queued()

    def resume_operations(self) -> list[searcher.Operation]:
        """After loading saved state: run again what was interrupted, then carry on."""
        tracker = self.method.tracker
        tracker.requeue([r.request_id for r in tracker.running])
        return self._start_queued()

    def _start_queued(self) -> list[searcher.Operation]:
        m = self.method
        if m.ending.should_shutdown(m):
            logger.info("search ends: %s", m.shutdown_reason)
            return [searcher.Shutdown(failure=m.search_failed)]
        ops: list[searcher.Operation] = []
        while m.tracker.can_start_more():
            request_id = m.choose_next()
            if request_id is None:
                break
            ops += self._start_ops(m.tracker.dequeue(request_id))
        return ops

    def progress(self, searcher_state: searcher.SearcherState) -> float:
        m = self.method
        return min(len(m.tracker.finished) / m.settings.max_trials, 1.0)

    def state_json(self) -> dict[str, Any]:
        return state_json(self.method)

    def load_state_json(self, state: dict[str, Any]) -> None:
        load_state_json(self.method, state)

    def save_method_state(self, path: Path) -> None:
        write_json_atomic(Path(path) / STATE_FILE, self.state_json())

    def load_method_state(self, path: Path) -> None:
        self.load_state_json(json.loads((Path(path) / STATE_FILE).read_text()))
