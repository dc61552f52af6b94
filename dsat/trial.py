"""The one record type for a trial, from the search method through the runners to the results."""

from __future__ import annotations

import dataclasses
import enum
import functools
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dsat.trial_failure import FailureCause
from dsat.zero_space import explicit_zero_config, knob_tags, section_key

# What each field of a saved record holds (``TrialRecord.from_json``); the enums check their own.
_JSON_FIELD_KINDS: dict[str, type | tuple[type, ...]] = {
    "request_id": str,
    "index": int,
    "hparams": dict,
    "ds_config": dict,
    "zero_stage": int,
    "mbs": int,
    "gas": int,
    "lineage_id": str,
    "parent_id": (str, type(None)),
    "search_range": (dict, type(None)),
    "rung": int,
    "metrics": dict,
    "error": (str, type(None)),
    "log": (str, type(None)),
}


def peak_memory_fraction(metrics: Mapping[str, Any]) -> float | None:
    """A trial's peak memory over its device's total, from its metrics, where it measured both."""
    peak, total = metrics.get("memory_peak_bytes"), metrics.get("memory_total_bytes")
    if isinstance(peak, (int, float)) and isinstance(total, (int, float)) and total > 0:
        return float(peak) / float(total)
    return None


def leaves_memory_margin(metrics: Mapping[str, Any], memory_margin: float) -> bool:
    """Whether a trial's peak memory leaves ``memory_margin`` of the device free (yes where it
    was not measured): the hand-over rule, for dsat's trials and the benchmark's alike."""
    fraction = peak_memory_fraction(metrics)
    return fraction is None or fraction <= 1.0 - memory_margin


