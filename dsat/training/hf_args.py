"""Make a HuggingFace Trainer's command line agree with the DeepSpeed config a trial tries.

HF checks its ``--per_device_train_batch_size``/``--gradient_accumulation_steps`` against the
``--deepspeed`` JSON and refuses a mismatch, so both have to carry dsat's overrides. The merged
JSON is written next to the original (the user's file is never modified) and ``--deepspeed`` is
pointed at it; each rank of a multi-process trial writes it whole (write_json_atomic: a temporary
file of its own, renamed), so they need no lock, and none is left beside the user's file.
"""

from __future__ import annotations

import logging
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dsat.atomic_file import write_json_atomic
from dsat.constants import (
    CHECKPOINTING_HPARAM,
)
from dsat.errors import DsatError
from dsat.experiment.batch_size import batch_value
from dsat.experiment.config import HF_BATCH_FLAGS, deep_merge, load_ds_json
from dsat.memory import Precision
from dsat.training.step_clock import note_config_taken, start_clock
from dsat.training.trial_config import checked_overwrites
from dsat.training.trial_directory import trial_directory

logger = logging.getLogger(__name__)

HF_DS_FLAG = "--deepspeed"
MERGED_SUFFIX = ".dsat.json"
# What HF's string_to_bool reads as false (a bare `--bf16` is true).
HF_FALSE = ("no", "false", "f", "n", "0")


def _flag_name(token: str) -> str:
    name = token.partition("=")[0]
    return "--" + name[2:].replace("-", "_") if name.startswith("--") else name


def _find_flag(args: Sequence[str], flag: str) -> tuple[int, str | None]:
    """Index of ``flag`` in ``args`` and its value (``--flag value`` or ``--flag=value``): its
    last occurrence, the one HF's argparse keeps where a flag is given twice."""
    for i in reversed(range(len(args))):
        token = args[i]
        if _flag_name(token) != flag:
            continue
        if "=" in token:
            return i, token.partition("=")[2]
        return i, args[i + 1] if i + 1 < len(args) else None
    return -1, None


def switch_on(args: Sequence[str], flag: str) -> bool:
    """Whether ``args`` turn the switch ``flag`` on (in any spelling HF takes): bare, or with a
    true value; the last given stands, as in argparse."""
    index, value = _find_flag(args, flag)
    if index < 0:
        return False
    if value is None or value.startswith("-"):  # a bare switch: the next word is a flag
        return True
    return value.strip().lower() in ("true", "1", "yes")


def passes_deepspeed(args: Sequence[str]) -> bool:
    """Whether ``args`` give ``--deepspeed PATH`` (in any spelling HF takes): an HF Trainer
    script's. DeepSpeed's own ``--deepspeed`` (``deepspeed.add_config_arguments``) is a switch
    with no value: a plain DeepSpeed script's, told it ran without the trial's config as one."""
    index, value = _find_flag(args, HF_DS_FLAG)
    return index >= 0 and value is not None and not value.startswith("-") and value != ""


def _set_flag(args: list[str], flag: str, value: str) -> list[str]:
    index, old = _find_flag(args, flag)
    if index < 0:
        logger.info("adding %s %s to match the DeepSpeed config", flag, value)
        return [*args, flag, value]
    if old != value:
        logger.info("changing %s from %s to %s to match the DeepSpeed config", flag, old, value)
    updated = list(args)
    if "=" in args[index]:
        updated[index] = f"{flag}={value}"
    elif old is None or old.startswith("--"):
        # A bare switch (`--gradient_checkpointing`): the next word is another flag, or the
        # value of one dsat just set, and overwriting it broke the command line.
        updated.insert(index + 1, value)
    else:
        updated[index + 1] = value
    return updated


def hf_precision(args: Sequence[str], ds_config: Mapping[str, Any]) -> Precision:
    """The trial's precision: HF's ``--bf16``/``--fp16`` switch (which fills in a JSON's
    ``"auto"``), else the JSON's own."""
    for flag, precision in (("--bf16", Precision.BF16), ("--fp16", Precision.FP16)):
        index, value = _find_flag(args, flag)
        if index < 0:
            continue
        if value is None or value.startswith("--") or value.lower() not in HF_FALSE:
            return precision
    return Precision.of(ds_config)


# Newer transformers name the switch activation_checkpointing and read gradient_checkpointing
# only where it is unset: a user's `--activation_checkpointing false` kept it off.
NEWER_CHECKPOINTING_FLAG = "--activation_checkpointing"


def checkpointing_flags(args: Sequence[str]) -> list[str]:
    """The switches that turn HF's activation checkpointing on for these arguments (the newer
    one only where they pass it: an older transformers refuses a flag it does not know)."""
    flags = [f"--{CHECKPOINTING_HPARAM}"]
    if _find_flag(args, NEWER_CHECKPOINTING_FLAG)[0] >= 0:
        flags.append(NEWER_CHECKPOINTING_FLAG)
    return flags


def merged_config_path(ds_config_path: Path) -> Path:
    """The trial's own config, in the trial's directory whatever ``--deepspeed`` names: an
    absolute path to the user's file had every trial write beside it, in the user's model dir,
    and trials running at once shared one file (a trial could train with another's config)."""
    name = ds_config_path.name.removesuffix(".json") + MERGED_SUFFIX
    directory = trial_directory()
    # By its name where the trial's directory is the working one: the arguments the log shows.
    return Path(name) if directory == Path.cwd() else directory / name


def get_hf_args_with_overwrites(args: Sequence[str], hparams: Mapping[str, Any]) -> list[str]:
    """HF Trainer arguments that carry this trial's DeepSpeed overrides."""
    overwrites = checked_overwrites(hparams)
    note_config_taken(hf_arguments=True)
    args = list(args)
    if not overwrites:
        return args
    index, value = _find_flag(args, HF_DS_FLAG)
    if index < 0 or not value:
        files = [a for a in args if a.endswith((".json", ".yaml", ".yml")) and a[:1] != "-"]
        raise DsatError(
            "get_hf_args_with_overwrites: the HF arguments have no --deepspeed PATH; pass your "
            "DeepSpeed JSON with --deepspeed"
            + (
                f" (arguments in {files[0]} are read by the script, not here: pass them as flags)"
                if files
                else ""
            )
        )
    source = Path(value)
    target = merged_config_path(source)
    user_config = load_ds_json(source, "--deepspeed")  # a path that is wrong leaves no lock file
    merged = deep_merge(user_config, overwrites)
    write_json_atomic(target, merged)
    # A search trial: dsat times its steps, and the Trainer's input_ids lead with the batch.
    start_clock(overwrites, hf_precision(args, merged), batch_first=True)
    args = _set_flag(args, HF_DS_FLAG, str(target))
    for flag, key in HF_BATCH_FLAGS.items():
        number = batch_value(merged, key, str(target))
        if number is not None:  # "auto" is left for HF to fill in from its own arguments
            args = _set_flag(args, flag, str(number))
    if hparams.get(CHECKPOINTING_HPARAM) is True:  # the fit ladder's rung: HF Trainer's switch
        for flag in checkpointing_flags(args):
            args = _set_flag(args, flag, "true")
    # The log's first line is the command as the user wrote it; this is what the trial ran with.
    print(f"dsat: HF arguments as dsat sets them: {shlex.join(args)}", file=sys.stderr, flush=True)
    return args
