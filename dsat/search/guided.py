"""The guided search: every trial's result bounds what is still worth trying.

Per configuration (a ZeRO stage with its knobs), the metric against the micro-batch is treated as
a concave curve (dsat.search.concave_curve): the trials run so far bound every untried micro-batch,
and a configuration is tried further only where it can still beat the best result. Memory is
monotone: a micro-batch above one that ran out of memory is never tried, for that configuration or
any that needs no less memory (larger buckets, overlap on); where another configuration ran out,
moved by the bucket memory this one saves, is where this one is expected to. Knobs are searched
by steps around each stage's best configuration (a bucket size one or two rungs up or down, a
switch flipped, overlap on with a smaller reduce bucket), ranked by an optimistic estimate of each
kind of step learned from every pair of tried configurations one step apart (an upper confidence
bound over step kinds). Aligned micro-batches (multiples of 8-64) are probed and modelled, the
leader's memory limit is checked where it decides the hand-over, and every tolerance widens with
the noise the search measured. The search ends when no untried knob step can beat the best by
more than 1% and no untried micro-batch can come within 0.5% of it (both widened by the noise),
leaving the rest of `--max-trials` unspent. docs/search.md has the details.

Everything is derived from the tracker's records, so a resumed search plans the same trials.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import math
from collections.abc import Callable
from typing import Any

from dsat.memory import Offload, section_bucket_bytes
from dsat.search import aligned_micro_batches as aligned
from dsat.search.concave_curve import NOISE as CURVE_NOISE
from dsat.search.concave_curve import CurveEvidence, Gap, best_possible, next_gap
from dsat.search.confirmation import leaders, repeated_measurements
from dsat.search.denoised_ranking import estimates, measured
from dsat.search.fit_ladder import offload_level, with_offload
from dsat.search.measurement_noise import noise_scale, relative_noise, residuals_of
from dsat.search.method import DsatSearchMethod
from dsat.search.stage3_knobs import hidden_size, stage3_start
from dsat.search.throughput_model import Observation
from dsat.trial import SearchRange, TrialKind, TrialRecord, TrialStatus
from dsat.zero_space import (
    BUCKET_SIZES,
    explicit_zero_config,
    knob_steps,
    needs_no_less_memory,
    searchable_section,
    section_key,
    stage3_ladders,
)

logger = logging.getLogger(__name__)

# Stop once nothing untried can beat the best by more than this (relative).
TOLERANCE = 0.01
# A configuration's micro-batch curve is explored while it may come within this of the best
# measured result, which is itself inflated by the luckiest measurement's noise.
CURVE_TOLERANCE = -0.005
# How much better than its stage's best an untried knob step may be, before any evidence.
STEP_OPTIMISM = 0.045
# Bucket steps come a little after switches: a switch changes how communication is done, a
# bucket step only how it is chunked.
BUCKET_STEP_OPTIMISM = 0.04
# Profiles under-report activations (by 10-30% in practice); bucket memory is counted in
# samples of this many reported activations when a step's micro-batch is chosen.
TYPICAL_UNDER_REPORT = 1.25
# The step that switches overlap on and shrinks the reduce bucket to keep memory level.
PAIRED_STEP = "overlap_comm+reduce_bucket_size"
# The step that shrinks both buckets two rungs at once, offered when the stage's best is held
# back by memory: one bucket alone often frees less than a sample, so each single step runs at
# the best's micro-batch (or out of memory above it) and the larger micro-batch is never tried.
MEMORY_STEP = "reduce_bucket_size+allgather_bucket_size"
# With overlap on, the reduce bucket is kept 4.5 times, so that step frees several samples and
# comes first among untried steps; with overlap off, the paired step above (memory kept level)
# comes first, and shrinking both buckets is an ordinary bucket step.
OVERLAPPED_MEMORY_STEP_OPTIMISM = 0.06
# ZeRO-3's own knobs come after the rest: on most hardware their defaults (or the hidden-size
# rules they start from) are near their best, and stepping them first delayed the steps that
# decide a stage (overlap on the knobs surface, from the 20th to the 43rd trial).
ZERO3_STEP_OPTIMISM = 0.02
# Overlap switched on with a smaller reduce bucket comes before the plain switches: overlap alone
# keeps 4.5 reduce buckets and often runs out of memory (or runs at a smaller micro-batch) where
# the paired step keeps memory level, and once overlap alone became the stage's best the paired
# step was never offered again.
PAIRED_STEP_OPTIMISM = 0.05
# Trials in flight at once: each result changes what is worth trying next.
PARALLEL_TRIALS = 4
# The leaders' neighbours: the estimate decides between the top configurations, and one lucky
# measurement of a configuration tried at a single micro-batch can lead it. So each of the top
# LEADERS distinct configurations by the estimate (within LEADER_SPAN of the best) gets trials of
# its own next to its best micro-batch (NEIGHBOURS, in this order, within its reach) until SUPPORT
# of its trials lie within 2 of it: the curve then averages its noise away. They compete with
# exploring at the value of the best estimate, so they run once nothing promises more. Ranked
# below a leader that has its neighbours, a configuration cannot displace it without rising above
# it first, so only the leaders above the first supported one are checked.
LEADERS = 3
LEADER_SPAN = 0.02
SUPPORT = 3
# Only a leader ahead of the best supported one by more than this is checked: level with it,
# either is as good to hand over (and a plateau of equal configurations is not checked forever).
LEADER_MARGIN = 0.005
# Estimates this close are equal (the fit's rounding): the first found stays the stage's best.
TIE = 1e-4
NEIGHBOURS = (-1, 1, -2, 2)
# Trials of one configuration this many micro-batches apart or closer are near each other.
NEAR = 2
# A stage's steps used to wait until its best configuration's micro-batch curve was settled: on
# noisy surfaces that took ten trials and more, while a step worth 5-10% (overlap on) waited. Now
# a step runs once the best rests on EARLY_STEP_SUPPORT trials within 2 micro-batches of its best
# one (not one lucky measurement), one step of the stage at a time while the curve is open, and
# only steps that keep bucket memory as it is (and the paired step, level by design): what a
# bucket step shows depends on where the memory limit lies, which the settled best tells (or a
# failure seen at it, see HELD_BACK_WITHIN). One that frees memory is worth most at that limit
# (run below it, it shows nothing and is never tried again); one that costs memory runs below it
# as well as it ever will, and a lucky measurement there leads until its own curve runs into the
# limit.
EARLY_STEP_SUPPORT = 2
# A stage's best is held back by memory when its best micro-batch lies within this many of the
# largest that may fit: near the limit the curve rises by less than one measurement's noise per
# micro-batch, so a lucky measurement two below the limit often leads (fp32 surface, seed 1: a
# lucky 30 against a limit at 32), and the step that frees memory was never offered. Where the
# limit is a failure already seen (not the memory model's estimate), that step may run while the
# curve below is still open: what it shows depends only on where the limit lies, which is known.
HELD_BACK_WITHIN = 2
# The paired step runs while a probe of its configuration is still pending (memory stays level,
# so what it shows does not wait on that probe) once the configuration ran at this many
# micro-batches. With four trials in flight a probe was nearly always pending, so the step waited
# until the curve was explored (pressure surface, seed 1: search trial 18, now 15; 100 seeds:
# median trials to 2% 25 -> 21). Run sooner, with the stage's curve pinned by fewer trials, later
# steps' lucky first measurements led more often (pressure, seeds 20-79: handed over within 2%
# 59 of 60 before, 53 at 3, 57 at 4 without the runner-up's steps below).
PAIRED_STEP_TRIALS = 4
# Knob steps start from each stage's best configuration and from its runner-up when that is
# within this of it: one lucky measurement of a step (contiguous gradients off, 3.5% high) made
# it the stage's best, every later step started from it, and the bucket steps that lead to the
# optimum from the configuration it displaced never ran (pressure surface, seed 1). At 2% the
# extra steps exposed more lucky single measurements (noisy 3B, seeds 100-199: 87 of 100 handed
# over within 2%, 91 at 1%, 93 before either change).
RUNNER_UP_SPAN = 0.01


@dataclasses.dataclass
class ConfigState:
    """What the trials of one ZeRO configuration showed."""

    section: dict[str, Any]
    values: dict[int, float] = dataclasses.field(default_factory=dict)  # larger is better
    failed: dict[int, TrialStatus] = dataclasses.field(default_factory=dict)
    pending_mbs: set[int] = dataclasses.field(default_factory=set)  # trials not yet finished
    # Micro-batches that ran but left less than --memory-margin free (never handed over): the
    # bytes each used beyond what leaves the margin, and its peak.
    over_margin: dict[int, tuple[float, float]] = dataclasses.field(default_factory=dict)
    first_index: int = 0  # when the search first tried it
    # The denoised estimate of its trials near the best (guided.estimates), where there is one.
    estimated: dict[int, float] = dataclasses.field(default_factory=dict)

    @property
    def stage(self) -> int:
        return int(self.section["stage"])

    @functools.cached_property
    def key(self) -> str:
        """Its section's identity (zero_space.section_key), worked out once per decision."""
        return section_key(self.section)

    @functools.cached_property
    def family(self) -> tuple[int, int]:
        """Its stage and how much it offloads (fit_ladder.offload_level): configurations that
        differ in what they offload have memory limits apart, so each family has its own best
        and explores its own curve, as a stage does."""
        return self.stage, offload_level(self.section)

    @property
    def pending(self) -> bool:
        return bool(self.pending_mbs)

    def _ranked(self, mbs: int) -> float:
        return self.estimated.get(mbs, self.values[mbs])

    @property
    def best(self) -> float | None:
        return max(self._ranked(m) for m in self.values) if self.values else None

    @property
    def best_micro_batch(self) -> int | None:
        return max(self.values, key=self._ranked) if self.values else None


