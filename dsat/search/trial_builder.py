"""Turning a method's choice (kind, ZeRO section, micro-batch) into a complete trial record.

Every trial gets the user's overrides, the ZeRO section, a consistent batch triple for its slots
and the autotuning block that makes DeepSpeed profile it and stop; its request id is a function of
the seed and its index, so a resumed search names its trials as the original would.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import uuid
from typing import Any

from dsat.constants import (
    AUTOTUNING_KEY,
    GRAD_ACCUM_STEPS,
    METRICS_FILE,
    MICRO_BATCH_SIZE,
    MODEL_INFO_FILE,
    OVERWRITE_KEY,
    TRAIN_BATCH_SIZE,
)
from dsat.experiment.batch_size import (
    consistent_batch_sizes,
    fixed_global_batch,
    micro_batches_for,
)
from dsat.experiment.config import deep_merge
from dsat.memory import unused_offloads
from dsat.training.step_clock import measured_window
from dsat.trial import SearchRange, TrialKind, TrialRecord

_REQUEST_NAMESPACE = uuid.UUID("6c1f7e1a-3f5e-4a52-9a3c-2f0d5c8e9b41")


def search_trial_autotuning(start_profile_step: int, end_profile_step: int) -> dict[str, Any]:
    """The autotuning block that makes DeepSpeed profile a search trial's steps and then stop;
    the trials' hyperparameters and the Determined custom experiment's both come from here."""
    return {
        "enabled": True,
        "start_profile_step": start_profile_step,
        "end_profile_step": end_profile_step,
    }


@dataclasses.dataclass(frozen=True)
class SearchSpec:
    """What a method needs to know of the experiment: no paths, only data."""

    hparams: dict[str, Any]  # the experiment's hyperparameters
    ds_config: dict[str, Any]  # the user's DeepSpeed config, as loaded
    slots_per_trial: int
    entrypoint: str | list[str] | None = None  # its command, for what it says (a sequence length)

    @functools.cached_property
    def user_config(self) -> dict[str, Any]:
        """The user's DeepSpeed config with their own overrides: what they train with."""
        return deep_merge(self.ds_config, self.hparams.get(OVERWRITE_KEY) or {})

    @functools.cached_property
    def global_batch(self) -> int | None:
        """The global batch every trial keeps (the user's numeric ``train_batch_size``, in their
        config or their overrides); None when the batch is free."""
        return fixed_global_batch(self.user_config)

    @functools.cached_property
    def micro_batches(self) -> list[int] | None:
        """The micro-batches that keep the global batch; None when any may run."""
        if self.global_batch is None:
            return None
        return micro_batches_for(self.global_batch, self.slots_per_trial)

    def batch_line(self, handed_over: TrialRecord | None) -> str:
        """The summary's line on the global batch: kept, or free and what it became."""
        made = ""
        if handed_over is not None:
            made = (
                f" (micro-batch {handed_over.mbs} x accumulation {handed_over.gas} x "
                f"{self.slots_per_trial} ranks)"
            )
        if self.global_batch is not None:
            return f"global batch: {self.global_batch}{made}, kept in every trial"
        if handed_over is None:  # nothing to train with: no advice on keeping its batch
            return "global batch: free"
        became = f"{handed_over.ds_config[TRAIN_BATCH_SIZE]}{made}, "
        return f"global batch: {became}free: set train_batch_size or --global-batch N to keep yours"

    def allowed_micro_batch(self, wanted: int, lo: int = 1, hi: int | None = None) -> int | None:
        """The micro-batch to run where a method wants ``wanted``: itself when the batch is free;
        with a fixed one, the allowed micro-batch in [lo, hi] nearest to it (the smaller of two
        as near: it needs less memory), or None when [lo, hi] holds none."""
        if self.micro_batches is None:
            return wanted
        inside = [m for m in self.micro_batches if m >= lo and (hi is None or m <= hi)]
        return min(inside, key=lambda m: (abs(m - wanted), m), default=None)


@dataclasses.dataclass(frozen=True)
class TrialBuilder:
    spec: SearchSpec
    random_seed: int
    start_profile_step: int
    end_profile_step: int

    @property
    def last_measured_step(self) -> int:
        """DeepSpeed ends a search trial after this step: the end of dsat's measured window."""
        return measured_window(self.start_profile_step, self.end_profile_step)[1]

    def autotuning_block(self, kind: TrialKind) -> dict[str, Any]:
        if kind is TrialKind.MODEL_PROFILE:
            return {
                "enabled": True,
                "model_info_path": MODEL_INFO_FILE,
                "model_info": {"profile": True},
            }
        block = search_trial_autotuning(self.start_profile_step, self.last_measured_step)
        return {**block, "metric_path": METRICS_FILE}

    def request_id(self, index: int) -> str:
        """The request id of the trial created ``index``-th."""
        return str(uuid.uuid5(_REQUEST_NAMESPACE, f"{self.random_seed}:{index}"))

    def make(
        self,
        index: int,
        kind: TrialKind,
        zero_config: dict[str, Any] | None,
        mbs: int | None,
        parent: TrialRecord | None = None,
        search_range: SearchRange | None = None,
        rung: int = 0,
        user_batch: dict[str, int] | None = None,
        extra_hparams: dict[str, Any] | None = None,
    ) -> TrialRecord:
        """The ``index``-th trial's record (not yet registered); ``zero_config`` and ``mbs``
        None keep the user's own section and batch triple (``user_batch``: where their script,
        not their config, sets it); ``extra_hparams`` set switches of the script's own (the fit
        ladder's activation checkpointing)."""
        spec = self.spec
        user_overwrites = deep_merge(spec.hparams.get(OVERWRITE_KEY) or {}, user_batch or {})
        overwrites = deep_merge(user_overwrites, {AUTOTUNING_KEY: self.autotuning_block(kind)})
        if zero_config is not None:
            overwrites = deep_merge(overwrites, {"zero_optimization": zero_config})
        merged = deep_merge(spec.ds_config, overwrites)
        if zero_config is not None:
            # The user's offloads merge into the trial's section: off where its stage has no use.
            off = {key: {"device": "none"} for key in unused_offloads(merged["zero_optimization"])}
            if off:
                overwrites = deep_merge(overwrites, {"zero_optimization": off})
                merged = deep_merge(merged, {"zero_optimization": off})
        batch = consistent_batch_sizes(merged, spec.slots_per_trial, micro_batch=mbs)
        overwrites = deep_merge(overwrites, batch)
        hparams = {
            **copy.deepcopy(spec.hparams),
            **(extra_hparams or {}),
            OVERWRITE_KEY: overwrites,
        }
        ds_config = deep_merge(spec.ds_config, overwrites)
        request_id = self.request_id(index)
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
