"""What a finished local trial left behind, read as its outcome.

DeepSpeed's metrics (through ``dsat_reporting_context``'s outcome file, or DeepSpeed's own files)
mean completed, even where a process crashed after writing them, unless for memory; an OOM
signature, oom; the timeout, timeout; anything else, error. Each failure
says why in its first line and whom it blames (``dsat.trial_failure``), the log's last lines after.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from dsat.constants import CONFIG_NOT_TAKEN, OOM_MARKER, TRIAL_OUTCOME_FILE
from dsat.training.oom import text_shows_out_of_memory
from dsat.training.reporting import read_autotuning_result
from dsat.trial import TrialStatus
from dsat.trial_failure import (
    EXCEPTION_LINE,
    FailureCause,
    diagnose_crash,
    exception_lines,
    lost_a_peer,
    not_the_machines,
    one_line,
    reporting_rank_left_first,
    said_lines,
)

LOG_TAIL_LINES = 20
# The lines after an exception's own that may still be its message (NCCL's "Last error:", then
# "Cuda failure 'out of memory'").
MESSAGE_LINES = 5
LOG_SCAN_BYTES = 256 * 1024
CGROUP_EVENTS = Path("/sys/fs/cgroup/memory.events")
# How long a trial that wrote its result may take to exit (DeepSpeed's and the process group's
# teardown) before what keeps it alive is stopped.
LINGER_S = 60.0
LINGERED = (
    "dsat: the trial wrote its result {seconds:.0f} s ago and has not exited since (a thread or "
    "a process it started keeps it alive): stopped, its result kept"
)
RAN_ON_TO_TIMEOUT = (
    "dsat: the trial wrote its result and ran on to the trial timeout of {timeout:g} s (a process "
    "of it did not exit): stopped, its result kept"
)


# A data iterator exhausted inside the training loop: ``next()`` on it raised, or a generator
# that called it did (PEP 479 turns that into this RuntimeError).
DATA_RAN_OUT = re.compile(
    r"^(?:\[rank\d+\]:\s*)?(?:RuntimeError: generator raised )?StopIteration\b", re.MULTILINE
)


def data_ran_out(log: str) -> bool:
    """Whether a process of the trial ended on an exhausted iterator (an epoch's end)."""
    return DATA_RAN_OUT.search("\n".join(said_lines(log))) is not None


def stopped_note(
    directory: Path, timed_out: bool, timeout: float, lingered: float | None
) -> str | None:
    """The line that says why dsat stopped a trial that wrote its result, if it did."""
    if lingered is not None:
        return LINGERED.format(seconds=lingered)
    if timed_out and reported(directory):
        return RAN_ON_TO_TIMEOUT.format(timeout=timeout)
    return None


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


def read_outcome(directory: Path) -> dict[str, Any]:
    """The trial's outcome file, where it is a JSON object whose "values", if any, are one too;
    empty otherwise (absent, torn, or overwritten by the script with something else): then the
    trial is judged by its exit and its log."""
    try:
        outcome = json.loads((directory / TRIAL_OUTCOME_FILE).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(outcome, dict) or not isinstance(outcome.get("values", {}), dict):
        return {}
    return outcome


def reported(directory: Path) -> bool:
    """Whether the trial in ``directory`` has written its result."""
    return read_outcome(directory).get("status") == "completed"


@dataclasses.dataclass
class ResultWatch:
    """Whether a running trial wrote its result long ago: one still running ``LINGER_S`` after
    is kept alive by something it started (a thread, a child), not by its training, and is
    stopped with its result kept. Looks once a second."""

    linger_s: float = LINGER_S
    reported_at: float | None = None  # when its result was first seen written
    looked: float = -1.0

    def lingered(self, now: float, has_reported: Callable[[], bool]) -> float | None:
        """Seconds since its result was written, once past ``linger_s``; None until then."""
        if self.reported_at is None:
            if now - self.looked >= 1.0:
                self.looked = now
                if has_reported():
                    self.reported_at = now
            return None
        waited = now - self.reported_at
        return waited if waited > self.linger_s else None


def out_of_memory_line(text: str, exceptions: list[str]) -> str | None:
    """The line by which the log says the trial ran out of memory, if it does: an exception that
    ended a process of it (the last, the rank that ran out, not a peer's error after it), or
    dsat's own marker; or a line a layer printed (an allocator's message, NCCL's "Cuda failure
    'out of memory'") while no exception puts the crash down to the machine, and, where a
    process ended in an exception of its own, within the lines of that exception's message. A
    traceback's source line is not one, nor a note printed before an exception of another kind:
    each made a rank's ValueError or KeyError, or a taken port, an OOM of the configuration, and
    lowered its micro-batch ceiling."""
    found = next((line for line in reversed(exceptions) if text_shows_out_of_memory(line)), None)
    if found is not None:
        return found
    marker = next((line for line in text.splitlines() if OOM_MARKER in line), None)
    if marker is not None:  # dsat.training.reporting's, with the error's summary
        return one_line(marker.partition(OOM_MARKER)[2].lstrip(": ")) or "out of memory"
    if not_the_machines(exceptions) != exceptions:  # an exception puts it down to the machine
        return None
    said = said_lines(text)
    ended = [  # where a process's own exception (not a peer's lost connection) was said
        i
        for i, line in enumerate(said)
        if EXCEPTION_LINE.match(line.strip()) and not lost_a_peer(line)
    ]
    return next(
        (
            one_line(line)
            for i, line in enumerate(said)
            if text_shows_out_of_memory(line)
            and (not ended or any(0 < i - end <= MESSAGE_LINES for end in ended))
        ),
        None,
    )


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
    every_rank_here: bool = True,
) -> TrialEnd:
    """What a finished trial's exit ``code``, its outcome file in ``directory`` and its log (from
    byte ``log_start``: this run's part) say about it. ``timed_out``: dsat stopped it (its
    timeout, or ``LINGER_S`` after it reported). ``oom_killed``: whether the kernel's OOM
    killer struck while it ran (None: unknown), which tells a SIGKILL from outside from one for
    memory. ``every_rank_here``: the log's launcher ran every rank (one node), so its summary
    names every rank that failed; on one node of several, it names only that node's."""
    outcome = read_outcome(directory)
    text = log_end(log_path, log_start)
    tail = log_tail(text)
    completed = outcome.get("status") == "completed"
    if timed_out:
        if completed:  # it reported, then did not exit: dsat stopped it, the measurement stands
            return TrialEnd(TrialStatus.COMPLETED, dict(outcome.get("values", {})), None, None)
        reason = f"stopped after the trial timeout of {timeout:g} s"
        return TrialEnd(TrialStatus.TIMEOUT, {}, f"{reason}\n{tail}", FailureCause.UNKNOWN)
    if completed and code == 0:
        return TrialEnd(TrialStatus.COMPLETED, dict(outcome.get("values", {})), None, None)
    if code == 0:
        result = read_autotuning_result(directory)  # the script reported without dsat
        if result is not None:
            return TrialEnd(TrialStatus.COMPLETED, result.values, None, None)
    if outcome.get("status") == "incomplete" and (code == 0 or data_ran_out(text)):
        needed = outcome.get("needed")
        ended = "training ended" if code == 0 else "the data ran out (StopIteration)"
        reason = (
            f"{ended} after {outcome.get('steps')} optimizer steps; dsat needs {needed} to "
            f"measure this configuration: let the training loop run at least {needed} steps (the "
            f"searcher operation's length, op.length, is {needed}; an HF Trainer's --max_steps; "
            "a loop over one epoch of the data ends sooner at a larger micro-batch: cycle it)"
        )
        return TrialEnd(TrialStatus.ERROR, {}, f"{reason}\n{tail}", FailureCause.SCRIPT)
    lines = exception_lines(text)
    oom_line = out_of_memory_line(text, lines)
    if outcome.get("status") == "oom" or oom_line is not None:
        reason = oom_line or (lines[-1] if lines else "out of memory")
        return TrialEnd(TrialStatus.OOM, {}, f"{reason}\n{tail}", FailureCause.CONFIG)
    if code == 0 and outcome.get("status") == CONFIG_NOT_TAKEN:
        reason = (
            "the script built its DeepSpeed engine without the trial's config: pass "
            "dsat.get_ds_config_from_hparams(hparams) to deepspeed.initialize, not your own JSON"
        )
        return TrialEnd(TrialStatus.ERROR, {}, f"{reason}\n{tail}", FailureCause.SCRIPT)
    if code == 0:
        reason = (
            "the script exited without reporting metrics: train inside "
            "dsat.dsat_reporting_context (or with DeepSpeed's autotuning enabled)"
        )
        if not outcome and (directory / TRIAL_OUTCOME_FILE).is_file():
            reason = (
                f"the script exited, and its {TRIAL_OUTCOME_FILE} is not what "
                "dsat.dsat_reporting_context writes (torn, or overwritten by the script): leave "
                "that file to dsat"
            )
        return TrialEnd(TrialStatus.ERROR, {}, f"{reason}\n{tail}", FailureCause.SCRIPT)
    if (
        every_rank_here
        and not outcome
        and read_autotuning_result(directory) is None
        and reporting_rank_left_first(text)
    ):
        reason = (
            "rank 0 (the rank that reports) exited cleanly before the others without reporting "
            "metrics: the training script ended it early; the others then failed without it: "
            f"{diagnose_crash(text, code, oom_killed).reason}"
        )
        return TrialEnd(TrialStatus.ERROR, {}, f"{one_line(reason)}\n{tail}", FailureCause.SCRIPT)
    diagnosis = diagnose_crash(text, code, oom_killed)
    if completed and not diagnosis.out_of_memory:
        # Rank 0 writes the metrics after every rank's measured steps, so a crash after them
        # that is not for memory (most often a process group's threads torn down at interpreter
        # exit: exit -6, "terminate called without an active exception") does not undo them.
        return TrialEnd(TrialStatus.COMPLETED, dict(outcome.get("values", {})), None, None)
    status = TrialStatus.OOM if diagnosis.out_of_memory else TrialStatus.ERROR
    return TrialEnd(status, {}, f"{diagnosis.reason}\n{tail}", diagnosis.cause)