@dataclasses.dataclass(frozen=True)
class Action:
    value: float  # how good what this trial may show can be (optimistic)
    section: dict[str, Any]
    mbs: int
    reach: int
    kind: str = "curve"  # why: stage, curve, step, aligned, neighbour, memory check

    @property
    def search_range(self) -> SearchRange:
        return SearchRange(1, max(self.reach, 1))


class GuidedSearch(DsatSearchMethod):
    name = "guided"
    # How much wider than on a quiet machine its tolerances are (measurement_noise.noise_scale),
    # worked out again from the records at every decision: not state of its own.
    scale = 1.0

    # ------------------------------------------------------------------ hooks

    def initial_lineages(self) -> list[TrialRecord]:
        return self.plan()

    def after_success(self, record: TrialRecord) -> list[TrialRecord]:
        return self.plan()

    def after_failure(self, record: TrialRecord) -> list[TrialRecord]:
        return self.plan()

    def after_baseline(self) -> list[TrialRecord]:
        # With --max-concurrent-trials 1 the baseline took the only place: nothing was planned,
        # and the search ended at once with "no configuration left to try".
        return self.plan()

    def plan(self) -> list[TrialRecord]:
        """The most promising trials, until the parallel limit is reached."""
        queued: list[TrialRecord] = []
        limit = min(self.settings.max_concurrent_trials, PARALLEL_TRIALS)
        tracker = self.tracker
        while (
            len(tracker.queue) + len(queued) + len(tracker.running) < limit
            and len(tracker.queue) + len(queued) + tracker.num_started < tracker.max_trials
        ):
            action = self.best_action()
            if action is None:
                break
            record = self.register(
                self.make_trial(
                    TrialKind.SEARCH,
                    action.section,
                    action.mbs,
                    search_range=action.search_range,
                )
            )
            if record is None:  # already tried: the evidence says otherwise; stop planning
                break
            logger.debug("guided: %s, %s (value %.4g)", action.kind, record.name, action.value)
            queued.append(record)
        return queued

    # ------------------------------------------------------------------ evidence

    def configs(self) -> dict[str, ConfigState]:
        states: dict[str, ConfigState] = {}
        for record in self.tracker.records:
            if record.kind is not TrialKind.SEARCH:
                continue
            state = states.get(record.zero_key)
            if state is None:
                state = states[record.zero_key] = ConfigState(
                    record.zero_section, first_index=record.index
                )
            value = measured(self.tracker, record)
            if value is not None:
                state.values[record.mbs] = value
                if self.tracker.too_large(record):
                    peak = float(record.metrics["memory_peak_bytes"])
                    limit = self.tracker.memory_limit(float(record.metrics["memory_total_bytes"]))
                    state.over_margin[record.mbs] = (peak - limit, peak)
            elif record.status.failed and not self.tracker.machine_failed_once(record):
                state.failed[record.mbs] = record.status
            elif not record.status.finished:
                state.pending_mbs.add(record.mbs)
        return states

    def estimates(self, states: dict[str, ConfigState]) -> dict[tuple[str, int], float]:
        """The denoised metric of every trial measured near the best (denoised_ranking)."""
        return estimates(
            [
                Observation(key, state.family, mbs, value)
                for key, state in states.items()
                for mbs, value in state.values.items()
            ]
        )

    def noise(
        self, states: dict[str, ConfigState], estimated: dict[tuple[str, int], float]
    ) -> float:
        """One measurement's relative noise, as this search saw it (measurement_noise)."""
        values = {(key, mbs): v for key, state in states.items() for mbs, v in state.values.items()}
        return relative_noise(residuals_of(values, estimated), repeated_measurements(self.tracker))

    def ceiling(self, section: dict[str, Any], states: dict[str, ConfigState]) -> int | None:
        """The largest micro-batch not ruled out: below this configuration's smallest failure,
        and below any OOM (or trial over the margin) of a configuration that needs no more
        memory."""
        bounds = []
        for state in states.values():
            own = state.section == section
            if not own and not needs_no_less_memory(section, state.section):
                continue
            for mbs, status in state.failed.items():
                if own or status is TrialStatus.OOM:
                    bounds.append(mbs - 1)
            # Over the margin is too large too, for it and what needs no less memory.
            bounds.extend(mbs - 1 for mbs in state.over_margin)
        return min(bounds) if bounds else None

    def reach(self, state: ConfigState, states: dict[str, ConfigState]) -> int:
        """The largest micro-batch worth trying: below a known failure; else where the stage's
        other configurations ran out of memory, moved by the bucket memory this one saves; else
        the memory model's estimate (or twice the largest success, once past it)."""
        ceiling = self.ceiling(state.section, states)
        if ceiling is not None:
            return ceiling
        largest = max(state.values, default=0)
        learned = [
            mbs - 1 + max(0, self.samples_freed(other.section, state.section))
            for other in states.values()
            if other.family == state.family
            for mbs, status in other.failed.items()
            if status is TrialStatus.OOM
        ]
        if learned:
            return max(min(learned), largest, 1)
        offload = Offload.of(state.section)
        estimate = max(self.model_reach(state.stage, offload), self.yours_ran(state.stage, offload))
        return max(estimate if largest < estimate else 2 * largest, 1)

    def yours_ran(self, stage: int, offload: Offload) -> int:
        """The micro-batch the user's own config completed at, at this stage or a lower one
        (which keeps more on each GPU) with this offload (0: none): it fits, whatever the
        scaled estimate says. At a fixed global batch whose only divisor under the estimate was
        1, the search ran micro-batch 1 alone and handed over 0.01x the user's run at 4099."""
        return max(
            (
                r.mbs
                for r in self.tracker.finished
                if r.kind is TrialKind.BASELINE
                and r.status is TrialStatus.COMPLETED
                and r.zero_stage <= stage
                and Offload.of(r.zero_section) == offload
            ),
            default=0,
        )

    def model_reach(self, stage: int, offload: Offload) -> int:
        """The memory model's largest micro-batch, scaled by --search-range-factor (below 1 on
        a CPU, where all of the RAM counts as the device's memory and the model allows
        thousands); at least 1."""
        estimate = self.micro_batch_ceiling(stage, offload=offload)
        return max(int(estimate * self.settings.search_range_factor), 1)

    def samples_freed(
        self, before: dict[str, Any], after: dict[str, Any], per_sample: float = 1.0
    ) -> int:
        """How many more samples fit with ``after``'s buckets than with ``before``'s (negative:
        fewer), by DeepSpeed's own estimate of bucket memory and the profile's activations per
        sample times ``per_sample`` (the profile under-reports: 1.0 errs towards higher)."""
        return self.samples_in(self.bytes_freed(before, after), per_sample)

    def samples_in(self, memory: float, per_sample: float) -> int:
        """How many samples' activations ``memory`` bytes hold, by the profile times
        ``per_sample`` (0 without a profile)."""
        profile = self.profile
        if profile is None or profile.activation_mem_per_gpu <= 0:
            return 0
        samples = memory / (profile.activation_mem_per_gpu * per_sample)
        return round(samples)  # to the nearest: half a sample moves the cliff as often as not

    def margin_step_mbs(self, base: ConfigState, mbs: int, section: dict[str, Any]) -> int:
        """Where a knob step from a best that ran over the margin at ``mbs`` runs: the memory
        the step frees first pays for the excess, what is left for more samples."""
        excess, _ = base.over_margin[mbs]
        freed = self.bytes_freed(base.section, section)
        if freed < excess:
            return mbs - self.margin_drop(base, mbs, freed)
        return mbs + self.samples_in(freed - excess, TYPICAL_UNDER_REPORT)

    def bytes_freed(self, before: dict[str, Any], after: dict[str, Any]) -> float:
        """Bucket memory ``after`` saves against ``before`` (DeepSpeed's estimate; negative:
        it costs more)."""
        profile = self.profile
        if profile is None:
            return 0.0
        params = profile.num_params
        return float(self._bucket_bytes(before, params) - self._bucket_bytes(after, params))

    def moves_memory(self, state: ConfigState, section: dict[str, Any]) -> bool:
        """Whether ``section`` keeps more or less bucket memory than ``state``'s configuration,
        or persists more or fewer parameters (which the memory model cannot count: it does not
        know the tensors' sizes)."""
        profile = self.profile
        if profile is None:
            return False
        knob = "stage3_param_persistence_threshold"
        if section.get(knob) != state.section.get(knob):
            return True
        params = profile.num_params
        return self._bucket_bytes(section, params) != self._bucket_bytes(state.section, params)

    def _bucket_bytes(self, section: dict[str, Any], num_params: int) -> int:
        return section_bucket_bytes(section, self.precision, num_params)

    def incumbents(self, states: dict[str, ConfigState]) -> dict[tuple[int, int], ConfigState]:
        """Each family's (stage's, with what it offloads) best configuration so far; among
        equals the first found, so that a plateau of equal results does not keep moving it (and
        its steps)."""
        best: dict[tuple[int, int], ConfigState] = {}
        for state in sorted(states.values(), key=lambda s: s.first_index):
            if state.best is None:
                continue
            current = best.get(state.family)
            if current is None or state.best > (current.best or 0.0) * (1 + TIE):
                best[state.family] = state
        return best

    @staticmethod
    def step_bases(
        incumbents: dict[tuple[int, int], ConfigState], states: dict[str, ConfigState]
    ) -> list[ConfigState]:
        """The configurations knob steps start from: each stage's best, and its runner-up when
        that is within RUNNER_UP_SPAN of it (the first found among equals)."""
        bases: list[ConfigState] = []
        for family in sorted(incumbents):
            best = incumbents[family]
            bases.append(best)
            floor = (best.best or 0.0) * (1 - RUNNER_UP_SPAN)
            rivals = [
                s
                for s in states.values()
                if s.family == family and s is not best and s.best is not None and s.best >= floor
            ]
            if rivals:
                bases.append(max(rivals, key=lambda s: (s.best or 0.0, -s.first_index)))
        return bases

    def evidence(
        self, state: ConfigState, reach: int, states: dict[str, ConfigState], incumbent: ConfigState
    ) -> CurveEvidence:
        """The configuration's own results plus the shape of a related curve of its stage: for a
        stage's best configuration, the best-explored one it shares a micro-batch with, scaled to
        agree there; for one without a success yet, the stage's best, optimistically scaled."""
        borrowed: dict[int, float] = {}
        if state is incumbent:
            donors = [
                other
                for other in states.values()
                if other is not state
                and other.family == state.family
                and any(m in other.values for m in state.values)
            ]
            if donors:
                donor = max(donors, key=lambda d: (len(d.values), d.key))
                shared = [m for m in state.values if m in donor.values]
                ratio = sum(state.values[m] / donor.values[m] for m in shared) / len(shared)
                borrowed = {m: v * ratio for m, v in donor.values.items() if m <= reach}
        else:
            ratio = _ratio(state, incumbent) if state.values else 1.0 + STEP_OPTIMISM
            borrowed = {m: v * ratio for m, v in incumbent.values.items() if m <= reach}
        return CurveEvidence(
            values=dict(state.values),
            reach=reach,
            through_origin=not self.settings.metric.smaller_is_better,
            borrowed=borrowed,
            noise=CURVE_NOISE * self.scale,
        )

    def step_scores(self, states: dict[str, ConfigState]) -> dict[tuple[str, str], list[float]]:
        """What each kind of knob step showed: the log-gains of every pair of tried
        configurations one step apart, compared where both ran."""
        seen: dict[tuple[str, str], list[float]] = {}
        tried = [s for s in states.values() if s.values]
        for a in tried:
            for b in tried:
                differing = sorted(k for k in a.section if a.section[k] != b.section.get(k))
                shared = [m for m in a.values if m in b.values]
                if not shared or set(a.section) != set(b.section):
                    continue
                gain = sum(math.log(a.values[m] / b.values[m]) for m in shared) / len(shared)
                if len(differing) == 1:
                    knob = differing[0]
                    kind = _step_kind(knob, b.section[knob], a.section[knob])
                elif (
                    differing == ["overlap_comm", "reduce_bucket_size"]
                    and a.section["overlap_comm"]
                ):
                    kind = (PAIRED_STEP, "True")
                else:
                    continue
                seen.setdefault(kind, []).append(gain)
        return seen

    def step_value(
        self, scores: dict[tuple[str, str], list[float]], kind: tuple[str, str]
    ) -> float:
        """Optimistic log-gain of a kind of step: the mean seen so far plus a bonus that
        shrinks with the evidence (an upper confidence bound), wider on a noisier machine."""
        gains = scores.get(kind, [])
        mean = sum(gains) / len(gains) if gains else 0.0
        prior = STEP_OPTIMISM if kind[1] in ("True", "False") else BUCKET_STEP_OPTIMISM
        if kind[0].startswith("stage3_"):
            prior = ZERO3_STEP_OPTIMISM
        if kind == (MEMORY_STEP, "overlapped"):
            prior = OVERLAPPED_MEMORY_STEP_OPTIMISM
        if kind == (PAIRED_STEP, "True"):
            prior = PAIRED_STEP_OPTIMISM
        return mean + self.scale * prior / math.sqrt(1 + len(gains))

    # ------------------------------------------------------------------ choosing

    def best_action(self) -> Action | None:
        states = self.configs()
        # The best there is, denoised: the luckiest single measurement would end the search early.
        estimated = self.estimates(states)
        for (key, mbs), value in estimated.items():
            states[key].estimated[mbs] = value  # each stage's best, and its best micro-batch
        self.scale = noise_scale(self.noise(states, estimated))
        tolerance, curve_tolerance = TOLERANCE * self.scale, CURVE_TOLERANCE * self.scale
        incumbents = self.incumbents(states)
        top = max(estimated.values(), default=0.0)
        actions: list[Action] = []

        for stage in self.zero_stages:
            for offload in self.offload_space(stage):
                users = searchable_section(self._user_zero_section(), stage)
                section = explicit_zero_config(with_offload(users, offload), stage)
                if stage == 3:  # ZeRO-3's own knobs, from the hidden size where the user set none
                    start = self.stage3_start()
                    mine = {
                        k: v
                        for k, v in section.items()
                        if k not in start or (isinstance(v, (int, float)) and v > 0)
                    }  # HF's "auto" is a value guided cannot step
                    section = {**start, **mine}
                if any(s.family == (stage, offload_level(section)) for s in states.values()):
                    continue
                reach = self.model_reach(stage, Offload.of(section))
                # A time (latency) is least at the smallest micro-batch: start there, not in
                # the middle, where a rate is best (the curve's other side was never tried).
                first = 1 if self.settings.metric.smaller_is_better else (1 + reach) // 2
                actions.append(Action(math.inf, section, first, reach, "stage"))

        curves: dict[str, tuple[int, CurveEvidence, Gap | None]] = {}

        def curve(state: ConfigState) -> tuple[int, CurveEvidence, Gap | None]:
            """Its reach, its evidence and its next gap, worked out once per decision."""
            key = state.key
            if key not in curves:
                reach = self.reach(state, states)
                evidence = self.evidence(state, reach, states, incumbents.get(state.family, state))
                gap = next_gap(evidence, curve_tolerance, top, self.spec.micro_batches)
                curves[key] = (reach, evidence, gap)
            return curves[key]

        for key in sorted(states):
            state = states[key]
            incumbent = incumbents.get(state.family)
            if state.pending:
                continue
            if state.values and incumbent is not None and state is not incumbent:
                if _ratio(state, incumbent) <= 1 + tolerance:
                    continue  # it lost to its stage's best where both ran
            reach, _, gap = curve(state)
            if reach < 1 or gap is None:
                continue
            actions.append(Action(gap.bound, state.section, self.probe(state, gap), reach))

        scores = self.step_scores(states)
        for base in self.step_bases(incumbents, states):
            best_mbs, best_value = base.best_micro_batch, base.best
            assert best_mbs is not None and best_value is not None
            if base.pending and len(base.values) < PAIRED_STEP_TRIALS:
                continue
            # While a probe of it is pending only the paired step runs: memory stays level, so
            # what it shows does not wait on the probe.
            paired_only = base.pending
            reach, evidence, gap = curve(base)
            # Steps are compared at its best micro-batch: while that may still move, only a
            # well-supported best gets steps, and only those that keep bucket memory level (or
            # any, once a failure has shown where the memory holding it back runs out).
            unsettled = gap is not None
            if unsettled and self.support(base, best_mbs) < EARLY_STEP_SUPPORT:
                continue
            stage_steps: list[Action] = []
            potential = best_possible(evidence)
            held_back = self.held_back(best_mbs, reach)
            limit_seen = held_back and self.ceiling(base.section, states) is not None
            for knob, value, section in memory_aware_steps(
                base.section, held_back, self.stage3_ladders()
            ):
                if knob == PAIRED_STEP:
                    kind: tuple[str, str] = (PAIRED_STEP, "True")
                elif knob == MEMORY_STEP:
                    kind = (
                        MEMORY_STEP,
                        "down" if base.section.get("overlap_comm") is False else "overlapped",
                    )
                else:
                    kind = _step_kind(knob, base.section[knob], value)
                if section_key(section) in states or (paired_only and knob != PAIRED_STEP):
                    continue
                changes_memory = knob != PAIRED_STEP and self.moves_memory(base, section)
                if unsettled and changes_memory and not limit_seen:
                    continue  # shown for what it is only at the settled best's memory limit
                ceiling = self.ceiling(section, states)
                mbs = best_mbs
                if held_back:
                    # The stage's best is held back by memory: run the step where the memory it
                    # frees (or costs) puts its own cliff.
                    if best_mbs in base.over_margin:  # and, first, leave the margin free
                        mbs = self.margin_step_mbs(base, best_mbs, section)
                    else:
                        mbs += self.samples_freed(base.section, section, TYPICAL_UNDER_REPORT)
                mbs = max(1, mbs if ceiling is None else min(mbs, ceiling))
                if ceiling is not None and ceiling < 1:
                    continue
                gain = math.exp(self.step_value(scores, kind))
                if potential * gain <= top * (1 + tolerance):
                    continue
                # Ranked by what the step can show where it runs: the stage's best micro-batch.
                step_reach = ceiling if ceiling is not None else reach
                stage_steps.append(
                    Action(best_value * gain, section, mbs, max(step_reach, mbs), "step")
                )
            if (unsettled or paired_only) and stage_steps:
                # One at a time: each is a bet on a best micro-batch that may still move (the
                # base's own probe aside, which the paired step does not depend on).
                busy = any(
                    s.pending for s in states.values() if s.family == base.family and s is not base
                )
                stage_steps = [] if busy else [max(stage_steps, key=lambda a: a.value)]
            actions.extend(stage_steps)

        actions.extend(self.neighbour_actions(states, estimated, top))
        actions.extend(self.aligned_actions(states, incumbents, top, curve))
        probe = self.memory_probe(states)
        if probe is not None:
            actions.append(probe)

        if self.spec.micro_batches is not None:
            actions = self.keeping_the_batch(actions)
        worth = [a for a in actions if a.value > top * (1 + min(tolerance, curve_tolerance))]
        if not worth:
            return None
        return max(worth, key=lambda a: a.value)

    # ------------------------------------------------------------------ nearby micro-batches
    # Near means within 2 micro-batches; with a fixed global batch, where only the divisors of
    # the batch per rank run (16, 32, 64, ...), the allowed ones next to each other.

    def _allowed_index(self, mbs: int) -> int | None:
        allowed = self.spec.micro_batches
        return None if allowed is None or mbs not in allowed else allowed.index(mbs)

    def near(self, one: int, other: int) -> bool:
        i, j = self._allowed_index(one), self._allowed_index(other)
        if i is None or j is None:
            return abs(one - other) <= NEAR
        return abs(i - j) <= 1

    def support(self, state: ConfigState, mbs: int, with_pending: bool = False) -> int:
        """How many of the configuration's trials ran (or, ``with_pending``, are running) near
        ``mbs``."""
        tried = [*state.values, *state.pending_mbs] if with_pending else list(state.values)
        return sum(1 for m in tried if self.near(m, mbs))

    def neighbours(self, mbs: int) -> list[int]:
        """The micro-batches next to ``mbs``, nearest first."""
        index, allowed = self._allowed_index(mbs), self.spec.micro_batches
        if index is None or allowed is None:
            return [mbs + offset for offset in NEIGHBOURS]
        return [allowed[i] for i in (index - 1, index + 1) if 0 <= i < len(allowed)]

    def held_back(self, best_mbs: int, reach: int) -> bool:
        """Whether a stage's best micro-batch sits at what memory lets it reach."""
        if self.spec.micro_batches is None:
            return best_mbs >= reach - HELD_BACK_WITHIN
        return self.spec.allowed_micro_batch(best_mbs + 1, best_mbs + 1, reach) is None

    def keeping_the_batch(self, actions: list[Action]) -> list[Action]:
        """With a fixed global batch, each action at the micro-batch it would run (the allowed
        one nearest its own, within its reach: ``make_trial``); those that would repeat a trial
        are dropped, so the next best is chosen instead."""
        kept: list[Action] = []
        for action in actions:
            record = self.make_trial(
                TrialKind.SEARCH,
                action.section,
                action.mbs,
                search_range=action.search_range,
            )
            if record is not None and not self.tracker.is_repeat(record):
                kept.append(dataclasses.replace(action, mbs=record.mbs))
        return kept

    def probe(self, state: ConfigState, gap: Gap) -> int:
        """Where to try a gap: its middle, moved to the most aligned micro-batch near it
        (aligned_micro_batches.snap); but right below a trial that ran over the margin, the
        largest micro-batch that may leave it, where a rising curve is best."""
        if self.spec.micro_batches is not None:  # a fixed batch: the allowed one nearest its middle
            middle = (gap.lo + gap.hi) // 2
            return self.spec.allowed_micro_batch(middle, gap.lo, gap.hi) or middle
        if gap.hi + 1 not in state.over_margin:
            return aligned.snap(gap.lo, gap.hi)
        return max(gap.lo, gap.hi + 1 - self.margin_drop(state, gap.hi + 1))

    def aligned_actions(
        self,
        states: dict[str, ConfigState],
        incumbents: dict[tuple[int, int], ConfigState],
        top: float,
        curve: Callable[[ConfigState], tuple[int, CurveEvidence, Gap | None]],
    ) -> list[Action]:
        """Aligned micro-batches next to each stage's best (aligned_micro_batches): valued at
        the best's curve there, lifted by what aligned trials showed so far, while that can
        beat the best by the tolerance."""
        lift = math.exp(aligned.optimism(aligned.gains({k: s.values for k, s in states.items()})))
        actions: list[Action] = []
        for base in incumbents.values():
            best_mbs = base.best_micro_batch
            if best_mbs is None:
                continue
            reach, _, _ = curve(base)
            for mbs in aligned.candidates(best_mbs, reach):
                if mbs in base.values or mbs in base.failed or mbs in base.pending_mbs:
                    continue
                value = _value_at(base, mbs) * lift
                if value > top * (1 + TOLERANCE * self.scale):
                    actions.append(Action(value, base.section, mbs, reach, "aligned"))
        return actions

    @staticmethod
    def margin_drop(state: ConfigState, mbs: int, freed: float = 0.0) -> int:
        """How many micro-batches below ``mbs``, where it ran over the margin, the configuration
        (with ``freed`` bytes of bucket memory less) may first leave the margin free: the fewest,
        since memory grows with the micro-batch at most in proportion."""
        excess, peak = state.over_margin[mbs]
        if freed >= excess:
            return 0
        return max(1, math.ceil((excess - freed) * mbs / peak))

    def neighbour_actions(
        self, states: dict[str, ConfigState], estimated: dict[tuple[str, int], float], top: float
    ) -> list[Action]:
        """Trials next to the leaders' best micro-batches, so that the estimate that ranks them
        (and hands one over) rests on more than one possibly lucky measurement of each."""
        ranked: list[tuple[float, str, int]] = sorted(
            ((value, key, mbs) for (key, mbs), value in estimated.items()), reverse=True
        )
        unsupported: list[tuple[float, ConfigState, int]] = []
        seen: set[str] = set()
        anchor = 0.0  # the best estimate of a configuration that already has its neighbours
        for value, key, mbs in ranked:
            if key in seen:
                continue
            seen.add(key)
            if value < top * (1 - LEADER_SPAN * self.scale):
                break
            state = states[key]
            if self.support(state, mbs, with_pending=True) >= SUPPORT:
                anchor = value
                break  # those below it cannot displace it without rising above it first
            if len(unsupported) < LEADERS:
                unsupported.append((value, state, mbs))
        actions: list[Action] = []
        for value, state, mbs in unsupported:
            if value <= anchor * (1 + LEADER_MARGIN * self.scale):
                continue  # level with a supported leader: either is as good to hand over
            reach = self.reach(state, states)
            for probe in self.neighbours(mbs):
                if probe < 1 or probe > reach or probe in state.values:
                    continue
                if probe in state.failed or probe in state.pending_mbs:
                    continue
                actions.append(Action(top, state.section, probe, reach, "neighbour"))
                break
        return actions

    def memory_probe(self, states: dict[str, ConfigState]) -> Action | None:
        """A trial that shows where the OOMs begin, as soon as the leader sits near a limit that
        is not known closely enough (usable_memory.memory_check): the search then steers by the
        memory a run can use, not the device's total."""
        if self.tracker.confirmed_id is not None:
            return None  # the search is over
        check = self.memory_check()
        if check is None:
            return None
        section, mbs = check
        return Action(math.inf, section, mbs, mbs, "memory check")

    def hidden_size(self) -> int:
        profile = self.profile
        return hidden_size(self.spec.hparams, profile.num_params if profile is not None else 0)

    def stage3_start(self) -> dict[str, Any]:
        """ZeRO-3's knobs where guided starts them: from the model's hidden size."""
        return stage3_start(self.hidden_size())

    def stage3_ladders(self) -> dict[str, tuple[Any, ...]]:
        return stage3_ladders(self.hidden_size())

    # ------------------------------------------------------------------ handing over

    def pick(self) -> TrialRecord | None:
        """What the search would hand over now: the confirmed trial once there is one, else the
        leader by the denoised estimate."""
        if self.tracker.confirmed_id is not None:
            return self.tracker.best()
        ranked = leaders(self.tracker, 1, self.leader_score())
        return ranked[0] if ranked else None


