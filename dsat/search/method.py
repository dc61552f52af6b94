"""What every dsat search method shares: the hooks a method overrides, and building its trials.

A method is pure: no processes, files (except its own state when asked to save), or clocks. Its
randomness comes from one numpy generator seeded by `--random-seed`, so the same seed and the same
events give the same trials, and its whole state is JSON (method_state.py), so a search resumes
where it stopped.

It speaks dsat's search protocol (protocol.py): ``suggest`` hands out the next queued trial,
``observe`` records an outcome and queues what the hooks return. Subclasses decide only what to
try after the model profile, a success and a failure (each hook returns the trials it built, and
those are queued), and which queued trial to start first. Trial records are built by
trial_builder.py; ending.py decides when the search is over and what is handed over.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from dsat.memory import (
    ModelProfile,
    ModelProfileError,
    Offload,
    Precision,
    approx_max_micro_batch,
    determined_max_micro_batch,
    fits_at_one,
    log_estimates,
)
from dsat.search.baseline import baseline_line, baseline_trial
from dsat.search.confirmation import Score, leaders
from dsat.search.denoised_ranking import denoised_score
from dsat.search.ending import SearchEnding, no_search_trial_succeeded, repeated_failure
from dsat.search.fit_ladder import (
    CHECKPOINTING_HPARAM,
    FitRung,
    ladder,
    offload_choices,
    offload_level,
    what_it_takes,
    with_offload,
    with_offload_of,
)
from dsat.search.ignored_batch import same_inputs_line
from dsat.search.method_settings import MethodSettings
from dsat.search.method_state import load_state_json, state_json
from dsat.search.protocol import SearchMethod
from dsat.search.short_batches import short_batches_line
from dsat.search.tracker import TrialTracker, config_key
from dsat.search.trial_builder import SearchSpec, TrialBuilder
from dsat.search.usable_memory import device_totals, limit_known, memory_check
from dsat.trial import SearchRange, TrialKind, TrialOutcome, TrialRecord, TrialStatus
from dsat.trial_failure import FailureCause
from dsat.zero_space import random_zero_config

logger = logging.getLogger(__name__)

# A memory model's largest micro-batch per stage, from the profile (dsat.memory).
CeilingEstimate = Callable[[ModelProfile, Precision, int, Offload], dict[int, int]]
# Bounds the draws for a configuration that was not tried yet, once the space runs dry.
MAX_DRAWS = 50


class DsatSearchMethod(SearchMethod):
    name = "base"

    def __init__(self, settings: MethodSettings, spec: SearchSpec) -> None:
        self.settings = settings
        self.spec = spec
        self.tracker = TrialTracker(
            metric=settings.metric,
            max_trials=settings.max_trials,
            max_concurrent_trials=settings.max_concurrent_trials,
            max_slots=settings.max_slots,
            slots_per_trial=spec.slots_per_trial,
            memory_margin=settings.memory_margin,
        )
        self.rng = np.random.default_rng(settings.random_seed)
        self.builder = TrialBuilder(
            spec, settings.random_seed, settings.start_profile_step, settings.end_profile_step
        )
        # What it takes to fit, tried in order while the model profile runs out of memory.
        self.fit_rungs = ladder(
            spec.user_config, spec.hparams, settings.zero_stages, settings.offload_nvme
        )
        self.next_index = 0
        self.ending = SearchEnding()
        # Whether an outcome (or a resume) came since the ending was last asked: the stop rules
        # run once per outcome, before the trials that outcome lets start.
        self.outcome_pending = False
        self._interrupted: set[str] = set()  # running when the search stopped, put back by resume
        self._finished = False
        # The precision worked out from the model profile's record (records are frozen: a new
        # one, or none, is worked out again).
        self._precision_of: tuple[TrialRecord | None, Precision] | None = None

    # ------------------------------------------------------------------ the protocol

    def suggest(self) -> TrialRecord | None:
        if self._finished:
            return None
        if not len(self.tracker):  # a new search: the model profile comes first, alone
            record = self.register(self.make_trial(TrialKind.MODEL_PROFILE, None, 1))
            assert record is not None  # the first trial cannot be a repeat
            return self.tracker.mark_running(record.request_id)
        for _ in range(2):
            if self.outcome_pending:
                self.outcome_pending = False
                if self.ending.should_shutdown(self):
                    logger.debug("search ends: %s", self.shutdown_reason)  # the launch says why
                    self._finished = True
                    return None
            if not self.tracker.can_start_more():
                return None
            request_id = self._next_queued()
            if request_id is not None:
                self.tracker.dequeue(request_id)
                return self.tracker.mark_running(request_id)
            if self.tracker.running or not self.tracker.queue:
                return None
            # Nothing queued was worth its run, nor any replacement drawn, and nothing running
            # can change that: no configuration is left to try. The stop rules say so (and start
            # the confirmation round); without them the search ended with no reason, unconfirmed.
            logger.info("no queued configuration is worth its run: the search ends")
            for queued in list(self.tracker.queue):
                self.tracker.discard(queued)
            self.outcome_pending = True
        return None

    def observe(self, outcome: TrialOutcome) -> None:
        request_id = outcome.request_id
        if self.tracker.get(request_id).status.finished:
            # On a cluster a trial that reported its metrics can still be marked errored while
            # DeepSpeed's exit races the Close: the first outcome stands.
            logger.info("ignoring a second outcome for finished trial %s", request_id)
            return
        self.outcome_pending = True
        if outcome.status is not TrialStatus.COMPLETED:
            record = self.tracker.mark_finished(
                request_id,
                outcome.status,
                error=outcome.error,
                cause=outcome.cause,
                log=outcome.log,
            )
            if self.tracker.machine_failed_once(record):
                # The machine's fault, not the config's: run it again; where it is queued
                # already, go on as after any other end.
                self._follow_up(lambda: self.rerun(record) or self.after_failure(record))
            elif record.kind is TrialKind.SEARCH:
                self._follow_up(lambda: self.after_failure(record))
            elif record.kind is TrialKind.BASELINE:
                self._follow_up(self.after_baseline)
            elif record.kind is TrialKind.MODEL_PROFILE and self.next_fit_rung() is not None:
                self._follow_up(self.climb)
            return
        record = self.tracker.mark_finished(
            request_id, TrialStatus.COMPLETED, outcome.metrics, log=outcome.log
        )
        if record.kind is TrialKind.MODEL_PROFILE:
            profile = self.profile
            if profile is not None:
                rung = self.fit_rung
                if rung.profile_stage is not None:
                    logger.info("the model fits at micro-batch 1 with %s", rung.name)
                log_estimates(
                    profile,
                    self.precision,
                    self.spec.slots_per_trial,
                    self.zero_stages,
                    rung.offload,
                )
                if self.settings.baseline:
                    self._queue(functools.partial(baseline_trial, self))
                self._follow_up(self.initial_lineages)
        elif record.kind is TrialKind.BASELINE:
            self._follow_up(self.after_baseline)
        elif record.kind is TrialKind.SEARCH and self.tracker.too_large(record):
            # It ran, but leaves less than --memory-margin free: to the search, too large.
            self._follow_up(lambda: self.after_failure(record))
        elif record.kind is TrialKind.SEARCH:
            self._follow_up(lambda: self.after_success(record))

    def planned_trials(self) -> int:
        """The most trials the search plans as far as it knows now: --max-trials, the user's
        baseline (on top, once the model profile queues it) and the confirmation round's runs
        until it starts. "5 of at most 5 trials" went on to "6 of at most 8"."""
        tracker = self.tracker
        planned = tracker.max_trials
        kinds = {r.kind for r in tracker.records}
        profile = tracker.model_profile
        if (
            self.settings.baseline
            and TrialKind.BASELINE not in kinds
            and (profile is None or not profile.status.finished)
        ):
            planned += 1
        if self.settings.confirm_top > 1 and TrialKind.CONFIRM not in kinds and not self.finished:
            planned += self.settings.confirm_top
        return planned

    def trial_length(self, record: TrialRecord) -> int:
        if record.kind is TrialKind.MODEL_PROFILE:
            return 1
        return self.builder.last_measured_step + 1

    def resume(self) -> None:
        interrupted = [r.request_id for r in self.tracker.running]
        self.tracker.requeue(interrupted)
        # They run again as they were: the uninterrupted search ran them, and judged again by
        # results that came after they started, some were dropped and new draws took their place.
        self._interrupted = set(interrupted)
        self.outcome_pending = True

    def abandon(self, request_id: str, reason: str) -> None:
        """End the search because ``request_id`` was stopped from outside (Determined's
        'canceled' or 'invalid hyperparameters'), as the reference does: no search trial is
        worth starting after it. The trial's end is not its configuration's (a user stopped
        it), and the search is not confirmed: no full experiment follows."""
        record = self.tracker.get(request_id)
        if not record.status.finished:
            self.tracker.mark_finished(
                request_id, TrialStatus.ERROR, error=reason, cause=FailureCause.MACHINE
            )
        self.ending.shutdown_reason = reason
        self.ending.stopped_from_outside = True
        self._finished = True

    def ended(self) -> None:
        """Mark a search loaded from a state saved after it finished as finished: a search
        runner restarted after its Shutdown read as stopped from outside."""
        self._finished = True

    @property
    def finished(self) -> bool:
        return self._finished

    def state_json(self) -> dict[str, Any]:
        return state_json(self)

    def load_state_json(self, state: dict[str, Any]) -> None:
        load_state_json(self, state)

    def _follow_up(self, hook: Callable[[], list[TrialRecord]]) -> None:
        """Queue what ``hook`` returns, while the search has room for it and goes on."""
        tracker = self.tracker
        if self.ending.confirming(self):
            return  # the search is over; only the confirmation round (and its checks) runs
        # The budget: --max-trials, and the trials added on top of it (the user's baseline).
        room = len(tracker.queue) + tracker.num_started < tracker.max_trials
        if room and self.ending.stop_reason(self) is None:
            self._queue(hook)

    def _queue(self, hook: Callable[[], list[TrialRecord]]) -> None:
        """Queue the trials ``hook`` built, in its order; every trial it registered must be among
        them (one left out would be counted as proposed and never run)."""
        first_index = self.next_index
        records = hook()
        built = {r.index for r in self.tracker.records if r.index >= first_index}
        if {r.index for r in records} != built:
            raise RuntimeError(f"{type(self).__name__}: a hook registered trials it did not return")
        self.tracker.enqueue([r.request_id for r in records])

    def _next_queued(self) -> str | None:
        """The queued trial to start (``choose_next``), after replacing, as the method asks, queued
        trials no longer worth running."""
        for _ in range(MAX_DRAWS):
            request_id = self.choose_next()
            if request_id is None:
                return None
            record = self.tracker.get(request_id)
            if request_id in self._interrupted or self.worth_running(record):
                self._interrupted.discard(request_id)
                return request_id
            self.tracker.discard(request_id)
            self._queue(functools.partial(self.replacement, record))
        return None

    # ------------------------------------------------------------------ hooks for subclasses

    def initial_lineages(self) -> list[TrialRecord]:
        """Trials to queue once the model profile is known: one lineage per concurrent slot."""
        count = min(self.settings.max_concurrent_trials, self.settings.max_trials - 1)
        if self.settings.max_slots is not None:
            count = min(count, max(self.settings.max_slots // self.spec.slots_per_trial, 1))
        return [t for t in (self.new_lineage() for _ in range(count)) if t is not None]

    def after_success(self, record: TrialRecord) -> list[TrialRecord]:
        """What to try after ``record`` succeeded, built by ``continue_lineage`` or
        ``new_lineage`` (which register it); what is returned is queued."""
        raise NotImplementedError

    def after_failure(self, record: TrialRecord) -> list[TrialRecord]:
        """What to try after ``record`` ran out of memory or failed; queued as returned."""
        raise NotImplementedError

    def after_baseline(self) -> list[TrialRecord]:
        """What to try once the user's own config has run: a method whose first trials waited
        for its slot plans them now (none by default: the others queue theirs at once)."""
        return []

    def choose_next(self) -> str | None:
        """The queued trial to start now (first come, first served), or None for none."""
        return self.tracker.queue[0] if self.tracker.queue else None

    def worth_running(self, record: TrialRecord) -> bool:
        """Whether a queued trial is still worth its run, now that it is its turn."""
        return True

    def replacement(self, dropped: TrialRecord) -> list[TrialRecord]:
        """What to queue instead of a trial no longer ``worth_running``."""
        return []

    def early_stopping_triggered(self) -> bool:
        return False

    def choose_stage(self) -> int:
        stages = self.live_stages()
        return int(stages[int(self.rng.integers(len(stages)))])

    def live_stages(self) -> list[int]:
        """The stages of ``--zero-stages`` still worth a configuration: not one where two
        configurations ran out of memory at micro-batch 1 and none ran (the model's states alone
        do not fit; buckets cannot make up for that). All of them if none is left."""
        dead = set()
        for stage in self.zero_stages:
            in_stage = [
                r
                for r in self.tracker.records
                if r.kind is TrialKind.SEARCH and r.zero_stage == stage
            ]
            at_one = {config_key(r) for r in in_stage if r.status is TrialStatus.OOM and r.mbs == 1}
            if len(at_one) >= 2 and stage not in self.tracker.successful_stages:
                dead.add(stage)
        return [s for s in self.zero_stages if s not in dead] or list(self.zero_stages)

    def untried_stage(self) -> int | None:
        """A stage a new configuration must take before any other is chosen; None for any."""
        return None

    def initial_range(self, stage: int, offload: Offload | None = None) -> SearchRange:
        """The whole range of Determined DSAT's own memory estimate, as the reference starts every
        configuration: where the binary searches' midpoints land against the memory cliff decides
        much of what asha and binary find (benchmarks/README.md). ``offload``: what the
        configuration keeps off the GPU (the fit rung's unless told)."""
        ceiling = self.micro_batch_ceiling(stage, determined_max_micro_batch, offload)
        hi = max(int(ceiling * self.settings.search_range_factor), 1)
        if self.spec.micro_batches is not None:  # a fixed global batch: none runs above it
            hi = min(hi, self.spec.micro_batches[-1])
        return SearchRange(1, hi)

    def first_micro_batch(self, search_range: SearchRange) -> int:
        return search_range.midpoint

    def used_up(self, search_range: SearchRange) -> bool:
        """Whether ``search_range`` holds no micro-batch to run (with a fixed global batch, none
        that keeps it)."""
        lo, hi = search_range.lo, search_range.hi
        return search_range.empty or self.spec.allowed_micro_batch(lo, lo, hi) is None

    def leader_score(self) -> Score | None:
        """How the confirmation round ranks its leaders and picks its winner (and so what is
        handed over): by each trial's metric denoised by its stage's other trials, not the
        single, possibly lucky, measurement (dsat.search.denoised_ranking)."""
        return denoised_score(self.tracker)

    # ------------------------------------------------------------------ building trials

    @property
    def precision(self) -> Precision:
        """What the trials run at: the model profile's report, else the user's config."""
        record = self.tracker.model_profile
        known = self._precision_of
        if known is not None and known[0] is record:  # asked for every memory estimate
            return known[1]
        metrics = record.metrics if record is not None else {}
        precision = Precision.of_run(metrics, self.spec.ds_config)
        self._precision_of = (record, precision)
        return precision

    @property
    def profile(self) -> ModelProfile | None:
        record = self.tracker.model_profile
        if record is None or record.status is not TrialStatus.COMPLETED:
            return None
        try:
            return ModelProfile.from_metrics(record.metrics)
        except ModelProfileError:
            return None

    def micro_batch_ceiling(
        self,
        stage: int,
        estimate: CeilingEstimate = approx_max_micro_batch,
        offload: Offload | None = None,
    ) -> int:
        """The largest micro-batch ``estimate`` (dsat's memory model unless told) allows at
        ``stage`` with ``offload`` (the fit rung's least unless told); 1 before the model
        profile is known."""
        profile = self.profile
        if profile is None:
            return 1
        offload = self.fit_rung.offload if offload is None else offload
        return estimate(profile, self.precision, self.spec.slots_per_trial, offload)[stage]

    def offload_of(self, section: dict[str, Any]) -> Offload:
        """What a configuration drawn as ``section`` will keep off the GPU once ``make_trial``
        gives it the fit rung's settings."""
        return Offload.of(with_offload_of(section, self.fit_rung.zero))

    def offload_space(self, stage: int) -> list[dict[str, Any]]:
        """What a new configuration at ``stage`` may keep off the GPU: on an offload rung of the
        fit ladder, or with ``--offload``, every choice keeping at least the rung's off (more
        frees memory for a larger micro-batch); else only the rung's own."""
        rung = self.fit_rung
        level = offload_level(rung.zero)
        if not self.settings.offload and level == 0:
            return [rung.zero]
        return offload_choices(stage, level, self.settings.offload_nvme) or [rung.zero]

    def rerun(self, failed: TrialRecord) -> list[TrialRecord]:
        """``failed``'s configuration once more, next in its lineage: the machine failed it on
        every attempt, and a machine fault is not the configuration's (a GPU that comes back, a
        node replaced). Were it left as failed, every method would take its micro-batch for too
        large and search below it. (Also the user's config measured again, ``baseline``.)"""
        again = failed.replace(
            request_id=self.builder.request_id(self.next_index),
            index=self.next_index,
            parent_id=failed.request_id,
            status=TrialStatus.QUEUED,
            metrics={},
            error=None,
            cause=None,
            log=None,
        )
        return [again] if self.register(again) is not None else []

    def make_trial(
        self,
        kind: TrialKind,
        zero_config: dict[str, Any] | None,
        mbs: int,
        parent: TrialRecord | None = None,
        search_range: SearchRange | None = None,
        rung: int = 0,
        fit: FitRung | None = None,
    ) -> TrialRecord | None:
        """The next trial's record (not yet registered): see TrialBuilder. With a fixed global
        batch it runs the allowed micro-batch nearest to ``mbs`` within ``search_range``
        (SearchSpec.allowed_micro_batch); None when the range holds none. On a rung of the fit
        ladder (``fit``, else the search's) it carries that rung's settings."""
        lo, hi = (search_range.lo, search_range.hi) if search_range is not None else (1, None)
        allowed = self.spec.allowed_micro_batch(mbs, lo, hi)
        if allowed is None:
            return None
        fit = self.fit_rung if fit is None else fit
        hparams: dict[str, Any] = {}
        if fit.profile_stage is not None:
            zero_config = with_offload_of(zero_config or self._user_zero_section(), fit.zero)
            hparams = fit.hparams
        return self.builder.make(
            self.next_index,
            kind,
            zero_config,
            allowed,
            parent,
            search_range,
            rung,
            extra_hparams=hparams,
        )

    def register(self, record: TrialRecord | None) -> TrialRecord | None:
        """Add ``record`` to the tracker, not yet queued (the protocol queues what a hook
        returns); None for a repeat of a configuration already registered."""
        if record is None or not self.tracker.add(record, queue=False):
            return None
        self.next_index += 1
        return record

    def memory_check(self) -> tuple[dict[str, Any], int] | None:
        """The configuration and micro-batch that would show where the OOMs begin, when that
        decides whether the leader (by ``leader_score``) may be handed over
        (usable_memory.memory_check). Ranking the leaders is the costly part, so it waits until
        the limit is known not to be known closely enough on every device size seen."""
        tracker = self.tracker
        records, usable, margin = (
            tracker.records,
            tracker.usable_memory,
            self.settings.memory_margin,
        )
        totals = device_totals(records)
        if totals and all(limit_known(records, usable, margin, total) for total in totals):
            return None
        ranked = leaders(tracker, 1, self.leader_score())
        subject = ranked[0] if ranked else None
        if self.spec.micro_batches is not None:
            subject = self.held_back_by_the_margin(subject) or subject
        if subject is None:
            return None
        return memory_check(records, usable, subject, margin, self.spec.micro_batches)

    def held_back_by_the_margin(self, leader: TrialRecord | None) -> TrialRecord | None:
        """The best trial that ran but left less than the margin of the memory known to be
        usable, when it beat ``leader``: with a fixed batch the micro-batch below it is often
        half of it, so whether it may be handed over decides much, and only a run that shows
        more memory usable can tell."""
        tracker = self.tracker
        over = [
            (value, r)
            for r in tracker.records
            if r.kind is TrialKind.SEARCH
            and (value := tracker.metric_value(r)) is not None
            and not tracker.may_hand_over(r)
            and not tracker.ran_out_of_memory_again(r)
        ]
        best: tuple[float, TrialRecord] | None = None
        for value, record in over:
            if best is None or tracker.metric.is_better(value, best[0]):
                best = (value, record)
        if best is None:
            return None
        leading = None if leader is None else tracker.metric_value(leader)
        if leading is None or tracker.metric.is_better(best[0], leading):
            return best[1]
        return None

    def summary_notes(self) -> list[str]:
        """The summary's lines on the global batch, on the user's own configuration and on
        trials fed short batches."""
        failed = self.search_failed and not self.model_profile_failed()
        none_ran = no_search_trial_succeeded(self.tracker.finished) if failed else None
        # Why, in the file a user reads later: a failed profile's summary said nothing of it.
        return [
            f"handed over: nothing: {self.failure_reason()}"
            if self.search_failed and (none_ran or self.finished)
            else "",
            self.spec.batch_line(self.tracker.best()),
            self.fit_line(self.tracker.best()),
            baseline_line(self),
            short_batches_line(self.tracker.finished),
            same_inputs_line(self.tracker.finished),
        ]

    def failure_reason(self) -> str:
        """Why a failed search hands over nothing, as its summary and its last line say it: its
        stop reason where the trials' failing alike ended it early (the summary said only that
        none succeeded, which read as a budget spent), with how the search trials failed
        otherwise."""
        reason = self.shutdown_reason or "no trial succeeded"
        none_ran = no_search_trial_succeeded(self.tracker.finished)
        if none_ran is None or reason == repeated_failure(self.tracker.finished):
            return reason
        return f"{none_ran} ({reason})"

    def fit_line(self, handed_over: TrialRecord | None) -> str:
        """The summary's line on what it took to fit, when the model did not as submitted."""
        if self.fit_rung.profile_stage is None or handed_over is None:
            return ""
        climbed = len(self.tracker.model_profiles)
        failed = [
            rung.name if rung.profile_stage is None else f"with {rung.name}"
            for rung in self.fit_rungs[: climbed - 1]
        ]
        return (
            f"to fit: {what_it_takes(handed_over.zero_section, handed_over.hparams)} (at "
            f"micro-batch 1 the model ran out of memory {' and '.join(failed)})"
        )

    def model_profile_failed(self) -> bool:
        """Whether the last model profile failed with no rung left to climb to."""
        record = self.tracker.model_profile
        if record is None or not record.status.finished or self.profile is not None:
            return False
        return record.status is not TrialStatus.OOM or self.next_fit_rung() is None

    # ------------------------------------------------------------------ what it takes to fit

    @property
    def fit_rung(self) -> FitRung:
        """The rung of the fit ladder this search is on: one per model profile it ran."""
        climbed = len(self.tracker.model_profiles)
        return self.fit_rungs[min(max(climbed - 1, 0), len(self.fit_rungs) - 1)]

    def next_fit_rung(self) -> FitRung | None:
        climbed = len(self.tracker.model_profiles)
        return self.fit_rungs[climbed] if climbed < len(self.fit_rungs) else None

    def climb(self) -> list[TrialRecord]:
        """The model profile of the next rung, after this one's ran out of memory."""
        rung = self.next_fit_rung()
        assert rung is not None and rung.profile_stage is not None  # only the first is the user's
        logger.info(
            "the model did not fit at micro-batch 1 (%s); trying %s",
            self.fit_rung.name,
            rung.name,
        )
        section = {**self._user_zero_section(), "stage": rung.profile_stage}
        record = self.register(self.make_trial(TrialKind.MODEL_PROFILE, section, 1, fit=rung))
        return [] if record is None else [record]

    @property
    def zero_stages(self) -> tuple[int, ...]:
        """The stages a configuration may take: ``--zero-stages``, or on a rung above the first,
        those that can carry it, that fit at micro-batch 1 by the memory model, and at which no
        model profile with as much offloaded ran out of memory (a lower stage needs more)."""
        rung = self.fit_rung
        if rung.profile_stage is None:
            return self.settings.zero_stages
        profile = self.profile
        fits = (
            fits_at_one(profile, self.precision, self.spec.slots_per_trial, rung.offload)
            if profile is not None
            else {}
        )
        level = offload_level(rung.zero)
        # A profile without the rung's activation checkpointing says nothing of a stage with it
        # (ZeRO-3 alone ran out, and ZeRO-1 with checkpointing, twice as fast, was never tried).
        checkpointing = rung.hparams.get(CHECKPOINTING_HPARAM) is True
        failed = [
            r.zero_stage
            for r in self.tracker.model_profiles
            if r.status is TrialStatus.OOM
            and offload_level(r.ds_config.get("zero_optimization")) >= level
            and (not checkpointing or r.hparams.get(CHECKPOINTING_HPARAM) is True)
        ]
        return tuple(
            s
            for s in rung.stages
            if s == rung.profile_stage or (fits.get(s, False) and s > max(failed, default=-1))
        )

    def _user_zero_section(self) -> dict[str, Any]:
        """The user's ZeRO section with their overrides' (the hyperparameters'): a knob set
        there was replaced by DeepSpeed's default in every search trial."""
        section = self.spec.user_config.get("zero_optimization")
        return dict(section) if isinstance(section, dict) else {}

    @property
    def shutdown_reason(self) -> str | None:
        return self.ending.shutdown_reason

    @property
    def search_failed(self) -> bool:
        return self.ending.search_failed(self)

    def draw_zero_config(self, stage: int) -> dict[str, Any]:
        """A ZeRO section for a new lineage, every knob drawn at random as the reference does
        (and what it offloads, when there is a choice)."""
        section = random_zero_config(stage, self.rng)
        choices = self.offload_space(stage)
        if len(choices) > 1:
            choice = choices[int(self.rng.integers(len(choices)))]
            kept = with_offload(self._user_zero_section(), choice)  # the user's pin_memory...
            section.update({key: kept[key] for key in choice})
        return section

    def new_lineage(self, stage: int | None = None) -> TrialRecord | None:
        """A new configuration, not tried before, at its first micro-batch."""
        for _ in range(MAX_DRAWS):
            chosen = self.untried_stage() if stage is None else stage
            if chosen is None:
                chosen = self.choose_stage()
            zero_config = self.draw_zero_config(chosen)
            search_range = self.initial_range(chosen, self.offload_of(zero_config))
            record = self.make_trial(
                TrialKind.SEARCH,
                zero_config,
                self.first_micro_batch(search_range),
                search_range=search_range,
            )
            if self.register(record) is not None:
                return record
        return None

    def continue_lineage(
        self, parent: TrialRecord, search_range: SearchRange, mbs: int, rung: int | None = None
    ) -> TrialRecord | None:
        """The next trial of ``parent``'s lineage; None when that micro-batch already ran."""
        if self.used_up(search_range):
            return None
        zero_config = parent.ds_config.get("zero_optimization")
        record = self.make_trial(
            TrialKind.SEARCH,
            dict(zero_config) if isinstance(zero_config, dict) else None,
            mbs,
            parent=parent,
            search_range=search_range,
            rung=parent.rung if rung is None else rung,
        )
        return self.register(record)
