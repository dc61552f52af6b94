"""``--run-full-experiment`` on this machine: the user's entrypoint once, with the best config.

It runs like a trial (a fresh copy of the model dir, the same launcher and slots) but without the
autotuning block, so DeepSpeed trains for the script's full length; its output streams to the
terminal and to ``logs/full-experiment.log``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from dsat.paths import shown
from dsat.runners.local.executor import HPARAMS_FILE, LocalExecutor, prepare_trial_directory
from dsat.runners.local.trial_processes import kill_process_group

FULL_RUN_DIR = "full-experiment"


class FullExperimentFailed(Exception):
    """The full training run with the best config exited non-zero (exit status 1)."""


def run_full_experiment(executor: LocalExecutor, hparams: dict[str, Any]) -> Path:
    """Run to the end, streaming output; returns the working directory it ran in."""
    results_dir = executor.results_dir
    directory = results_dir / FULL_RUN_DIR
    prepare_trial_directory(directory, executor.model_dir, executor.includes, hparams, results_dir)
    slots = executor.pool.take(executor.slots_per_trial)
    log_path = results_dir / "logs" / f"{FULL_RUN_DIR}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"dsat: full experiment in {shown(directory)} ({HPARAMS_FILE} holds the best overrides)")
    with log_path.open("wb") as log:
        process, command = executor.spawn(directory, slots, subprocess.PIPE, log)
        print(f"dsat: $ {' '.join(command)}", flush=True)
        try:
            assert process.stdout is not None  # stdout=PIPE above
            for line in process.stdout:
                log.write(line)
                sys.stdout.buffer.write(line)
                sys.stdout.flush()
            code = process.wait()
        except KeyboardInterrupt:
            kill_process_group(process)
            raise
        finally:
            executor.pool.give_back(slots)
    if code != 0:
        raise FullExperimentFailed(
            f"the full experiment with the best config exited with code {code}; "
            f"its log is {shown(log_path)}"
        )
    print(f"dsat: full experiment finished; its log is {shown(log_path)}")
    return directory