class TrialStatus(str, enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    OOM = "oom"
    ERROR = "error"
    TIMEOUT = "timeout"

    @property
    def finished(self) -> bool:
        return self not in (TrialStatus.QUEUED, TrialStatus.RUNNING)

    @property
    def failed(self) -> bool:
        return self in (TrialStatus.OOM, TrialStatus.ERROR, TrialStatus.TIMEOUT)


class TrialKind(str, enum.Enum):
    MODEL_PROFILE = "model_profile"  # micro-batch 1, measures the model for the memory model
    SEARCH = "search"  # measures one DeepSpeed configuration
    CONFIRM = "confirm"  # runs a leading configuration again before it is handed over
    BASELINE = "baseline"  # the user's own configuration as submitted, to compare the hand-over


@dataclasses.dataclass(frozen=True)
class TrialOutcome:
    """How a trial ended, as its runner saw it: what a search method observes."""

    request_id: str
    status: TrialStatus  # a finished one: completed, oom, error or timeout
    metrics: dict[str, Any]
    error: str | None  # its first line is the reason, for the terminal
    start: float  # seconds on the runner's clock
    end: float
    cause: FailureCause | None = None  # who a failure is blamed on
    log: str | None = None  # the trial's log, where the runner keeps one
    # The runs of it the machine failed before this one (SearchDriver.retried): their slots'
    # time is the search's cost too, and their logs say what the machine did.
    machine_failed: tuple[TrialOutcome, ...] = ()


@dataclasses.dataclass(frozen=True)
class SearchRange:
    """The micro-batch interval [lo, hi] a lineage's binary search still considers."""

    lo: int
    hi: int

    @property
    def empty(self) -> bool:
        return self.hi < self.lo

    @property
    def midpoint(self) -> int:
        return (self.lo + self.hi) // 2


# A runner's name for a trial's log and its directory: logs/NNN-<id>.log, trials/NNN-<id>/.
LOG_NUMBER = re.compile(r"^(\d{3,})-")


def trial_number(index: int, log: str | None) -> int:
    """The number of the trial's log and directory where its runner wrote them (launch order,
    carried on by a resume), else its place in the search from 1: the screen counted from 0 in
    creation order and trials.jsonl in finishing order, so with trials at once "trial 1" named
    three different trials."""
    found = LOG_NUMBER.match(Path(log).name) if log else None
    return int(found.group(1)) if found else index + 1


@dataclasses.dataclass(frozen=True)
class TrialRecord:
    """A trial and, once finished, its outcome. Immutable: updates make a new record.

    A *lineage* is the chain of trials that binary-search the micro-batch of one random ZeRO
    configuration; ``parent_id`` links each to the trial before it, ``lineage_id`` names the first.
    """

    request_id: str
    index: int  # creation order, 0 for the model-profile trial
    kind: TrialKind
    hparams: dict[str, Any]  # the experiment's hyperparameters plus overwrite_deepspeed_args
    ds_config: dict[str, Any]  # the user's DeepSpeed config with the overrides merged in
    zero_stage: int
    mbs: int
    gas: int
    lineage_id: str
    parent_id: str | None = None
    search_range: SearchRange | None = None
    rung: int = 0
    status: TrialStatus = TrialStatus.QUEUED
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
    error: str | None = None
    cause: FailureCause | None = None
    log: str | None = None

    @property
    def zero_section(self) -> dict[str, Any]:
        """Its ``zero_optimization`` section with every knob of its stage spelled out (DeepSpeed's
        defaults where the config sets none), so that two trials' knobs can be compared."""
        return dict(self._zero_section)

    @functools.cached_property
    def _zero_section(self) -> dict[str, Any]:
        # Worked out once: a search compares its trials' knobs tens of thousands of times.
        zero = self.ds_config.get("zero_optimization")
        return explicit_zero_config(dict(zero) if isinstance(zero, dict) else {}, self.zero_stage)

    @functools.cached_property
    def zero_key(self) -> str:
        """Its ZeRO section's identity (zero_space.section_key): equal for two trials with the
        same knobs."""
        return section_key(self._zero_section)

    @property
    def number(self) -> int:
        """The number a user finds it by, on screen, in trials.jsonl and the report: see
        ``trial_number``."""
        return trial_number(self.index, self.log)

    @property
    def memory_fraction(self) -> float | None:
        """Its peak memory over the device's total, where the trial measured both."""
        return peak_memory_fraction(self.metrics)

    @property
    def name(self) -> str:
        """Its stage, micro-batch per GPU, gradient accumulation (when more than 1) and every
        ZeRO knob it sets apart from DeepSpeed's default (zero_space.knob_tags):
        ``z2_mb16_gas4_rb5e7_overlap``."""
        parts = [f"z{self.zero_stage}", f"mb{self.mbs}"]
        if self.gas > 1:
            parts.append(f"gas{self.gas}")
        parts.extend(knob_tags(self.zero_section, self.zero_stage))
        return "_".join(parts)

    def replace(self, **changes: Any) -> TrialRecord:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["kind"] = self.kind.value
        data["status"] = self.status.value
        data["cause"] = None if self.cause is None else self.cause.value
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrialRecord:
        """The record ``to_json`` wrote; ``ValueError`` naming the field where a value is not
        of its kind (a state edited by hand failed later, in the search, as a traceback)."""
        data = dict(data)
        for name, kinds in _JSON_FIELD_KINDS.items():
            value = data.get(name)
            if name in data and (isinstance(value, bool) or not isinstance(value, kinds)):
                raise ValueError(f"trial {data.get('request_id')!r}: {name} is {value!r}")
        for name in ("mbs", "gas"):
            if data.get(name, 1) < 1:
                raise ValueError(f"trial {data.get('request_id')!r}: {name} is {data[name]!r}")
        data["kind"] = TrialKind(data["kind"])
        data["status"] = TrialStatus(data["status"])
        if data.get("cause") is not None:
            data["cause"] = FailureCause(data["cause"])
        if data.get("search_range") is not None:
            data["search_range"] = SearchRange(**data["search_range"])
        return cls(**data)
