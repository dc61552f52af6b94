"""The contract between a search run here and the runner its trials run on.

A ``RunnerSetup`` is a runner checked against the experiment before anything starts (the
entrypoint exists, the slots are there, the simulator loads), so every user mistake is found
before the first trial. Opening it gives a ``TrialRunner``: the driver starts trials on it and
waits for their outcomes, the launch stops and closes it, and asks it for the full run with the
winner. How each of those is done is the runner's own business (processes on slots, a performance
function on a virtual clock), as with Syne Tune's ``TrialBackend``.

Determined's runner has no ``TrialRunner``: there the whole search runs on the cluster, and the
master starts the trials (``runners/determined``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from dsat.trial import TrialOutcome


@dataclasses.dataclass(frozen=True)
class StoppedRun:
    """A run of a trial that ``stop_all`` ended before it finished, on the runner's clock: it held
    its slots, so a resumed search counts its time in the cost."""

    request_id: str
    start: float
    end: float
    log: str | None = None


class RunnerStopped(Exception):
    """The runner cannot go on, for a cause outside the search and the user's command (the Ray
    cluster lost the nodes a trial needs): it stopped every trial; the search is resumed once
    the cause is gone. Not a DsatError, whose exit status 2 says the command was wrong: the
    command was right, and the search ends with exit status 1."""

    def __init__(self, why: str, remedy: str, stopped: Sequence[StoppedRun] = ()) -> None:
        super().__init__(f"{why}; {remedy}")
        self.why = why
        self.remedy = remedy
        self.stopped = list(stopped)  # the runs it stopped: their time counts on the resume


class TrialRunner(Protocol):
    @property
    def slot_limit(self) -> int | None:
        """The slots trials may use at once here; None: only the method's own limits."""

    @property
    def slot_kind(self) -> str:
        """What its slots are, "GPU" or "CPU": the unit of what the search cost."""

    @property
    def takes_real_time(self) -> bool:
        """Trials take real time: a line per finished trial, and how to resume, are worth
        printing."""

    def start(
        self, request_id: str, hparams: dict[str, Any], ds_config: dict[str, Any], length: int
    ) -> None:
        """Start the trial; it runs until ``wait`` returns its outcome or ``stop_all``."""

    def wait(self) -> TrialOutcome:
        """The next trial to finish, whichever it is (only called while one is running)."""

    def running_count(self) -> int:
        """Trials started and not yet returned by ``wait``."""

    def stop_all(self) -> list[StoppedRun]:
        """Stop every running trial; their outcomes are never returned, only what they ran."""

    def close(self) -> None:
        """Let go of what the runner holds between trials (warm workers); a later ``start``
        takes it up again."""

    def run_full_experiment(self, hparams: dict[str, Any], length: int | None = None) -> None:
        """Train once with ``hparams`` for the script's full length (``--run-full-experiment``);
        ``length``: the searcher operation's, where the experiment gives one (off a cluster
        Determined's would be 1: a loop over ``op.length`` trained one step)."""


class RunnerSetup(Protocol):
    def open(self, results_dir: Path) -> TrialRunner:
        """The runner, ready for trials whose files go under ``results_dir``."""


class EndedSearchRunner:
    """The runner of a resume that runs no trial (the search had ended; a plain ``--resume``
    writes its report again): nothing is opened, so a Ray cluster need not be up, nor DeepSpeed's
    ops built, nor this machine's slots free."""

    slot_limit = None
    takes_real_time = False  # nothing runs: no progress, nor a resume line, to print
    slot_kind = ""  # unknown here: each recorded row says its own, which the cost reads

    def start(
        self, request_id: str, hparams: dict[str, Any], ds_config: dict[str, Any], length: int
    ) -> None:
        raise RuntimeError("a search that had ended started a trial on its resume")

    def wait(self) -> TrialOutcome:
        raise RuntimeError("a search that had ended waited for a trial on its resume")

    def running_count(self) -> int:
        return 0

    def stop_all(self) -> list[StoppedRun]:
        """Nothing runs."""
        return []

    def close(self) -> None:
        """Nothing is held."""

    def run_full_experiment(self, hparams: dict[str, Any], length: int | None = None) -> None:
        raise RuntimeError("the full run needs the search's own runner")


def fewer_slots_fix(slots_per_trial: int, resumed: bool) -> str:
    """What to do where a trial's slots cannot be had: lower slots_per_trial, except in a
    resumed search, whose trials were measured on that many (a changed experiment is refused)."""
    if not resumed:
        return "lower slots_per_trial"
    return (
        f"resume this search where {slots_per_trial} are free (its trials ran on "
        f"{slots_per_trial}), or start a new one with a lower slots_per_trial"
    )
