"""The user's own configuration, run once as submitted, so the summary can say how much faster
the hand-over is (as DeepSpeed's autotuning tutorial reports against its baseline).

It runs right after the model profile, on top of ``--max-trials`` like the confirmation round,
and is never handed over. Where the config leaves the micro-batch to an HF script (``"auto"``),
the entrypoint's ``--per_device_train_batch_size`` (and accumulation) is the user's. It is skipped
(and the summary says why) when neither sets it, or when the memory model says it cannot fit;
``--no-baseline`` skips it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from dsat.constants import GRAD_ACCUM_STEPS, MICRO_BATCH_SIZE
from dsat.errors import DsatError
from dsat.experiment.batch_size import batch_value, consistent_batch_sizes, fixed_global_batch
from dsat.experiment.config import deep_merge, entrypoint_batch_flags
from dsat.experiment.metric import positive_number
from dsat.search.confirmation import measurements, repeated_measurements
from dsat.search.measurement_noise import relative_noise
from dsat.trial import TrialKind, TrialRecord, TrialStatus
from dsat.zero_space import knob_tags

if TYPE_CHECKING:
    from dsat.search.method import DsatSearchMethod


def script_batch(method: DsatSearchMethod) -> dict[str, int]:
    """The micro-batch and accumulation the entrypoint passes an HF script
    (``--per_device_train_batch_size``, ``--gradient_accumulation_steps``): what a config of
    ``"auto"`` values trains with."""
    flags = entrypoint_batch_flags(method.spec.entrypoint)
    return {key: number for key, number in flags.items() if number > 0}


def user_micro_batch(method: DsatSearchMethod) -> tuple[int, int, dict[str, int]] | None:
    """The user's (ZeRO stage, micro-batch), as their config or their script sets them, and what
    the script sets; None when neither says. With a fixed global batch the accumulation makes it
    up, as in every trial, whatever the script passes. Raises DsatError where the batch sizes
    do not add up."""
    spec = method.spec
    merged = spec.user_config
    from_script: dict[str, int] = {}
    if batch_value(merged, MICRO_BATCH_SIZE, "config") is None:
        from_script = script_batch(method)
        if fixed_global_batch(merged) is not None:
            from_script.pop(GRAD_ACCUM_STEPS, None)
        merged = deep_merge(merged, from_script)
    micro = batch_value(merged, MICRO_BATCH_SIZE, "config")
    if micro is None and fixed_global_batch(merged) is None:
        return None
    batch = consistent_batch_sizes(merged, spec.slots_per_trial)
    zero = merged.get("zero_optimization")
    stage = int(zero.get("stage", 0)) if isinstance(zero, dict) else 0
    return stage, batch[MICRO_BATCH_SIZE], from_script


def why_no_baseline(method: DsatSearchMethod) -> str | None:
    """Why the user's configuration is not run; None when it is (or will be)."""
    return _user_batch_or_why_not(method)[1]


def _user_batch_or_why_not(
    method: DsatSearchMethod,
) -> tuple[tuple[int, int, dict[str, int]] | None, str | None]:
    """The user's batch (``user_micro_batch``) where their configuration runs, else why not."""
    if method.fit_rung.profile_stage is not None:
        return None, "it ran out of memory at micro-batch 1, in the model profile"
    try:
        found = user_micro_batch(method)
    except DsatError as err:
        return None, f"its batch sizes do not add up: {err}"
    if found is None:
        return None, "neither your DeepSpeed config nor your entrypoint sets the micro-batch"
    stage, micro, _ = found
    if method.profile is not None and micro > method.micro_batch_ceiling(stage):
        return (
            None,
            f"ZeRO-{stage} at micro-batch {micro} does not fit by the memory model",
        )
    return found, None


def baseline_trial(method: DsatSearchMethod) -> list[TrialRecord]:
    """The baseline trial to queue first once the model profile is in (registered, on top of
    the budget); none when it is skipped."""
    found, _ = _user_batch_or_why_not(method)
    if found is None:
        return []
    record = method.register(
        method.builder.make(method.next_index, TrialKind.BASELINE, None, None, user_batch=found[2])
    )
    if record is None:
        return []
    method.tracker.max_trials += 1
    return [record]


def describe(record: TrialRecord) -> str:
    return f"ZeRO-{record.zero_stage} micro-batch {record.mbs}" + (
        f" x accumulation {record.gas}" if record.gas > 1 else ""
    )


def described_with_knobs(record: TrialRecord) -> str:
    """``describe`` and what its ZeRO knobs change from DeepSpeed's defaults (``rb5e7``): two
    configurations at one micro-batch never read alike."""
    knobs = knob_tags(record.zero_section, record.zero_stage)
    return describe(record) + (f" ({', '.join(knobs)})" if knobs else "")


def baseline_run(method: DsatSearchMethod) -> TrialRecord | None:
    """The run of the user's own configuration (the last, if a resumed search ran it again)."""
    runs = [r for r in method.tracker.records if r.kind is TrialKind.BASELINE]
    return runs[-1] if runs else None


def speedup_over_yours(method: DsatSearchMethod) -> float | None:
    """How many times faster the hand-over measured than the user's own config (the mean of its
    runs, as the summary's global row), where both were measured."""
    tracker = method.tracker
    baseline, handed = baseline_run(method), tracker.best()
    mine = None if baseline is None else tracker.baseline_value(baseline)
    theirs = None if handed is None else tracker.mean_of_runs(handed)
    if not mine or theirs is None:
        return None
    return mine / theirs if tracker.metric.smaller_is_better else theirs / mine


