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
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from dsat.constants import (
    CONFIG_NOT_TAKEN,
    HPARAMS_FILE,
    MEMORY_RAN_OUT,
    OOM_MARKER,
    OVERWRITE_KEY,
    ROWS_OVER_BATCH,
    RUN_ALONE,
    TRIAL_OUTCOME_FILE,
)
from dsat.experiment.settings import DEFAULT_END_PROFILE_STEP, DEFAULT_START_PROFILE_STEP
from dsat.training.batch_taken import (
    BATCH_CHANGED,
    BATCH_KEYS,
    batch_sizes_changed_reason,
    changed_batch_sizes,
)
from dsat.training.oom import (
    allocator_says_out_of_memory,
    host_memory_ran_out,
    memory_error_line,
    text_shows_out_of_memory,
)
from dsat.training.reporting import read_autotuning_result
from dsat.training.step_clock import measured_window
from dsat.trial import TrialStatus
from dsat.trial_failure import (
    FailureCause,
    diagnose_crash,
    exception_lines,
    final_exceptions,
    last_words,
    lost_a_peer,
    message_after,
    not_the_machines,
    one_line,
    peer_left_cleanly,
    reporting_rank_left_first,
    said_lines,
)

LOG_TAIL_LINES = 20
# The lines after an exception's own that may still be its message (NCCL's "Last error:", then
# "Cuda failure 'out of memory'").
MESSAGE_LINES = 5
LOG_SCAN_BYTES = 256 * 1024
LOG_SEARCH_BYTES = 8 * 2**20  # how far back a traceback is looked for where the scan has none
TRACEBACK_START = b"Traceback (most recent call last):"
TAIL_LINE_CHARS = 500
CGROUP_EVENTS = Path("/sys/fs/cgroup/memory.events")
# How long a trial that wrote its result may take to exit (DeepSpeed's and the process group's
# teardown) before what keeps it alive is stopped.
LINGER_S = 60.0
LINGERED = (
    "dsat: the trial wrote its result {seconds:.0f} s ago and has not exited since (its code "
    "after training blocks, or a thread or a process it started keeps it alive): stopped, its "
    "result kept"
)
RAN_ON_TO_TIMEOUT = (
    "dsat: the trial wrote its result and ran on to the trial timeout of {timeout:g} s (a process "
    "of it did not exit): stopped, its result kept"
)

# The steps a trial needs with the default profile window (--start-profile-step 3,
# --end-profile-step 5): more than this is the user's flags' doing.
DEFAULT_STEPS_NEEDED = measured_window(DEFAULT_START_PROFILE_STEP, DEFAULT_END_PROFILE_STEP)[1] + 1


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
    or torchrun's summary ends up. Where its last ``LOG_SCAN_BYTES`` hold no traceback, from the
    last one in its last ``LOG_SEARCH_BYTES``: an atexit summary of thousands of lines, or an
    exception's enormous message, came after it, and the reason was a line of either."""
    try:
        with path.open("rb") as handle:
            size = path.stat().st_size
            handle.seek(max(start, size - LOG_SCAN_BYTES))
            text = handle.read()
            if TRACEBACK_START not in text and size - LOG_SCAN_BYTES > start:
                handle.seek(max(start, size - LOG_SEARCH_BYTES))
                searched = handle.read()
                found = searched.rfind(TRACEBACK_START)
                if found >= 0:
                    text = searched[found:]
            return text.decode(errors="replace")
    except OSError:
        return ""


def own_output(text: str) -> list[str]:
    """The lines of a trial's log its processes printed: not dsat's own (its command line, its
    notes), nor blank."""
    return [
        line for line in text.splitlines() if line.strip() and not line.startswith(("$ ", "dsat: "))
    ]


def log_tail(text: str, lines: int = LOG_TAIL_LINES) -> str:
    """The last lines of a log, each cut to ``TAIL_LINE_CHARS``: a reason keeps them in
    trials.jsonl and the search's state, both written again after every trial (one enormous
    line put 256 KB in each row)."""
    return "\n".join(_cut(line) for line in text.splitlines()[-lines:])


# torchrun's own lines once dsat stops it: it passes the signal on to its processes, then its
# handler's traceback ends in a SignalException.
LAUNCHER_STOPPING = re.compile(
    r"Sending process \d+ closing signal SIG|death signal, shutting down workers"
    r"|SignalException: Process \d+ got signal"
)


