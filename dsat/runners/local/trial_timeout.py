"""How long a local trial may run before it is stopped and counted as a timeout.

A fixed hour lets one hung trial (a stale build lock, a deadlocked collective) hold its slot for
an hour. Unless ``--trial-timeout`` says otherwise, the limit follows what the search measured:
the model-profile trial gets a generous fixed allowance (nothing is known yet), and every later
trial a multiple of the profile trial's time, never less than a floor. Search trials run larger
micro-batches than the profile's 1 and may shard more, hence the wide multiple.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from dsat.results.directory import TRIALS_FILE
from dsat.trial import TrialKind, TrialStatus

logger = logging.getLogger(__name__)

PROFILE_TRIAL_LIMIT_S = 1200.0
FLOOR_S = 300.0
PROFILE_MULTIPLE = 10.0


class TrialTimeout:
    """The current limit in seconds: explicit, or derived once the profile trial has run."""

    def __init__(self, explicit: float | None) -> None:
        self.explicit = explicit
        self.profile_seconds: float | None = None

    @property
    def seconds(self) -> float:
        if self.explicit is not None:
            return self.explicit
        if self.profile_seconds is None:
            return PROFILE_TRIAL_LIMIT_S
        return max(FLOOR_S, PROFILE_MULTIPLE * self.profile_seconds)

    def describe(self) -> str:
        """The effective value and where it comes from, for the terminal."""
        if self.explicit is not None:
            return f"trial timeout {self.explicit:g} s (--trial-timeout)"
        if self.profile_seconds is None:
            return (
                f"trial timeout {PROFILE_TRIAL_LIMIT_S:g} s for the model-profile trial, then "
                f"{PROFILE_MULTIPLE:g}x its time (at least {FLOOR_S:g} s); --trial-timeout sets one"
            )
        return (
            f"trial timeout {self.seconds:.0f} s ({PROFILE_MULTIPLE:g}x the model-profile trial's "
            f"{seconds_said(self.profile_seconds)} s, at least {FLOOR_S:g} s; --trial-timeout "
            "sets one)"
        )

    def profile_finished(self, seconds: float, announce: bool = True) -> None:
        """Derive the limit from the profile trial; later calls change nothing."""
        if self.profile_seconds is not None:
            return
        self.profile_seconds = max(0.0, seconds)
        if announce and self.explicit is None:
            logger.info(self.describe())

    def resume_from(self, results_dir: Path) -> None:
        """A resumed search takes the profile trial's time from the trials it already ran."""
        seconds = profile_seconds(_rows(results_dir / TRIALS_FILE))
        if seconds is not None:
            self.profile_finished(seconds, announce=False)


def profile_seconds(rows: Iterable[Mapping[str, Any]]) -> float | None:
    """How long the completed model-profile trial among ``rows`` (trials.jsonl) ran."""
    for row in rows:
        if (
            row.get("kind") == TrialKind.MODEL_PROFILE.value
            and row.get("status") == TrialStatus.COMPLETED.value
        ):
            try:
                return float(row["end"]) - float(row["start"])
            except (KeyError, TypeError, ValueError):
                return None
    return None


def _rows(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def seconds_said(seconds: float) -> str:
    """Whole seconds, but a profile under a second is not "0 s" (10x of it was 300 s)."""
    return f"{seconds:.0f}" if seconds >= 10 else f"{seconds:.2g}"
