"""dsat's own measurement: the window, the metrics from it, DeepSpeed's figures kept beside."""

from __future__ import annotations

import json
from pathlib import Path
from unittest.mock import patch

import pytest

from dsat.constants import INPUT_SHAPE
from dsat.memory import Precision
from dsat.training.hf_args import hf_precision
from dsat.training.step_clock import (
    KNOWN_TO,
    MEASURED_STEPS,
    MIN_MEASURED_STEPS,
    WARMUP_STEPS,
    StepClock,
    current_clock,
    device_peak,
    flops_per_step,
    input_shape,
    measured_window,
    spread,
    stop_clock,
)
from dsat.training.trial_config import get_ds_config_from_hparams

DEEPSPEED = {"throughput": 900.0, "latency": 10.0, "FLOPS_per_gpu": 4e12, "fwd": 3.0}


def test_the_window_opens_after_the_warm_up_and_is_long_enough() -> None:
    assert measured_window(3, 5) == (WARMUP_STEPS, WARMUP_STEPS + MEASURED_STEPS - 1)
    assert measured_window(8, 40) == (8, 40)  # a longer window asked for is kept


def clock_with(step_seconds: list[float], first: int = 5, batch: int = 8) -> StepClock:
    clock = StepClock(first, opened_at=first)
    now = 100.0
    clock.marks.append((first, now))
    for number, seconds in enumerate(step_seconds, start=first + 1):
        now += seconds
        clock.marks.append((number, now))
    clock.train_batch_size = batch
    return clock


def test_metrics_come_from_the_wall_clock_and_deepspeeds_are_kept() -> None:
    values = clock_with([0.5] * 10).metrics(DEEPSPEED)
    assert values["throughput"] == pytest.approx(8 / 0.5)
    assert values["latency"] == pytest.approx(500.0)
    flops = 4e12 * 10.0 / 1e6  # DeepSpeed's FLOPs per iteration
    assert values["FLOPS_per_gpu"] == pytest.approx(flops / 0.5)
    assert values["deepspeed_throughput"] == 900.0 and values["deepspeed_latency"] == 10.0
    assert values["fwd"] == 3.0 and values["measured_steps"] == 10
    assert values["warmup_steps"] == 5
    assert values["step_time_spread"] == pytest.approx(0.0)
    assert values["step_time_stderr"] == pytest.approx(0.0)


def test_steps_before_the_window_do_not_count() -> None:
    clock = StepClock(first_step=5)
    for step in range(1, 8):
        clock.mark(step, train_batch_size=4)
    assert [number for number, _ in clock.window()] == [5, 6, 7]


def fed(
    clock: StepClock, rows_by_step: dict[int, list[int]], micro: int, accumulation: int
) -> None:
    for done, rows in rows_by_step.items():
        for count in rows:
            clock.note_forward(done, (count, 32), micro, accumulation)


def test_short_batches_in_the_window_count_the_samples_they_ran() -> None:
    clock = clock_with([0.5] * 4, batch=16)  # steps 6-9 measured: their forwards at 5-8
    # Micro-batch 8, accumulation 2: the data runs out at step 8's second micro-step (3 rows).
    fed(clock, {4: [8, 8], 5: [8, 8], 6: [8, 8], 7: [8, 3], 8: [8, 8], 9: [8, 8]}, 8, 2)
    assert clock.full_batch_share() == pytest.approx(59 / 64)
    values = clock.metrics(DEEPSPEED)
    assert values["throughput"] == pytest.approx(16 / 0.5 * 59 / 64)
    assert values["full_batch_share"] == pytest.approx(59 / 64)
    # Short batches outside the window do not count.
    outside = clock_with([0.5] * 4, batch=16)
    fed(outside, {4: [8, 3], 5: [8, 8], 6: [8, 8], 7: [8, 8], 8: [8, 8], 9: [2]}, 8, 2)
    assert outside.full_batch_share() == 1.0
    assert "full_batch_share" not in outside.metrics(DEEPSPEED)


def test_a_leading_dimension_that_is_never_the_micro_batch_is_not_taken_for_one() -> None:
    clock = clock_with([0.5] * 4, batch=8)
    fed(clock, {step: [128] for step in range(5, 9)}, 8, 1)  # sequence-first, say
    assert clock.full_batch_share() is None
    assert clock.metrics(DEEPSPEED)["throughput"] == pytest.approx(8 / 0.5)
    assert clock_with([0.5] * 4).full_batch_share() is None  # no forward seen