def memory_aware_steps(
    config: dict[str, Any],
    held_back: bool = False,
    stage3: dict[str, tuple[Any, ...]] | None = None,
) -> list[tuple[str, Any, dict[str, Any]]]:
    """Every single-knob step, plus overlap switched on with a reduce bucket small enough that
    the bucket memory stays the same: overlap keeps 4.5 copies of the reduce bucket, so alone
    it often runs out of memory where it would help. When ``held_back`` (the configuration's
    best micro-batch is at or just below its memory limit), also both buckets two rungs down at
    once, so that enough memory is freed for a larger micro-batch."""
    steps = [(knob, value, {**config, knob: value}) for knob, value in knob_steps(config, stage3)]
    if config.get("overlap_comm") is False and "reduce_bucket_size" in config:
        smaller = [b for b in BUCKET_SIZES if b <= config["reduce_bucket_size"] / 4.5]
        if smaller:
            paired = {**config, "overlap_comm": True, "reduce_bucket_size": max(smaller)}
            steps.append((PAIRED_STEP, True, paired))
    buckets = ("reduce_bucket_size", "allgather_bucket_size")
    if held_back and all(b in config for b in buckets):
        shrunk = {**config}
        for bucket in buckets:
            below = sorted((b for b in BUCKET_SIZES if b < config[bucket]), reverse=True)
            shrunk[bucket] = below[min(1, len(below) - 1)] if below else config[bucket]
        if all(shrunk[b] < config[b] for b in buckets):
            steps.append((MEMORY_STEP, "down", shrunk))
    return steps


def _step_kind(knob: str, before: Any, after: Any) -> tuple[str, str]:
    """A step's kind: the knob, and which way it went (a switch's new value)."""
    if isinstance(after, bool):
        return knob, str(after)
    return knob, "up" if after > before else "down"


def _value_at(state: ConfigState, mbs: int) -> float:
    """The configuration's value at ``mbs``, interpolated between its results (0 at 0)."""
    points = sorted([(0, 0.0), *state.values.items()])
    for (m1, y1), (m2, y2) in itertools.pairwise(points):
        if m1 <= mbs <= m2:
            return y1 + (y2 - y1) * (mbs - m1) / (m2 - m1)
    return points[-1][1]


def _ratio(state: ConfigState, reference: ConfigState) -> float:
    """How ``state`` compares with ``reference`` where ``state`` ran (geometric mean)."""
    logs = [math.log(v / _value_at(reference, m)) for m, v in state.values.items()]
    return math.exp(sum(logs) / len(logs))
