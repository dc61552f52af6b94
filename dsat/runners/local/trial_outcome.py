"""What a finished local trial left behind, read as its outcome.

DeepSpeed's metrics (through ``dsat_reporting_context``'s outcome file, or DeepSpeed's own files)
mean completed, even where a process crashed after writing them, unless for memory; an OOM
signature, oom; the timeout, timeout; anything else, error. Each failure
says why in its first line and whom it blames (``dsat.trial_failure``), the log's last lines after.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

from dsat.constants import TRIAL_OUTCOME_FILE
from dsat.training.oom import text_shows_out_of_memory
from dsat.training.reporting import read_autotuning_result
from dsat.trial import TrialStatus
from dsat.trial_failure import FailureCause, diagnose_crash, exception_lines

LOG_TAIL_LINES = 20
LOG_SCAN_BYTES = 256 * 1024
CGROUP_EVENTS = Path("/sys/fs/cgroup/memory.events")


def log_end(path: Path, start: int = 0) -> str:
    """The last part of a log, from byte ``start`` at the earliest: where a crash, an OOM report
    or torchrun's summary ends up."""
    try:
        with path.open("rb") as handle:
            handle.seek(max(start, path.stat().st_size - LOG_SCAN_BYTES))
            return handle.read().decode(errors="replace")
    except OSError:
        return ""


def log_tail(text: str, lines: int = LOG_TAIL_LINES) -> str:
    return "\n".join(text.splitlines()[-lines:])


def oom_kill_count() -> int | None:
    """How many processes the kernel's out-of-memory killer has ended, on this machine and in
    this container's cgroup together; None where neither is readable. A trial killed by SIGKILL
    while this rose was out of memory; one killed while it stood still was killed from outside."""
    total, known = 0, False
    for path, key in ((Path("/proc/vmstat"), "oom_kill"), (CGROUP_EVENTS, "oom_kill")):
        try:
            for line in path.read_text().splitlines():
                name, _, value = line.partition(" ")
                if name == key:
                    total, known = total + int(value), True
        except (OSError, ValueError):
            continue
    return total if known else None


def oom_killed_since(count_at_start: int | None) -> bool | None:
    now = oom_kill_count()
    if count_at_start is None or now is None:
        return None
    return now > count_at_start


class TrialEnd(NamedTuple):
    status: TrialStatus
    metrics: dict[str, Any]
    error: str | None  # its first line is the one-line reason
    cause: FailureCause | None


def classify(
    directory: Path,
    log_path: Path,
    code: int | None,
    timed_out: bool,
    timeout: float,
    oom_killed: bool | None = None,
    log_start: int = 0,
) -> TrialEnd:
    """What a finished trial's exit ``code``, its outcome file in ``directory`` and its log (from
    byte ``log_start``: this run's part) say about it. ``oom_killed``: whether the kernel's OOM
    killer struck while it ran (None: unknown), which tells a SIGKILL from outside from one for
    memory."""
    outcome_path = directory / TRIAL_OUTCOME_FILE
    outcome: dict[str, Any] = {}
    if outcome_path.is_file():
        try:
            outcome = json.loads(outcome_path.read_text())
        except (OSError, json.JSONDecodeError):
            outcome = {}
    text = log_end(log_path, log_start)
    tail = log_tail(text)
    if timed_out:
        reason = f"stopped after the trial timeout of {timeout:g} s"
        return TrialEnd(TrialStatus.TIMEOUT, {}, f"{reason}\n{tail}", FailureCause.UNKNOWN)
    completed = outcome.get("status") == "completed"
    if completed and code == 0:
        return TrialEnd(TrialStatus.COMPLETED, dict(outcome.get("values", {})), None, None)
    if code == 0:
        result = read_autotuning_result(directory)  # the script reported without dsat
        if result is not None:
            return TrialEnd(TrialStatus.COMPLETED, result.values, None, None)
    if code == 0 and outcome.get("status") == "incomplete":
        needed = outcome.get("needed")
        reason = (
            f"training ended after {outcome.get('steps')} optimizer steps; dsat needs {needed} to "
            f"measure this configuration: let the training loop run at least {needed} steps (the "
            f"searcher operation's length, op.length, is {needed}; an HF Trainer's --max_steps; "
            "a loop over one epoch of the data ends sooner at a larger micro-batch: cycle it)"
        )
        return TrialEnd(TrialStatus.ERROR, {}, f"{reason}\n{tail}", FailureCause.SCRIPT)
    if outcome.get("status") == "oom" or text_shows_out_of_memory(text):
        # The rank that ran out, not a peer's NCCL error that followed it.
        lines = exception_lines(text)
        oom_line = next((line for line in reversed(lines) if text_shows_out_of_memory(line)), None)
        reason = oom_line or (lines[-1] if lines else "out of memory")
        return TrialEnd(TrialStatus.OOM, {}, f"{reason}\n{tail}", FailureCause.CONFIG)
    if code == 0:
        reason = (
            "the script exited without reporting metrics: train inside "
            "dsat.dsat_reporting_context (or with DeepSpeed's autotuning enabled)"
        )
        return TrialEnd(TrialStatus.ERROR, {}, f"{reason}\n{tail}", FailureCause.SCRIPT)
    diagnosis = diagnose_crash(text, code, oom_killed)
    if completed and not diagnosis.out_of_memory:
        # Rank 0 writes the metrics after every rank's measured steps, so a crash after them
        # that is not for memory (most often a process group's threads torn down at interpreter
        # exit: exit -6, "terminate called without an active exception") does not undo them.
        return TrialEnd(TrialStatus.COMPLETED, dict(outcome.get("values", {})), None, None)
    status = TrialStatus.OOM if diagnosis.out_of_memory else TrialStatus.ERROR
    return TrialEnd(status, {}, f"{diagnosis.reason}\n{tail}", diagnosis.cause)
