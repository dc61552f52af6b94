"""dsat: find the fastest DeepSpeed configuration for your model on your hardware.

Trial code needs only these functions; importing dsat loads neither torch nor DeepSpeed (in a
trial that dsat runs, it loads Determined's Core API, which the trial uses anyway).
"""

import sys

# Before anything that needs 3.10: on a cluster the uploaded package runs on the image's Python.
if sys.version_info < (3, 10):  # noqa: UP036 (pip enforces it; an upload does not)
    raise SystemExit(
        f"dsat needs Python 3.10 or later; {sys.executable} is {sys.version.split()[0]}: on "
        "Determined, give the experiment an image with Python 3.10+ (environment.image)"
    )

from dsat.errors import DsatError
from dsat.training.hf_args import get_hf_args_with_overwrites
from dsat.training.reporting import dsat_reporting_context
from dsat.training.trial_config import (
    get_ds_config_from_hparams,
    get_hparams,
    lengthen_offcluster_operations,
    overwrite_deepspeed_config,
)

lengthen_offcluster_operations()  # in a trial only: before any det.core.init() of the script

__all__ = [
    "DsatError",
    "dsat_reporting_context",
    "get_ds_config_from_hparams",
    "get_hf_args_with_overwrites",
    "get_hparams",
    "overwrite_deepspeed_config",
]
__version__ = "0.1.0"
