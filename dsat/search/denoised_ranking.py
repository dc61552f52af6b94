"""How every method ranks what it may hand over: each trial's metric denoised by its stage's other
trials (dsat.search.throughput_model), not the single measurement.

The best of dozens of short, noisy trials is usually a lucky one. Handing over the best measured
trial (the reference's rule) then often hands over a configuration a percent or two slower than
another the search also ran. In the simulated suite, ranking by this estimate instead hands over a
configuration within 2% of the optimum more often for asha, binary and random alike (results in
benchmarks/README.md); guided, which plans with the same estimate, always ranked this way. The
confirmation round's runs count as more measurements of their configuration.
"""

from __future__ import annotations

import math

from dsat.search.confirmation import Score, oriented
from dsat.search.fit_ladder import offload_level
from dsat.search.throughput_model import Observation, estimate
from dsat.search.tracker import TrialTracker
from dsat.trial import TrialKind, TrialRecord
from dsat.zero_space import setting_tags

# Only trials measured within this of the best (about four times one measurement's noise) are
# estimated: pooling moves a trial by a fraction of its noise, never past this.
CANDIDATE_SPAN = 0.06
# The best of many single measurements is the luckiest: a configuration with only one trial
# within 2 micro-batches of a trial ranks this much lower there when the search picks what to
# hand over (about two thirds of one measurement's noise), so a rival as good by the estimate
# whose level rests on several trials is handed over instead.
SINGLE_TRIAL_DISCOUNT = 0.01
# Trials of one configuration within this many micro-batches of each other support each other.
SUPPORT_SPAN = 2


def measured(tracker: TrialTracker, record: TrialRecord) -> float | None:
    """A search trial's metric (larger is better), averaged with its confirmation runs: one
    observation either way, since part of what makes a configuration measure well can be its
    own (the same kernels, the same placement) and would not average out."""
    runs = [tracker.metric_value(record)] + [
        tracker.confirmed_value(r) for r in tracker.confirmation_runs(record.request_id)
    ]
    values = [oriented(v, tracker.metric) for v in runs if v is not None]
    values = [v for v in values if 0 < v < math.inf]
    return sum(values) / len(values) if values else None


def observations(tracker: TrialTracker) -> list[Observation]:
    """Every search trial that ran, as the throughput model sees it."""
    found: dict[tuple[str, int], Observation] = {}
    for record in tracker.records:
        if record.kind is not TrialKind.SEARCH:
            continue
        value = measured(tracker, record)
        if value is not None:
            key = record.zero_key
            # Grouped by stage and what it offloads: each offload has a curve of its own.
            group = (record.zero_stage, offload_level(record.zero_section))
            found[(key, record.mbs)] = Observation(
                key, group, record.mbs, value, setting_tags(record.zero_section)
            )
    return list(found.values())


def estimates(observed: list[Observation]) -> dict[tuple[str, int], float]:
    """The denoised metric (larger is better) of every trial measured near the best, each
    pooled with its stage's other trials."""
    best = max((o.value for o in observed), default=0.0)
    result: dict[tuple[str, int], float] = {}
    for o in observed:
        if o.value >= best * (1 - CANDIDATE_SPAN):
            result[(str(o.config), o.mbs)] = estimate(observed, o.config, o.mbs) or o.value
    return result


def denoised_score(tracker: TrialTracker) -> Score:
    """Each search trial's denoised metric, in the metric's own direction (its measurement when
    it is too far from the best to be estimated), from the records as they are now: the
    confirmation round's leaders and winner are ranked by it."""
    observed = observations(tracker)
    estimated = estimates(observed)
    micro_batches: dict[str, list[int]] = {}
    for o in observed:
        micro_batches.setdefault(str(o.config), []).append(o.mbs)
    metric = tracker.metric

    def score(record: TrialRecord) -> float:
        key = record.zero_key
        value = estimated.get((key, record.mbs)) or measured(tracker, record)
        if not value:
            return -math.inf if metric.smaller_is_better else 0.0
        near = sum(1 for m in micro_batches.get(key, []) if abs(m - record.mbs) <= SUPPORT_SPAN)
        if near < 2:
            value *= 1 - SINGLE_TRIAL_DISCOUNT  # one measurement: likely the lucky one
        return 1.0 / value if metric.smaller_is_better else value

    return score
