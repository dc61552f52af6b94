"""Where a trial's result files belong, wherever its script moves.

A script may change its working directory (Hydra does, before ``main`` runs); DeepSpeed's
results and dsat's outcome file must still land where the runner reads them. Under a dsat runner
that is the directory of the trial's hyperparameters file, which the runner names by its absolute
path; elsewhere (a Determined trial, a run by hand) it is the working directory.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dsat.constants import AUTOTUNING_KEY, ENV_HPARAMS_FILE

# The autotuning block's keys that name files DeepSpeed writes for dsat to read.
RESULT_PATH_KEYS = ("model_info_path", "metric_path")


def trial_directory() -> Path:
    """The directory this trial's result files go to."""
    path = os.environ.get(ENV_HPARAMS_FILE)
    if path and os.path.isabs(path):
        return Path(path).parent
    return Path.cwd()


def anchored_result_paths(overwrites: Mapping[str, Any]) -> Mapping[str, Any]:
    """``overwrites`` with the autotuning block's relative result paths made absolute in the
    trial's directory, so DeepSpeed writes them there even after the script's ``os.chdir``."""
    block = overwrites.get(AUTOTUNING_KEY)
    if not isinstance(block, Mapping):
        return overwrites
    directory = trial_directory()
    relative = {
        key: str(directory / value)
        for key in RESULT_PATH_KEYS
        if isinstance(value := block.get(key), str) and not os.path.isabs(value)
    }
    if not relative:
        return overwrites
    return {**overwrites, AUTOTUNING_KEY: {**block, **relative}}
