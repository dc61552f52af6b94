"""How much of the device a configuration may really use: what the OOMs show, not its nominal total.

A device's nominal memory is more than a run can use (the CUDA context, the allocator's caching
and fragmentation), and near the limit an OOM comes and goes from one run to the next. So a trial
that ran out of memory says the usable memory is below what it needed. What it needed is not
measured (it failed); it is estimated from the peaks the search's other trials measured: its own
configuration's at other micro-batches, moved by the bytes a sample takes (fitted from trials of
its stage), or, failing those, a configuration of its stage that differs only in bucket sizes and
overlap, moved by DeepSpeed's estimate of the bucket memory between them. The least such estimate
bounds the usable memory from above (an OOM that needed more than the device has says nothing);
the largest peak any run completed with bounds it from below, and that is what a run may count
on: ``--memory-margin`` applies to it (TrialTracker.memory_limit). Counting on more (the middle
of the bracket) handed over configurations a hair over the margin of the true limit.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections.abc import Sequence
from typing import Any

from dsat.constants import MEMORY_RAN_OUT
from dsat.memory import Precision, section_bucket_bytes
from dsat.trial import TrialKind, TrialRecord, TrialStatus
from dsat.zero_space import BUCKET_SIZES, section_key

# An OOM that needed less than this share of the device says nothing of its memory either: not
# this configuration's peak but something else ran out (another process on the device, a leak,
# an OOM a test injects on the CPU), and a margin below it would refuse every configuration.
MIN_OOM_SHARE = 0.5
# Knobs whose values move only bucket memory, which DeepSpeed's estimate accounts for.
BUCKET_KNOBS = ("reduce_bucket_size", "allgather_bucket_size", "overlap_comm")


def _peak(record: TrialRecord) -> float | None:
    peak = record.metrics.get("memory_peak_bytes")
    if record.status is not TrialStatus.COMPLETED or not isinstance(peak, (int, float)):
        return None
    return float(peak)


def largest_peak(records: Sequence[TrialRecord]) -> float | None:
    """The most memory any run completed with (the model profile aside): a lower bound on what is
    usable."""
    peaks = [_peak(r) for r in records if r.kind is not TrialKind.MODEL_PROFILE]
    return max((p for p in peaks if p is not None), default=None)


def fills_device(peak: float, margin: float, total: float) -> bool:
    """Whether a run that completed with ``peak`` used nearly all of a ``total``-byte device, so
    that, with no OOM placed, the total is what is usable."""
    return peak >= (1 - margin / 2) * total


def _rest(record: TrialRecord) -> str:
    """Its stage and every knob that moves memory in ways the bucket estimate does not see."""
    return section_key({k: v for k, v in record.zero_section.items() if k not in BUCKET_KNOBS})


def _slope(points: list[tuple[int, float]]) -> float | None:
    """Bytes per sample, by least squares over one configuration's (micro-batch, peak)."""
    if len({m for m, _ in points}) < 2:
        return None
    mean_m = statistics.fmean(m for m, _ in points)
    mean_p = statistics.fmean(p for _, p in points)
    spread = sum((m - mean_m) ** 2 for m, _ in points)
    return sum((m - mean_m) * (p - mean_p) for m, p in points) / spread


