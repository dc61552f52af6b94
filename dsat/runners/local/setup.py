"""The local runner checked against the experiment, then opened on this machine."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

from dsat.experiment.config import Experiment
from dsat.experiment.settings import SearchSettings
from dsat.runners.local.deepspeed_ops import build_ops, ops_for_trials
from dsat.runners.local.entrypoint import entrypoint_tokens, require_command
from dsat.runners.local.runner import LocalRunner
from dsat.runners.local.slots import SlotPool
from dsat.runners.local.trial_processes import stop_leftover_trials
from dsat.runners.local.trial_timeout import TrialTimeout

OPS_LOG = "deepspeed-ops.log"


@dataclasses.dataclass(frozen=True)
class LocalSetup:
    settings: SearchSettings
    experiment: Experiment
    entrypoint: tuple[str, ...]
    pool: SlotPool

    @classmethod
    def prepare(
        cls, settings: SearchSettings, experiment: Experiment, environ: Mapping[str, str]
    ) -> LocalSetup:
        """The entrypoint's command must exist and the machine must have the trial's slots."""
        config_path = str(experiment.config_path)
        entrypoint = tuple(entrypoint_tokens(experiment.config.get("entrypoint"), config_path))
        require_command(entrypoint, config_path)
        pool = SlotPool.for_machine(experiment.slots_per_trial, settings.max_slots, dict(environ))
        return cls(settings, experiment, entrypoint, pool)

    def open(self, results_dir: Path) -> LocalRunner:
        """The runner, with the machine made ready: nothing left running by an earlier dsat for
        this search, DeepSpeed's ops built once, the trial timeout chosen."""
        pool = self.pool
        kind = "GPU" if pool.on_gpu else "CPU"
        print(f"dsat: {pool.size} {kind} slot(s) on this machine: {', '.join(pool.slots)}")
        timeout = TrialTimeout(self.settings.trial_timeout)
        if self.settings.resume is not None:
            stopped = stop_leftover_trials(results_dir)
            if stopped:
                print(f"dsat: stopped {stopped} process(es) an earlier run left for this search")
            timeout.resume_from(results_dir)
        runner = LocalRunner(
            list(self.entrypoint),
            self.experiment.model_dir,
            self.experiment.includes,
            results_dir,
            pool,
            self.experiment.slots_per_trial,
            timeout,
            warm=not self.settings.fresh_processes,
        )
        build_ops(
            ops_for_trials(self.experiment.ds_config, pool.on_gpu),
            runner.op_build_environment(),
            results_dir / "logs" / OPS_LOG,
        )
        print(f"dsat: {timeout.describe()}")
        return runner
