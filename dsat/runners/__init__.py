"""Runners turn trial requests into running trials; this module picks one."""

from __future__ import annotations

import enum
from collections.abc import Mapping

from dsat.constants import ENV_DET_MASTER, ENV_RAY_ADDRESS


class RunnerKind(str, enum.Enum):
    """Where trials run."""

    LOCAL = "local"  # processes on this machine; the embedded default
    RAY = "ray"  # placement groups on a Ray cluster
    DETERMINED = "determined"  # a custom-searcher experiment on a Determined cluster
    SIMULATED = "simulated"  # a performance function instead of training


def resolve_runner(
    requested: str, environ: Mapping[str, str], ray_address: str | None = None
) -> tuple[RunnerKind, str]:
    """The runner to use and why: ``auto`` follows ``--ray-address``, then DET_MASTER, like
    Determined's own CLI, then RAY_ADDRESS, like Ray's."""
    if requested != "auto":
        return RunnerKind(requested), "chosen with --runner"
    if ray_address:
        return RunnerKind.RAY, "--ray-address is given"
    if environ.get(ENV_DET_MASTER):
        return RunnerKind.DETERMINED, f"{ENV_DET_MASTER} is set"
    if environ.get(ENV_RAY_ADDRESS):
        return RunnerKind.RAY, f"{ENV_RAY_ADDRESS} is set and {ENV_DET_MASTER} is not"
    return RunnerKind.LOCAL, f"neither {ENV_DET_MASTER} nor {ENV_RAY_ADDRESS} is set"