class PeakModel:
    """Estimates the peak memory of any configuration of the search from the peaks measured."""

    def __init__(self, records: Sequence[TrialRecord]) -> None:
        self.points: dict[str, list[tuple[int, float]]] = {}
        self.sections: dict[str, TrialRecord] = {}
        # What moves each configuration's memory beyond its buckets (_rest), by zero_key.
        self._rests: dict[str, str] = {}
        # The configurations measured, by stage and what moves their memory beyond buckets.
        self.kin: dict[tuple[int, str], list[str]] = {}
        for record in records:
            peak = _peak(record)
            if peak is None or record.kind is TrialKind.MODEL_PROFILE:
                continue
            key = record.zero_key
            self.points.setdefault(key, []).append((record.mbs, peak))
            if key not in self.sections:
                self.sections[key] = record
                self.kin.setdefault((record.zero_stage, self._rest_of(record)), []).append(key)
        profiles = [r for r in records if r.kind is TrialKind.MODEL_PROFILE]
        profile = profiles[-1] if profiles else None  # the fit ladder's last
        metrics: dict[str, Any] = profile.metrics if profile is not None else {}
        self.num_params = metrics.get("num_params")
        self.profile_per_sample = metrics.get("activation_mem_per_gpu")
        self.profile_metrics = metrics
        self._per_sample: dict[int, float | None] = {}
        self._kin_buckets: dict[str, float] = {}  # each measured configuration's bucket bytes

    def _rest_of(self, record: TrialRecord) -> str:
        """_rest of its configuration, worked out once per configuration."""
        if record.zero_key not in self._rests:
            self._rests[record.zero_key] = _rest(record)
        return self._rests[record.zero_key]

    def per_sample(self, stage: int) -> float | None:
        """Bytes a sample adds at ``stage`` (worked out once)."""
        if stage not in self._per_sample:
            self._per_sample[stage] = self._fit_per_sample(stage)
        return self._per_sample[stage]

    def _fit_per_sample(self, stage: int) -> float | None:
        """The median of the stage's configurations' fitted slopes, else the profile's
        activations (profiles under-report: an estimate that errs low)."""
        slopes = [
            slope
            for key, points in self.points.items()
            if self.sections[key].zero_stage == stage
            and (slope := _slope(points)) is not None
            and slope > 0
        ]
        if slopes:
            return statistics.median(slopes)
        if isinstance(self.profile_per_sample, (int, float)) and self.profile_per_sample > 0:
            return float(self.profile_per_sample)
        return None

    def needed(self, record: TrialRecord) -> float | None:
        """The peak ``record``'s configuration needs at its micro-batch (None: nothing to go by)."""
        per_sample = self.per_sample(record.zero_stage)
        if per_sample is None:
            return None
        own = self.points.get(record.zero_key)
        if own:
            mbs, peak = min(own, key=lambda point: abs(point[0] - record.mbs))
            return peak + per_sample * (record.mbs - mbs)
        if not isinstance(self.num_params, (int, float)):
            return None
        kin = self.kin.get((record.zero_stage, self._rest_of(record)))
        if not kin:
            return None
        estimates = []
        buckets = self._buckets(record)
        for key in kin:
            mbs, peak = min(self.points[key], key=lambda point: abs(point[0] - record.mbs))
            if key not in self._kin_buckets:
                self._kin_buckets[key] = self._buckets(self.sections[key])
            moved = buckets - self._kin_buckets[key]
            estimates.append(peak + per_sample * (record.mbs - mbs) + moved)
        return min(estimates)

    def _buckets(self, record: TrialRecord) -> float:
        if not isinstance(self.num_params, (int, float)):
            return 0.0
        precision = Precision.of_run(self.profile_metrics, record.ds_config)
        return float(section_bucket_bytes(record.zero_section, precision, int(self.num_params)))


@dataclasses.dataclass(frozen=True)
class UsableMemory:
    """Where the OOMs begin: at or above ``ran`` (the largest peak any run completed) and below
    ``failed`` (the least any OOM'd trial needed, estimated)."""

    failed: float
    ran: float | None

    @property
    def bytes(self) -> float:
        """What a run may count on: the most a run completed with (the usable memory may be a
        little more, but an OOM came before the next run, and a hand-over must be safe), or,
        with none, the least an OOM needed."""
        return self.failed if self.ran is None else self.ran


def usable_memory(records: Sequence[TrialRecord]) -> UsableMemory | None:
    """Where the OOMs seen so far place the usable memory (None when none can be placed, or
    every OOM needed more than the device has, which says nothing its total does not, or less
    than half of it)."""
    failed = [
        r
        for r in records
        if r.status is TrialStatus.OOM
        and r.kind in (TrialKind.SEARCH, TrialKind.CONFIRM)
        and MEMORY_RAN_OUT not in r.metrics  # the host's memory: the GPU's says nothing
    ]
    if not failed:
        return None
    model = PeakModel(records)
    total = min(device_totals(records), default=math.inf)
    levels = [
        level
        for r in failed
        if (level := model.needed(r)) is not None and MIN_OOM_SHARE * total <= level < total
    ]
    if not levels:
        return None
    return UsableMemory(min(levels), largest_peak(records))


def device_totals(records: Sequence[TrialRecord]) -> set[float]:
    """The device memory the trials reported (one size, unless a cluster's nodes differ)."""
    return {
        float(r.metrics["memory_total_bytes"])
        for r in records
        if isinstance(r.metrics.get("memory_total_bytes"), (int, float))
    }


def limit_known(
    records: Sequence[TrialRecord], usable: UsableMemory | None, margin: float, total: float
) -> bool:
    """Whether the usable memory of a ``total``-byte device is known closely enough that no
    memory check could tell more, whatever the leader: with no OOM placed, a run used nearly
    all of the device (the total is what is usable); with one, what ran and what failed are
    within 2% of the device."""
    if usable is None:
        return fills_device(largest_peak(records) or 0.0, margin, total)
    return usable.failed - usable.bytes <= 0.02 * total


