"""The user's own configuration, run once as submitted, so the summary can say how much faster
the hand-over is (as DeepSpeed's autotuning tutorial reports against its baseline).

It runs right after the model profile, on top of ``--max-trials`` like the confirmation round,
and is never handed over. Where its run was unsteady (another job on the machine) and the
hand-over cannot be told apart from it for that, it runs once more at the end of the
confirmation round: measure again rather than say "too rough to tell". Where the config leaves
the micro-batch to an HF script (``"auto"``), the entrypoint's ``--per_device_train_batch_size``
(and accumulation) is the user's. It is skipped (and the summary says why) when neither sets
it, or when the memory model says it cannot fit; ``--no-baseline`` skips it.
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
from dsat.zero_space import auto_size_tags, knob_tags

if TYPE_CHECKING:
    from dsat.search.method import DsatSearchMethod


def times(ratio: float) -> str:
    """A speed-up as a multiple: two decimals, or two figures below 0.1 (a time metric's
    0.0047 read "0.00x")."""
    return f"{ratio:.2f}x" if ratio >= 0.1 else f"{ratio:.2g}x"


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
    total = fixed_global_batch(merged)
    if micro is None and total is None:
        return None
    slots = spec.slots_per_trial
    if micro is not None and total is not None and total % (micro * slots):
        # Said in the user's terms: the batch may be --global-batch's and the micro-batch the
        # script's flag, neither of them in the config the generic message named.
        where = (
            "your entrypoint's --per_device_train_batch_size"
            if MICRO_BATCH_SIZE in from_script
            else f"your config's {MICRO_BATCH_SIZE}"
        )
        raise DsatError(
            f"its micro-batch {micro} ({where}) does not divide the global batch {total} over "
            f"{slots} slot(s)"
        )
    batch = consistent_batch_sizes(merged, slots)
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


def described_against(record: TrialRecord, yours: TrialRecord) -> str:
    """``described_with_knobs``, and the size knobs the user's config leaves to HF's "auto"
    fill: theirs as "auto", the hand-over's value even at DeepSpeed's default ("ZeRO-2
    micro-batch 4 -> ZeRO-2 micro-batch 8" said nothing of a bucket that went from HF's
    hidden-size fill to 5e8)."""
    knobs = knob_tags(record.zero_section, record.zero_stage)
    filled = None if record is yours else record.zero_section
    extra = auto_size_tags(yours.zero_section, record.zero_stage, filled)
    tags = knobs + [t for t in extra if t not in knobs]
    return describe(record) + (f" ({', '.join(tags)})" if tags else "")


def baseline_runs(method: DsatSearchMethod) -> list[TrialRecord]:
    """Every run of the user's own configuration, in order (a second where the first was
    unsteady, ``measure_yours_again``)."""
    return [r for r in method.tracker.records if r.kind is TrialKind.BASELINE]


def baseline_run(method: DsatSearchMethod) -> TrialRecord | None:
    """The last run of the user's own configuration."""
    runs = baseline_runs(method)
    return runs[-1] if runs else None


def run_stderr(record: TrialRecord) -> float:
    """How well a run knew its own mean step time (``step_time_stderr``, relative; 0 where it
    did not say)."""
    return positive_number(record.metrics.get("step_time_stderr")) or 0.0


def yours_measured(method: DsatSearchMethod) -> tuple[float, float, int] | None:
    """The user's config's metric, how well its runs knew it (relative; 0: not said) and how
    many runs measured it. Two runs are pooled by how steady each was (weighted by the inverse
    of its variance, in logs): a run on a busy machine is slow as well as rough, and a steady
    one beside it should decide. Where a run did not say, the last that measured stands. Where
    the search ran the same configuration too (``runs_of_yours``), every run counts alike, as
    the hand-over's do (``mean_of_runs``): weighted by their own steadiness, a steady but slow
    baseline outweighed runs 2.4x faster, and "1.95x your config" stood beside "13.4% ahead
    of it, within the noise"."""
    tracker = method.tracker
    runs = [
        (value, run_stderr(r))
        for r in baseline_runs(method)
        if (value := tracker.baseline_value(r)) is not None and value > 0
    ]
    if not runs:
        return None
    if len(runs) == 1 or any(stderr == 0 for _, stderr in runs):
        mine = (*runs[-1], 1)
    else:
        weights = [1 / stderr**2 for _, stderr in runs]
        pooled = sum(w * math.log(value) for w, (value, _) in zip(weights, runs, strict=True))
        mine = (math.exp(pooled / sum(weights)), 1 / math.sqrt(sum(weights)), len(runs))
    others = [tracker.measured_value(r) for r in runs_of_yours(method)]
    values = [v for v, _ in runs] + [v for v in others if v is not None and v > 0]
    if len(values) == len(runs):
        return mine
    return sum(values) / len(values), 0.0, len(values)