def test_an_hf_trials_batches_count_as_short_even_when_all_are() -> None:
    """A dataset of 5 samples at micro-batch 8: every batch holds 5; HF's input_ids lead with
    the batch, so that is seen."""
    clock = clock_with([0.5] * 4, batch=8)
    fed(clock, {step: [5] for step in range(5, 9)}, 8, 1)
    assert clock.full_batch_share() is None  # unknown where the input may lead with a sequence
    clock.batch_first = True  # as get_hf_args_with_overwrites starts the clock
    assert clock.full_batch_share() == pytest.approx(5 / 8)


def test_an_hf_script_feeding_more_rows_than_the_trials_batch_is_said() -> None:
    """An HF script that set per_device_train_batch_size = 3 after parsing, at the trial's
    micro-batch 1: its steps ran 3 rows each, measured as 1; nothing said it. A trial that ran
    so ends as the script's error, not as a measurement."""
    from dsat.constants import ROWS_OVER_BATCH
    from dsat.runners.local.trial_outcome import script_batch_note

    clock = clock_with([0.5] * 4, batch=1)
    clock.batch_first = True  # as get_hf_args_with_overwrites starts the clock
    fed(clock, {step: [3] for step in range(5, 9)}, 1, 1)
    values = clock.metrics(DEEPSPEED)
    assert values[ROWS_OVER_BATCH] == pytest.approx(3.0) and "full_batch_share" not in values
    note = script_batch_note({"status": "completed", "values": values})
    assert note is not None and note.startswith(
        "the training script fed its steps 3.00x the rows of the trial's batch: it sets a batch "
        "size of its own"
    )
    full = clock_with([0.5] * 4, batch=1)
    full.batch_first = True
    fed(full, {step: [1] for step in range(5, 9)}, 1, 1)
    assert script_batch_note({"values": full.metrics(DEEPSPEED)}) is None


def test_the_input_shape_is_the_first_tensor_inputs() -> None:
    import torch

    ids = torch.zeros(6, 32, dtype=torch.long)
    assert input_shape((), {"input_ids": ids, "labels": torch.zeros(9)}) == (6, 32)
    assert input_shape((torch.zeros(3, 4),), {}) == (3, 4)
    assert input_shape(({"input_ids": ids},), {}) == (6, 32)
    assert input_shape(((ids, torch.zeros(6)),), {}) == (6, 32)  # a (inputs, labels) batch
    assert input_shape((None, 2.0), {"x": torch.zeros(5)}) == (5,)
    assert input_shape((torch.tensor(1.0),), {}) is None
    assert input_shape(("text",), {}) is None


def test_one_input_shape_for_every_forward_is_reported() -> None:
    """What tells a search that a script feeds its own batch size (search/ignored_batch.py)."""
    clock = clock_with([0.5] * 4, batch=8)
    fed(clock, {step: [16] for step in range(5, 9)}, 8, 1)
    assert clock.metrics(DEEPSPEED)[INPUT_SHAPE] == [16, 32]
    varied = clock_with([0.5] * 4, batch=8)
    fed(varied, {5: [8], 6: [8], 7: [3], 8: [8]}, 8, 1)  # one short batch
    assert INPUT_SHAPE not in varied.metrics(DEEPSPEED)


def run_steps(clock: StepClock, step_seconds: list[float]) -> int:
    """Feed ``clock`` steps of these durations (step 1 ends at t=0) until it is complete and
    one step more (DeepSpeed's last); the last step run."""
    now, complete = 0.0, False
    for number, seconds in enumerate([0.0, *step_seconds], start=1):
        now += seconds
        with patch("time.perf_counter", return_value=now):
            if complete:
                clock.mark(number, train_batch_size=8)
                return number
            complete = clock.mark(number, train_batch_size=8)
    return 0


def settling_clock() -> StepClock:
    return StepClock(WARMUP_STEPS, WARMUP_STEPS + MEASURED_STEPS - 1, settle=True, earliest_step=4)


