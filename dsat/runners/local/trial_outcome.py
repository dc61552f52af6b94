"""What a finished local trial left behind, read as its outcome.

DeepSpeed's metrics (through ``dsat_reporting_context``'s outcome file, or DeepSpeed's own files)
mean completed; an OOM signature, oom; the timeout, timeout; anything else, error with the log's
last lines.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

from dsat.constants import TRIAL_OUTCOME_FILE
from dsat.training.oom import text_shows_out_of_memory
from dsat.training.reporting import read_autotuning_result
from dsat.trial import TrialStatus

LOG_TAIL_LINES = 20
LOG_SCAN_BYTES = 256 * 1024


def log_end(path: Path) -> str:
    """The last part of a log: where a crash, an OOM report or torchrun's summary ends up."""
    try:
        with path.open("rb") as handle:
            handle.seek(max(0, path.stat().st_size - LOG_SCAN_BYTES))
            return handle.read().decode(errors="replace")
    except OSError:
        return ""


def log_tail(text: str, lines: int = LOG_TAIL_LINES) -> str:
    return "\n".join(text.splitlines()[-lines:])


def classify(
    directory: Path, log_path: Path, code: int | None, timed_out: bool, timeout: float
) -> tuple[TrialStatus, dict[str, Any], str | None]:
    """What a finished trial's exit ``code``, its outcome file in ``directory`` and its log say
    about it."""
    outcome_path = directory / TRIAL_OUTCOME_FILE
    outcome: dict[str, Any] = {}
    if outcome_path.is_file():
        try:
            outcome = json.loads(outcome_path.read_text())
        except (OSError, json.JSONDecodeError):
            outcome = {}
    text = log_end(log_path)
    if timed_out:
        return (
            TrialStatus.TIMEOUT,
            {},
            f"stopped after the trial timeout of {timeout:g} s\n{log_tail(text)}",
        )
    if outcome.get("status") == "completed" and code == 0:
        return TrialStatus.COMPLETED, dict(outcome.get("values", {})), None
    if code == 0:
        result = read_autotuning_result(directory)  # the script reported without dsat
        if result is not None:
            return TrialStatus.COMPLETED, result.values, None
    tail = log_tail(text)
    if code == 0 and outcome.get("status") == "incomplete":
        needed = outcome.get("needed")
        return (
            TrialStatus.ERROR,
            {},
            f"DeepSpeed stopped after {outcome.get('steps')} steps; it needs {needed} to measure "
            f"this configuration: let the training loop run at least {needed} steps (the "
            f"searcher operation's length, op.length, is {needed})\n{tail}",
        )
    if outcome.get("status") == "oom" or text_shows_out_of_memory(text):
        return TrialStatus.OOM, {}, tail
    if code == -signal.SIGKILL:  # not dsat's doing (that is a timeout): the kernel's OOM killer
        return TrialStatus.OOM, {}, f"killed by SIGKILL, most likely out of host memory\n{tail}"
    reason = f"exit code {code}" if code else "exited without DeepSpeed's autotuning results"
    return TrialStatus.ERROR, {}, f"{reason}\n{tail}"
