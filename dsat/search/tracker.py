"""Every trial of a search, its queue, the global limits, and the best results.

The tracker is the search's memory: search methods ask it what happened and register what to try
next; it enforces `--max-trials`, `--max-concurrent-trials` and `--max-slots` for all of them.
"""

from __future__ import annotations

import json
from typing import Any

from dsat.constants import CHECKPOINTING_HPARAM, FULL_BATCH_SHARE, OVERWRITE_KEY
from dsat.experiment.metric import Metric, finite_number
from dsat.search.usable_memory import UsableMemory, fills_device, largest_peak, usable_memory
from dsat.trial import TrialKind, TrialRecord, TrialStatus
from dsat.trial_failure import FailureCause


def config_key(record: TrialRecord) -> str:
    """Identity of a trial's configuration: two trials with the same key measure the same thing
    (a confirmation run measures it again on purpose, so each has its own, as does the user's
    config run again)."""
    if record.kind is TrialKind.CONFIRM:
        return f"confirm:{record.request_id}"
    if record.kind is TrialKind.BASELINE and record.parent_id is not None:
        return f"again:{record.request_id}"
    overwrites = record.hparams.get(OVERWRITE_KEY, {})
    switch = record.hparams.get(CHECKPOINTING_HPARAM)
    if switch is not None:  # the script's own switch, which the fit ladder may set
        return json.dumps({OVERWRITE_KEY: overwrites, CHECKPOINTING_HPARAM: switch}, sort_keys=True)
    return json.dumps(overwrites, sort_keys=True)