def before_the_stop(text: str) -> str:
    """A stopped trial's log up to its launcher's reaction to the stop: the tail of a timed-out
    two-process trial was torchrun's 20-line shutdown traceback, and the script's last words
    (where it hung) were above it, left out."""
    found = LAUNCHER_STOPPING.search(text)
    return text if found is None else text[: text.rfind("\n", 0, found.start()) + 1]


def _cut(line: str) -> str:
    return line if len(line) <= TAIL_LINE_CHARS else line[: TAIL_LINE_CHARS - 3] + "..."


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


def out_of_memory_line(text: str, code: int | None) -> str | None:
    """The line by which the log says the trial ran out of memory, if it does: an exception that
    ended a process of it (``final_exceptions``: the rank that ran out, not a peer's error after
    it, nor an OOM the script caught and went on after), or dsat's own marker; or a line a layer
    printed (NCCL's "Cuda failure 'out of memory'") within the lines of the message of an
    exception that ended a process, while none puts the crash down to the machine; or, where no
    exception of its own ended a process, an allocator's message among its last words (a C++
    abort's). A traceback's source line is not one, nor a note or tip printed before the end:
    each made a ValueError, a KeyError, a taken port or an exit the script chose an OOM of the
    configuration, and lowered its micro-batch ceiling."""
    final = final_exceptions(text, code)
    found = next(
        (
            line
            for _, line in reversed(final)
            if text_shows_out_of_memory(line) or memory_error_line(line)
        ),
        None,
    )
    if found is not None:
        return found
    marker = next((line for line in text.splitlines() if OOM_MARKER in line), None)
    if marker is not None:  # dsat.training.reporting's, with the error's summary
        return one_line(marker.partition(OOM_MARKER)[2].lstrip(": ")) or "out of memory"
    lines = [line for _, line in final]
    if not_the_machines(lines) != lines:  # an exception puts it down to the machine
        return None
    ended = [number for number, line in final if not lost_a_peer(line)]
    if ended:
        said = said_lines(text)
        return next(
            (
                one_line(line)
                for number in ended
                for line in message_after(said, number, MESSAGE_LINES)
                if text_shows_out_of_memory(line)
            ),
            None,
        )
    return next(
        (
            one_line(line)
            for line in reversed(last_words(text))
            if allocator_says_out_of_memory(line)
        ),
        None,
    )


def config_not_taken(taken: bool, hf: bool) -> str:
    """Why the trial's engine ran the user's own JSON, and the fix for the script's kind: an HF
    Trainer script told to call deepspeed.initialize, or one that called dsat's helper and
    parsed its own arguments anyway told to "train inside dsat.dsat_reporting_context", which
    it did, was given a fix that was not its own."""
    if hf and taken:
        return (
            "the HF Trainer ran without the trial's config (its DeepSpeed engine had no "
            "autotuning block): build the TrainingArguments from the arguments "
            "dsat.get_hf_args_with_overwrites(args, hparams) returns (their --deepspeed is the "
            "trial's config), not from your own"
        )
    if hf:
        return (
            "the script built its DeepSpeed engine without the trial's config: pass its "
            "arguments through dsat.get_hf_args_with_overwrites(args, hparams) and build the "
            "TrainingArguments from what it returns"
        )
    if taken:
        return (
            "the script's DeepSpeed engine ran without the trial's config (it had no autotuning "
            "block): pass what dsat.get_ds_config_from_hparams(hparams) returns to "
            "deepspeed.initialize, not your own JSON"
        )
    return (
        "the script built its DeepSpeed engine without the trial's config: pass "
        "dsat.get_ds_config_from_hparams(hparams) to deepspeed.initialize, not your own JSON"
    )


