"""Whether a trial's engine ran the batch sizes dsat gave it.

A script that sets its own (an ``args.batch_size`` written over the JSON, consistently, so that
DeepSpeed takes it) runs every trial at one batch: each measured the same configuration under
another name, and the search handed over a micro-batch no trial ran.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dsat.constants import GRAD_ACCUM_STEPS, MICRO_BATCH_SIZE, TRAIN_BATCH_SIZE

BATCH_KEYS = (TRAIN_BATCH_SIZE, MICRO_BATCH_SIZE, GRAD_ACCUM_STEPS)
# A trial's outcome where its engine ran other batch sizes than the trial's.
BATCH_CHANGED = "batch_changed"


def changed_batch_sizes(asked: Mapping[str, Any], ran: Mapping[str, Any]) -> list[str]:
    """``ran``'s batch sizes that differ from those ``asked`` gives, in words: the ones the
    trial set (an integer), against what the engine ran."""
    return [
        f"{key} {ran[key]}, not {asked[key]}"
        for key in BATCH_KEYS
        if isinstance(asked.get(key), int)
        and isinstance(ran.get(key), int)
        and asked[key] != ran[key]
    ]


def batch_sizes_changed_reason(changed: Sequence[str], rejected: bool, hf: bool = False) -> str:
    """Why the trial is the script's: ``rejected``, DeepSpeed refused what the script made of
    the batch sizes; otherwise it trained with them, another configuration than the trial's."""
    what = (
        "and DeepSpeed rejected them"
        if rejected
        else "so it measured another configuration than the trial's"
    )
    fix = (
        "train with the arguments dsat.get_hf_args_with_overwrites returns, not a "
        "per_device_train_batch_size of its own"
        if hf
        else "build the engine from dsat.get_ds_config_from_hparams(hparams) as it is, not with "
        "a batch size of its own"
    )
    return (
        f"the training script changed the batch sizes dsat gave the trial ({'; '.join(changed)})"
        f", {what}: {fix}"
    )