def test_the_window_opens_when_the_steps_stop_falling_and_closes_when_the_mean_is_known() -> None:
    """GPT-2 medium on an H100 took 1.4 s, 2.2 s, then 0.5 s a step: the window opens at the
    first step no faster than the one before (not before the step after DeepSpeed's profiled
    one), and closes after the least steps once they agree."""
    clock = settling_clock()
    ended = run_steps(clock, [2.2, 1.0] + [0.5] * 12)
    assert clock.opened_at == 5  # step 4 (0.5 s) was still faster than step 3 (1.0 s)
    assert ended == 5 + MIN_MEASURED_STEPS + 1
    values = clock.metrics(DEEPSPEED)
    assert values["measured_steps"] == MIN_MEASURED_STEPS + 1 and values["warmup_steps"] == 5
    assert values["throughput"] == pytest.approx(8 / 0.5)


def test_a_level_start_opens_the_window_after_the_profiled_step() -> None:
    clock = settling_clock()
    run_steps(clock, [0.5] * 12)
    assert clock.opened_at == 4


def test_noisy_steps_are_measured_until_known_or_for_at_most_the_full_window() -> None:
    noisy = [0.5, 0.6] * 10  # 9% apart: the mean is not known to 1% within ten steps
    clock = settling_clock()
    ended = run_steps(clock, noisy)
    assert ended == clock.opened_at + MEASURED_STEPS
    assert clock.metrics(DEEPSPEED)["measured_steps"] == MEASURED_STEPS
    assert clock.metrics(DEEPSPEED)["step_time_stderr"] > KNOWN_TO
    # A little noise: known to 1% after a few more steps than the least.
    slightly = [0.5, 0.51, 0.49, 0.52, 0.48, 0.5, 0.5, 0.51, 0.49, 0.5, 0.5, 0.5, 0.5, 0.5]
    clock = settling_clock()
    ended = run_steps(clock, slightly)
    assert clock.opened_at is not None
    assert clock.opened_at + MIN_MEASURED_STEPS < ended < clock.opened_at + MEASURED_STEPS
    assert clock.metrics(DEEPSPEED)["step_time_stderr"] <= KNOWN_TO


def test_a_window_the_user_asked_for_is_kept_whole() -> None:
    """Without ``settle`` (a later start or a longer window asked for), the window opens at its
    first step and never closes early: DeepSpeed ends the trial after its last."""
    clock = StepClock(8, 40)
    assert run_steps(clock, [0.5] * 45) == 0
    assert clock.opened_at == 8 and clock.metrics(DEEPSPEED)["measured_steps"] == 38


def test_a_window_still_warming_up_shows_as_spread() -> None:
    assert spread([2.0, 2.0, 0.5, 0.5]) == pytest.approx(1.5 / 1.25)
    assert spread([0.5]) == 0.0


def test_without_a_window_deepspeeds_figures_stand() -> None:
    assert StepClock(5).metrics(DEEPSPEED) == {**DEEPSPEED, "measured_steps": 0}
    one = clock_with([0.5]).metrics(DEEPSPEED)  # one step: no standard error (JSON has no inf)
    assert one["measured_steps"] == 1 and "step_time_stderr" not in one
    assert flops_per_step({"throughput": 1.0}) is None


def test_a_trial_knows_its_precision_and_its_device_peak_only_on_a_known_gpu(
    tmp_path: Path,
) -> None:
    """The trial's precision reaches the clock (for its GPU's peak, and so MFU); on the CPU no
    peak is reported, so the search reports no MFU unless --peak-tflops gives one."""
    (tmp_path / "ds.json").write_text(json.dumps({"bf16": {"enabled": True}}))
    overwrites = {"autotuning": {"enabled": True, "start_profile_step": 3, "end_profile_step": 5}}
    stop_clock()
    try:
        get_ds_config_from_hparams(
            {"deepspeed_config": "ds.json", "overwrite_deepspeed_args": overwrites},
            base_dir=tmp_path,
        )
        clock = current_clock()
        assert clock is not None and clock.precision is Precision.BF16
        assert device_peak(clock.precision) == {}  # no GPU here
    finally:
        stop_clock()


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--bf16"], Precision.BF16),
        (["--fp16", "True", "--output_dir", "x"], Precision.FP16),
        (["--bf16=false"], Precision.FP32),
        (["--bf16", "--output_dir", "x"], Precision.BF16),
        ([], Precision.FP32),
    ],
)
def test_an_hf_trials_precision_is_its_switch(args: list[str], expected: Precision) -> None:
    assert hf_precision(args, {"bf16": {"enabled": "auto"}}) is expected