def memory_check(
    records: Sequence[TrialRecord],
    usable: UsableMemory | None,
    leader: TrialRecord,
    margin: float,
    allowed: Sequence[int] | None = None,
) -> tuple[dict[str, Any], int] | None:
    """A configuration and micro-batch to run to learn where the OOMs begin, when that decides
    whether ``leader`` may be handed over; None when it does not.

    The margin applies to the memory a run can use, less than the device's total (the CUDA
    context, fragmentation), and only an OOM says how much less. With no OOM placed yet, the
    check aims at 99% of the device's total (if it completes, the total is nearly all usable);
    with more than a sample (or 2% of the device) between the most a run completed with and the
    least an OOM needed, at the middle of that gap (a gap within a sample only when the leader's
    next micro-batch leaves the margin at one end of it and not at the other); none while a run
    near the aim is on its way. It runs the leader's configuration, its
    buckets moved up or down the ladder and its micro-batch raised, whichever the measured
    peaks (and DeepSpeed's estimate of bucket memory) put nearest the aim: a sample can be a
    fifth of the device, a bucket moves memory in smaller steps. Only when the leader's peak is
    within two margins of the limit: further below, where the limit lies does not matter. With
    ``allowed`` (a fixed global batch), only those micro-batches.
    """
    peak = leader.metrics.get("memory_peak_bytes")
    total = leader.metrics.get("memory_total_bytes")
    if not isinstance(peak, (int, float)) or not isinstance(total, (int, float)) or total <= 0:
        return None
    if limit_known(records, usable, margin, total):
        return None
    model = PeakModel(records)
    per_sample = model.per_sample(leader.zero_stage)
    if not per_sample:
        return None
    if usable is None:
        aim, floor, ceiling = 0.99 * total, float(total), float(total)
    else:
        floor = usable.bytes
        if allowed is None and usable.failed - floor <= per_sample:
            # Known to within a sample, unless that sample is the leader's next one: whether
            # the micro-batch above it leaves the margin turns on where in the gap the limit is.
            above = model.needed(leader.replace(mbs=leader.mbs + 1))
            if above is None or not (1 - margin) * floor < above < (1 - margin) * usable.failed:
                return None
        aim, ceiling = (floor + usable.failed) / 2, usable.failed
    if peak < (1.0 - 2 * margin) * floor:
        return None
    for pending in (r for r in records if not r.status.finished):
        need = model.needed(pending)
        if need is not None and need >= (floor + aim) / 2:
            return None  # a run near the aim is on its way: it will tell
    tried = {(r.zero_key, r.mbs) for r in records}  # queued and running ones too
    if allowed is not None:
        return _check_at(
            records, model, leader, tried, allowed, float(peak) / (1 - margin), aim, ceiling
        )
    best: tuple[float, dict[str, Any], int] | None = None
    for section in _bucket_variants(leader.zero_section):
        probe = leader.replace(
            ds_config={**leader.ds_config, "zero_optimization": section},
            hparams={},
        )
        for extra in range(0, 1 + max(1, math.ceil((aim - peak) / per_sample))):
            candidate = probe.replace(mbs=leader.mbs + extra)
            if allowed is not None and candidate.mbs not in allowed:
                continue
            need = model.needed(candidate)
            if need is None or need >= ceiling or (candidate.zero_key, candidate.mbs) in tried:
                continue
            miss = abs(need - aim)
            if best is None or miss < best[0]:
                best = (miss, section, candidate.mbs)
    if best is None or best[0] > 0.5 * per_sample + 0.005 * total:
        return None
    return best[1], best[2]


def _check_at(
    records: Sequence[TrialRecord],
    model: PeakModel,
    leader: TrialRecord,
    tried: set[tuple[str, int]],
    allowed: Sequence[int],
    shows_margin: float,
    aim: float,
    ceiling: float,
) -> tuple[dict[str, Any], int] | None:
    """The memory check where only ``allowed`` micro-batches may run (a fixed global batch):
    the next allowed one is often twice the leader's, far past the limit, so any configuration
    the search ran (or the leader's with other buckets) at any allowed micro-batch may show it.
    A run that completes needing ``shows_margin`` or more shows that the leader leaves the
    margin; one that runs out of memory below ``ceiling`` lowers the known limit. The nearest
    to ``aim`` of those is run; None when there is none."""
    sections = {leader.zero_key: leader.zero_section}
    for section in _bucket_variants(leader.zero_section):
        sections.setdefault(section_key(section), section)
    for record in records:
        if record.kind is TrialKind.SEARCH and _peak(record) is not None:
            sections.setdefault(record.zero_key, record.zero_section)
    best: tuple[float, dict[str, Any], int] | None = None
    for key, section in sections.items():
        probe = leader.replace(
            ds_config={**leader.ds_config, "zero_optimization": section},
            hparams={},
            zero_stage=int(section.get("stage", leader.zero_stage)),
        )
        for mbs in allowed:
            if (key, mbs) in tried:
                continue
            need = model.needed(probe.replace(mbs=mbs))
            if need is None or not shows_margin <= need < ceiling:
                continue
            if best is None or abs(need - aim) < best[0]:
                best = (abs(need - aim), section, mbs)
    return None if best is None else (best[1], best[2])


def _bucket_variants(section: dict[str, Any]) -> list[dict[str, Any]]:
    """``section`` with its bucket sizes anywhere on the ladder (itself first)."""
    if "reduce_bucket_size" not in section:
        return [section]
    variants = [section]
    for reduce, gather in itertools.product(BUCKET_SIZES, BUCKET_SIZES):
        variant = {**section, "reduce_bucket_size": reduce, "allgather_bucket_size": gather}
        if variant != section:
            variants.append(variant)
    return variants
