"""Where a configuration stops leaving ``--memory-margin`` free, from the peaks trials measured.

Every trial reports its peak memory and the device's total (dsat.training.step_clock). Within a
ZeRO stage the peak is model states plus bucket buffers plus activations that grow by a fixed
amount per sample, so two trials of one configuration give that amount, and one trial of the
stage, moved by the bucket memory another configuration keeps, tells where that one crosses the
margin. This is finer than counting failures: a bucket step that frees a fraction of a sample
shows only in bytes, and a trial that used 96.7% of a 5% margin says by how much it was over.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping


def bytes_per_sample(peaks_of_configs: Iterable[Mapping[int, float]]) -> float | None:
    """The activation memory one more sample costs: the median slope of each configuration's
    measured peaks between its smallest and largest micro-batch (None with no two of one)."""
    slopes = []
    for peaks in peaks_of_configs:
        if len(peaks) >= 2:
            low, high = min(peaks), max(peaks)
            slopes.append((peaks[high] - peaks[low]) / (high - low))
    positive = [s for s in slopes if s > 0]
    return statistics.median(positive) if positive else None


def largest_within(known_mbs: int, known_peak: float, per_sample: float, limit: float) -> int:
    """The largest micro-batch whose peak, from one known at ``known_mbs`` and ``per_sample``
    bytes a sample, stays at or below ``limit`` bytes."""
    return known_mbs + math.floor((limit - known_peak) / per_sample)