def _caught(text: str) -> str:
    """Where a script that exited 0 had caught an exception, which: what ended its training early
    (it was told only to let the loop run longer)."""
    lines = exception_lines(text)
    return f" (the log's last exception, which the script caught: {lines[-1]})" if lines else ""


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
    on_gpu: bool = False,
    shared: bool = False,
) -> TrialEnd:
    """What a finished trial's exit ``code``, its outcome file in ``directory`` and its log (from
    byte ``log_start``: this run's part) say about it. ``timed_out``: dsat stopped it (its
    timeout, or ``LINGER_S`` after it reported). ``oom_killed``: whether the kernel's OOM
    killer struck while it ran (None: unknown), which tells a SIGKILL from outside from one for
    memory. ``every_rank_here``: the log's launcher ran every rank (one node), so its summary
    names every rank that failed; on one node of several, it names only that node's.
    ``on_gpu``: it ran on GPUs, so an OOM of the host's memory is not one of the device's
    (``MEMORY_RAN_OUT`` in its metrics says so). ``shared``: other trials ran on this machine
    while it ran, so the host's memory running out says as much of theirs as of its own: the
    machine is blamed, and the trial runs again alone (``RUN_ALONE`` in its metrics)."""
    outcome = read_outcome(directory)
    text = log_end(log_path, log_start)
    tail = log_tail(text)
    if outcome.get("status") == BATCH_CHANGED and isinstance(outcome.get("error"), str):
        return TrialEnd(TrialStatus.ERROR, {}, f"{outcome['error']}\n{tail}", FailureCause.SCRIPT)
    completed = outcome.get("status") == "completed"
    fed_more = script_batch_note(outcome) if completed else None
    if fed_more is not None:
        return TrialEnd(TrialStatus.ERROR, {}, f"{fed_more}\n{tail}", FailureCause.SCRIPT)
    if timed_out:
        if completed:  # it reported, then did not exit: dsat stopped it, the measurement stands
            return TrialEnd(TrialStatus.COMPLETED, dict(outcome.get("values", {})), None, None)
        reason = f"stopped after the trial timeout of {timeout:g} s"
        before = log_tail(before_the_stop(text))  # where it was, not torchrun's shutdown
        return TrialEnd(TrialStatus.TIMEOUT, {}, f"{reason}\n{before}", FailureCause.UNKNOWN)
    if completed and code == 0:
        return TrialEnd(TrialStatus.COMPLETED, dict(outcome.get("values", {})), None, None)
    if code == 0:
        result = read_autotuning_result(directory)  # the script reported without dsat
        if result is not None:
            return TrialEnd(TrialStatus.COMPLETED, result.values, None, None)
    caught = _caught(text) if code == 0 else ""
    if outcome.get("status") == "incomplete" and (code == 0 or data_ran_out(text)):
        needed = outcome.get("needed")
        ended = "training ended" if code == 0 else "the data ran out (StopIteration)"
        reason = (
            f"{ended} after {outcome.get('steps')} optimizer steps{caught}; dsat needs {needed} to "
            f"measure this configuration: let the training loop run at least {needed} steps (the "
            f"searcher operation's length, op.length, is {needed}; an HF Trainer's --max_steps; "
            "a loop over one epoch of the data ends sooner at a larger micro-batch: cycle it)"
        )
        if isinstance(needed, int) and needed > DEFAULT_STEPS_NEEDED:
            # Set by the profile flags, which the fix above left out (and the screen cut off).
            reason = (
                f"{ended} after {outcome.get('steps')} optimizer steps{caught}; the profile "
                f"window of --start-profile-step/--end-profile-step needs {needed}: lower them, "
                f"or let the training loop run at least {needed} steps"
            )
        return TrialEnd(TrialStatus.ERROR, {}, f"{reason}\n{tail}", FailureCause.SCRIPT)
    oom_line = out_of_memory_line(text, code)
    if outcome.get("status") == "oom" or oom_line is not None:
        lines = exception_lines(text)
        reason = oom_line or (lines[-1] if lines else "out of memory")
        host = host_memory_ran_out(reason)
        return _out_of_memory(reason, tail, host, on_gpu, shared, FailureCause.CONFIG)
    if code == 0 and outcome.get("status") == CONFIG_NOT_TAKEN:
        reason = config_not_taken(bool(outcome.get("taken")), bool(outcome.get("hf")))
        return TrialEnd(TrialStatus.ERROR, {}, f"{reason}\n{tail}", FailureCause.SCRIPT)
    if code == 0:
        said = own_output(text)
        last = f"; its last line: {one_line(said[-1])}" if said and not caught else ""
        reason = (
            f"the script exited without reporting metrics{caught}{last}: train inside "
            "dsat.dsat_reporting_context (or with DeepSpeed's autotuning enabled)"
        )
        if not said:  # no main() called: it imported what it needs, and ended
            reason = (
                "the script exited (exit code 0) without a word: does the entrypoint start its "
                'training (its main() called under `if __name__ == "__main__":`)?'
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
    if every_rank_here and not completed and peer_left_cleanly(text, code):
        reason = (
            "a rank exited cleanly (exit code 0) while its peers trained, and they then failed "
            "without it: the training script ended that rank early (every rank must run every step)"
        )
        return TrialEnd(TrialStatus.ERROR, {}, f"{one_line(reason)}\n{tail}", FailureCause.SCRIPT)
    changed = batch_sizes_changed(text, directory)
    if changed is not None:
        return TrialEnd(TrialStatus.ERROR, {}, f"{changed}\n{tail}", FailureCause.SCRIPT)
    diagnosis = diagnose_crash(text, code, oom_killed)
    if completed and not diagnosis.out_of_memory:
        # Rank 0 writes the metrics after every rank's measured steps, so a crash after them
        # that is not for memory (most often a process group's threads torn down at interpreter
        # exit: exit -6, "terminate called without an active exception") does not undo them.
        return TrialEnd(TrialStatus.COMPLETED, dict(outcome.get("values", {})), None, None)
    if diagnosis.out_of_memory:  # killed for it: the host's memory ran out, not a GPU's
        return _out_of_memory(diagnosis.reason, tail, True, on_gpu, shared, diagnosis.cause)
    return TrialEnd(TrialStatus.ERROR, {}, f"{diagnosis.reason}\n{tail}", diagnosis.cause)


# DeepSpeed's refusal of batch sizes that do not multiply out, with its figures.
BATCH_CHECK = re.compile(r"world_size (\d+) != (\d+) \* (\d+) \* \d+")


def script_batch_note(outcome: Mapping[str, Any]) -> str | None:
    """Where the measured steps' forwards were fed more rows than the trial's batch (the step
    clock's ``ROWS_OVER_BATCH``): the script set a batch size of its own (an HF script that
    changed ``per_device_train_batch_size`` after parsing; DeepSpeed does not see it), so the
    measurement is of another configuration. It read "short batches: the data ran out" at a
    larger micro-batch, and passed unsaid at a smaller one."""
    values = outcome.get("values")
    share = values.get(ROWS_OVER_BATCH) if isinstance(values, Mapping) else None
    if not isinstance(share, (int, float)) or share <= 1:
        return None
    return (
        f"the training script fed its steps {share:.2f}x the rows of the trial's batch: it sets "
        "a batch size of its own (an HF script: per_device_train_batch_size changed after its "
        "arguments were parsed), so this measured another configuration; train with the batch "
        "sizes dsat gives"
    )


def batch_sizes_changed(text: str, directory: Path) -> str | None:
    """Where DeepSpeed refused the batch sizes because the script changed those dsat gave the
    trial (its own --batch-size flag won): the script is to blame, not the configuration."""
    found = BATCH_CHECK.search(text)
    if found is None:
        return None
    try:
        hparams = json.loads((directory / HPARAMS_FILE).read_text())
    except (OSError, ValueError):
        return None
    asked = hparams.get(OVERWRITE_KEY) if isinstance(hparams, dict) else None
    if not isinstance(asked, dict):
        return None
    ran = {key: int(value) for key, value in zip(BATCH_KEYS, found.groups(), strict=True)}
    changed = changed_batch_sizes(asked, ran)
    return batch_sizes_changed_reason(changed, rejected=True) if changed else None


def _out_of_memory(
    reason: str, tail: str, host: bool, on_gpu: bool, shared: bool, cause: FailureCause | None
) -> TrialEnd:
    """An OOM's end. ``host``: the memory that ran out was the host's (on a GPU trial,
    ``MEMORY_RAN_OUT`` says so). Where other trials shared the host, it is the machine's."""
    metrics: dict[str, Any] = {MEMORY_RAN_OUT: "host"} if host and on_gpu else {}
    if not (host and shared):
        return TrialEnd(TrialStatus.OOM, metrics, f"{reason}\n{tail}", cause)
    reason = f"the host's memory ran out while other trials shared this machine ({reason})"
    metrics[RUN_ALONE] = True
    return TrialEnd(TrialStatus.ERROR, metrics, f"{one_line(reason)}\n{tail}", FailureCause.MACHINE)