def yours_handed_over(method: DsatSearchMethod) -> bool:
    """Whether the configuration handed over is the user's own (the same ZeRO settings,
    micro-batch and accumulation): then its runs against the baseline's are one configuration
    measured again, not a speed-up."""
    mine, handed = baseline_run(method), method.tracker.best()
    if mine is None or handed is None:
        return False
    return (handed.zero_key, handed.mbs, handed.gas) == (mine.zero_key, mine.mbs, mine.gas)


# A run whose mean step time is known only to this (its standard error, relative) or worse: its
# steps varied as on a busy machine (another job on the cores, a throttled GPU).
UNSTEADY_RUN = 0.10


def baseline_stderr(method: DsatSearchMethod) -> float:
    """How well the user's config's run knew its own mean step time (``step_time_stderr``,
    relative; 0 where it did not say): one run is all the comparison has of it."""
    baseline = baseline_run(method)
    value = None if baseline is None else baseline.metrics.get("step_time_stderr")
    return positive_number(value) or 0.0


def unsteady_baseline_said(method: DsatSearchMethod, level: bool = False) -> str | None:
    """Where the user's config's run was unsteady (``UNSTEADY_RUN``), that the ratio against it
    is rough: a baseline measured while something else used the machine read 700x slower than
    the hand-over, and was compared as if it were exact. ``level``: the two were not told apart,
    for that unsteadiness."""
    stderr = baseline_stderr(method)
    if stderr < UNSTEADY_RUN:
        return None
    rough = "too rough to tell the two apart" if level else "rough"
    return (
        f"your config's run was unsteady (its mean step time known only to +/-{stderr:.0%}: "
        f"was the machine busy?), so this ratio is {rough}"
    )


def against_yours_said(method: DsatSearchMethod) -> str | None:
    """Where the hand-over and the user's own config measured within the noise of each other, or
    the user's measured faster, what that means, in plain words (None where the hand-over is
    faster by more than the noise): "0.83x your config" alone reads as "dsat made it worse", and
    "1.02x" as a gain, while on a short, noisy trial one configuration can measure 20% apart."""
    judged = _against_yours(method)
    if judged is None:
        return None
    speedup, beyond_noise, noise = judged
    unsteady = unsteady_baseline_said(method, level=not beyond_noise)
    said = None
    if not beyond_noise and unsteady is None:
        said = f"level with your config within the noise ({noise:.1%} a run)"
    elif not beyond_noise:
        # A 0.76x "level within the noise (1.9% a run)": the run of the user's config, not
        # this search's noise, is what could not tell them apart, and is said as such.
        said = None
    elif speedup < 1:
        said = (
            f"your config measured faster, by more than the noise ({noise:.1%} a run): keep it, "
            f"or start a longer search (--max-trials, {method.settings.max_trials} here)"
        )
    return "; ".join(part for part in (said, unsteady) if part) or None


def yours_clearly_faster(method: DsatSearchMethod) -> bool:
    """Whether the user's own config measured faster than the hand-over, by more than the noise
    (``against_yours_said``): a full run with the hand-over then says so before it trains."""
    judged = _against_yours(method)
    return judged is not None and judged[0] < 1 and judged[1]


def _against_yours(method: DsatSearchMethod) -> tuple[float, bool, float] | None:
    """The hand-over's speed-up over the user's config, whether it is more than the noise either
    way, and that noise (one run's, as this search's repeated runs showed it), judged with the
    mean of the hand-over's runs against the one run of the user's config, whose own unsteadiness
    (``baseline_stderr``) adds to it. None without both."""
    speedup = speedup_over_yours(method)
    handed = method.tracker.best()
    if speedup is None or handed is None:
        return None
    tracker = method.tracker
    noise = relative_noise([], repeated_measurements(tracker))
    runs = max(1, len(measurements(tracker, handed)))
    spread = math.sqrt(noise**2 * (1 + 1 / runs) + baseline_stderr(method) ** 2)
    return speedup, abs(math.log(speedup)) > 2 * spread, noise


def baseline_line(method: DsatSearchMethod) -> str:
    """The summary's line comparing the hand-over with the user's own configuration."""
    if not method.settings.baseline:
        return ""
    tracker = method.tracker
    baseline, handed = baseline_run(method), tracker.best()
    if baseline is None:
        why = why_no_baseline(method)
        return f"your config: not run ({why})" if why else ""
    mine = tracker.baseline_value(baseline)
    if mine is None:
        ended = "ran out of memory" if baseline.status is TrialStatus.OOM else baseline.status.value
        return f"your config ({describe(baseline)}): {ended}"
    speedup = speedup_over_yours(method)
    if handed is None or speedup is None:
        return f"your config ({describe(baseline)}): {mine:.4g} {tracker.metric.value}"
    if yours_handed_over(method):
        return (
            f"your config is the one handed over ({described_with_knobs(handed)}): nothing "
            f"faster that this search could hand over ran ({speedup:.2f}x is its runs against "
            f"your config's run, {tracker.metric.value} {mine:.4g})"
        )
    said = against_yours_said(method)
    return (
        f"{speedup:.2f}x your config ({tracker.metric.value} {mine:.4g}): "
        f"{described_with_knobs(baseline)} -> {described_with_knobs(handed)}"
        + (f"; {said}" if said else "")
    )
