"""The simulated runner checked against the settings: its performance function loads."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

from dsat.errors import DsatError
from dsat.experiment.config import Experiment
from dsat.experiment.function_path import load_callable
from dsat.experiment.settings import SearchSettings
from dsat.runners.simulated.runner import NO_FULL_RUN, PerformanceFunction, SimulatedRunner


@dataclasses.dataclass(frozen=True)
class SimulatedSetup:
    function: PerformanceFunction
    slots_per_trial: int

    @classmethod
    def prepare(
        cls, settings: SearchSettings, experiment: Experiment, environ: Mapping[str, str]
    ) -> SimulatedSetup:
        if settings.run_full_experiment:
            raise DsatError(NO_FULL_RUN)
        if settings.simulator is None:
            raise DsatError("--runner simulated needs --simulator MODULE_OR_FILE:FUNCTION")
        return cls(load_callable(settings.simulator, "--simulator"), experiment.slots_per_trial)

    def open(self, results_dir: Path) -> SimulatedRunner:
        return SimulatedRunner(self.function, self.slots_per_trial)