def runs_of_yours(method: DsatSearchMethod) -> list[TrialRecord]:
    """The search's completed trials and confirmation runs of the user's own configuration (its
    ZeRO settings, micro-batch and accumulation): with several slots the baseline runs beside
    the others' start-up, and alone it measured 2.4x below the search's run of it, which made
    "11.28x your config" of a 5.5x."""
    mine = baseline_run(method)
    if mine is None:
        return []
    return [
        r
        for r in method.tracker.records
        if r.kind in (TrialKind.SEARCH, TrialKind.CONFIRM)
        and r.status is TrialStatus.COMPLETED
        and (r.zero_key, r.mbs, r.gas) == (mine.zero_key, mine.mbs, mine.gas)
    ]


def speedup_over_yours(method: DsatSearchMethod, handed: TrialRecord | None = None) -> float | None:
    """How many times faster the hand-over (or ``handed``) measured than the user's own config
    (the mean of its runs, as the summary's global row), where both were measured."""
    tracker = method.tracker
    handed = handed or tracker.best()
    yours = yours_measured(method)
    theirs = None if handed is None else tracker.mean_of_runs(handed)
    if yours is None or theirs is None:
        return None
    mine = yours[0]
    return mine / theirs if tracker.metric.smaller_is_better else theirs / mine


def yours_handed_over(method: DsatSearchMethod, handed: TrialRecord | None = None) -> bool:
    """Whether the configuration handed over (or ``handed``) is the user's own (the same ZeRO
    settings, micro-batch and accumulation): then its runs against the baseline's are one
    configuration measured again, not a speed-up."""
    mine, handed = baseline_run(method), handed or method.tracker.best()
    if mine is None or handed is None:
        return False
    return (handed.zero_key, handed.mbs, handed.gas) == (mine.zero_key, mine.mbs, mine.gas)


# A run whose mean step time is known only to this (its standard error, relative) or worse: its
# steps varied as on a busy machine (another job on the cores, a throttled GPU).
UNSTEADY_RUN = 0.10


def baseline_stderr(method: DsatSearchMethod) -> float:
    """How well the user's config's runs knew its mean step time (``yours_measured``; 0 where
    they did not say): its runs are all the comparison has of it."""
    yours = yours_measured(method)
    return 0.0 if yours is None else yours[1]


def unsteady_baseline_said(method: DsatSearchMethod, level: bool = False) -> str | None:
    """Where the user's config's run was unsteady (``UNSTEADY_RUN``), that the ratio against it
    is rough: a baseline measured while something else used the machine read 700x slower than
    the hand-over, and was compared as if it were exact. ``level``: the two were not told apart,
    for that unsteadiness."""
    yours = yours_measured(method)
    if yours is None or yours[1] < UNSTEADY_RUN:
        return None
    _, stderr, runs = yours
    rough = "too rough to tell the two apart" if level else "rough"
    which = "run was" if runs == 1 else f"{runs} runs were"
    return (
        f"your config's {which} unsteady (its mean step time known only to +/-{stderr:.0%}: "
        f"was the machine busy?), so this ratio is {rough}"
    )


def measure_yours_again(method: DsatSearchMethod, handed: TrialRecord) -> list[TrialRecord]:
    """One more run of the user's config, registered and on top of the budget, where its only
    run was unsteady and ``handed`` (the round's choice) could not be told apart from it for
    that: "0.76x your config, too rough to tell" left the user with nothing to act on, where one
    steadier run decides. At most once, and not where the hand-over is the user's own config."""
    tracker = method.tracker
    runs = baseline_runs(method)
    measured = [r for r in runs if tracker.baseline_value(r) is not None]
    if len(measured) != 1 or runs[-1] is not measured[0] or yours_handed_over(method, handed):
        return []
    first = measured[0]
    judged = _against_yours(method, handed)
    if run_stderr(first) < UNSTEADY_RUN or judged is None or judged[1]:
        return []
    again = method.rerun(first)
    tracker.max_trials += len(again)
    return again


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
    if yours_handed_over(method):  # "keep yours, which measured faster" than itself
        return False
    judged = _against_yours(method)
    return judged is not None and judged[0] < 1 and judged[1]


