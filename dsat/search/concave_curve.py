"""One configuration's metric against its micro-batch: how good it can still get, and where to
look next.

Throughput rises with the micro-batch with diminishing returns and may fall again as memory fills
(allocator retries, cache flushes): a concave curve, with throughput 0 at micro-batch 0. Outside
any chord, a concave curve lies below that chord's extension, so the trials already run bound
every untried micro-batch from above. The search tries the gap with the highest bound and stops
once no gap can beat the best trial by more than a tolerance. Measurements are noisy, so each
chord's extension is raised by the noise allowed for.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence

import numpy as np

# Relative measurement noise allowed for when a chord is extended.
NOISE = 0.005


@dataclasses.dataclass(frozen=True)
class Gap:
    """Untried micro-batches from ``lo`` to ``hi`` (inclusive), and the best they can reach."""

    lo: int
    hi: int
    bound: float

    @property
    def probe(self) -> int:
        return (self.lo + self.hi) // 2


@dataclasses.dataclass(frozen=True)
class CurveEvidence:
    """What is known of one configuration; values are larger-is-better and positive."""

    values: Mapping[int, float]  # micro-batch -> measured value
    reach: int  # the largest micro-batch worth trying: below the smallest failure, or an estimate
    through_origin: bool = True  # the value is 0 at micro-batch 0 (throughput, FLOPS)
    # Points of a related curve (the stage's best configuration, scaled to this one): they bound
    # the shape, but are never reported as this configuration's own results.
    borrowed: Mapping[int, float] = dataclasses.field(default_factory=dict)
    # The noise allowed for (relative): NOISE on a quiet machine, more on a noisy one.
    noise: float = NOISE

    @property
    def best(self) -> float | None:
        return max(self.values.values()) if self.values else None


# Chords between points closer than this (relative to the larger micro-batch) say more about
# the noise than the curve, and bound nothing.
MIN_CHORD_SPAN = 0.15


@dataclasses.dataclass(frozen=True)
class _Chord:
    """The line through points ``i`` < ``j`` of a curve's sorted points."""

    i: int
    j: int
    left: tuple[float, float]
    right: tuple[float, float]
    slope: float


def _informative(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return abs(b[0] - a[0]) >= max(2.0, MIN_CHORD_SPAN * max(a[0], b[0]))


def _points(evidence: CurveEvidence) -> list[tuple[float, float]]:
    merged = {**evidence.borrowed, **evidence.values}
    points = sorted((float(m), float(y)) for m, y in merged.items())
    if evidence.through_origin:
        points.insert(0, (0.0, 0.0))
    return points


def _chords(points: list[tuple[float, float]]) -> list[_Chord]:
    """Every informative chord between ``points`` (worked out once for all of a curve's gaps)."""
    return [
        _Chord(i, j, a, b, (b[1] - a[1]) / (b[0] - a[0]))
        for i, a in enumerate(points)
        for j in range(i + 1, len(points))
        if _informative(a, b := points[j])
    ]


def _bound_between(
    points: list[tuple[float, float]],
    chords: list[_Chord],
    left: int | None,
    right: int | None,
    lo: int,
    hi: int,
    noise: float = NOISE,
) -> float:
    """The highest a concave curve through ``points`` can be on [lo, hi], which lies between
    point index ``left`` and ``right`` (None: open on that side). Every chord on either side,
    extended past its end nearer the gap and raised by the noise, bounds it; chords between close
    points are loose once noise is allowed for, so the tightest of all of them counts."""
    # (the end the chord is extended from, its slope)
    ends = [(c.right, c.slope) for c in chords if left is not None and c.j <= left]
    ends += [(c.left, c.slope) for c in chords if right is not None and c.i >= right]
    if not ends:
        after = points[right:] if right is not None else []
        if after and after[0][1] > 0:
            # Below the smallest micro-batch tried, with nothing to its right to say the curve
            # falls: a smaller micro-batch is taken to be no faster (it only pays more overhead).
            return after[0][1]
        return math.inf
    count = min(hi - lo + 1, 17)
    samples = np.array(
        sorted({lo + round(i * (hi - lo) / max(count - 1, 1)) for i in range(count)}), dtype=float
    )
    # One row per chord, one column per sample: the tightest chord at each, the loosest sample.
    lines = np.array([(x, y, slope) for (x, y), slope in ends])
    x, y, slope = lines[:, 0:1], lines[:, 1:2], lines[:, 2:3]
    return float(((y + slope * (samples[None, :] - x)) * (1 + noise)).min(axis=0).max())


def _saturating_bound(points: list[tuple[float, float]], at: float, noise: float = NOISE) -> float:
    """Above the largest micro-batch tried, a step's time grows at least linearly with the
    micro-batch (time = a + b * mbs, a >= 0), so throughput = mbs / (a + b * mbs); fitted through
    the two largest points and widened by the noise."""
    real = [(m, y) for m, y in points if m > 0 and y > 0]
    if len(real) < 2:
        return math.inf
    (m1, y1), (m2, y2) = real[-2], real[-1]
    if y2 <= y1 or not _informative((m1, y1), (m2, y2)):
        return math.inf  # falling already: the concave bound applies
    # 1/y = a/m + b through both points, each moved by the noise to favour growth.
    inv1, inv2 = 1 / (y1 * (1 - noise)), 1 / (y2 * (1 + noise))
    a = (inv1 - inv2) / (1 / m1 - 1 / m2)
    b = inv2 - a / m2
    if b <= 0:
        return math.inf
    return at / (a + b * at)


def gaps(evidence: CurveEvidence) -> list[Gap]:
    """Every run of untried micro-batches up to the reach, with its bound. Borrowed points split
    runs (they bound the curve on both sides) and are untried themselves: each is bounded by its
    borrowed value."""
    points = _points(evidence)
    chords = _chords(points)
    result: list[Gap] = []
    for m, y in evidence.borrowed.items():
        if m not in evidence.values and 1 <= m <= evidence.reach:
            result.append(Gap(m, m, y * (1 + evidence.noise)))
    edges = [0, *sorted({int(m) for m, _ in points if m > 0}), evidence.reach + 1]
    for lower, upper in itertools.pairwise(edges):
        lo, hi = lower + 1, min(upper - 1, evidence.reach)
        if lo > hi:
            continue
        left = max((i for i, (m, _) in enumerate(points) if m < lo), default=None)
        right = min((i for i, (m, _) in enumerate(points) if m > hi), default=None)
        bound = _bound_between(points, chords, left, right, lo, hi, evidence.noise)
        if right is None and evidence.through_origin:
            bound = min(bound, _saturating_bound(points, hi, evidence.noise))
        result.append(Gap(lo, hi, bound))
    return result


def best_possible(evidence: CurveEvidence) -> float:
    """The most this configuration can reach at any micro-batch up to its reach."""
    own = evidence.best if evidence.best is not None else 0.0
    return max([own, *(g.bound for g in gaps(evidence))])


def next_gap(
    evidence: CurveEvidence,
    tolerance: float,
    target: float,
    allowed: Sequence[int] | None = None,
) -> Gap | None:
    """The gap to try next (its ``probe`` is the micro-batch, its ``bound`` what it may reach),
    or None when no untried micro-batch can beat ``target`` by more than ``tolerance``
    (relative). With ``allowed`` (a fixed global batch), only gaps that hold one of them."""
    open_gaps = [
        g
        for g in gaps(evidence)
        if g.bound > target * (1 + tolerance)
        and (allowed is None or any(g.lo <= m <= g.hi for m in allowed))
    ]
    if not open_gaps:
        return None
    return max(open_gaps, key=lambda g: (g.bound, -g.lo))
