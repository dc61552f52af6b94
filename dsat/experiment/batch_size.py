"""A consistent DeepSpeed batch triple for a given micro-batch and number of slots.

DeepSpeed insists that ``train_batch_size == micro_batch * grad_accum * world_size``. dsat tunes
the micro-batch. When the user's config gives a numeric ``train_batch_size`` (or ``--global-batch``
sets one), that global batch is the user's optimisation (learning rate and warm-up are set for it)
and every trial keeps it: the micro-batch is one of the values that divide the batch per rank, and
the gradient accumulation makes up the rest. Without one the batch is free: dsat keeps the user's
accumulation (an HF Trainer entrypoint's ``--gradient_accumulation_steps`` where the config
leaves it ``"auto"``, ``config.with_script_accumulation``; else 1 when absent or ``"auto"``) and
derives the train batch size.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dsat.constants import AUTO, GAS_DEFAULT, GRAD_ACCUM_STEPS, MICRO_BATCH_SIZE, TRAIN_BATCH_SIZE
from dsat.errors import DsatError


def batch_value(config: Mapping[str, Any], key: str, source: str) -> int | None:
    """The positive integer under ``key`` (a whole float taken as one); None when absent or
    ``"auto"``."""
    value = config.get(key)
    if value is None or (isinstance(value, str) and value.strip() == AUTO):
        return None
    if isinstance(value, float) and value.is_integer() and value > 0:
        return int(value)  # 2.56e2 or 256.0 as JSON writers give it; every trial writes 256
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise DsatError(f'{source}: {key} must be a positive integer or "auto", got {value!r}')
    return value


def fixed_global_batch(config: Mapping[str, Any], source: str = "config") -> int | None:
    """The global batch every trial keeps: a numeric ``train_batch_size``; None when free."""
    return batch_value(config, TRAIN_BATCH_SIZE, source)


def micro_batches_for(global_batch: int, slots: int) -> list[int]:
    """The micro-batches that keep ``global_batch`` on ``slots`` data-parallel ranks, ascending:
    the divisors of the batch per rank (the accumulation is the quotient)."""
    per_rank = global_batch // slots
    small = [d for d in range(1, int(per_rank**0.5) + 1) if per_rank % d == 0]
    return sorted({*small, *(per_rank // d for d in small)})


GLOBAL_BATCH_FLAG = "--global-batch"


# The largest batch per rank dsat lists the divisors of (a million steps; a typo's 10^20 took
# hours). No training steps its optimizer once per 10^12 samples.
LARGEST_BATCH_PER_RANK = 2**40


def check_global_batch(global_batch: int, slots: int, source: str) -> None:
    """A global batch that no configuration can keep is the user's mistake, said before any trial."""
    if global_batch // slots > LARGEST_BATCH_PER_RANK:
        raise DsatError(
            f"{source}: {TRAIN_BATCH_SIZE} {global_batch} is {global_batch // slots} samples per "
            f"rank, more than any training takes in one step (dsat keeps at most 2^40); check "
            "the number"
        )
    if global_batch % slots:
        fix = f"make it a multiple of {slots}" if global_batch > slots else f"raise it to {slots}"
        # The flag takes a number only: its way to a free batch is to leave it out.
        free = (
            "drop --global-batch"
            if source == GLOBAL_BATCH_FLAG
            else f'set {TRAIN_BATCH_SIZE} to "auto"'
        )
        raise DsatError(
            f"{source}: {TRAIN_BATCH_SIZE} {global_batch} cannot be split evenly over {slots} "
            f"slots per trial (data-parallel ranks); {fix}, or {free} to let dsat choose the "
            "batch"
        )


