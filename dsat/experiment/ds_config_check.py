"""Ask DeepSpeed's own config parser whether it accepts a config, without a GPU or a process group.

DeepSpeed takes the world size from ``torch.distributed``; outside a launched job it assumes 1. To
check the batch triple for a multi-slot trial, the parser is given the trial's world size just
before it runs its batch check. Importing DeepSpeed is slow, so this module is imported lazily.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from dsat.errors import DsatError
from dsat.quiet_output import quiet_output


def load_deepspeed() -> None:
    """Import DeepSpeed quietly, or say in one line why it cannot be: not the config's fault, nor
    one a traceback helps with (a broken install, or a limit of this shell: ``ulimit -v`` too low
    to map torch's libraries, ``ulimit -n``)."""
    try:
        with quiet_output("importing DeepSpeed"):
            import deepspeed.runtime.config  # noqa: F401
    except (ImportError, OSError, MemoryError) as err:
        reason = ": ".join([type(err).__name__, *str(err).split("\n")[:1]]).rstrip(": ")
        raise DsatError(
            f"cannot import DeepSpeed here ({reason}); dsat checks the config with it and runs "
            "trials with it: fix this Python environment (its install, or a limit of this shell: "
            "`ulimit -a`)"
        ) from None


def deepspeed_config_error(config: Mapping[str, Any], world_size: int) -> str | None:
    """DeepSpeed's one-line reason for rejecting ``config``, or None when it accepts it."""
    load_deepspeed()
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.utils import logger as ds_logger

    class ConfigAtWorldSize(DeepSpeedConfig):  # type: ignore[misc]
        def _configure_train_batch_size(self) -> None:
            self.world_size = world_size
            super()._configure_train_batch_size()

    previous_level = ds_logger.level
    ds_logger.setLevel(logging.WARNING)  # DeepSpeed logs the whole config at INFO
    try:
        ConfigAtWorldSize(dict(config))
    except Exception as err:  # pydantic, assertion and value errors all mean "rejected"
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        reason = "; ".join(line for line in lines if not line.startswith("For further information"))
        return f"{type(err).__name__}: {reason}" if reason else type(err).__name__
    finally:
        ds_logger.setLevel(previous_level)
    return engine_config_error(config)


def engine_config_error(config: Mapping[str, Any]) -> str | None:
    """What DeepSpeed's parser lets through and its engine then refuses in every trial: an
    optimizer or scheduler it does not know, NVMe offload with no path."""
    import torch
    from deepspeed.runtime import lr_schedules
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

    optimizer = _section(config, "optimizer").get("type")
    if isinstance(optimizer, str) and not (
        optimizer.lower() in DEEPSPEED_OPTIMIZERS or hasattr(torch.optim, optimizer)
    ):
        return (
            f"optimizer type {optimizer!r} is none of DeepSpeed's ({', '.join(DEEPSPEED_OPTIMIZERS)}) "
            "nor a torch.optim class"
        )
    scheduler = _section(config, "scheduler").get("type")
    if isinstance(scheduler, str) and not (
        hasattr(lr_schedules, scheduler) or hasattr(torch.optim.lr_scheduler, scheduler)
    ):
        return (
            f"scheduler type {scheduler!r} is none of DeepSpeed's "
            f"({', '.join(lr_schedules.VALID_LR_SCHEDULES)}) nor a torch.optim.lr_scheduler class"
        )
    zero = _section(config, "zero_optimization")
    for part in ("offload_optimizer", "offload_param"):
        offload = _section(zero, part)
        if offload.get("device") == "nvme" and not offload.get("nvme_path"):
            return f"zero_optimization.{part} goes to nvme with no nvme_path; set one"
    return None


def _section(config: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = config.get(key)
    return value if isinstance(value, Mapping) else {}
