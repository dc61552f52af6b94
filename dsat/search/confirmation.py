"""The confirmation round: the leading configurations run again before one is handed over.

One short trial per configuration ranks them, and a single measurement can be lucky. When the
search ends, the leading distinct configurations run again, interleaved (A, B, C, A, B, C), so
machine noise hits them alike; the winner is the best by the method's estimate (or the mean of
the runs), unless the runs say otherwise by more than their noise: then the round measures again
rather than overrule them, and after that the runs decide. Leaders within the noise the round
measured, by the estimate and by their runs, count as equal, and among equals the one with the
most memory headroom wins: one that barely fits a short trial can run out of memory hours into a
real run, which is also why a configuration leaving less than ``--memory-margin`` of the usable
memory is never handed over.
The verdict says why, in plain words. The round is sized by the spread its runs show: a second
round only where the first did not repeat the search's measurements closely, and never more than
a share of the search's trials.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Sequence

from dsat.experiment.metric import Metric
from dsat.search.measurement_noise import relative_noise, repeat_spread
from dsat.search.tracker import TrialTracker, config_key
from dsat.trial import TrialKind, TrialRecord

# The round's runs, as a share of the search trials that finished (at least one per leader).
SHARE_OF_SEARCH = 0.15
REPEATS = 2
# A second round runs only where the first did not repeat the search's measurements: one run's
# relative standard deviation, pooled over the leaders, above this. Where the runs repeat within
# it, a second one moves a leader's mean by a fraction of a percent, and in the simulated suite it
# made no hand-over better (benchmarks/README.md): on a quiet machine it only costs GPU-hours.
QUIET_SPREAD = 0.01
# Among equals, more headroom wins only when it is this much of the device's memory or more.
HEADROOM_STEP = 0.05
# ... and equals are never further apart than this: the range of a few noisy runs can span
# several percent, and a user trades at most this much speed for headroom they did not ask for.
MOST_GIVEN_FOR_HEADROOM = 0.005


# A method's estimate of a search trial's metric, in the metric's own units and direction.
Score = Callable[[TrialRecord], float]
# Extra rounds of the leaders the estimate and the runs disagree on, before the runs decide.
EXTRA_ROUNDS = 2


def oriented(value: float, metric: Metric) -> float:
    """``value`` so that larger is better (a latency becomes its inverse)."""
    if metric.smaller_is_better:
        return 1.0 / value if value > 0 else math.inf
    return value


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


def allowed_rounds(candidates: Sequence[TrialRecord], search_trials: int) -> int:
    """How many rounds the share of the search allows: one at the least, ``REPEATS`` at the most
    (none when there is nothing to choose between)."""
    if len(candidates) < 2:
        return 0
    budget = max(len(candidates), int(SHARE_OF_SEARCH * search_trials))
    return max(1, min(REPEATS, budget // len(candidates)))


def search_trials(tracker: TrialTracker) -> int:
    """The search trials that finished: the share of them the confirmation round may take."""
    return sum(1 for r in tracker.finished if r.kind is TrialKind.SEARCH)


def runs_spread(tracker: TrialTracker, candidates: Sequence[TrialRecord]) -> float | None:
    """One run's spread over the leaders' search trials and runs (measurement_noise.repeat_spread):
    what sizes the round, and what the summary says sized it."""
    return repeat_spread(measurements(tracker, c) for c in candidates)


def next_round(
    tracker: TrialTracker, candidates: Sequence[TrialRecord], search_trials: int
) -> list[TrialRecord]:
    """The candidates to run again before the verdict (interleaved, one run each), or none:
    after the first round, another while the share of the search allows it and the runs so far
    did not repeat the measurements within ``QUIET_SPREAD``."""
    done = rounds_run(tracker, candidates)
    if done >= allowed_rounds(candidates, search_trials):
        return []
    if done >= 1:
        spread = runs_spread(tracker, candidates)
        if spread is not None and spread <= QUIET_SPREAD:
            return []
    return list(candidates)


def rounds_run(tracker: TrialTracker, candidates: Sequence[TrialRecord]) -> int:
    """The rounds every candidate has run again so far."""
    return min((len(tracker.confirmation_runs(c.request_id)) for c in candidates), default=0)


def rounds_note(tracker: TrialTracker, candidates: Sequence[TrialRecord]) -> str | None:
    """Why the round ran once or twice, in plain words (None: no leader ran again): a spread
    above ``QUIET_SPREAD`` with one round only was the share of the search's trials, and the
    summary says so rather than promise a second round that did not run."""
    spread = runs_spread(tracker, candidates)
    if spread is None:
        return None
    rounds = rounds_run(tracker, candidates)
    said = f"one run's spread, search trials and runs: {spread:.1%}"
    runs = {c.name: len(tracker.confirmation_runs(c.request_id)) for c in candidates}
    more = [name for name, count in runs.items() if count > rounds]
    if more:  # the estimate and the runs disagreed on them (decide): they ran again
        said += (
            f"; {' and '.join(more)} ran {max(runs.values()) - rounds} more time(s), where the "
            "estimate and their runs disagreed"
        )
    if rounds >= 2:
        return (
            f"{said} ({rounds} rounds: the leaders run again where the first round did not "
            f"repeat the search's within {QUIET_SPREAD:.0%}, or its runs and the estimate disagree)"
        )
    if spread <= QUIET_SPREAD:
        return f"{said} (within {QUIET_SPREAD:.0%}: one round is enough)"
    searched = search_trials(tracker)
    if allowed_rounds(candidates, searched) < 2:
        return (
            f"{said} (above {QUIET_SPREAD:.0%}, but a second round would take more than "
            f"{SHARE_OF_SEARCH:.0%} of the search's {searched} trials: one round)"
        )
    return f"{said} (one round)"


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the round decided: the configuration handed over and, in plain words, why; or the
    leaders to measure again first (``again``), when the estimate and the runs disagree."""

    chosen: TrialRecord | None
    reason: str = ""
    again: tuple[TrialRecord, ...] = ()