def with_global_batch(
    ds_config: Mapping[str, Any], global_batch: int, slots: int, source: str
) -> dict[str, Any]:
    """``ds_config`` with its global batch fixed at ``global_batch`` (``--global-batch``): the
    user's micro-batch stays where it divides the batch per rank, the accumulation is derived."""
    check_global_batch(global_batch, slots, source)
    config = {**ds_config, TRAIN_BATCH_SIZE: global_batch}
    config.pop(GRAD_ACCUM_STEPS, None)
    micro_batch = batch_value(ds_config, MICRO_BATCH_SIZE, source)
    if micro_batch is None or (global_batch // slots) % micro_batch:
        config.pop(MICRO_BATCH_SIZE, None)
    else:
        config[GRAD_ACCUM_STEPS] = global_batch // (slots * micro_batch)
    return config


def replaced_batch(
    ds_config: Mapping[str, Any], global_batch: int, slots: int, source: str
) -> str | None:
    """The batch ``ds_config`` trains with, where ``--global-batch`` changes it (None where it
    sets none or the same): said at launch, since every trial and the user's own config as the
    baseline then train at another batch than the file says."""
    train_batch = fixed_global_batch(ds_config, source)
    if train_batch is not None:
        return None if train_batch == global_batch else f"{TRAIN_BATCH_SIZE} {train_batch}"
    micro_batch = batch_value(ds_config, MICRO_BATCH_SIZE, source)
    if micro_batch is None:
        return None
    accumulation = batch_value(ds_config, GRAD_ACCUM_STEPS, source) or 1
    batch = micro_batch * accumulation * slots
    if batch == global_batch:
        return None
    return f"micro-batch {micro_batch} x accumulation {accumulation} x {slots} slot(s) = {batch}"


def consistent_batch_sizes(
    ds_config: Mapping[str, Any], slots: int, micro_batch: int | None = None, source: str = "config"
) -> dict[str, int]:
    """The batch triple to merge into ``ds_config`` for a trial on ``slots`` data-parallel ranks.

    ``micro_batch`` is the value being tried; without it the config's own micro-batch is kept, or
    derived from its train batch size, or 1 when the config gives neither. With a fixed global
    batch a tried micro-batch must divide the batch per rank.
    """
    if slots <= 0:
        raise DsatError(f"{source}: slots_per_trial must be a positive integer, got {slots}")
    train_batch = fixed_global_batch(ds_config, source)
    if train_batch is not None:
        check_global_batch(train_batch, slots, source)
    if micro_batch is not None and micro_batch <= 0:
        raise DsatError(f"{source}: micro-batch size must be positive, got {micro_batch}")
    if micro_batch is not None and train_batch is not None:
        if (train_batch // slots) % micro_batch:
            raise ValueError(
                f"micro-batch {micro_batch} does not divide {TRAIN_BATCH_SIZE} {train_batch} "
                f"over {slots} slots"
            )  # the search chooses among micro_batches_for; anything else is dsat's bug
        return {
            TRAIN_BATCH_SIZE: train_batch,
            MICRO_BATCH_SIZE: micro_batch,
            GRAD_ACCUM_STEPS: train_batch // (slots * micro_batch),
        }
    given_gas = batch_value(ds_config, GRAD_ACCUM_STEPS, source)
    gas = given_gas or GAS_DEFAULT
    if micro_batch is None:
        micro_batch = batch_value(ds_config, MICRO_BATCH_SIZE, source)
        if micro_batch is None and train_batch is not None:
            if train_batch % (gas * slots):
                raise DsatError(
                    f"{source}: {TRAIN_BATCH_SIZE} {train_batch} is not divisible by "
                    f"{GRAD_ACCUM_STEPS} {gas} x {slots} slots; make it a multiple of "
                    f"{gas * slots}, or drop {GRAD_ACCUM_STEPS} and set {MICRO_BATCH_SIZE}"
                )
            micro_batch = train_batch // (gas * slots)
        elif micro_batch is not None and train_batch is not None:
            if given_gas is None and train_batch % (micro_batch * slots) == 0:
                # DeepSpeed derives the accumulation from the other two, and so does dsat.
                gas = train_batch // (micro_batch * slots)
            elif given_gas is None:
                raise DsatError(
                    f"{source}: {TRAIN_BATCH_SIZE} {train_batch} is not divisible by "
                    f"{MICRO_BATCH_SIZE} {micro_batch} x {slots} slots, so no "
                    f"{GRAD_ACCUM_STEPS} makes it up; change one of them or set "
                    f'{TRAIN_BATCH_SIZE} to "auto"'
                )
            elif train_batch != micro_batch * gas * slots:
                raise DsatError(
                    f"{source}: {TRAIN_BATCH_SIZE} {train_batch} != {MICRO_BATCH_SIZE} "
                    f"{micro_batch} x {GRAD_ACCUM_STEPS} {gas} x {slots} slots; fix one of them "
                    f'or set {TRAIN_BATCH_SIZE} to "auto"'
                )
        micro_batch = micro_batch or 1
    return {
        TRAIN_BATCH_SIZE: micro_batch * gas * slots,
        MICRO_BATCH_SIZE: micro_batch,
        GRAD_ACCUM_STEPS: gas,
    }
