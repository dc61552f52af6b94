"""dsat's own measurement of a trial: wall-clock time of whole training iterations, and peak memory.

DeepSpeed's autotuning figure is the mean of its forward/backward/step timers over a few profile
steps. It leaves out whatever a configuration spends outside those timers (ZeRO-3's parameter
gathering, host work between steps) and it starts while the run is still warming up, so it can
rank configurations in the wrong order. dsat instead marks the end of every optimizer step (the
device synchronised) in the trial's process and takes the steady-state time per iteration over a
window after a warm-up. The metrics the search ranks by come from that time; DeepSpeed's own stay
beside them, prefixed ``deepspeed_``.

The clock needs no line in user code: ``get_ds_config_from_hparams`` and
``get_hf_args_with_overwrites`` start it for a tuning trial, before the engine exists, and
``dsat_reporting_context`` reads it when DeepSpeed ends the trial.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import itertools
import math
import os
import resource
import statistics
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dsat.atomic_file import write_json_atomic
from dsat.constants import (
    AUTOTUNING_KEY,
    FULL_BATCH_SHARE,
    GRAD_ACCUM_STEPS,
    INPUT_SHAPE,
    MICRO_BATCH_SIZE,
    ROWS_OVER_BATCH,
    TRAIN_BATCH_SIZE,
    TRIAL_OUTCOME_FILE,
)
from dsat.device_peaks import peak_flops
from dsat.memory import Precision
from dsat.training.batch_taken import BATCH_KEYS, changed_batch_sizes
from dsat.training.trial_directory import trial_directory

# Optimizer steps before the window opens at the latest: the first steps of a run allocate,
# compile and fill caches (on an H100, GPT-2 medium took 1.4 s, 2.2 s, then 0.5 s a step). It opens
# earlier, from MIN_WARMUP_STEPS on, once a step is no longer faster than the one before by more
# than SETTLED.
WARMUP_STEPS = 5
MIN_WARMUP_STEPS = 2
SETTLED = 0.05
# Steps in the window at the most; it closes earlier, after MIN_MEASURED_STEPS, once the mean step
# time is known to KNOWN_TO (its standard error, relative), and the trial ends then.
MEASURED_STEPS = 10
MIN_MEASURED_STEPS = 4
KNOWN_TO = 0.01
DEEPSPEED_PREFIX = "deepspeed_"
# DeepSpeed's figures that dsat replaces with its own measurement.
REMEASURED = ("throughput", "latency", "FLOPS_per_gpu")


def measured_window(start_profile_step: int, end_profile_step: int) -> tuple[int, int]:
    """The window dsat measures, as (first, last) optimizer step: it opens when step ``first``
    ends and closes when step ``last + 1`` ends, which is when DeepSpeed ends the trial with
    ``end_profile_step = last`` in its autotuning block."""
    first = max(start_profile_step, WARMUP_STEPS)
    return first, max(end_profile_step, first + MEASURED_STEPS - 1)


@dataclasses.dataclass
class StepClock:
    """Ends of optimizer steps, as (DeepSpeed's global step count after it, seconds), and the
    window over them.

    With ``settle`` (dsat's own window, not a longer one the user asked for), the window opens
    when the steps stop getting faster and closes when their mean is known to ``KNOWN_TO``:
    a trial then runs as few steps as its measurement needs. Otherwise it spans ``first_step``
    to DeepSpeed's exit after ``last_step``."""

    first_step: int  # the window opens when this step ends, at the latest
    last_step: int = 0  # DeepSpeed ends the trial when step last_step + 1 ends
    marks: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    train_batch_size: int | None = None
    steps_done: int = 0
    precision: Precision | None = None  # the trial's, for its device's peak FLOPS (MFU)
    settle: bool = False
    earliest_step: int = 0  # with ``settle``, the window may open when this step ends
    opened_at: int | None = None  # the step whose end opened the window
    # Rows the training forwards were fed on this rank, by the optimizer steps done before them
    # (the forwards of step s + 1 run while s steps are done), and a full step's rows.
    rows: dict[int, int] = dataclasses.field(default_factory=dict)
    rows_per_step: int | None = None
    # Whether the forwards' leading dimension is the batch: known (HF), or seen to be the
    # micro-batch at least once.
    batch_first: bool = False
    # The training forwards' first input's shape, while every one had the same (None after
    # one differed): a search tells from it a script that feeds its own batch size.
    input_shape: tuple[int, ...] | None = None
    shapes_differ: bool = False
    # The batch sizes the trial set, and those its engine ran (at its last step).
    asked_batch: dict[str, Any] = dataclasses.field(default_factory=dict)
    engine_batch: dict[str, int] = dataclasses.field(default_factory=dict)

    def mark(self, global_steps: int, train_batch_size: int) -> bool:
        """Note the end of an optimizer step; True once the window is complete with the next
        step (the trial may end after it)."""
        self.steps_done = global_steps
        self.marks.append((global_steps, time.perf_counter()))
        if self.opened_at is None and self._warmed_up(global_steps):
            self.opened_at = global_steps
        if self.opened_at is not None:
            self.train_batch_size = train_batch_size
        return self.complete()

    def note_forward(
        self, steps_done: int, shape: tuple[int, ...], micro_batch: int, accumulation: int
    ) -> None:
        """Note a training forward whose first input has ``shape`` (its leading dimension the
        rows it was fed, where the model is batch-first)."""
        rows = shape[0]
        if self.input_shape is None and not self.shapes_differ:
            self.input_shape = shape
        elif shape != self.input_shape:
            self.input_shape, self.shapes_differ = None, True
        self.rows[steps_done] = self.rows.get(steps_done, 0) + rows
        self.rows_per_step = micro_batch * accumulation
        self.batch_first = self.batch_first or rows == micro_batch

    def batch_changed(self) -> list[str]:
        """The batch sizes the engine ran that differ from the trial's, in words."""
        return changed_batch_sizes(self.asked_batch, self.engine_batch)

    def full_batch_share(self) -> float | None:
        """The rows the window's steps were fed, as a share of full batches: below 1 when the
        data ran out inside the window and an epoch's last batch came short (a data loader that
        keeps it, with too few samples for the trial's steps). None where the forwards' leading
        dimension is not the batch, or was not seen."""
        window = self.window()
        if not self.batch_first or not self.rows_per_step or len(window) < 2:
            return None
        first, last = window[0][0], window[-1][0]
        fed = sum(self.rows.get(step, 0) for step in range(first, last))
        return fed / (self.rows_per_step * (last - first)) if fed else None

    def _warmed_up(self, global_steps: int) -> bool:
        if global_steps >= self.first_step:
            return True
        if not self.settle or global_steps < max(self.earliest_step, MIN_WARMUP_STEPS):
            return False
        durations = [b[1] - a[1] for a, b in itertools.pairwise(self.marks)]
        return len(durations) >= 2 and durations[-1] >= (1 - SETTLED) * durations[-2]

    def window(self) -> list[tuple[int, float]]:
        if self.opened_at is None:
            return []
        return [(step, at) for step, at in self.marks if step >= self.opened_at]

    def seconds_per_step(self) -> list[float]:
        return [b[1] - a[1] for a, b in itertools.pairwise(self.window())]

    def complete(self) -> bool:
        """Whether the window has what it needs once the next step (the trial's last: DeepSpeed
        ends it there) is in: with ``settle``, the mean step time known to ``KNOWN_TO`` after
        at least MIN_MEASURED_STEPS, or MEASURED_STEPS steps."""
        if not self.settle:
            return False
        durations = self.seconds_per_step()
        if len(durations) + 1 >= MEASURED_STEPS:
            return True
        return len(durations) >= MIN_MEASURED_STEPS and relative_stderr(durations) <= KNOWN_TO

    def metrics(self, deepspeed: Mapping[str, Any]) -> dict[str, Any]:
        """dsat's metrics from the window, with DeepSpeed's kept beside them."""
        window = self.window()
        durations = self.seconds_per_step()
        if not durations or not self.train_batch_size:
            return {**deepspeed, "measured_steps": 0}  # nothing to measure: DeepSpeed's figures
        seconds = (window[-1][1] - window[0][1]) / (window[-1][0] - window[0][0])
        ours: dict[str, Any] = {
            "throughput": self.train_batch_size / seconds,
            "latency": seconds * 1000.0,  # ms per iteration (DeepSpeed's own is in µs)
            "warmup_steps": window[0][0],
            "measured_steps": len(durations),
            "step_time_spread": spread(durations),
        }
        stderr = relative_stderr(durations)
        if math.isfinite(stderr):  # JSON has no infinity
            ours["step_time_stderr"] = stderr
        share = self.full_batch_share()
        if share is not None and share < 1:  # samples/s counts the samples the steps ran
            ours["throughput"] *= share
            ours[FULL_BATCH_SHARE] = share
        elif share is not None and share > 1:  # more than a full batch: not the data running out
            ours[ROWS_OVER_BATCH] = share
        if self.input_shape is not None:
            ours[INPUT_SHAPE] = list(self.input_shape)
        flops = flops_per_step(deepspeed)
        if flops is not None:
            ours["FLOPS_per_gpu"] = flops / seconds
        kept = {f"{DEEPSPEED_PREFIX}{k}": deepspeed[k] for k in REMEASURED if k in deepspeed}
        return {**deepspeed, **kept, **ours}


def relative_stderr(durations: list[float]) -> float:
    """The standard error of the mean step time, as a share of it (infinite from one step)."""
    if len(durations) < 2:
        return math.inf
    mean = statistics.fmean(durations)
    return statistics.stdev(durations) / math.sqrt(len(durations)) / mean if mean > 0 else 0.0


def spread(durations: list[float]) -> float:
    """How far the two halves of the window disagree, relative to the whole: what two runs of
    one configuration would differ by, roughly."""
    if len(durations) < 2:
        return 0.0
    half = len(durations) // 2
    first, second = statistics.fmean(durations[:half]), statistics.fmean(durations[half:])
    return abs(first - second) / statistics.fmean(durations)


def flops_per_step(deepspeed: Mapping[str, Any]) -> float | None:
    """The model's FLOPs per iteration per GPU, recovered from DeepSpeed's figures (it reports
    ``FLOPS_per_gpu = flops * 1e6 * gas / latency``)."""
    try:
        value = float(deepspeed["FLOPS_per_gpu"]) * float(deepspeed["latency"]) / 1e6
    except (KeyError, TypeError, ValueError):
        return None
    return value if value > 0 else None


def peak_memory() -> dict[str, int]:
    """This process's peak memory and the device's total: GPU allocated and reserved bytes, or
    the peak resident set on the CPU."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        device = torch.cuda.current_device()
        return {
            "memory_peak_bytes": int(torch.cuda.max_memory_allocated(device)),
            "memory_reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
            "memory_total_bytes": int(torch.cuda.get_device_properties(device).total_memory),
        }
    from dsat.process_limits import cpu_memory_bytes

    return {
        "memory_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "memory_total_bytes": cpu_memory_bytes(),
    }


def device_peak(precision: Precision | None) -> dict[str, float]:
    """The GPU's peak FLOPS at the trial's precision (dsat.device_peaks), where it is known: the
    search works out MFU from it. Nothing on the CPU."""
    import torch

    if precision is None or not (torch.cuda.is_available() and torch.cuda.is_initialized()):  # type: ignore[no-untyped-call]
        return {}
    peak = peak_flops(torch.cuda.get_device_name(torch.cuda.current_device()), precision)
    return {} if peak is None else {"device_peak_flops": peak}


_clock: StepClock | None = None
_precision: Precision | None = None  # the trial's, from its start_clock
# Whether the script asked for the trial's config (get_ds_config_from_hparams, the HF arguments):
# a script that builds its engine from its own JSON runs every trial at its own config.
_config_taken = False
# Whether it asked through the HF arguments (an HF Trainer script), and whether an engine then
# stepped without the autotuning block all the trial's configs carry (the result thrown away).
_hf_arguments = False
_untuned_engine = False


def current_clock() -> StepClock | None:
    """The clock of this trial, if one was started."""
    return _clock


def trial_precision() -> Precision | None:
    """The precision this trial's code said it runs at (``start_clock``), if it said."""
    return _precision


def stop_clock() -> None:
    """Forget this process's clock and precision (a process that runs several trials' code: a
    trial host, the tests)."""
    global _clock, _precision, _config_taken, _hf_arguments, _untuned_engine
    _clock = None
    _precision = None
    _config_taken = False
    _hf_arguments = False
    _untuned_engine = False


def note_config_taken(hf_arguments: bool = False) -> None:
    """The script asked for the trial's DeepSpeed config (or, ``hf_arguments``, its HF
    arguments)."""
    global _config_taken, _hf_arguments
    _config_taken = True
    _hf_arguments = _hf_arguments or hf_arguments


def config_taken() -> bool:
    return _config_taken


def hf_arguments_taken() -> bool:
    return _hf_arguments


def note_engine_step(autotuning_enabled: bool) -> None:
    """An engine stepped; without autotuning, it was not built from the trial's config."""
    global _untuned_engine
    _untuned_engine = _untuned_engine or not autotuning_enabled


def untuned_engine_stepped() -> bool:
    """Whether an engine stepped without the trial's config, though the script asked for it
    (``dsat.get_hf_args_with_overwrites`` called, what it returned not parsed)."""
    return _untuned_engine


def start_clock(
    overwrites: Mapping[str, Any] | None,
    precision: Precision | None = None,
    batch_first: bool = False,
) -> StepClock | None:
    """Start timing DeepSpeed's optimizer steps when ``overwrites`` make this a search trial (an
    autotuning block with a metric window); idempotent. ``precision``: the trial's.
    ``batch_first``: the forwards' first tensor input is known to lead with the batch (HF's
    ``input_ids``), so batches that are all short (a dataset smaller than one micro-batch) count
    as short too."""
    global _clock, _precision
    if precision is not None:  # what a model profile reports too
        _precision = precision
    block = (overwrites or {}).get(AUTOTUNING_KEY)
    if not isinstance(block, Mapping):
        return None
    _time_engine_steps()  # also in the model profile: an engine without the block is noted
    if "end_profile_step" not in block:
        return None
    if _clock is None:
        start = int(block.get("start_profile_step", 0))
        first, last = measured_window(start, int(block["end_profile_step"]))
        # dsat's own window settles; one the user asked to start later or run longer is kept.
        # It opens after the step DeepSpeed's FLOPs profiler slows (the one from ``start``).
        settle = start <= WARMUP_STEPS and last - first + 1 <= MEASURED_STEPS
        _clock = StepClock(first, last, settle=settle, earliest_step=start + 1)
        _clock.asked_batch = {k: v for k, v in (overwrites or {}).items() if k in BATCH_KEYS}
        atexit.register(_explain_missing_results, trial_directory())
    if precision is not None:
        _clock.precision = precision
    _clock.batch_first = _clock.batch_first or batch_first
    return _clock


def _explain_missing_results(directory: Path) -> None:
    """At exit, when the trial ended without an outcome (its loop stopped before DeepSpeed's
    autotuning exit), leave how far it got, so the runner can say why in one line."""
    clock = _clock
    outcome = directory / TRIAL_OUTCOME_FILE
    if clock is None or outcome.exists() or os.environ.get("RANK", "0") != "0":
        return
    with contextlib.suppress(OSError):
        write_json_atomic(
            outcome,
            {"status": "incomplete", "steps": clock.steps_done, "needed": clock.last_step + 1},
        )


def _time_engine_steps() -> None:
    """Wrap ``DeepSpeedEngine.step`` so the end of every optimizer step is marked, the device
    synchronised, even when DeepSpeed ends the trial inside that step; and once the window is
    complete, have DeepSpeed end the trial after the next step. Wrap ``forward`` too, to count the
    rows each training forward is fed (a short batch must not count as a full one)."""
    import torch
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.engine import DeepSpeedEngine

    original = DeepSpeedEngine.step
    if getattr(original, "_dsat_timed", False):
        return
    accelerator = get_accelerator()
    original_forward = DeepSpeedEngine.forward

    def forward(engine: Any, *args: Any, **kwargs: Any) -> Any:
        if _clock is not None and engine.training and torch.is_grad_enabled():
            shape = input_shape(args, kwargs)
            if shape:
                _clock.note_forward(
                    int(engine.global_steps),
                    shape,
                    int(engine.train_micro_batch_size_per_gpu()),
                    int(engine.gradient_accumulation_steps()),
                )
        return original_forward(engine, *args, **kwargs)

    def mark(engine: Any, before: int, decide: bool) -> bool:
        if engine.global_steps == before or _clock is None:
            return False
        accelerator.synchronize()
        complete = _clock.mark(int(engine.global_steps), int(engine.train_batch_size()))
        _clock.engine_batch = {
            TRAIN_BATCH_SIZE: int(engine.train_batch_size()),
            MICRO_BATCH_SIZE: int(engine.train_micro_batch_size_per_gpu()),
            GRAD_ACCUM_STEPS: int(engine.gradient_accumulation_steps()),
        }
        if not decide or not _clock.settle:
            return False
        if engine.global_steps < MIN_WARMUP_STEPS + MIN_MEASURED_STEPS:
            return False  # no window can be complete yet, on any rank
        return _rank_zeros(complete, accelerator)

    def step(engine: Any, *args: Any, **kwargs: Any) -> Any:
        before = engine.global_steps
        note_engine_step(bool(engine.autotuning_enabled()))
        try:
            result = original(engine, *args, **kwargs)
        except BaseException:  # DeepSpeed's own end of the trial among them
            mark(engine, before, decide=False)
            raise
        if mark(engine, before, decide=True) and engine.autotuning_enabled():
            # DeepSpeed ends the trial after the next step, as after its last profile step (its
            # timers for this one are already reset, so its metrics could not be written now).
            engine._config.autotuning_config.end_profile_step = int(engine.global_steps)
        return result

    step._dsat_timed = True  # type: ignore[attr-defined]
    DeepSpeedEngine.step = step
    DeepSpeedEngine.forward = forward


def input_shape(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[int, ...] | None:
    """The shape of a forward's first tensor input (HF's ``input_ids``, a plain model's input;
    a dict, list or tuple of tensors passed whole counts by its first): its leading dimension
    is the batch where the model is batch-first."""
    import torch

    values = [*args, *kwargs.values()]
    if values and isinstance(values[0], Mapping):
        values = [*values[0].values(), *values[1:]]
    elif values and isinstance(values[0], (list, tuple)):
        values = [*values[0], *values[1:]]
    for value in values:
        if isinstance(value, torch.Tensor):
            return tuple(int(n) for n in value.shape) if value.dim() > 0 else None
    return None


def _rank_zeros(complete: bool, accelerator: Any) -> bool:
    """Rank 0's ``complete``, on every rank: ranks time their steps apart, and one that ended
    alone would leave the others waiting in the next collective. Every rank calls this at the
    same steps."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return complete
    flag = torch.tensor([1.0 if complete else 0.0], device=accelerator.current_device_name())
    dist.broadcast(flag, src=0)
    return bool(flag.item())
