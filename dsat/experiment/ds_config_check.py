"""Ask DeepSpeed's own config parser whether it accepts a config, without a GPU or a process group.

DeepSpeed takes the world size from ``torch.distributed``; outside a launched job it assumes 1. To
check the batch triple for a multi-slot trial, the parser is given the trial's world size just
before it runs its batch check. Importing DeepSpeed is slow, so this module is imported lazily.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from dsat.quiet_output import quiet_output


def deepspeed_config_error(config: Mapping[str, Any], world_size: int) -> str | None:
    """DeepSpeed's one-line reason for rejecting ``config``, or None when it accepts it."""
    with quiet_output("importing DeepSpeed"):
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
    return None
