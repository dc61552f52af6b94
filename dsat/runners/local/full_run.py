"""``--run-full-experiment`` on this machine: the user's entrypoint once, with the best config.

The local runner starts it like a trial (a fresh copy of the model dir, the same launcher and
slots) but without the autotuning block, so DeepSpeed trains for the script's full length; here
its output streams to the terminal and to ``logs/full-experiment.log``.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO

from dsat.paths import shown
from dsat.runners.local.trial_processes import kill_process_group

# Starts the full run with its output on a pipe, having written its command into the log first.
FullRunStarter = Callable[[IO[bytes]], tuple["subprocess.Popen[bytes]", list[str]]]
# How long the output of a full run that exited may still come (what its last children print)
# before what it left running is stopped; each one holds the pipe open.
OUTPUT_AFTER_EXIT_S = 5.0


class FullExperimentFailed(Exception):
    """The full training run with the best config exited non-zero (exit status 1)."""


def run_to_the_end(
    log_path: Path, start: FullRunStarter, stop_left_running: Callable[[], None]
) -> None:
    """Run what ``start`` starts, streaming its output, until it exits; then stop what it left
    running (``stop_left_running``). Its output is read beside it: a process it left running
    keeps the pipe open, and reading to the pipe's end waited for that process, not the run."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        process, command = start(log)
        print(f"dsat: $ {' '.join(command)}", flush=True)
        assert process.stdout is not None  # the starter pipes stdout
        streaming = threading.Thread(target=_stream, args=(process.stdout, log), daemon=True)
        streaming.start()
        try:
            code = process.wait()
            streaming.join(OUTPUT_AFTER_EXIT_S)
        except KeyboardInterrupt:
            kill_process_group(process)
            raise
        finally:
            stop_left_running()
            streaming.join(OUTPUT_AFTER_EXIT_S)  # the pipe's end, once what held it is gone
    if code != 0:
        raise FullExperimentFailed(
            f"the full experiment with the best config exited with code {code}; "
            f"its log is {shown(log_path)}"
        )
    print(f"dsat: full experiment finished; its log is {shown(log_path)}")


def _stream(output: IO[bytes], log: IO[bytes]) -> None:
    """Copy the run's output to its log and to the terminal, line by line, to its end (or to
    the log's closing, where a process that hides from ``stop_left_running`` holds the pipe).
    Each line reaches the log's file at once: a dsat killed with SIGKILL lost up to the last
    8 KiB of the user's training log, all of it in a short run."""
    with contextlib.suppress(ValueError):  # written to once closed
        for line in output:
            log.write(line)
            log.flush()
            sys.stdout.buffer.write(line)
            sys.stdout.flush()
