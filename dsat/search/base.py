"""What every dsat search method shares, speaking Determined's custom-searcher events.

A method is pure: no processes, files (except its own state when asked to save), or clocks. Its
randomness comes from one numpy generator seeded by `--random-seed`, so the same seed and the same
events give the same trials, and its whole state is JSON, so a search resumes where it stopped.

Subclasses decide only what to try after the model profile, a success and a failure, and which
queued trial to start first; this base turns that into Create/ValidateAfter/Close/Shutdown
operations and enforces the global limits through the tracker.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import uuid
import warnings
from pathlib import Path
from typing import Any

import numpy as np
from determined import searcher

from dsat.atomic_file import write_json_atomic
from dsat.batch_size import consistent_batch_sizes
from dsat.config import deep_merge
from dsat.constants import (
    AUTOTUNING_KEY,
    GRAD_ACCUM_STEPS,
    METRICS_FILE,
    MICRO_BATCH_SIZE,
    MODEL_INFO_FILE,
    OOM_METRIC_KEY,
    OVERWRITE_KEY,
    STATE_FILE,
)
from dsat.memory import (
    ModelProfile,
    ModelProfileError,
    Precision,
    approx_max_micro_batch,
    log_estimates,
)
from dsat.search.confirmation import leaders, planned_runs, winner
from dsat.search.method_settings import MethodSettings
from dsat.search.space import neighbour_zero_config, random_zero_config
from dsat.search.tracker import TrialTracker, config_key
from dsat.search.trial import SearchRange, TrialFailure, TrialKind, TrialRecord, TrialStatus
from dsat.step_clock import measured_window

logger = logging.getLogger(__name__)

STATE_VERSION = 1
_REQUEST_NAMESPACE = uuid.UUID("6c1f7e1a-3f5e-4a52-9a3c-2f0d5c8e9b41")
# Chance that a new lineage varies the best configuration of its stage instead of a random one.
EXPLOIT_PROBABILITY = 0.5
# Bounds the draws for a configuration that was not tried yet, once the space runs dry.
MAX_DRAWS = 50


@dataclasses.dataclass(frozen=True)
class SearchSpec:
    """What a method needs to know of the experiment: no paths, only data."""

    hparams: dict[str, Any]  # the experiment's hyperparameters
    ds_config: dict[str, Any]  # the user's DeepSpeed config, as loaded
    slots_per_trial: int


class DsatSearchMethod(searcher.SearchMethod):  # type: ignore[misc]
    name = "base"
    exploit_probability = EXPLOIT_PROBABILITY

    def __init__(self, settings: MethodSettings, spec: SearchSpec) -> None:
        with warnings.catch_warnings():  # Determined marks custom searchers deprecated in 0.37
            warnings.simplefilter("ignore", FutureWarning)
            super().__init__()
        self.settings = settings
        self.spec = spec
        self.tracker = TrialTracker(
            metric=settings.metric,
            max_trials=settings.max_trials,
            max_concurrent_trials=settings.max_concurrent_trials,
            max_slots=settings.max_slots,
            slots_per_trial=spec.slots_per_trial,
        )
        self.rng = np.random.default_rng(settings.random_seed)
        self.precision = Precision.of(spec.ds_config)
        self._next_index = 0
        self.shutdown_reason: str | None = None
        self.confirmation_candidates: list[str] = []
        self.search_end_reason = ""
        self.unsafe_memory = False  # every configuration that ran leaves too little memory

    # ------------------------------------------------------------------ hooks for subclasses

    def initial_lineages(self) -> list[TrialRecord]:
        """Trials to queue once the model profile is known: one lineage per concurrent slot."""
        count = min(self.settings.max_concurrent_trials, self.settings.max_trials - 1)
        if self.settings.max_slots is not None:
            count = min(count, max(self.settings.max_slots // self.spec.slots_per_trial, 1))
        return [t for t in (self.new_lineage() for _ in range(count)) if t is not None]

    def after_success(self, record: TrialRecord) -> list[TrialRecord]:
        """Queue what to try after ``record`` succeeded (through ``continue_lineage`` or
        ``new_lineage``, which register it); returns what was queued."""
        raise NotImplementedError

    def after_failure(self, record: TrialRecord) -> list[TrialRecord]:
        """Queue what to try after ``record`` ran out of memory or failed; returns it."""
        raise NotImplementedError

    def choose_next(self) -> str | None:
        """The queued trial to start now (first come, first served), or None for none."""
        return self.tracker.queue[0] if self.tracker.queue else None

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
        for stage in self.settings.zero_stages:
            in_stage = [
                r
                for r in self.tracker.records
                if r.kind is TrialKind.SEARCH and r.zero_stage == stage
            ]
            at_one = {config_key(r) for r in in_stage if r.status is TrialStatus.OOM and r.mbs == 1}
            if len(at_one) >= 2 and stage not in self.tracker.successful_stages:
                dead.add(stage)
        return [s for s in self.settings.zero_stages if s not in dead] or list(
            self.settings.zero_stages
        )

    def untried_stage(self) -> int | None:
        """A stage of ``--zero-stages`` that has no trial yet: each gets one before any gets a
        second configuration."""
        untried = sorted(set(self.settings.zero_stages) - self.tracker.tried_stages())
        return int(untried[int(self.rng.integers(len(untried)))]) if untried else None

    def initial_range(self, stage: int, section: dict[str, Any] | None = None) -> SearchRange:
        """The memory model's range for a stage's first configuration; a later one starts from
        what the stage proved for it: the largest micro-batch that ran with a configuration
        needing no less memory, below the smallest OOM of one needing no more."""
        estimate = max(int(self.micro_batch_ceiling(stage) * self.settings.search_range_factor), 1)
        ran, out_of_memory = self.tracker.proven_micro_batches(stage, section)
        lo = ran or 1
        hi = out_of_memory - 1 if out_of_memory is not None else max(estimate, lo)
        return SearchRange(lo, max(hi, lo))

    def first_micro_batch(self, search_range: SearchRange) -> int:
        return search_range.midpoint

    # ------------------------------------------------------------------ building trials

    @property
    def profile(self) -> ModelProfile | None:
        record = self.tracker.model_profile
        if record is None or record.status is not TrialStatus.COMPLETED:
            return None
        try:
            return ModelProfile.from_metrics(record.metrics)
        except ModelProfileError:
            return None

    def micro_batch_ceiling(self, stage: int) -> int:
        profile = self.profile
        if profile is None:
            return 1
        return approx_max_micro_batch(profile, self.precision, self.spec.slots_per_trial)[stage]

    def _autotuning_block(self, kind: TrialKind) -> dict[str, Any]:
        if kind is TrialKind.MODEL_PROFILE:
            return {
                "enabled": True,
                "model_info_path": MODEL_INFO_FILE,
                "model_info": {"profile": True},
            }
        return {
            "enabled": True,
            "start_profile_step": self.settings.start_profile_step,
            "end_profile_step": self.last_measured_step,
            "metric_path": METRICS_FILE,
        }

    @property
    def last_measured_step(self) -> int:
        """DeepSpeed ends a search trial after this step: the end of dsat's measured window."""
        return measured_window(self.settings.start_profile_step, self.settings.end_profile_step)[1]

    def make_trial(
        self,
        kind: TrialKind,
        zero_config: dict[str, Any] | None,
        mbs: int,
        parent: TrialRecord | None = None,
        search_range: SearchRange | None = None,
        rung: int = 0,
    ) -> TrialRecord:
        """A record (not yet registered) with a consistent batch triple and autotuning block."""
        user_overwrites = self.spec.hparams.get(OVERWRITE_KEY) or {}
        overwrites = deep_merge(user_overwrites, {AUTOTUNING_KEY: self._autotuning_block(kind)})
        if zero_config is not None:
            overwrites = deep_merge(overwrites, {"zero_optimization": zero_config})
        merged = deep_merge(self.spec.ds_config, overwrites)
        batch = consistent_batch_sizes(merged, self.spec.slots_per_trial, micro_batch=mbs)
        overwrites = deep_merge(overwrites, batch)
        hparams = {**copy.deepcopy(self.spec.hparams), OVERWRITE_KEY: overwrites}
        ds_config = deep_merge(self.spec.ds_config, overwrites)
        index = self._next_index
        request_id = self._request_id(index)
        zero = ds_config.get("zero_optimization")
        return TrialRecord(
            request_id=request_id,
            index=index,
            kind=kind,
            hparams=hparams,
            ds_config=ds_config,
            zero_stage=int(zero.get("stage", 0)) if isinstance(zero, dict) else 0,
            mbs=int(ds_config[MICRO_BATCH_SIZE]),
            gas=int(ds_config[GRAD_ACCUM_STEPS]),
            lineage_id=parent.lineage_id if parent is not None else request_id,
            parent_id=parent.request_id if parent is not None else None,
            search_range=search_range,
            rung=rung,
        )

    def _request_id(self, index: int) -> str:
        """The request id of the trial created ``index``-th: a function of the seed and the
        index, so a resumed search names its trials as the original would."""
        return str(uuid.uuid5(_REQUEST_NAMESPACE, f"{self.settings.random_seed}:{index}"))

    def _register(self, record: TrialRecord | None, queue: bool = True) -> TrialRecord | None:
        if record is None or not self.tracker.add(record, queue=queue):
            return None
        self._next_index += 1
        return record

    def draw_zero_config(self, stage: int) -> dict[str, Any]:
        """A ZeRO section for a new lineage: at random, or, half of the time once the stage has a
        best trial, that trial's section with one knob changed (a local step that exploits it)."""
        best = self.tracker.best(stage)
        explore = self.exploit_probability == 0 or self.rng.random() >= self.exploit_probability
        if best is None or explore:
            return random_zero_config(stage, self.rng)
        section = best.ds_config.get("zero_optimization")
        return neighbour_zero_config(
            dict(section) if isinstance(section, dict) else {"stage": stage}, self.rng
        )

    def new_lineage(self, stage: int | None = None) -> TrialRecord | None:
        """A new configuration, not tried before, at its first micro-batch."""
        for _ in range(MAX_DRAWS):
            chosen = self.untried_stage() if stage is None else stage
            if chosen is None:
                chosen = self.choose_stage()
            zero_config = self.draw_zero_config(chosen)
            search_range = self.initial_range(chosen, zero_config)
            record = self.make_trial(
                TrialKind.SEARCH,
                zero_config,
                self.first_micro_batch(search_range),
                search_range=search_range,
            )
            if self._register(record) is not None:
                return record
        return None

    def continue_lineage(
        self, parent: TrialRecord, search_range: SearchRange, mbs: int, rung: int | None = None
    ) -> TrialRecord | None:
        """The next trial of ``parent``'s lineage; None when that micro-batch already ran."""
        if search_range.empty:
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
        return self._register(record)

    # ------------------------------------------------------------------ shutdown

    def model_profile_failed(self) -> bool:
        record = self.tracker.model_profile
        return record is not None and record.status.finished and self.profile is None

    def _stop_reason(self) -> str | None:
        """Why the search must stop now, whatever is still queued; None to go on."""
        if self.model_profile_failed():
            return (
                "the model-profile trial failed: the model must run at micro-batch 1 with the "
                "submitted DeepSpeed config; fix that (see the trial's log) and try again"
            )
        if self.early_stopping_triggered():
            return "early stopping: no improvement in the last trials"
        if len(self.tracker.finished) >= self.tracker.max_trials:
            return "all trials finished"
        return None

    def should_shutdown(self) -> bool:
        tracker = self.tracker
        if self.confirming:
            if tracker.running or tracker.queue:
                return False
            self._end_confirmation()
            return True
        reason = self._stop_reason()
        if reason is None and not tracker.running:
            if not tracker.queue or tracker.num_started >= tracker.max_trials:
                reason = "no configuration left to try"
        unconfirmed = tracker.confirmed_id is None and not self.unsafe_memory
        if reason is not None and unconfirmed and tracker.best() is not None:
            for request_id in list(tracker.queue):  # the search is over: nothing more of it runs
                tracker.discard(request_id)
            if tracker.running:
                return False  # the confirmation round starts once the last search trial ends
            if self._start_confirmation(reason):
                return False
            if self.unsafe_memory:
                reason = (
                    f"{reason}, but every configuration that ran leaves less than "
                    f"{self.settings.memory_margin:.0%} of the device's memory free "
                    "(--memory-margin); none is handed over"
                )
        if reason is not None:
            self.shutdown_reason = reason
        return reason is not None

    # ------------------------------------------------------------------ the confirmation round

    @property
    def confirming(self) -> bool:
        return bool(self.confirmation_candidates) and self.tracker.confirmed_id is None

    def _start_confirmation(self, reason: str) -> bool:
        """Queue the runs of the confirmation round; False when there is nothing to confirm."""
        candidates = leaders(self.tracker, self.settings.confirm_top, self.settings.memory_margin)
        searched = sum(1 for r in self.tracker.finished if r.kind is TrialKind.SEARCH)
        runs = planned_runs(candidates, searched) if self.settings.confirm_top > 1 else []
        if not runs:
            if candidates:
                self.tracker.confirmed_id = candidates[0].request_id
            else:
                self.unsafe_memory = True
            return False
        self.search_end_reason = reason
        self.confirmation_candidates = [c.request_id for c in candidates]
        for candidate in runs:
            index = self._next_index
            request_id = self._request_id(index)
            run = candidate.replace(
                request_id=request_id,
                index=index,
                kind=TrialKind.CONFIRM,
                parent_id=candidate.request_id,
                status=TrialStatus.QUEUED,
                metrics={},
                error=None,
            )
            self._register(run)
        self.tracker.max_trials += len(runs)
        logger.info(
            "search ends: %s; confirmation round: %d run(s) of the %d leading configurations "
            "(%s), interleaved",
            reason,
            len(runs),
            len(candidates),
            ", ".join(c.name for c in candidates),
        )
        return True

    def _end_confirmation(self) -> None:
        candidates = [self.tracker.get(i) for i in self.confirmation_candidates]
        chosen = winner(self.tracker, candidates)
        if chosen is None:  # every leader failed when run again: the search's best stands
            chosen = candidates[0]
            logger.info("confirmation round: no leader ran again; keeping %s", chosen.name)
        self.tracker.confirmed_id = chosen.request_id
        self.shutdown_reason = f"{self.search_end_reason}; confirmed {chosen.name}"

    @property
    def search_failed(self) -> bool:
        """A search with no successful trial (or no model profile, or only configurations that
        leave too little memory) has failed."""
        return self.model_profile_failed() or self.tracker.best() is None or self.unsafe_memory

    # ------------------------------------------------------------------ Determined's events

    def _start_ops(self, record: TrialRecord) -> list[searcher.Operation]:
        self.tracker.mark_running(record.request_id)
        request_id = uuid.UUID(record.request_id)
        length = 1 if record.kind is TrialKind.MODEL_PROFILE else self.last_measured_step + 1
        return [
            searcher.Create(request_id=request_id, hparams=record.hparams, checkpoint=None),
            searcher.ValidateAfter(request_id=request_id, length=length),
        ]

    def initial_operations(
        self, searcher_state: searcher.SearcherState
    ) -> list[searcher.Operation]:
        record = self._register(self.make_trial(TrialKind.MODEL_PROFILE, None, 1), queue=False)
        assert record is not None  # the first trial cannot be a repeat
        return self._start_ops(record)

    def on_trial_created(
        self, searcher_state: searcher.SearcherState, request_id: uuid.UUID
    ) -> list[searcher.Operation]:
        return []

    def on_validation_completed(
        self,
        searcher_state: searcher.SearcherState,
        request_id: uuid.UUID,
        metric: Any,
        train_length: int,
    ) -> list[searcher.Operation]:
        if self._already_finished(request_id):
            return []
        if isinstance(metric, dict) and OOM_METRIC_KEY in metric:  # reported by the trial
            self._failed(request_id, TrialStatus.OOM, str(metric[OOM_METRIC_KEY]))
            return [searcher.Close(request_id)]
        metrics = metric if isinstance(metric, dict) else {self.settings.metric.value: metric}
        record = self.tracker.mark_finished(str(request_id), TrialStatus.COMPLETED, metrics)
        if record.kind is TrialKind.MODEL_PROFILE:
            profile = self.profile
            if profile is not None:
                log_estimates(profile, self.precision, self.spec.slots_per_trial)
                self._follow_up(self.initial_lineages)
        elif record.kind is TrialKind.SEARCH:
            self._follow_up(lambda: self.after_success(record))
        return [searcher.Close(request_id)]

    def on_trial_exited_early(
        self,
        searcher_state: searcher.SearcherState,
        request_id: uuid.UUID,
        exited_reason: searcher.ExitedReason,
        failure: TrialFailure | None = None,
    ) -> list[searcher.Operation]:
        """Determined says only 'errored' (an OOM arrives as a reported metric there); dsat's
        runners add what they know (an OOM, a timeout) as ``failure``."""
        status = failure.status if failure is not None else TrialStatus.ERROR
        error = failure.error if failure is not None else None
        if self._already_finished(request_id):
            return []
        if exited_reason is not searcher.ExitedReason.ERRORED:
            self.tracker.mark_finished(str(request_id), status, error=error)
            self.shutdown_reason = f"trial exited early: {exited_reason.value}"
            return [searcher.Shutdown(failure=self.search_failed)]
        self._failed(request_id, status, error)
        return []

    def _failed(self, request_id: uuid.UUID, status: TrialStatus, error: str | None) -> None:
        record = self.tracker.mark_finished(str(request_id), status, error=error)
        if record.kind is TrialKind.SEARCH:
            self._follow_up(lambda: self.after_failure(record))

    def _already_finished(self, request_id: uuid.UUID) -> bool:
        """A second outcome for one trial (on a cluster, a trial that reported its metrics can
        still be marked errored while DeepSpeed's exit races the Close) changes nothing."""
        finished = self.tracker.get(str(request_id)).status.finished
        if finished:
            logger.info("ignoring a second outcome for finished trial %s", request_id)
        return finished

    def _follow_up(self, make: Any) -> None:
        room = len(self.tracker.queue) + self.tracker.num_started < self.settings.max_trials
        if room and self._stop_reason() is None:
            make()

    def on_trial_closed(
        self, searcher_state: searcher.SearcherState, request_id: uuid.UUID
    ) -> list[searcher.Operation]:
        return self._start_queued()

    def resume_operations(self) -> list[searcher.Operation]:
        """After loading saved state: run again what was interrupted, then carry on."""
        self.tracker.requeue([r.request_id for r in self.tracker.running])
        return self._start_queued()

    def _start_queued(self) -> list[searcher.Operation]:
        if self.should_shutdown():
            logger.info("search ends: %s", self.shutdown_reason)
            return [searcher.Shutdown(failure=self.search_failed)]
        ops: list[searcher.Operation] = []
        while self.tracker.can_start_more():
            request_id = self.choose_next()
            if request_id is None:
                break
            ops += self._start_ops(self.tracker.dequeue(request_id))
        return ops

    def progress(self, searcher_state: searcher.SearcherState) -> float:
        return min(len(self.tracker.finished) / self.settings.max_trials, 1.0)

    # ------------------------------------------------------------------ state

    def state_json(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "method": self.name,
            "tracker": self.tracker.to_json(),
            "rng": self.rng.bit_generator.state,
            "next_index": self._next_index,
            "confirmation_candidates": self.confirmation_candidates,
            "search_end_reason": self.search_end_reason,
        }

    def load_state_json(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION or state.get("method") != self.name:
            raise ValueError(
                f"search state is for {state.get('method')!r} v{state.get('version')}, "
                f"not {self.name!r} v{STATE_VERSION}"
            )
        self.tracker.load_json(state["tracker"])
        self.rng.bit_generator.state = state["rng"]
        self._next_index = int(state["next_index"])
        self.confirmation_candidates = list(state.get("confirmation_candidates", []))
        self.search_end_reason = str(state.get("search_end_reason", ""))
        confirm_runs = sum(1 for r in self.tracker.records if r.kind is TrialKind.CONFIRM)
        self.tracker.max_trials = self.settings.max_trials + confirm_runs

    def save_method_state(self, path: Path) -> None:
        write_json_atomic(Path(path) / STATE_FILE, self.state_json())

    def load_method_state(self, path: Path) -> None:
        self.load_state_json(json.loads((Path(path) / STATE_FILE).read_text()))