class TrialTracker:
    def __init__(
        self,
        metric: Metric,
        max_trials: int,
        max_concurrent_trials: int,
        max_slots: int | None,
        slots_per_trial: int,
        memory_margin: float = 0.0,
    ) -> None:
        self.metric = metric
        self.max_trials = max_trials
        self.max_concurrent_trials = max_concurrent_trials
        self.max_slots = max_slots
        self.slots_per_trial = slots_per_trial
        self.memory_margin = memory_margin
        self._records: dict[str, TrialRecord] = {}
        self._keys: set[str] = set()
        # The confirmation runs of each search trial, by its request id; the model profiles.
        self._confirmations: dict[str, list[str]] = {}
        self._profiles: list[str] = []
        self.queue: list[str] = []
        self.trials_since_best = 0
        # The search trial the confirmation round chose, which is then the best there is.
        self.confirmed_id: str | None = None
        # The usable memory the OOMs show (usable_memory.py), worked out again after each outcome.
        self._usable: UsableMemory | None = None
        self._usable_stale = True
        self._ran_peak: float | None = None
        # The least FLOPs a sample any trial's figures gave (model_flops), kept as trials finish.
        self._flops_per_sample: float | None = None

    # ------------------------------------------------------------------ registration

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._records

    def get(self, request_id: str) -> TrialRecord:
        return self._records[request_id]

    def add(self, record: TrialRecord, queue: bool = True) -> bool:
        """Register ``record`` (and queue it); False, and nothing registered, for a repeat."""
        key = config_key(record)
        if key in self._keys:
            return False
        self._keys.add(key)
        self._records[record.request_id] = record
        self._index(record)
        self._note_flops(record)
        if record.status.finished:  # one that ran elsewhere (an import): its peak counts now
            self._usable_stale = True
        if queue:
            self.enqueue([record.request_id])
        return True

    def is_repeat(self, record: TrialRecord) -> bool:
        """Whether ``record``'s configuration is registered already (``add`` would refuse it)."""
        return config_key(record) in self._keys

    def enqueue(self, request_ids: list[str]) -> None:
        """Queue registered trials, to start in ``choose_next``'s order."""
        self.queue.extend(request_ids)

    def discard(self, request_id: str) -> None:
        """Forget a queued trial that will never run."""
        record = self._records.pop(request_id)
        self._keys.discard(config_key(record))
        parent = _confirmed_parent(record)
        if parent is not None:
            self._confirmations[parent].remove(request_id)
        if request_id in self._profiles:
            self._profiles.remove(request_id)
        self.queue.remove(request_id)

    def requeue(self, request_ids: list[str]) -> None:
        """Put interrupted trials back at the front of the queue, to run again."""
        for request_id in request_ids:
            self._records[request_id] = self._records[request_id].replace(status=TrialStatus.QUEUED)
        self.queue = [*request_ids, *self.queue]

    def dequeue(self, request_id: str) -> TrialRecord:
        self.queue.remove(request_id)
        return self.get(request_id)

    # ------------------------------------------------------------------ lifecycle

    def mark_running(self, request_id: str) -> TrialRecord:
        record = self._records[request_id].replace(status=TrialStatus.RUNNING)
        self._records[request_id] = record
        return record

    def mark_finished(
        self,
        request_id: str,
        status: TrialStatus,
        metrics: dict[str, Any] | None = None,
        error: str | None = None,
        cause: FailureCause | None = None,
        log: str | None = None,
    ) -> TrialRecord:
        record = self._records[request_id].replace(
            status=status, metrics=dict(metrics or {}), error=error, cause=cause, log=log
        )
        self._records[request_id] = record
        self._usable_stale = True
        self._note_flops(record)
        if self.machine_failed_once(record):  # free for the run again (method.rerun)
            self._keys.discard(config_key(record))
        if record.kind is TrialKind.SEARCH:
            if self.best() is record:
                self.trials_since_best = 0
            elif self.best() is not None:
                self.trials_since_best += 1
        return record

    # ------------------------------------------------------------------ views

    @property
    def records(self) -> list[TrialRecord]:
        return list(self._records.values())

    def confirmation_runs(self, request_id: str) -> list[TrialRecord]:
        """The confirmation round's runs of the search trial ``request_id``."""
        return [self._records[i] for i in self._confirmations.get(request_id, ())]

    def _index(self, record: TrialRecord) -> None:
        """Where a registered record is found again by what it is (its kind never changes)."""
        parent = _confirmed_parent(record)
        if parent is not None:
            self._confirmations.setdefault(parent, []).append(record.request_id)
        if record.kind is TrialKind.MODEL_PROFILE:
            self._profiles.append(record.request_id)

    @property
    def model_profiles(self) -> list[TrialRecord]:
        """Every model profile, in order: one per rung of the fit ladder the search climbed."""
        return [self._records[i] for i in self._profiles]

    @property
    def model_profile(self) -> TrialRecord | None:
        """The last model profile: the one the search runs on (an earlier one ran out of
        memory, and the fit ladder climbed)."""
        profiles = self.model_profiles
        return profiles[-1] if profiles else None

    @property
    def running(self) -> list[TrialRecord]:
        return [r for r in self._records.values() if r.status is TrialStatus.RUNNING]

    @property
    def finished(self) -> list[TrialRecord]:
        return [r for r in self._records.values() if r.status.finished]

    @property
    def num_started(self) -> int:
        return sum(1 for r in self._records.values() if r.status is not TrialStatus.QUEUED)

    @property
    def successful_stages(self) -> set[int]:
        return {r.zero_stage for r in self._records.values() if self.metric_value(r) is not None}

    def tried_stages(self) -> set[int]:
        """ZeRO stages with a search trial, queued or further along."""
        return {r.zero_stage for r in self._records.values() if r.kind is TrialKind.SEARCH}

    def can_start_more(self) -> bool:
        if not self.queue or self.num_started >= self.max_trials:
            return False
        running = len(self.running)
        if running >= self.max_concurrent_trials:
            return False
        if self.max_slots is not None:
            return (running + 1) * self.slots_per_trial <= self.max_slots
        return True

    def metric_value(self, record: TrialRecord) -> float | None:
        """The searched metric of a completed search trial; None for anything else."""
        if record.kind is not TrialKind.SEARCH:
            return None
        return self._value(record)

    def measured_value(self, record: TrialRecord) -> float | None:
        """The searched metric of any completed trial that measures it: a search trial, the
        user's own config, a confirmation run."""
        return None if record.kind is TrialKind.MODEL_PROFILE else self._value(record)

    def confirmed_value(self, record: TrialRecord) -> float | None:
        """The searched metric of a completed confirmation run; None for anything else."""
        return self._value(record) if record.kind is TrialKind.CONFIRM else None

    def mean_of_runs(self, record: TrialRecord) -> float | None:
        """The mean metric of a search trial and its confirmation runs: what its configuration
        measured (the summary's global row, the comparison with the user's config)."""
        values = [self.metric_value(record)] + [
            self.confirmed_value(r) for r in self.confirmation_runs(record.request_id)
        ]
        ran = [v for v in values if v is not None]
        return sum(ran) / len(ran) if ran else None

    def baseline_value(self, record: TrialRecord) -> float | None:
        """The searched metric of the user's own configuration's run; None for anything else."""
        return self._value(record) if record.kind is TrialKind.BASELINE else None

    def model_flops(self, record: TrialRecord) -> float | None:
        """Its FLOPS_per_gpu counting the model's FLOPs once: DeepSpeed's profiler counts 1.9x
        the FLOPs under ZeRO-3 on a small GPT (likely its linear layers twice: ZeRO-3's own
        linear and the matmul inside it) and counts activation checkpointing's recompute, so its
        figure ranks such configurations above faster ones. A trial whose FLOPs a sample exceed
        the least any trial gave by more than 1% is counted at that least: what its throughput
        does."""
        if record.status is not TrialStatus.COMPLETED:
            return None
        measured, least = _flops_and_rate(record), self._flops_per_sample
        if measured is None or least is None:
            return finite_number(record.metrics.get("FLOPS_per_gpu"))
        flops, throughput = measured
        return flops if flops / throughput <= 1.01 * least else least * throughput

    def _note_flops(self, record: TrialRecord) -> None:
        """Not from a trial whose steps were fed short batches: its FLOPs come from one profiled
        step, its samples from the window, and their ratio is no model's."""
        if record.status is not TrialStatus.COMPLETED or FULL_BATCH_SHARE in record.metrics:
            return
        measured = _flops_and_rate(record)
        if measured is not None and measured[0]:
            ratio = measured[0] / measured[1]
            if self._flops_per_sample is None or ratio < self._flops_per_sample:
                self._flops_per_sample = ratio

    def _value(self, record: TrialRecord) -> float | None:
        if record.status is not TrialStatus.COMPLETED:
            return None
        if self.metric is Metric.FLOPS_PER_GPU and "FLOPS_per_gpu" in record.metrics:
            return self.model_flops(record)
        for key in (self.metric.file_key, self.metric.value):
            value = finite_number(record.metrics.get(key))
            if value is not None:
                return value
        return None

    @property
    def usable_memory(self) -> UsableMemory | None:
        """Where the OOMs seen so far place the usable memory (None before any)."""
        if self._usable_stale:
            records = list(self._records.values())
            self._usable = usable_memory(records)
            self._ran_peak = largest_peak(records)
            self._usable_stale = False
        return self._usable

    def memory_limit(self, total: float) -> float:
        """The most a configuration may use and be handed over, on a device of ``total`` bytes:
        ``--memory-margin`` of the memory that is usable (what the OOMs show, at most the
        device's total) left free."""
        usable, margin = self.usable_memory, self.memory_margin
        if usable is not None:
            return (1.0 - margin) * min(total, usable.bytes)
        ran = self._ran_peak
        if ran is not None and not fills_device(ran, margin, total):
            # No OOM, and no run near the total, shows how much of it is usable, and a memory
            # check may not be able to (a sample can be half the device, the micro-batch above
            # twice as large with a fixed batch): near the total, only what ran is known to be
            # usable. Below two margins of the total the limit does not matter. (Never above
            # the margin of the total: what ran is below it.)
            return max((1.0 - margin) * ran, (1.0 - 2 * margin) * total)
        return (1.0 - margin) * total

    def leaves_margin(self, record: TrialRecord) -> bool:
        """Whether its peak memory leaves ``--memory-margin`` of the usable memory free (yes
        where it was not measured): one that barely fits a short trial can run out of memory
        hours into a real run, so one that does not is never handed over."""
        peak, total = (
            record.metrics.get("memory_peak_bytes"),
            record.metrics.get("memory_total_bytes"),
        )
        if not isinstance(peak, (int, float)) or not isinstance(total, (int, float)) or total <= 0:
            return True
        return peak <= self.memory_limit(float(total))

    def ran_out_of_memory_again(self, record: TrialRecord) -> bool:
        """Whether a run of its configuration after it (the confirmation round) ran out of
        memory: near the limit an OOM comes and goes, and one that came once can come in
        training."""
        return any(r.status is TrialStatus.OOM for r in self.confirmation_runs(record.request_id))

    def may_hand_over(self, record: TrialRecord) -> bool:
        """Whether it is safe to hand over: it leaves the margin, and no run of it ran out of
        memory."""
        return self.leaves_margin(record) and not self.ran_out_of_memory_again(record)

    def too_large(self, record: TrialRecord) -> bool:
        """Whether its micro-batch is above what its configuration may use: it failed, or it ran
        but left less than the margin free. Searches treat both alike (a binary search goes
        below it), so that they look for the best configuration that can be handed over."""
        if record.status.failed:
            return not self.machine_failed_once(record)
        return record.status is TrialStatus.COMPLETED and not self.leaves_margin(record)

    def machine_failed_once(self, record: TrialRecord) -> bool:
        """Whether the machine failed this search trial on every attempt, the first time its
        configuration ran: that says nothing of the configuration, which runs once more
        (DsatSearchMethod.rerun). A second such failure of it counts against it, as any."""
        if record.kind is not TrialKind.SEARCH or record.cause is not FailureCause.MACHINE:
            return False
        parent = self._records.get(record.parent_id) if record.parent_id else None
        return not (
            parent is not None
            and parent.cause is FailureCause.MACHINE
            and config_key(parent) == config_key(record)
        )

    def best_of(self, records: list[TrialRecord]) -> TrialRecord | None:
        """The best of ``records`` that may be handed over (``may_hand_over``)."""
        best: TrialRecord | None = None
        best_value = 0.0
        for record in records:
            value = self.metric_value(record)
            if value is not None and not self.may_hand_over(record):
                continue
            if value is not None and (best is None or self.metric.is_better(value, best_value)):
                best, best_value = record, value
        return best

    def best(self, stage: int | None = None) -> TrialRecord | None:
        """The best trial overall (the confirmed one, once confirmed) or of one ZeRO stage (the
        earliest among equals)."""
        if stage is None and self.confirmed_id is not None:
            return self._records[self.confirmed_id]
        return self.best_of(
            [
                r
                for r in self._records.values()
                if (stage is None or r.zero_stage == stage) and r.kind is not TrialKind.BASELINE
            ]
        )

    # ------------------------------------------------------------------ lineages

    def lineage(self, lineage_id: str) -> list[TrialRecord]:
        return [r for r in self._records.values() if r.lineage_id == lineage_id]

    def latest_in_lineage(self, lineage_id: str) -> TrialRecord:
        return self.lineage(lineage_id)[-1]

    def finished_in_lineage(self, lineage_id: str) -> int:
        return sum(1 for r in self.lineage(lineage_id) if r.status.finished)

    def lineage_ids(self) -> list[str]:
        seen: dict[str, None] = {}
        for record in self._records.values():
            if record.kind is TrialKind.SEARCH:
                seen.setdefault(record.lineage_id, None)
        return list(seen)

    def error_in_history(self, record: TrialRecord) -> bool:
        current: TrialRecord | None = record
        while current is not None:
            if current.status.failed:
                return True
            current = self._records.get(current.parent_id) if current.parent_id else None
        return False

    # ------------------------------------------------------------------ state

    def to_json(self) -> dict[str, Any]:
        return {
            "records": [r.to_json() for r in self._records.values()],
            "queue": list(self.queue),
            "trials_since_best": self.trials_since_best,
            "confirmed_id": self.confirmed_id,
        }

    def load_json(self, data: dict[str, Any]) -> None:
        self._records = {}
        self._keys = set()
        self._confirmations = {}
        self._profiles = []
        for item in data["records"]:
            record = TrialRecord.from_json(item)
            self._records[record.request_id] = record
            self._index(record)
        self._keys = {
            config_key(r) for r in self._records.values() if not self.machine_failed_once(r)
        }
        self.queue = list(data["queue"])
        self.trials_since_best = int(data["trials_since_best"])
        self.confirmed_id = data.get("confirmed_id")
        # Ids that name no trial (a state edited by hand) failed later, in the search, as a
        # KeyError's traceback; here they are a damaged state, in one line.
        unknown = [i for i in [*self.queue, self.confirmed_id] if i is not None and i not in self]
        if unknown:
            raise ValueError(f"{unknown[0]!r} names no trial of the state's records")
        self._usable_stale = True
        self._flops_per_sample = None
        for record in self._records.values():
            self._note_flops(record)


def _confirmed_parent(record: TrialRecord) -> str | None:
    """The search trial a confirmation run measures again (None for any other trial)."""
    return record.parent_id if record.kind is TrialKind.CONFIRM else None


def _flops_and_rate(record: TrialRecord) -> tuple[float, float] | None:
    """Its FLOPS_per_gpu and throughput, where it reports both (a positive throughput)."""
    flops = finite_number(record.metrics.get("FLOPS_per_gpu"))
    throughput = finite_number(record.metrics.get("throughput"))
    if flops is None or throughput is None or not throughput > 0:
        return None
    return flops, throughput
