"""A consistent DeepSpeed batch triple for a given micro-batch and number of slots.

DeepSpeed insists that ``train_batch_size == micro_batch * grad_accum * world_size``. dsat tunes
the micro-batch, keeps the user's gradient accumulation (1 when absent or ``"auto"``, as HF
writes it) and derives the train batch size, so every trial's config passes DeepSpeed's check.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dsat.constants import AUTO, GAS_DEFAULT, GRAD_ACCUM_STEPS, MICRO_BATCH_SIZE, TRAIN_BATCH_SIZE
from dsat.errors import DsatError


def batch_value(config: Mapping[str, Any], key: str, source: str) -> int | None:
    """The positive integer under ``key``; None when absent or ``"auto"``."""
    value = config.get(key)
    if value is None or (isinstance(value, str) and value.strip() == AUTO):
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise DsatError(f'{source}: {key} must be a positive integer or "auto", got {value!r}')
    return value


def consistent_batch_sizes(
    ds_config: Mapping[str, Any], slots: int, micro_batch: int | None = None, source: str = "config"
) -> dict[str, int]:
    """The batch triple to merge into ``ds_config`` for a trial on ``slots`` data-parallel ranks.

    ``micro_batch`` is the value being tried; without it the config's own micro-batch is kept, or
    derived from its train batch size, or 1 when the config gives neither.
    """
    if slots <= 0:
        raise DsatError(f"{source}: slots_per_trial must be a positive integer, got {slots}")
    gas = batch_value(ds_config, GRAD_ACCUM_STEPS, source) or GAS_DEFAULT
    if micro_batch is None:
        micro_batch = batch_value(ds_config, MICRO_BATCH_SIZE, source)
        train_batch = batch_value(ds_config, TRAIN_BATCH_SIZE, source)
        if micro_batch is None and train_batch is not None:
            if train_batch % (gas * slots):
                raise DsatError(
                    f"{source}: {TRAIN_BATCH_SIZE} {train_batch} is not divisible by "
                    f"{GRAD_ACCUM_STEPS} {gas} x {slots} slots; set "
                    f"{MICRO_BATCH_SIZE} instead"
                )
            micro_batch = train_batch // (gas * slots)
        elif micro_batch is not None and train_batch is not None:
            if train_batch != micro_batch * gas * slots:
                raise DsatError(
                    f"{source}: {TRAIN_BATCH_SIZE} {train_batch} != {MICRO_BATCH_SIZE} "
                    f"{micro_batch} x {GRAD_ACCUM_STEPS} {gas} x {slots} slots; fix one of them "
                    f'or set {TRAIN_BATCH_SIZE} to "auto"'
                )
        micro_batch = micro_batch or 1
    elif micro_batch <= 0:
        raise DsatError(f"{source}: micro-batch size must be positive, got {micro_batch}")
    return {
        TRAIN_BATCH_SIZE: micro_batch * gas * slots,
        MICRO_BATCH_SIZE: micro_batch,
        GRAD_ACCUM_STEPS: gas,
    }
