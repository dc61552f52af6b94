"""The confirmation round: the leading configurations run again before one is handed over.

One short trial per configuration ranks them, and a single measurement can be lucky. When the
search ends, the leading distinct configurations run again, interleaved (A, B, C, A, B, C), so
machine noise hits them alike; the winner is the best mean of those runs. Leaders within the
noise the round measured (the spread of its runs) count as equal, and among equals the one with
the most memory headroom wins: one that barely fits a short trial can run out of memory hours
into a real run, which is also why a configuration leaving less than ``--memory-margin`` of the
device is never handed over. The round is kept to a share of the search's trials.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

from dsat.search.tracker import TrialTracker, config_key
from dsat.trial import TrialRecord

# The round's runs, as a share of the search trials that finished (at least one per leader).
SHARE_OF_SEARCH = 0.15
REPEATS = 2
# Among equals, more headroom wins only when it is this much of the device's memory or more.
HEADROOM_STEP = 0.05


# A method's estimate of a search trial's metric, in the metric's own units and direction.
Score = Callable[[TrialRecord], float]


def leaders(tracker: TrialTracker, count: int, score: Score | None = None) -> list[TrialRecord]:
    """The best ``count`` distinct configurations that leave ``--memory-margin`` of the device:
    by their measured metric, or by ``score``, a method's estimate that pools other trials."""
    ranked = sorted(
        (r for r in tracker.records if tracker.metric_value(r) is not None),
        key=score or (lambda r: tracker.metric_value(r) or 0.0),
        reverse=not tracker.metric.smaller_is_better,
    )
    chosen: list[TrialRecord] = []
    seen: set[str] = set()
    for record in ranked:
        if not tracker.may_hand_over(record):
            continue
        key = config_key(record)
        if key not in seen:
            seen.add(key)
            chosen.append(record)
        if len(chosen) == count:
            break
    return chosen


def planned_runs(candidates: Sequence[TrialRecord], search_trials: int) -> list[TrialRecord]:
    """The candidates in the order they run again: interleaved, as many rounds as the share of
    the search allows (one at the least, ``REPEATS`` at the most)."""
    if len(candidates) < 2:
        return []  # nothing to choose between
    budget = max(len(candidates), int(SHARE_OF_SEARCH * search_trials))
    rounds = max(1, min(REPEATS, budget // len(candidates)))
    return [candidate for _ in range(rounds) for candidate in candidates]


def winner(
    tracker: TrialTracker, candidates: Sequence[TrialRecord], score: Score | None = None
) -> TrialRecord | None:
    """The confirmed best of ``candidates``, from their confirmation runs: by the mean of the
    runs, or by ``score``, a method's estimate that counts them with its other trials (a
    candidate that failed when run again is not handed over either way)."""
    means: dict[str, float] = {}
    # Leaders are equal only within the spread the round measured: a fixed floor would call
    # configurations equal that steady measurements tell apart, and hand over a slower one.
    noise = 0.0
    for candidate in candidates:
        runs = tracker.confirmation_runs(candidate.request_id)
        values = [v for v in (tracker.confirmed_value(r) for r in runs) if v is not None]
        if not values:
            continue  # it failed when run again: not handed over
        mean = statistics.fmean(values)
        means[candidate.request_id] = mean if score is None else score(candidate)
        if len(values) > 1 and mean:
            noise = max(noise, (max(values) - min(values)) / abs(mean))
        spreads = [r.metrics.get("step_time_spread") for r in runs]
        noise = max([noise, *(float(s) for s in spreads if isinstance(s, (int, float)))])
    if not means:
        return None
    better = tracker.metric.is_better
    best_id = next(iter(means))
    for request_id, value in means.items():
        if better(value, means[best_id]):
            best_id = request_id
    best_value = means[best_id]
    equals = [
        c
        for c in candidates
        if c.request_id in means
        and abs(means[c.request_id] - best_value) <= noise * abs(best_value)
    ]
    best = next(c for c in candidates if c.request_id == best_id)
    roomiest = min(equals, key=lambda c: c.memory_fraction or 0.0)
    freed = (best.memory_fraction or 0.0) - (roomiest.memory_fraction or 0.0)
    return roomiest if freed >= HEADROOM_STEP else best
