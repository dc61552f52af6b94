"""dsat's search protocol: what a runner's loop, or an adapter for another platform, needs of a
search method.

A method hands out trial records one at a time and is told how each ended; nothing else passes
between it and whatever runs its trials (processes here, a Ray cluster, a Determined master, a
performance model). It keeps its whole state as JSON, so a stopped search resumes where it was.
Like Ray Tune's ``Searcher`` (``suggest``/``on_trial_complete``) or Optuna's ask/tell, with
dsat's own records instead of dictionaries.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from dsat.trial import TrialOutcome, TrialRecord


class SearchMethod(ABC):
    name = "base"

    @abstractmethod
    def suggest(self) -> TrialRecord | None:
        """The next trial to start now, marked running; None when none may start until an
        outcome arrives, or when the search is over (``finished``)."""

    @abstractmethod
    def observe(self, outcome: TrialOutcome) -> None:
        """How a running trial ended; a second outcome for one trial changes nothing."""

    @abstractmethod
    def trial_length(self, record: TrialRecord) -> int:
        """The optimizer steps ``record`` must be given to finish (DeepSpeed then stops it)."""

    @abstractmethod
    def resume(self) -> None:
        """After loading a saved state: trials that were running when it was saved run again."""

    @property
    @abstractmethod
    def finished(self) -> bool:
        """The search is over: nothing more will be suggested, running trials are not needed."""

    @property
    @abstractmethod
    def shutdown_reason(self) -> str | None:
        """Why the search ended, once it has."""

    @property
    @abstractmethod
    def search_failed(self) -> bool:
        """The search has nothing to hand over."""

    @abstractmethod
    def state_json(self) -> dict[str, Any]:
        """The whole state, JSON only (no pickle)."""

    @abstractmethod
    def load_state_json(self, state: dict[str, Any]) -> None:
        """Take up ``state_json``'s state; raises ValueError for another method's."""