def measurements(tracker: TrialTracker, candidate: TrialRecord) -> list[float]:
    """Everything the candidate's configuration measured: its search trial, then its runs in the
    round that completed (larger is better)."""
    runs = [tracker.metric_value(candidate)] + [
        tracker.confirmed_value(r) for r in tracker.confirmation_runs(candidate.request_id)
    ]
    return [oriented(v, tracker.metric) for v in runs if v is not None and v > 0]


def repeated_measurements(tracker: TrialTracker) -> list[list[float]]:
    """The measurements of every search trial that ran again (``measurements``): what shows
    the run-to-run noise."""
    return [
        measurements(tracker, record)
        for record in tracker.records
        if tracker.metric_value(record) is not None and tracker.confirmation_runs(record.request_id)
    ]


def decide(
    tracker: TrialTracker,
    candidates: Sequence[TrialRecord],
    score: Score | None = None,
    measure_again: bool = False,
) -> Verdict:
    """The confirmed best of ``candidates`` (those that may be handed over), and why.

    Ranked by ``score`` (a method's estimate that pools other trials, and counts the runs) or
    by the mean of the runs. Where the estimate's winner measured slower in its runs than
    another leader, by more than the noise the runs show, the round does not overrule the
    measurements: with ``measure_again`` both run again first; after that, the measurements
    decide. Leaders within the noise the round measured (by the estimate, and by the mean of
    their runs) count as equal, and the one with the most memory headroom among them wins when
    it frees ``HEADROOM_STEP`` of the device."""
    ran = {c.request_id: measurements(tracker, c) for c in candidates}
    ran = {i: values for i, values in ran.items() if len(values) > 1}  # failed when run again
    if not ran:
        return Verdict(None, "no leader ran again")
    pool = [c for c in candidates if c.request_id in ran]
    mean = {i: statistics.fmean(values) for i, values in ran.items()}
    estimate = {
        c.request_id: (mean[c.request_id] if score is None else oriented(score(c), tracker.metric))
        for c in pool
    }
    noise = relative_noise([], ran.values())
    by_estimate = max(pool, key=lambda c: estimate[c.request_id])
    by_runs = max(pool, key=lambda c: mean[c.request_id])
    if by_runs is not by_estimate:
        n1, n2 = len(ran[by_runs.request_id]), len(ran[by_estimate.request_id])
        lead = mean[by_runs.request_id] / mean[by_estimate.request_id] - 1
        if lead > 2 * noise * math.sqrt(1 / n1 + 1 / n2):
            if measure_again:
                return Verdict(None, "", (by_estimate, by_runs))
            return Verdict(
                by_runs,
                f"measured {lead:.1%} faster than {by_estimate.name} over "
                f"{n1} and {n2} runs, more than the noise ({noise:.1%} a run), though its "
                "neighbours' trials said otherwise",
            )
    best = by_estimate
    # Leaders are equal only within the spread the round measured: a fixed floor would call
    # configurations equal that steady measurements tell apart, and hand over a slower one.
    spread = 0.0
    for values in ran.values():
        if len(values) > 2:
            again = values[1:]
            spread = max(spread, (max(again) - min(again)) / statistics.fmean(again))
    for c in pool:
        window = [
            r.metrics.get("step_time_spread") for r in tracker.confirmation_runs(c.request_id)
        ]
        steps = max((float(w) for w in window if isinstance(w, (int, float))), default=0.0)
        spread = max(spread, steps)
    top = estimate[best.request_id]
    tie = min(spread, MOST_GIVEN_FOR_HEADROOM)
    # Level by the estimate and by the runs: on a noisy machine the estimate can call two
    # configurations level that are 2-3% apart, and the runs then often show it.
    equals = [
        c
        for c in pool
        if abs(estimate[c.request_id] - top) <= tie * abs(top)
        and mean[c.request_id] >= mean[best.request_id] * (1 - tie)
    ]
    roomiest = min(equals, key=lambda c: c.memory_fraction or 0.0)
    freed = (best.memory_fraction or 0.0) - (roomiest.memory_fraction or 0.0)

    def faster_in_its_runs(chosen: TrialRecord) -> str:
        """The leaders whose runs measured faster than the chosen one's, said plainly: the
        table beside the verdict shows them, and a reader would ask why they lost (the rival
        it is "ahead of" by the estimate among them: naming only the fastest left that one
        unsaid)."""
        faster = sorted(
            (c for c in pool if mean[c.request_id] > mean[chosen.request_id]),
            key=lambda c: -mean[c.request_id],
        )
        if not faster:
            return ""
        parts = []
        for rival in faster:
            lead = mean[rival.request_id] / mean[chosen.request_id] - 1
            # "measured 0.0% faster" beside "0.8% ahead" read as a contradiction.
            by = "as fast" if f"{lead:.1%}" == f"{0:.1%}" else f"{lead:.1%} faster"
            parts.append(f"{rival.name} measured {by} over its {len(ran[rival.request_id])} runs")
        said = f"; {', '.join(parts)}, within the noise ({noise:.1%} a run)"
        shown = repeat_spread(ran.values())
        if shown is not None and shown < noise / 2:  # the prior, not these runs, says "noise"
            said += (
                f", which these runs did not show ({shown:.1%}): a few runs cannot rule out "
                "what the search's other trials say, and the estimate decides"
            )
        return said

    if roomiest is not best and freed >= HEADROOM_STEP:
        return Verdict(
            roomiest,
            f"level with {best.name} within the noise ({tie:.1%}), and leaves "
            f"{freed:.0%} more of the device's memory free" + faster_in_its_runs(roomiest),
        )
    rivals = [c for c in pool if c is not best]
    if not rivals:
        return Verdict(best, "the only leader that ran again")
    second = max(rivals, key=lambda c: estimate[c.request_id])
    ahead = top / estimate[second.request_id] - 1
    how = "by its trials and its neighbours'" if score is not None else "in its runs"
    # Within the noise as the round judges a disagreement: by the noise of a run's mean, never
    # by how much a run's own steps varied (on the CPU up to 70%, which called a lead of 48%,
    # shown in every run, "either is as good").
    n1, n2 = len(ran[best.request_id]), len(ran[second.request_id])
    level = ahead <= 2 * noise * math.sqrt(1 / n1 + 1 / n2)
    # The summary's "one run's spread" is the repeats' alone: 0.0% beside "the noise: 1.1% a
    # run" read as a contradiction where the prior and the other trials set the noise.
    shown = repeat_spread(ran.values())
    whose = (
        f" by the search's trials (these runs: {shown:.1%})"
        if shown is not None and shown < noise / 2
        else ""
    )
    return Verdict(
        best,
        f"the fastest {how}: {ahead:.1%} ahead of {second.name}"
        + (
            f" (within the noise: {noise:.1%} a run{whose}, over {n1} and {n2} runs; either is "
            "as good)"
            if level
            else ""
        )
        + faster_in_its_runs(best),
    )
