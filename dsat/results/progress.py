"""What a user watches while trials run: one line per finished trial and live counts.

On a terminal a rich status line (running / done / oom / error / timeout, best so far, elapsed)
stays at the bottom and refreshes on its own; when stdout is a file or a pipe (CI logs, ``| tee``)
only the plain per-trial lines are written, so the log reads cleanly.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from types import TracebackType

from rich.console import Console
from rich.live import Live
from rich.text import Text

from dsat.constants import LINGERED_KEY, RUN_ALONE
from dsat.search.tracker import TrialTracker
from dsat.trial import TrialKind, TrialOutcome, TrialRecord, TrialStatus, trial_number
from dsat.trial_failure import MACHINE_ATTEMPTS, first_line, log_note

PREFIX = "dsat:"


def format_elapsed(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


class SearchProgress:
    """A trial listener for the search driver (see ``dsat.runners.driver.TrialListener``)."""

    def __init__(
        self,
        tracker: TrialTracker,
        console: Console | None = None,
        clock: Callable[[], float] = time.monotonic,
        planned: Callable[[], int] | None = None,
    ) -> None:
        """``planned``: the most trials the search plans now (its baseline and confirmation
        round included); the tracker's budget where not given."""
        self.tracker = tracker
        self.planned = planned or (lambda: tracker.max_trials)
        self.console = console or Console(highlight=False, soft_wrap=True)
        self.clock = clock
        self.started_at = clock()
        self._live: Live | None = None

    def carry_on(self, seconds: float) -> None:
        """Count the elapsed time on from ``seconds``: a resumed search's, whose trials.jsonl
        times carry on (its lines restarted at 00:00 beside rows ending at 124 s)."""
        self.started_at = self.clock() - seconds

    # ------------------------------------------------------------------ listener hooks

    def trial_started(self, request_id: str) -> None:
        self._refresh()

    def trial_finished(self, request_id: str, outcome: TrialOutcome) -> None:
        record = self.tracker.get(request_id)
        line = f"{PREFIX} {self.trial_line(record)} | {self.status_line()}"
        self.console.print(line, highlight=False, markup=False)
        self._refresh()

    def trial_retried(self, request_id: str, outcome: TrialOutcome, attempt: int) -> None:
        record = self.tracker.get(request_id)
        alone = (
            ", alone, once the trials running beside it end"
            if outcome.metrics.get(RUN_ALONE)
            else ""
        )
        line = (
            f"{PREFIX} trial {trial_number(record.index, outcome.log)} "
            f"{self.trial_label(record)}: the machine failed it, "
            f"not its configuration: {first_line(outcome.error)}{log_note(outcome.log)}; running "
            f"it again{alone} (attempt {attempt + 1} of {MACHINE_ATTEMPTS})"
        )
        self.console.print(line, highlight=False, markup=False)
        self._refresh()

    # ------------------------------------------------------------------ text

    def counts(self) -> collections.Counter[TrialStatus]:
        return collections.Counter(record.status for record in self.tracker.finished)

    @staticmethod
    def trial_label(record: TrialRecord) -> str:
        if record.kind is TrialKind.MODEL_PROFILE:
            return "model profile"
        if record.kind is TrialKind.BASELINE:
            return f"your config ({record.name})"
        return record.name

    def trial_line(self, record: TrialRecord) -> str:
        """Its result, with its unit; a failed one says why in one line, and where its log is."""
        text = f"trial {record.number} {self.trial_label(record)}: {record.status.value}"
        value = self.tracker.measured_value(record)
        if value is not None:
            text += f", {self.tracker.metric.describe(value)}"
        if record.status.failed:
            reason = first_line(record.error)
            text += (f": {reason}" if reason else "") + log_note(record.log)
        lingered = record.metrics.get(LINGERED_KEY)
        if isinstance(lingered, (int, float)):  # each such trial costs that much more
            text += (
                f" (stopped {lingered:g} s after its result: its code after training blocked, or "
                f"something it started kept it alive{log_note(record.log)})"
            )
        return text

    def status_line(self) -> str:
        counts = self.counts()
        parts = [
            f"running {len(self.tracker.running)}",
            f"done {counts[TrialStatus.COMPLETED]}",
            f"oom {counts[TrialStatus.OOM]}",
            f"error {counts[TrialStatus.ERROR]}",
        ]
        if counts[TrialStatus.TIMEOUT]:  # a hang is not a crash: its trial line says which
            parts.append(f"timeout {counts[TrialStatus.TIMEOUT]}")
        planned = max(self.planned(), sum(counts.values()))
        parts[-1] += f" ({sum(counts.values())} of at most {planned} trials)"
        best = self.tracker.best()
        value = self.tracker.metric_value(best) if best is not None else None
        if best is not None and value is not None:
            parts.append(f"best {best.name} {self.tracker.metric.describe(value)}")
        parts.append(format_elapsed(self.clock() - self.started_at))
        return ", ".join(parts)

    def __rich__(self) -> Text:
        # Live re-renders this on every refresh, so the elapsed time moves on between trials.
        return Text(f"{PREFIX} {self.status_line()}", style="bold")

    # ------------------------------------------------------------------ live display

    def _refresh(self) -> None:
        if self._live is not None:
            self._live.refresh()

    def __enter__(self) -> SearchProgress:
        if self.console.is_terminal:
            self._live = Live(self, console=self.console, refresh_per_second=2, transient=True)
            self._live.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
