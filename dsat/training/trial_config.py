"""Trial-side access to the hyperparameters and the DeepSpeed config a trial should run with.

One training script runs unchanged under dsat's local runner and on a Determined cluster: the
hyperparameters come from the file a dsat runner names in the environment, or from Determined's
cluster info.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dsat.constants import DS_CONFIG_KEY, ENV_HPARAMS_FILE, ENV_TRIAL_LENGTH, OVERWRITE_KEY
from dsat.errors import DsatError
from dsat.experiment.config import deep_merge, load_ds_json
from dsat.memory import Precision
from dsat.training.step_clock import note_config_taken, start_clock
from dsat.training.trial_directory import anchored_result_paths, trial_directory


def overwrite_deepspeed_config(
    base: str | Path | Mapping[str, Any], overwrites: Mapping[str, Any]
) -> dict[str, Any]:
    """``base`` (a dict or a JSON path) with ``overwrites`` deep-merged on top: Determined's
    way to the trial's config (noted, see ``config_taken``)."""
    note_config_taken()
    if not isinstance(base, Mapping):
        base = load_ds_json(Path(base), "overwrite_deepspeed_config")
    return deep_merge(base, anchored_result_paths(overwrites))


def checked_overwrites(hparams: Mapping[str, Any]) -> Mapping[str, Any]:
    """The trial's DeepSpeed overrides (``overwrite_deepspeed_args``), a mapping or none: what
    the script asks for when it takes the trial's config (noted, see ``config_taken``)."""
    note_config_taken()
    overwrites = hparams.get(OVERWRITE_KEY) or {}
    if not isinstance(overwrites, Mapping):
        raise DsatError(
            f"hyperparameters.{OVERWRITE_KEY} must be a mapping of DeepSpeed keys to values, "
            f"got {type(overwrites).__name__}; remove it (dsat sets it in each trial)"
        )
    return anchored_result_paths(overwrites)


def get_ds_config_from_hparams(
    hparams: Mapping[str, Any], base_dir: str | Path = "."
) -> dict[str, Any]:
    """The trial's DeepSpeed config: the JSON named by the hyperparameters plus dsat's overrides."""
    relative = hparams.get(DS_CONFIG_KEY)
    if relative is not None and not isinstance(relative, str):  # a dict, as a config inline
        raise DsatError(
            f"hyperparameters.{DS_CONFIG_KEY} is a {type(relative).__name__}, not a path; set "
            "it to the path of your DeepSpeed JSON in the experiment YAML"
        )
    if not isinstance(relative, str) or not relative:
        raise DsatError(
            f"hyperparameters.{DS_CONFIG_KEY} is missing; set it to the path of your DeepSpeed "
            "JSON in the experiment YAML"
        )
    path = Path(base_dir) / relative
    moved = trial_directory() / path  # where it is if the script moved (os.chdir) after it started
    if not path.is_file() and moved.is_file():
        path = moved
    if not path.is_absolute() and not path.is_file():
        # The YAML's path was checked at launch: read from elsewhere, the script has changed
        # its working directory (os.chdir), and "fix the path" sent the user to a right one.
        raise DsatError(
            f"hyperparameters.{DS_CONFIG_KEY}: {path} is not in the working directory "
            f"{os.getcwd()}; the trial starts in the directory that holds it: call "
            "get_ds_config_from_hparams before changing directory, or pass base_dir="
        )
    base = load_ds_json(path, f"hyperparameters.{DS_CONFIG_KEY}")
    overwrites = checked_overwrites(hparams)
    merged = deep_merge(base, overwrites)
    start_clock(overwrites, Precision.of(merged))  # a search trial: dsat times the steps itself
    return merged


def lengthen_offcluster_operations() -> None:
    """Have off-cluster ``det.core.init()`` hand out operations of the trial's length.

    Off a cluster Determined's searcher yields one operation of length 1, so the Core API idiom
    ``for batch in range(op.length)`` would stop before DeepSpeed measures anything. Under dsat's
    runners the operation gets the length a cluster would give (``ENV_TRIAL_LENGTH``), read
    when the context is made, so a process that runs trial after trial gives each its own. Done
    wherever a trial process starts (``import dsat``, a warm worker's or host's next trial) and
    not only in ``get_hparams``: a script may call ``det.core.init()`` first. Without the
    variable (a run by hand, a cluster) nothing is imported or changed."""
    if not os.environ.get(ENV_TRIAL_LENGTH, "").isdigit():
        return
    from determined.core import _searcher

    context = _searcher.DummySearcherContext
    original = getattr(context.__init__, "_dsat_original", context.__init__)

    def init(self: Any, dist: Any, length: int = 1) -> None:
        given = os.environ.get(ENV_TRIAL_LENGTH, "")
        original(self, dist, int(given) if given.isdigit() else length)

    init._dsat_original = original  # type: ignore[attr-defined]
    context.__init__ = init  # type: ignore[method-assign]


def get_hparams() -> dict[str, Any]:
    """The trial's hyperparameters, whether dsat's local runner or Determined launched it."""
    path = os.environ.get(ENV_HPARAMS_FILE)
    if path:
        try:
            hparams = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise DsatError(
                f"{ENV_HPARAMS_FILE}={path}: cannot read hyperparameters ({err})"
            ) from None
        if not isinstance(hparams, dict):
            raise DsatError(f"{ENV_HPARAMS_FILE}={path}: hyperparameters must be a JSON object")
        lengthen_offcluster_operations()
        return hparams
    import determined

    info = determined.get_cluster_info()  # type: ignore[attr-defined]  # public, re-exported
    if info is not None and info.task_type == "TRIAL":
        return dict(info.trial.hparams)
    raise DsatError(
        "no trial hyperparameters: launch this script with `python3 -m dsat ...` or on a "
        f"Determined cluster, or set {ENV_HPARAMS_FILE} to a JSON file of hyperparameters"
    )
