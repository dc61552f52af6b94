"""Runners turn trial requests into running trials; this module picks one."""

from __future__ import annotations

import enum
from collections.abc import Mapping

from dsat.constants import ENV_DET_MASTER


class Backend(str, enum.Enum):
    """Where trials run."""

    LOCAL = "local"  # processes on this machine; the embedded default
    DETERMINED = "determined"  # a custom-searcher experiment on a Determined cluster
    SIMULATED = "simulated"  # a performance function instead of training


def resolve_backend(requested: str, environ: Mapping[str, str]) -> tuple[Backend, str]:
    """The backend to use and why: ``auto`` follows DET_MASTER, like Determined's own CLI."""
    if requested != "auto":
        return Backend(requested), "chosen with --backend"
    if environ.get(ENV_DET_MASTER):
        return Backend.DETERMINED, f"{ENV_DET_MASTER} is set"
    return Backend.LOCAL, f"{ENV_DET_MASTER} is not set"
