"""What a search cost: the slot-hours its trials held (slots per trial x trial time, added up).

Every recorded trial held its slots while it ran, so every one counts: the model profile, the
search's trials, the confirmation round, and failed trials, with their earlier runs that the
machine failed or a stop of the search cut short. Computed from the rows of
trials.jsonl alone, so the summary, the report and the terminal's last line agree, and a
resumed search (whose rows carry on the clock) is counted whole. On the simulated runner the
clock is virtual: its hours are the simulated cluster's.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from dsat.trial import TrialKind

COST_PREFIX = "cost:"
# A row's kind, as the cost line names it (singular, plural).
KIND_WORDS = {
    TrialKind.MODEL_PROFILE.value: ("model profile", "model profiles"),
    TrialKind.SEARCH.value: ("search", "search"),
    TrialKind.CONFIRM.value: ("confirmation run", "confirmation runs"),
    TrialKind.BASELINE.value: ("baseline", "baselines"),
}

# A row's runs of the trial that the machine failed before the one it records (a taken port, a
# signal from outside): each one's start, end, reason and log; their slots were held too.
MACHINE_FAILED_KEY = "machine_failed"
# A row's runs of the trial that a stop of the search cut short (Ctrl-C, a lost Ray node), before
# the resume ran it again: each one's start, end and log.
INTERRUPTED_KEY = "interrupted"
EARLIER_RUN_KEYS = (MACHINE_FAILED_KEY, INTERRUPTED_KEY)


@dataclasses.dataclass(frozen=True)
class SearchCost:
    """The trials a search ran and the slot time they held."""

    kinds: tuple[tuple[str, int], ...]  # (kind, trials), in the order a search runs them
    failed: int
    trial_seconds: float  # every trial's end - start, added up
    slot_seconds: float | None  # each trial's slots x its time, added up; None: slots unknown
    slots: tuple[int, ...]  # the slots per trial seen (one count in any one search)
    slot_kind: str  # "GPU", "CPU", or "" when the rows disagree

    @property
    def trials(self) -> int:
        return sum(count for _, count in self.kinds)

    @property
    def slot_hours(self) -> float | None:
        return None if self.slot_seconds is None else self.slot_seconds / 3600

    def hours_text(self) -> str:
        """The cost in a few words: ``0.0424 CPU slot-hours``, ``11.2 GPU-hours``."""
        hours = self.slot_hours
        if hours is None:
            return f"{duration(self.trial_seconds)} of trials"
        unit = {"GPU": "GPU-hours", "CPU": "CPU slot-hours"}.get(self.slot_kind, "slot-hours")
        return f"{figure(hours)} {unit}"

    def line(self) -> str:
        """The summary's line: the trials by kind, the slot-hours, and what they multiply."""
        counts = ", ".join(
            f"{count} {KIND_WORDS.get(kind, (kind, kind))[count != 1]}"
            for kind, count in self.kinds
        )
        failed = f"; {self.failed} failed" if self.failed else ""
        trials = f"{self.trials} trial{'s' if self.trials != 1 else ''}"
        if self.slot_hours is None:
            how = "slots per trial not recorded"
        else:
            slots = " or ".join(str(n) for n in self.slots)
            one = len(self.slots) == 1 and self.slots[0] == 1
            word = {"GPU": "GPU", "CPU": "CPU slot"}.get(self.slot_kind, "slot")
            how = f"{slots} {word}{'' if one else 's'} per trial x {duration(self.trial_seconds)}"
            how += " of trials"
        return f"{COST_PREFIX} {trials} ({counts}{failed}), {self.hours_text()} ({how})"


def search_cost(
    rows: Iterable[Mapping[str, Any]], slots: int | None = None, slot_kind: str = "GPU"
) -> SearchCost:
    """The cost of the trials in ``rows`` (trials.jsonl's); ``slots`` and ``slot_kind`` stand in
    for rows written before trials.jsonl recorded them."""
    kinds: Counter[str] = Counter()
    failed = 0
    trial_seconds = 0.0
    slot_seconds: float | None = 0.0
    seen_slots: set[int] = set()
    seen_kinds: set[str] = set()
    for row in rows:
        kinds[str(row.get("kind"))] += 1
        failed += row.get("status") in ("oom", "error", "timeout")
        earlier = [run for key in EARLIER_RUN_KEYS for run in row.get(key) or []]
        seconds = sum(  # with its runs that failed or were stopped before: their slots were held
            max(0.0, float(run.get("end", 0.0)) - float(run.get("start", 0.0)))
            for run in [row, *earlier]
            if isinstance(run, Mapping)
        )
        trial_seconds += seconds
        count = row.get("slots", slots)
        seen_kinds.add(str(row.get("slot_kind", slot_kind)))
        if count is None or slot_seconds is None:
            slot_seconds = None
            continue
        seen_slots.add(int(count))
        slot_seconds += int(count) * seconds
    order = list(KIND_WORDS)
    ranked = sorted(kinds.items(), key=lambda kc: order.index(kc[0]) if kc[0] in order else 99)
    return SearchCost(
        kinds=tuple(ranked),
        failed=failed,
        trial_seconds=trial_seconds,
        slot_seconds=slot_seconds,
        slots=tuple(sorted(seen_slots)),
        slot_kind=seen_kinds.pop() if len(seen_kinds) == 1 else "",
    )


def figure(value: float) -> str:
    """Three significant figures, no exponent: 0.000213, 0.0212, 11.2, 1234."""
    if value <= 0:
        return "0"
    if value >= 100:
        return f"{value:.0f}"
    return f"{value:.{2 - math.floor(math.log10(value))}f}"


def duration(seconds: float) -> str:
    """A length of time in the unit a person reads best, to three figures as the total it
    multiplies to (8 GPUs x 5.2 h read as 41.6, beside a total of 42.0): 7.62 s, 42.1 min,
    5.24 h."""
    if seconds < 120:
        return f"{figure(seconds)} s"
    if seconds < 7200:
        return f"{figure(seconds / 60)} min"
    return f"{figure(seconds / 3600)} h"