def _against_yours(
    method: DsatSearchMethod, handed: TrialRecord | None = None
) -> tuple[float, bool, float] | None:
    """The hand-over's (or ``handed``'s) speed-up over the user's config, whether it is more
    than the noise either way, and that noise (one run's, as this search's repeated runs showed
    it), judged with the mean of the hand-over's runs against the runs of the user's config,
    whose own unsteadiness (``baseline_stderr``) adds to it. None without both."""
    handed = handed or method.tracker.best()
    speedup = speedup_over_yours(method, handed)
    if speedup is None or handed is None:
        return None
    tracker = method.tracker
    noise = relative_noise([], repeated_measurements(tracker))
    runs = max(1, len(measurements(tracker, handed)))
    spread = math.sqrt(noise**2 * (1 + 1 / runs) + baseline_stderr(method) ** 2)
    return speedup, abs(math.log(speedup)) > 2 * spread, noise


def measured_as(method: DsatSearchMethod, value: float) -> str:
    """The user's config's value as the summary gives it, with what its run again showed where
    its first run was unsteady (``measure_yours_again``)."""
    tracker = method.tracker
    said = f"{tracker.metric.value} {value:.4g}"
    searched = [r.name for r in runs_of_yours(method) if tracker.measured_value(r)]
    if searched:  # the search ran it too: the figure is not its baseline run's alone
        names = ", ".join(dict.fromkeys(searched))
        count = f"{len(searched)} runs" if len(searched) > 1 else "run"
        said += f", with the search's {count} of it ({names})"
    runs = baseline_runs(method)
    ids = {r.request_id for r in runs}
    again = [r for r in runs if r.parent_id in ids]
    if not again:
        return said
    first = tracker.get(again[-1].parent_id or "")
    unsteady = f"the first, unsteady (+/-{run_stderr(first):.0%}), ran again"
    if again[-1].status is not TrialStatus.COMPLETED:
        return f"{said}: {unsteady} and {again[-1].status.value}"
    counted = yours_measured(method)
    pooled = (
        "the mean of every run"
        if searched
        else "weighted by how steady each was"
        if counted and counted[2] > 1
        else "the last"
    )
    return f"{said} over 2 runs, {pooled}: {unsteady}"


def baseline_line(method: DsatSearchMethod) -> str:
    """The summary's line comparing the hand-over with the user's own configuration."""
    if not method.settings.baseline:
        return ""
    tracker = method.tracker
    baseline, handed = baseline_run(method), tracker.best()
    if baseline is None:
        why = why_no_baseline(method)
        return f"your config: not run ({why})" if why else ""
    yours = yours_measured(method)
    if yours is None:
        if baseline.status is TrialStatus.OOM:
            ended = "ran out of memory"
        elif baseline.status.finished or not method.finished:
            ended = baseline.status.value
        else:  # it ran when the search ended: "running" in a summary written after dsat exited
            ended = "not run to its end (the search ended first)"
        return f"your config ({describe(baseline)}): {ended}"
    mine = yours[0]
    speedup = speedup_over_yours(method)
    if handed is None or speedup is None:
        return f"your config ({describe(baseline)}): {mine:.4g} {tracker.metric.value}"
    if yours_handed_over(method):
        return (
            f"your config is the one handed over ({described_with_knobs(handed)}): nothing "
            f"faster that this search could hand over ran ({times(speedup)} is its runs against "
            f"your config's {'runs' if (yours[2] > 1) else 'run'}, {measured_as(method, mine)})"
        )
    said = against_yours_said(method)
    # A speed-up of a time metric: "1.71x your config (latency 83.7)" read as 1.71x the time.
    as_fast = "as fast as " if tracker.metric.smaller_is_better else ""
    return (
        f"{times(speedup)} {as_fast}your config ({measured_as(method, mine)}): "
        f"{described_against(baseline, baseline)} -> {described_against(handed, baseline)}"
        + (f"; {said}" if said else "")
    )
