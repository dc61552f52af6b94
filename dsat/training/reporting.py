"""Turn DeepSpeed's autotuning exit into a reported trial result.

With an ``autotuning`` block, DeepSpeed's engine writes its measurements to a JSON file and calls
``exit()``. ``dsat_reporting_context`` catches that ``SystemExit``, reads the file, reports it
through the Determined Core API context (rank 0 only), leaves a copy for dsat's local runner, and
re-raises, so the trial ends exactly as DeepSpeed meant it to.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from dsat.atomic_file import write_json_atomic
from dsat.constants import (
    AUTOTUNING_KEY,
    CONFIG_NOT_TAKEN,
    ENV_HPARAMS_FILE,
    ERROR_CAUSE_METRIC_KEY,
    ERROR_METRIC_KEY,
    METRICS_FILE,
    MODEL_INFO_FILE,
    OOM_MARKER,
    OOM_METRIC_KEY,
    OVERWRITE_KEY,
    PRECISION_KEY,
    REPORTED_AT_KEY,
    TRIAL_OUTCOME_FILE,
)
from dsat.training.batch_taken import BATCH_CHANGED, batch_sizes_changed_reason
from dsat.training.hf_args import passes_deepspeed
from dsat.training.oom import is_out_of_memory
from dsat.training.step_clock import (
    config_taken,
    current_clock,
    device_peak,
    hf_arguments_taken,
    peak_memory,
    trial_precision,
    untuned_engine_stepped,
)
from dsat.training.trial_directory import trial_directory
from dsat.trial_failure import FailureCause, could_not_connect, diagnose_crash, lost_a_peer

logger = logging.getLogger(__name__)

MODEL_INFO = "model_info"
METRICS = "metrics"
FILE_CLOCK_SLACK_S = 1.0


@dataclasses.dataclass(frozen=True)
class AutotuningResult:
    """What DeepSpeed wrote when it exited: model info of a profile trial, or timing metrics."""

    kind: str  # MODEL_INFO or METRICS
    values: dict[str, Any]


def device_memory_bytes() -> int:
    """Memory of this rank's accelerator: the GPU's own, or on the CPU the machine's RAM
    (less where a container's or the shell's limit is lower)."""
    import torch

    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    from dsat.process_limits import cpu_memory_bytes

    return cpu_memory_bytes()


def read_autotuning_result(directory: Path, since: float = 0.0) -> AutotuningResult | None:
    """The newest of DeepSpeed's model-info and metric files in ``directory`` written at or
    after ``since`` (a time.time()), if any: one left from an earlier run is not this one's."""
    found = [
        (mtime, kind, path)
        for kind, path in (
            (MODEL_INFO, directory / MODEL_INFO_FILE),
            (METRICS, directory / METRICS_FILE),
        )
        if path.is_file() and (mtime := path.stat().st_mtime) >= since
    ]
    if not found:
        return None
    _, kind, path = max(found)
    try:
        values = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None  # another rank may still be writing; only rank 0's copy is reported
    if not isinstance(values, dict):
        return None
    if kind == MODEL_INFO:
        values["gpu_mem"] = device_memory_bytes()
        precision = trial_precision()
        if precision is not None:
            values[PRECISION_KEY] = precision.value
    return AutotuningResult(kind, values)


