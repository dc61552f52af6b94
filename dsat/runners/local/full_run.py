"""``--run-full-experiment`` on this machine: the user's entrypoint once, with the best config.

The local runner starts it like a trial (a fresh copy of the model dir, the same launcher and
slots) but without the autotuning block, so DeepSpeed trains for the script's full length; here
its output streams to the terminal and to ``logs/full-experiment.log``.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import IO

from dsat.paths import shown
from dsat.runners.local.trial_processes import kill_process_group

# Starts the full run with its output on a pipe, having written its command into the log first.
FullRunStarter = Callable[[IO[bytes]], tuple["subprocess.Popen[bytes]", list[str]]]


class FullExperimentFailed(Exception):
    """The full training run with the best config exited non-zero (exit status 1)."""


def run_to_the_end(log_path: Path, start: FullRunStarter) -> None:
    """Run what ``start`` starts, streaming its output, until it exits."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        process, command = start(log)
        print(f"dsat: $ {' '.join(command)}", flush=True)
        try:
            assert process.stdout is not None  # the starter pipes stdout
            for line in process.stdout:
                log.write(line)
                sys.stdout.buffer.write(line)
                sys.stdout.flush()
            code = process.wait()
        except KeyboardInterrupt:
            kill_process_group(process)
            raise
    if code != 0:
        raise FullExperimentFailed(
            f"the full experiment with the best config exited with code {code}; "
            f"its log is {shown(log_path)}"
        )
    print(f"dsat: full experiment finished; its log is {shown(log_path)}")
