"""Aligned micro-batches: on GPUs a micro-batch that fills tensor-core tiles (a multiple of 8, 16,
32 or 64) can run several percent faster than its neighbours, so throughput is not a smooth,
concave curve of the micro-batch there, and a search that only bisects can step over the best one.

Each curve probe is moved to the most aligned micro-batch in the middle of its gap (it bisects as
well from there), and next to a stage's best micro-batch the aligned ones are tried, valued by what
the aligned trials of this search showed against their unaligned neighbours, plus an optimism that
shrinks with that evidence (an upper confidence bound, as for knob steps): on hardware without the
effect, a few aligned trials that show nothing end it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping

from dsat.search.throughput_model import ALIGNMENTS

# How much faster an aligned micro-batch may be before any evidence (log).
ALIGNED_OPTIMISM = 0.03
# Aligned candidates next to a best micro-batch: not further below it than this share.
ALIGNED_REACH_DOWN = 0.8
# An aligned trial's neighbours, for its evidence, lie within this share of it.
NEIGHBOUR_SPAN = 0.25


def alignment(mbs: int) -> int:
    """The largest tile ``mbs`` is a multiple of (1: none)."""
    return max((k for k in ALIGNMENTS if mbs % k == 0), default=1)


def snap(lo: int, hi: int) -> int:
    """The micro-batch to probe in the gap [lo, hi]: its middle, or the most aligned micro-batch
    in the middle half of it (the nearest to the middle among equals)."""
    middle = (lo + hi) // 2
    quarter = (hi - lo) // 4
    window = range(max(lo, middle - quarter), min(hi, middle + quarter) + 1)
    return max(window, key=lambda m: (alignment(m), -abs(m - middle)), default=middle)


def gains(curves: Mapping[object, Mapping[int, float]]) -> list[float]:
    """What each aligned trial showed: its log-metric above the line between its configuration's
    nearest unaligned trials on either side (larger is better)."""
    found: list[float] = []
    for values in curves.values():
        plain = sorted((m, v) for m, v in values.items() if alignment(m) == 1)
        for mbs, value in values.items():
            if alignment(mbs) == 1:
                continue
            below = [(m, v) for m, v in plain if mbs * (1 - NEIGHBOUR_SPAN) <= m < mbs]
            above = [(m, v) for m, v in plain if mbs < m <= mbs * (1 + NEIGHBOUR_SPAN)]
            if not below or not above:
                continue
            (m1, v1), (m2, v2) = below[-1], above[0]
            line = v1 + (v2 - v1) * (mbs - m1) / (m2 - m1)
            if line > 0 and value > 0:
                found.append(math.log(value / line))
    return found


def optimism(shown: list[float]) -> float:
    """How much faster (log) an untried aligned micro-batch may be: the mean gain shown so far
    plus a bonus that shrinks with the evidence."""
    mean = sum(shown) / len(shown) if shown else 0.0
    return mean + ALIGNED_OPTIMISM / math.sqrt(1 + len(shown))


def candidates(best_mbs: int, reach: int) -> list[int]:
    """Aligned micro-batches next to ``best_mbs`` worth a trial: for each tile, the multiples on
    either side, up to ``reach`` and not far below the best."""
    found: set[int] = set()
    for tile, side in itertools.product(ALIGNMENTS, (0, 1)):
        mbs = (best_mbs // tile + side) * tile
        if best_mbs * ALIGNED_REACH_DOWN <= mbs <= reach and mbs >= 1 and mbs != best_mbs:
            found.add(mbs)
    return sorted(found)