def oom_summary(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"


def record_out_of_memory(err: BaseException, directory: Path) -> None:
    """Make an OOM unmistakable to a local runner: a marker line on stderr and an outcome file."""
    summary = oom_summary(err)
    print(f"{OOM_MARKER}: {summary}", file=sys.stderr, flush=True)
    with contextlib.suppress(OSError):
        write_json_atomic(directory / TRIAL_OUTCOME_FILE, {"status": "oom", "error": summary})


def oom_metric(err: BaseException) -> dict[str, str]:
    """The searcher metric that tells dsat's search on a cluster this trial ran out of memory."""
    return {OOM_METRIC_KEY: oom_summary(err)}


def searcher_metric(values: Mapping[str, Any]) -> dict[str, Any]:
    """What a trial tells the search on a cluster: its outcome, and when it reported it (the
    search runner may read it minutes later, after a restart)."""
    return {**values, REPORTED_AT_KEY: time.time()}


def report_out_of_memory(core_context: Any, op: Any, err: BaseException) -> None:
    """Tell the search (rank 0 only) that the trial ran out of memory, before the error ends it.
    A report that fails must not hide the OOM itself, so its error is only logged."""
    if op is None or core_context.distributed.get_rank() != 0:
        return
    try:
        op.report_completed(searcher_metric(oom_metric(err)))
    except Exception as report_error:  # the OOM is what the trial must raise
        logger.warning("could not report the out-of-memory outcome: %s", report_error)


def report_error(core_context: Any, op: Any, err: BaseException) -> None:
    """Tell the search on a cluster (rank 0 only) why the trial failed, as the local runner
    reads it from the trial's log. A failure that only says a peer went away, or with peers
    that they could not be reached, is left to Determined's 'errored': the rank that failed
    first may be another, out of sight. A fault of the machine rank 0 saw itself (a failing
    GPU, a full disk) is said as the machine's: the search runs the configuration again rather
    than take its micro-batch for too large."""
    distributed = core_context.distributed
    if op is None or distributed.get_rank() != 0:
        return
    diagnosis = diagnose_crash("".join(traceback.format_exception(err)), None, None)
    if lost_a_peer(diagnosis.reason) or (
        distributed.get_size() > 1 and could_not_connect(diagnosis.reason)
    ):
        return
    said = {ERROR_METRIC_KEY: diagnosis.reason, ERROR_CAUSE_METRIC_KEY: diagnosis.cause.value}
    try:
        op.report_completed(searcher_metric(said))
    except Exception as report_error:  # the error is what the trial must raise
        logger.warning("could not report the trial's error: %s", report_error)


def report_result(
    core_context: Any,
    op: Any,
    steps_completed: int | None,
    result: AutotuningResult,
    directory: Path,
) -> None:
    """Report on rank 0 only; the other ranks' files are partial or absent."""
    if core_context.distributed.get_rank() != 0:
        return
    clock = current_clock()
    changed = clock.batch_changed() if clock is not None and result.kind == METRICS else []
    if changed:  # a measurement of another configuration than the trial's: the script's fault
        reason = batch_sizes_changed_reason(changed, rejected=False, hf=hf_script())
        write_json_atomic(
            directory / TRIAL_OUTCOME_FILE, {"status": BATCH_CHANGED, "error": reason}
        )
        if op is not None:
            op.report_completed(
                searcher_metric(
                    {ERROR_METRIC_KEY: reason, ERROR_CAUSE_METRIC_KEY: FailureCause.SCRIPT.value}
                )
            )
        return
    if result.kind == METRICS and clock is not None:
        measured = {**clock.metrics(result.values), **peak_memory(), **device_peak(clock.precision)}
        result = AutotuningResult(METRICS, measured)
    write_json_atomic(
        directory / TRIAL_OUTCOME_FILE,
        {"status": "completed", "kind": result.kind, "values": result.values},
    )
    if steps_completed is None:
        steps_completed = op.length if op is not None else 0
    core_context.train.report_validation_metrics(
        steps_completed=steps_completed, metrics=result.values
    )
    if op is not None:
        op.report_completed(searcher_metric(result.values))


@contextlib.contextmanager
def dsat_reporting_context(
    core_context: Any, op: Any, steps_completed: int | None = None
) -> Iterator[None]:
    """Wrap the training steps of a trial so DeepSpeed's autotuning results get reported.

    Any exception other than DeepSpeed's ``SystemExit`` passes through untouched; an OOM is also
    recorded so the runner can tell it from other crashes. Only DeepSpeed's own exit (``exit()``,
    code None) with a file written while the context ran is a result: a script's ``sys.exit(3)``
    is its failure, and a file from an earlier run by hand in the same folder is not this run's.
    """
    # File times come from a coarser clock than time.time(): a second's slack.
    entered = time.time() - FILE_CLOCK_SLACK_S
    try:
        yield
    except SystemExit as exit_:
        directory = trial_directory()
        result = read_autotuning_result(directory, entered) if exit_.code in (None, 0) else None
        if result is not None:
            report_result(core_context, op, steps_completed, result, directory)
        raise
    except BaseException as err:
        if is_out_of_memory(err):
            record_out_of_memory(err, trial_directory())
            report_out_of_memory(core_context, op, err)
        elif isinstance(err, Exception):  # not a Ctrl-C, nor the task being stopped
            report_error(core_context, op, err)
        raise
    else:
        # The loop ended without DeepSpeed's exit: where the script never asked for the trial's
        # config, its engine ran the user's own JSON (no autotuning block, so no results, and
        # every trial the same): say that, not "train inside dsat_reporting_context".
        # Where it asked for the config and an engine stepped without it, the result was
        # thrown away (HF arguments parsed from sys.argv, not from what dsat returned).
        untuned = not config_taken() or untuned_engine_stepped()
        if untuned and autotuned_trial() and core_context.distributed.get_rank() == 0:
            said = {"status": CONFIG_NOT_TAKEN, "taken": config_taken(), "hf": hf_script()}
            with contextlib.suppress(OSError):
                write_json_atomic(trial_directory() / TRIAL_OUTCOME_FILE, said)


def hf_script() -> bool:
    """Whether this is an HF Trainer script: it asked for its HF arguments, or was given
    ``--deepspeed`` (the fix to give it is ``dsat.get_hf_args_with_overwrites``)."""
    return hf_arguments_taken() or passes_deepspeed(sys.argv[1:])


def autotuned_trial() -> bool:
    """Whether dsat launched this process as a trial DeepSpeed's autotuning ends (its overrides
    carry an autotuning block): not a full run, nor a run by hand."""
    path = os.environ.get(ENV_HPARAMS_FILE)
    if not path:
        return False
    try:
        hparams = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return False
    overwrites = hparams.get(OVERWRITE_KEY) if isinstance(hparams, dict) else None
    return isinstance(overwrites, dict) and AUTOTUNING_KEY in overwrites
