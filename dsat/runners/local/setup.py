"""The local runner checked against the experiment, then opened on this machine."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

from dsat.experiment.config import Experiment
from dsat.experiment.settings import SearchSettings
from dsat.runners.local.deepspeed_ops import build_ops, ops_for_trials
from dsat.runners.local.entrypoint import entrypoint_tokens, require_command
from dsat.runners.local.machine_claims import ClaimedSlots, claim_slots, lock_dir
from dsat.runners.local.runner import LocalRunner
from dsat.runners.local.slots import SlotPool, claimable_slots
from dsat.runners.local.trial_processes import stop_leftover_trials
from dsat.runners.local.trial_timeout import TrialTimeout

OPS_LOG = "deepspeed-ops.log"


def hosts_trials(asked: bool | None) -> bool:
    """Whether one-slot trials run in a trial host: as asked (``--trial-host`` /
    ``--no-trial-host``), else yes. On the CPU a hosted trial was measured faster than a forked
    one and nearer a fresh process's throughput; on an H100 faster than a fresh process, where
    importing DeepSpeed starts the CUDA driver and so leaves the warm worker nothing to fork
    (benchmarks/README.md)."""
    return True if asked is None else asked


@dataclasses.dataclass(frozen=True)
class LocalSetup:
    settings: SearchSettings
    experiment: Experiment
    entrypoint: tuple[str, ...]
    pool: SlotPool
    claimable: tuple[str, ...]  # the slots of the machine this search may claim
    needed: int  # how many of them
    lock_dir: Path
    # Released when the setup is dropped (a search run in-process) or when dsat exits.
    claimed: list[ClaimedSlots] = dataclasses.field(default_factory=list, compare=False)

    @classmethod
    def prepare(
        cls, settings: SearchSettings, experiment: Experiment, environ: Mapping[str, str]
    ) -> LocalSetup:
        """The entrypoint's command must exist and the machine must have the trial's slots."""
        config_path = str(experiment.config_path)
        entrypoint = tuple(entrypoint_tokens(experiment.config.get("entrypoint"), config_path))
        require_command(entrypoint, config_path)
        resumed = settings.resume is not None
        slots = experiment.slots_per_trial
        pool = SlotPool.for_machine(slots, settings.max_slots, dict(environ), resumed)
        claimable, needed = claimable_slots(pool, dict(environ))
        return cls(
            settings, experiment, entrypoint, pool, tuple(claimable), needed, lock_dir(environ)
        )

    def open(self, results_dir: Path) -> LocalRunner:
        """The runner, with the machine made ready: its slots claimed from other searches on it
        (waiting while they hold them), nothing left running by an earlier dsat for this search,
        DeepSpeed's ops built once, the trial timeout chosen."""
        pool = self.claim(results_dir)
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
            trial_host=hosts_trials(self.settings.trial_host),
        )
        build_ops(
            ops_for_trials(self.experiment.ds_config, pool.on_gpu, self.settings.offload),
            runner.op_build_environment(),
            results_dir / "logs" / OPS_LOG,
        )
        print(f"dsat: {timeout.describe()}")
        return runner

    def claim(self, results_dir: Path) -> SlotPool:
        """The pool's slots, held for this search until dsat exits; on a GPU the first free
        ones of the visible GPUs, so two searches capped by --max-slots share a machine."""
        claimed = claim_slots(
            self.claimable, self.needed, self.lock_dir, results_dir, self.pool.on_gpu
        )
        self.claimed.append(claimed)
        return SlotPool(claimed.slots, on_gpu=True) if self.pool.on_gpu else self.pool
