"""How noisy one trial's measurement is, as this search saw it.

One short trial measures a configuration with some noise: a percent or two on a quiet machine,
more over PCIe or on a shared cluster, and run to run it differs again. A search that decides on
fixed tolerances calls configurations equal that it cannot tell apart on a noisy machine, and
apart that it cannot on a quiet one. Two things show the noise: how far each trial measured from
what its neighbours say (the denoised estimate, dsat.search.throughput_model), and, where a
configuration ran more than once, how far its runs differ. Both are pooled with a prior of
``PRIOR_NOISE`` worth ``PRIOR_WEIGHT`` measurements, so that a few trials cannot talk it down to
nothing (or up to a lot).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

# What a short trial's measurement varies by on a quiet machine (relative standard deviation):
# dsat's own window measured 0.3-3% on the CPU and the H100 check (benchmarks/README.md), and the
# search's fixed tolerances were tuned at about this much.
PRIOR_NOISE = 0.015
PRIOR_WEIGHT = 4.0
# A residual from an estimate that includes the trial itself understates its noise; about this
# much of a trial's weight is its own in the estimate.
OWN_SHARE = 0.45


def relative_noise(
    residuals: Iterable[tuple[float, float]], repeats: Iterable[Sequence[float]] = ()
) -> float:
    """The relative standard deviation of one measurement.

    ``residuals``: (measured, estimated) pairs, larger is better, both positive; ``repeats``:
    the measurements of each configuration that ran more than once."""
    squares = PRIOR_WEIGHT * PRIOR_NOISE**2
    weight = PRIOR_WEIGHT
    for measured, estimated in residuals:
        if measured > 0 and estimated > 0:
            squares += math.log(measured / estimated) ** 2 / (1 - OWN_SHARE)
            weight += 1
    repeated, freedom = _repeat_squares(repeats)
    return math.sqrt((squares + repeated) / (weight + freedom))


def repeat_spread(repeats: Iterable[Sequence[float]]) -> float | None:
    """The relative standard deviation of one run from the repeats alone, with no prior: what
    this machine showed, however quiet (None: nothing ran twice)."""
    squares, freedom = _repeat_squares(repeats)
    return math.sqrt(squares / freedom) if freedom else None


def _repeat_squares(repeats: Iterable[Sequence[float]]) -> tuple[float, int]:
    """The squared log-deviations of each configuration's runs from their mean, summed, and
    their degrees of freedom."""
    squares, freedom = 0.0, 0
    for runs in repeats:
        logs = [math.log(v) for v in runs if v > 0]
        if len(logs) < 2:
            continue
        mean = sum(logs) / len(logs)
        squares += sum((x - mean) ** 2 for x in logs)
        freedom += len(logs) - 1
    return squares, freedom


def noise_scale(noise: float) -> float:
    """How much wider than on a quiet machine the search's tolerances are: 1 at the prior's
    noise or less, in proportion above it."""
    return max(1.0, noise / PRIOR_NOISE)


def residuals_of(
    values: Mapping[tuple[str, int], float], estimated: Mapping[tuple[str, int], float]
) -> list[tuple[float, float]]:
    """(measured, estimated) for every trial with an estimate."""
    return [(values[key], value) for key, value in estimated.items() if key in values]
