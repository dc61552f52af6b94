"""The guided search: bounded by what trials showed, ending when nothing can beat the best."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import pytest

from dsat.experiment.metric import Metric
from dsat.experiment.settings import DEFAULT_MEMORY_MARGIN as MARGIN
from dsat.runners.driver import SearchDriver
from dsat.runners.simulated.performance_models import (
    BUILTIN_MODELS,
    STRESS_MODELS,
    PerformanceModel,
    optimum,
)
from dsat.runners.simulated.runner import SimulatedRunner
from dsat.search import MethodSettings, make_search_method
from dsat.search.guided import ConfigState
from dsat.search.method import DsatSearchMethod
from dsat.search.trial_builder import SearchSpec
from dsat.trial import TrialKind, TrialRecord, TrialStatus
from dsat.zero_space import needs_no_less_memory
from tests.search.helpers import (
    BASE_DS,
    cliff_function,
    history,
    method,
    run,
    settings,
    spec,
    start_profile,
)


def test_it_ends_when_nothing_untried_can_beat_the_best() -> None:
    m = method("guided", zero_stages=(1, 2, 3), max_trials=64)
    driver = run(m, cliff_function(40, {2: 0.2}))
    best = m.tracker.best()
    assert best is not None and (best.zero_stage, best.mbs) == (2, 40)
    assert m.shutdown_reason == "no configuration left to try"
    assert len(driver.history) < 40  # the rest of --max-trials is left unspent


def test_it_never_spends_more_than_max_trials() -> None:
    m = method("guided", zero_stages=(1, 2, 3), max_trials=6)
    driver = run(m, cliff_function(40, {2: 0.2}))
    assert len(driver.history) == 6 == len(m.tracker.finished)


def test_the_same_events_give_the_same_trials_whatever_the_seed() -> None:
    """Nothing in it is random: a seed changes nothing, and a resume plans the same."""
    runs = [history(run(method("guided", random_seed=seed), cliff_function(21))) for seed in (5, 6)]
    assert runs[0] == runs[1]


def surface_search(
    model: PerformanceModel, seed: int, memory_margin: float = MARGIN
) -> DsatSearchMethod:
    """The guided search as a user of ``model``'s hardware would start it."""
    ds_config = {"train_micro_batch_size_per_gpu": 1, **model.base_ds_config}
    chosen = settings("guided", random_seed=seed, memory_margin=memory_margin)
    return make_search_method(chosen, spec(model.gpus, ds_config))


def within_2_percent(model: PerformanceModel, config: dict[str, Any] | None) -> bool:
    """Whether ``config`` truly (without noise) reaches 98% of the surface's optimum."""
    if config is None:
        return False
    found = model.metrics(config, model.gpus, noisy=False)["FLOPS_per_gpu"]
    return bool(found >= 0.98 * optimum_value(model))


@functools.cache
def optimum_value(model: PerformanceModel) -> float:
    """The surface's exhaustive optimum, worked out once per surface (it tries every config)."""
    best_value, _ = optimum(
        model, model.gpus, "FLOPS_per_gpu", False, (1, 2, 3), model.base_ds_config, MARGIN
    )
    return float(best_value)


def assert_handed_over_within_2_percent(m: DsatSearchMethod, model: PerformanceModel) -> None:
    handed_over = m.tracker.best()
    assert handed_over is not None
    assert within_2_percent(model, handed_over.ds_config)


def search_indices(m: DsatSearchMethod, matches: Callable[[TrialRecord], bool]) -> list[int]:
    """The positions, among the search's own trials, of those ``matches`` accepts."""
    search = [r for r in m.tracker.records if r.kind is TrialKind.SEARCH]
    return [i for i, r in enumerate(search) if matches(r)]


def paired_step_indices(m: DsatSearchMethod) -> list[int]:
    """Where ZeRO-2 with overlap on and the default reduce bucket shrunk to 1e8 (the paired step
    from the defaults) ran among the search's own trials."""
    return search_indices(
        m,
        lambda r: (
            r.zero_stage == 2
            and r.zero_section["overlap_comm"]
            and r.zero_section["reduce_bucket_size"] == 100_000_000
        ),
    )


class _Picks:
    """What the search would hand over after each finished trial."""

    def __init__(self, m: DsatSearchMethod) -> None:
        self.m = m
        self.picks: list[dict[str, Any] | None] = []

    def trial_started(self, request_id: str) -> None:
        pass

    def trial_finished(self, request_id: str, outcome: Any) -> None:
        record = self.m.pick()
        self.picks.append(None if record is None else dict(record.ds_config))

    def trial_retried(self, request_id: str, outcome: Any, attempt: int) -> None:
        pass


def search_with_picks(
    name: str, seed: int, memory_margin: float = MARGIN
) -> tuple[DsatSearchMethod, PerformanceModel, list[dict[str, Any] | None]]:
    """A search of the built-in surface ``name`` with the noise of ``seed``, run to its end, and
    what it would have handed over after each finished trial."""
    base = BUILTIN_MODELS[name]
    model = dataclasses.replace(base, noise_seed=base.noise_seed * 1000 + seed)
    m = surface_search(model, seed=seed, memory_margin=memory_margin)
    picks = _Picks(m)
    SearchDriver(m, SimulatedRunner(model, model.gpus), [picks]).run()
    return m, model, picks.picks


@pytest.mark.parametrize("name", sorted(STRESS_MODELS))
def test_no_trial_above_an_oom_that_already_decides_it(name: str) -> None:
    """A micro-batch at or above one that ran out of memory with a configuration needing no more
    memory is never tried: earlier trials already decided it."""
    model = BUILTIN_MODELS[name]
    m = surface_search(model, seed=0)
    driver = run(m, model, slots=model.gpus)
    finished: list[Any] = []
    for trial in driver.history:
        record = m.tracker.get(trial.outcome.request_id)
        if record.kind is TrialKind.SEARCH:
            for earlier, ended in finished:
                if ended > trial.outcome.start:
                    continue  # still running when this one started: it could not know
                decided = earlier.status is TrialStatus.OOM and needs_no_less_memory(
                    record.zero_section, earlier.zero_section
                )
                assert not (decided and record.mbs >= earlier.mbs), (record.name, earlier.name)
            finished.append((record, trial.outcome.end))


# Seeds, of 20, where the configuration the search hands over is within 2% of the optimum; each
# seed draws the surface's noise afresh (as benchmarks/search_efficiency.py does). Measured; the
# searches are deterministic, so these are exact. The hand-over is the leader by the denoised
# estimate (dsat/search/throughput_model.py); by the best single measurement it was 169 of 200,
# by the estimate alone 183, with the leaders' neighbours tried and each stage's best taken by
# the estimate 190 (see benchmarks/README.md), and with both buckets shrunk at once when the best
# is held back by memory 197 (under-reported 16->19, bucket memory 18->20, ZeRO-3 wins 18->20,
# knobs 19->20); with that step tried first when overlap is on, still 197 (under-reported 20,
# bucket memory 19: seed 8 hands over a lucky ZeRO-1 configuration 2.06% off); with overlap on
# plus a smaller reduce bucket ranked above the plain switches, 198 (bucket memory 20); with
# steps before a stage's best micro-batch settles and single trials discounted at the hand-over,
# 200 (pressure 20); with the step that frees memory offered to a best within two of a limit
# where a trial ran out of memory, 198 (bucket memory 19: seed 5 hands over the lucky ZeRO-1
# configuration 2.06% off that led the pick from trial 47 before too, until one more trial moved
# it; 7B 19: seed 7 hands over one 2.01% off); on 100 seeds of all 13 surfaces it hands over
# 1284 of 1300, up from 1281 (fp32 93 -> 100); with the paired step run beside a pending probe
# and steps from the stage's runner-up, 199 (7B 20; the floor left at 19). Since the simulated
# trials report their peak memory, the default 5% memory margin applies, and the optimum is the
# best configuration that leaves it free: 196 (fp32 19, bucket memory 18, 7B 19). Steering the
# search by limits predicted from the measured peaks was measured and not kept (see
# benchmarks/README.md); a trial over the margin bounding the micro-batch as an OOM does, the
# probe below it at the largest micro-batch that may leave the margin, and knob steps from a best
# over the margin run where their freed memory pays for the excess: 199 (bucket memory 19).
# Since 2026-11-25 what is safe to hand over leaves the margin of the memory a run can use (what
# the OOMs show), never of the device's nominal total, and a hand-over that is not safe counts as
# a miss: by that rule the search before handed over 57 of these 200 safe and within 2% (the
# first ten); now 190, none unsafe (fp32 17, bucket memory 17 and 14B 18: the limit the search
# may count on, the most a run completed with, is up to a sample below the true one).
# Since the hand-over's ranking pools knob settings and the headroom preference gives up at most
# 0.5% (2026-11-26), 276 of these 300 (was 275): run noise 16 -> 15 and flaky OOM 14 -> 13 here,
# where the benchmark's 40 seeds went 32 -> 36 and 30 -> 34 (benchmarks/README.md). Counting
# only on what ran near the device's total until an OOM shows more: 279 (under-reported 20 -> 19,
# bucket memory 19 -> 18).
REACHED = {
    "bert_base_16xv100": 20,
    "bert_large_fp32_2xv100": 20,
    "gpt2_large_16xv100": 20,
    "gpt_1b_knobs_16xethernet": 20,
    "gpt_1b_underreported_4xa10": 19,
    "gpt_2b_bucket_memory_8xa100": 18,
    "gpt_350m_pressure_2x4090": 20,
    "gpt_6b_zero3_wins_16xa100": 20,
    "llama_14b_no_low_stages_8xa100": 20,
    "llama_7b_8xa100": 20,
    # The hardware-like surfaces (run-to-run noise, flaky OOMs, aligned micro-batches, knobs of
    # either sign): 5, 2, 6, 5 and 2 of 20 before the search learned the usable memory, tried
    # aligned micro-batches and scaled its tolerances with the noise it measured.
    "gpt_1b_run_noise_8xa100": 15,
    # 15 until a memory check may split a gap narrower than a sample (2026-11-26): one then
    # runs in the flaky band, and its OOM reorders the search (at seeds 20-39, 17 either way).
    "llama_8b_flaky_oom_8xh100": 13,
    "gpt_760m_aligned_8xa100": 20,
    "gpt_2b_pcie_knobs_8xl40": 20,
    "gpt_3b_hardware_4xa100": 14,
}


@pytest.mark.parametrize("name", sorted(REACHED))
def test_what_it_hands_over_is_within_2_percent_of_the_optimum(name: str) -> None:
    metric = Metric.FLOPS_PER_GPU
    reached = 0
    base = BUILTIN_MODELS[name]
    # Noise-free, so the same for every seed's noise.
    best_value, _ = optimum(
        base, base.gpus, metric.file_key, False, (1, 2, 3), base.base_ds_config, MARGIN
    )
    for seed in range(20):
        model = dataclasses.replace(base, noise_seed=base.noise_seed * 1000 + seed)
        m = surface_search(model, seed)
        run(m, model, slots=model.gpus)
        handed_over = m.tracker.best()
        assert handed_over is not None
        found = model.metrics(handed_over.ds_config, model.gpus, noisy=False)[metric.file_key]
        # What is handed over is safe: it never runs out of memory, and leaves the margin of
        # the usable memory; so nothing it hands over beats the best that does.
        assert model.is_safe(handed_over.ds_config, model.gpus, MARGIN)
        assert found <= best_value * (1 + 1e-9)
        reached += found >= 0.98 * best_value
    assert reached >= REACHED[name]


def test_the_confirmation_round_confirms_by_the_denoised_estimate() -> None:
    """On the under-reported surface's seed 1, the luckiest measurement is a ZeRO-2 configuration
    at micro-batch 17: its neighbours say otherwise, so it neither leads the round nor is handed
    over; one at micro-batch 18 (the optimum's), truly better, is. (On seed 0, where this test
    used to look, the luckiest is now also the best estimated once both buckets were shrunk
    first; on the 14B surface's seed 0 once the leaders' neighbours ran.) Without a memory
    margin: micro-batch 18 uses 96.8% of the device, which the default 5% margin refuses."""
    base = BUILTIN_MODELS["gpt_1b_underreported_4xa10"]
    model = dataclasses.replace(base, noise_seed=base.noise_seed * 1000 + 1)
    ds_config = {"train_micro_batch_size_per_gpu": 1, **model.base_ds_config}
    chosen = settings("guided", confirm_top=3, memory_margin=0.0)
    m = make_search_method(chosen, spec(model.gpus, ds_config))
    run(m, model, slots=model.gpus)
    luckiest = m.tracker.best_of(m.tracker.records)
    handed_over = m.tracker.best()
    assert luckiest is not None and handed_over is not None
    assert m.ending.confirmation_candidates[0] == handed_over.request_id != luckiest.request_id
    assert any(r.kind is TrialKind.CONFIRM for r in m.tracker.records)

    def true(record: Any) -> float:
        return model.metrics(record.ds_config, model.gpus, noisy=False)["FLOPS_per_gpu"]

    assert (luckiest.mbs, handed_over.mbs) == (17, 18)
    assert true(handed_over) > true(luckiest)


def test_a_leader_tried_at_one_micro_batch_gets_its_neighbours() -> None:
    """The leading configuration gets trials of its own next to its best micro-batch (below the
    cliff at 40: 39 and 38, which the curve alone never asks for), so the estimate that ranks
    it does not rest on one measurement; knob steps level with it are not checked again."""
    m = method("guided", zero_stages=(1, 2, 3), max_trials=64)
    run(m, cliff_function(40, {2: 0.2}))
    ran: dict[str, set[int]] = {}
    for r in m.tracker.records:
        if r.zero_stage == 2 and r.status is TrialStatus.COMPLETED:
            ran.setdefault(repr(sorted(r.zero_section.items())), set()).add(r.mbs)
    assert sum({38, 39, 40} <= mbs for mbs in ran.values()) == 1
    assert len(m.tracker.records) < 40


def test_a_stage_best_micro_batch_is_the_estimate_s_not_the_luckiest() -> None:
    """A lucky measurement at 30 does not make 30 the configuration's best micro-batch when the
    estimate puts 32 above it (knob steps then run where memory holds it back)."""
    state = ConfigState({"stage": 1}, values={30: 0.978, 32: 0.959}, estimated={30: 0.962})
    assert state.best_micro_batch == 30  # 32 not estimated: its measurement counts
    state.estimated[32] = 0.971
    assert (state.best_micro_batch, state.best) == (32, 0.971)


def test_a_best_held_back_by_memory_gets_both_buckets_smaller() -> None:
    """On the ZeRO-3-wins surface's seed 18, the default buckets fit micro-batch 15 and a reduce
    bucket one step smaller fits 16, but the optimum is at 17, which needs the all-gather bucket
    smaller too. Single bucket steps run at the best's micro-batch (or out of memory above it),
    where shrinking shows nothing, so the larger micro-batch used never to run and a lucky 15 was
    handed over, 3.4% off. The step that shrinks both buckets two rungs at once, offered when the
    stage's best is held back by memory, runs at 17 and what is handed over is within 2%."""
    base = BUILTIN_MODELS["gpt_6b_zero3_wins_16xa100"]
    model = dataclasses.replace(base, noise_seed=base.noise_seed * 1000 + 18)
    m = surface_search(model, seed=18)
    run(m, model, slots=model.gpus)
    default = 500_000_000
    assert any(
        r.status is TrialStatus.COMPLETED
        and r.zero_stage == 3
        and r.mbs == 17
        and r.zero_section["reduce_bucket_size"] < default
        and r.zero_section["allgather_bucket_size"] < default
        for r in m.tracker.records
    )
    assert_handed_over_within_2_percent(m, model)


def test_a_best_two_below_a_seen_memory_limit_gets_both_buckets_smaller_early() -> None:
    """On the fp32 surface's seed 1, ZeRO-1's default buckets run out of memory at 33 and its best
    measurement is a lucky 30 (truly 3.6% off; the limit's 32 is 2.8% off), so its best was not
    taken to be held back by memory and its curve stayed open below 30: the step that shrinks
    both buckets, which fits 40 micro-batches (the optimum runs 41, 0.2% better), waited for small
    micro-batches to be probed and ran as the 34th search trial, and the pick got within 2% at
    trial 50. A best within two of a limit where a trial ran out of memory now gets that step
    among the first 24 search trials, and the pick stays within 2% from the 30th trial on (the
    25th before the memory check and the aligned micro-batches took trials of their own)."""
    m, model, picks = search_with_picks("bert_large_fp32_2xv100", seed=1)
    default = 500_000_000
    shrunk = search_indices(
        m,
        lambda r: (
            r.zero_stage == 1
            and r.zero_section["reduce_bucket_size"] < default
            and r.zero_section["allgather_bucket_size"] < default
        ),
    )
    assert shrunk and shrunk[0] < 24
    assert all(within_2_percent(model, config) for config in picks[29:])


def test_the_paired_step_runs_while_a_probe_of_the_best_is_pending() -> None:
    """On the memory-pressure surface's seed 1, ZeRO-2 with overlap on and a smaller reduce
    bucket is 8% faster than without. The paired step waited until no probe of ZeRO-2's best
    was pending, which with four trials in flight meant until its curve was explored: it ran as
    search trial 18 and the pick got within 2% at trial 25. It keeps bucket memory level, so what
    it shows does not wait on those probes: once the best ran at four micro-batches it runs
    beside them (as trial 15), and the pick first gets within 2% at trial 17."""
    m, model, picks = search_with_picks("gpt_350m_pressure_2x4090", seed=1)
    paired = paired_step_indices(m)
    assert paired and paired[0] < 16
    first_within = [i for i, config in enumerate(picks) if within_2_percent(model, config)]
    assert first_within and first_within[0] < 20


def test_steps_also_start_from_the_stage_s_runner_up() -> None:
    """On the memory-pressure surface's seed 1, with the paired step run early, contiguous
    gradients switched off measured 3.5% above its true level at 14 and became ZeRO-2's best;
    every later step started from it (none reaches within 2%), and it was handed over 2.9% off.
    The configuration it displaced, within 1% of it, gets steps of its own too: its step to a
    smaller all-gather bucket is handed over, 1.7% off."""
    m, model, _ = search_with_picks("gpt_350m_pressure_2x4090", seed=1)
    assert_handed_over_within_2_percent(m, model)


def test_overlap_with_a_smaller_reduce_bucket_comes_before_the_plain_switches() -> None:
    """On the under-reported surface's seed 0, the optimum is ZeRO-2 with overlap on and a small
    reduce bucket. Overlap alone keeps 4.5 reduce buckets and runs out of memory where the
    optimum runs; ranked level with the plain switches, the step that switches overlap on and
    shrinks the reduce bucket came after them, and by then overlap alone (measured at a smaller
    micro-batch) had become the stage's best, so the paired step never ran and the pick got
    within 2% only at trial 56. Ranked first among switches, it runs before overlap alone, among
    the first 30 trials (24 before the memory check and the aligned micro-batches)."""
    base = BUILTIN_MODELS["gpt_1b_underreported_4xa10"]
    model = dataclasses.replace(base, noise_seed=base.noise_seed * 1000)
    m = surface_search(model, seed=0)
    run(m, model, slots=model.gpus)
    paired = paired_step_indices(m)
    alone = search_indices(
        m,
        lambda r: (
            r.zero_stage == 2
            and r.zero_section["overlap_comm"]
            and r.zero_section["reduce_bucket_size"] == 500_000_000
        ),
    )
    assert paired and paired[0] < 30
    assert not alone or paired[0] < alone[0]


def test_steps_start_before_the_best_micro_batch_settles() -> None:
    """On the knobs surface's seed 0, ZeRO-2 with overlap on is 15% faster than without. Its
    steps used to wait until ZeRO-2's (and ZeRO-3's) micro-batch curves were settled, and
    overlap ran as search trial 45. Once the stage's best rests on two trials near its best
    micro-batch, its steps that keep bucket memory level run one at a time: overlap (with a
    smaller reduce bucket) runs among the first 24 (16 before the memory check, which runs first
    once the leader nears the device's memory, and the aligned micro-batches)."""
    base = BUILTIN_MODELS["gpt_1b_knobs_16xethernet"]
    model = dataclasses.replace(base, noise_seed=base.noise_seed * 1000)
    m = surface_search(model, seed=0)
    run(m, model, slots=model.gpus)
    overlap = search_indices(m, lambda r: r.zero_stage == 2 and r.zero_section["overlap_comm"])
    assert overlap and overlap[0] < 24


def test_a_configuration_tried_once_is_not_handed_over_on_its_luck() -> None:
    """On the Llama 7B surface's seed 31, ZeRO-2 with overlap on and reduce-scatter off, tried at
    micro-batch 16 only, measures 0.8% above the optimum (truly 2.2% below) and leads the
    estimate at the end (its confirmation runs measure the same); handed over, it is 2.2% off.
    Ranked 1% lower for resting on one trial, ZeRO-1 at 15, whose level rests on several trials,
    is handed over instead (1.5% off). (Since the margin applies to the usable memory, ZeRO-1 at
    15 leaves too little of it; what is handed over, 2.2% off, is not the lucky one either.)"""
    base = BUILTIN_MODELS["llama_7b_8xa100"]
    model = dataclasses.replace(base, noise_seed=base.noise_seed * 1000 + 31)
    m = surface_search(model, seed=31)
    run(m, model, slots=model.gpus)
    handed_over = m.tracker.best()
    assert handed_over is not None
    section = handed_over.zero_section
    lucky = section["stage"] == 2 and section["overlap_comm"] and not section["reduce_scatter"]
    assert not (lucky and handed_over.mbs == 16)


def test_a_step_that_costs_memory_waits_for_the_best_micro_batch() -> None:
    """On the bucket-memory surface's seed 17, ZeRO-1's best was at 21, 1.6% off the optimum,
    from trial 7 on. Its step to a larger reduce bucket (more memory) ran at 20 while ZeRO-1's
    curve was still open, measured 1.6% above its true level and took the pick, just over 2% off,
    until ZeRO-2 with overlap ran. A step that keeps more or less bucket memory now waits until the
    best micro-batch, and with it the memory limit, is settled: the pick stays within 2%. Without
    a memory margin, as when this was found (the margin moves the limit the test is about). From
    trial 9 on (7 before the probes moved to aligned micro-batches)."""
    _, model, picks = search_with_picks("gpt_2b_bucket_memory_8xa100", seed=17, memory_margin=0.0)
    assert all(within_2_percent(model, config) for config in picks[8:])  # from trial 9 on


def rising_with_memory(used: Callable[[int], float]) -> Callable[..., dict[str, Any]]:
    """Throughput rising with the micro-batch up to an OOM above 40, at a peak of ``used(mbs)``
    of the device's memory."""

    def perform(ds_config: dict[str, Any], slots: int) -> dict[str, Any]:
        result = cliff_function(40)(ds_config, slots)
        if "num_params" not in result:  # not the model profile
            mbs = ds_config["train_micro_batch_size_per_gpu"]
            result["memory_peak_bytes"] = int(used(mbs) * 2**30)
            result["memory_total_bytes"] = 2**30
        return result

    return perform


def test_below_a_trial_over_the_margin_it_tries_where_the_margin_is_first_left() -> None:
    """Memory at 30% plus 1.75% a sample: micro-batch 37 leaves the 5% margin, 38 does not. A
    trial over the margin bounds its configuration, and those needing no less memory, as an OOM
    does; the next trial below it runs at the largest micro-batch that may leave the margin
    (memory grows at most in proportion to the micro-batch), not in the middle of the range:
    37, right after the first trial over the margin, and 37 is handed over."""
    m = method("guided", zero_stages=(1,), max_concurrent_trials=1, max_trials=30)
    driver = run(m, rising_with_memory(lambda mbs: 0.3 + 0.0175 * mbs))
    records = [m.tracker.get(t.outcome.request_id) for t in driver.history]
    search = [r for r in records if r.kind is TrialKind.SEARCH]
    first_over = next(
        i
        for i, r in enumerate(search)
        if r.status is TrialStatus.COMPLETED and m.tracker.too_large(r)
    )
    assert search[first_over].mbs > 37
    assert search[first_over + 1].mbs == 37
    for index, record in enumerate(search):
        for earlier in search[:index]:
            decided = m.tracker.too_large(earlier) and needs_no_less_memory(
                record.zero_section, earlier.zero_section
            )
            assert not (decided and record.mbs >= earlier.mbs), (record.name, earlier.name)
    best = m.tracker.best()
    assert best is not None and best.mbs == 37


def test_a_step_from_a_best_over_the_margin_runs_where_its_freed_memory_leaves_it() -> None:
    """A knob step from a best that ran over the margin runs where the bucket memory it frees
    (DeepSpeed's estimate) first pays for the excess: at the best's micro-batch or above when it
    frees enough, below it when it frees nothing."""
    m, _, _ = search_with_picks("gpt2_large_16xv100", seed=0)
    guided: Any = m
    section = {
        "stage": 2,
        "overlap_comm": False,
        "reduce_bucket_size": 500_000_000,
        "allgather_bucket_size": 500_000_000,
        "contiguous_gradients": True,
        "reduce_scatter": True,
    }
    peak = 0.967 * 32 * 2**30
    excess = peak - (1 - MARGIN) * 32 * 2**30  # 1.7% of the device over the margin
    base = ConfigState(section, values={4: 1.0}, over_margin={4: (excess, peak)})
    smaller = {**section, "allgather_bucket_size": 100_000_000}
    assert guided.bytes_freed(section, smaller) > excess
    assert guided.margin_step_mbs(base, 4, smaller) >= 4
    no_memory = {**section, "contiguous_gradients": False}
    assert guided.bytes_freed(section, no_memory) == 0
    assert guided.margin_step_mbs(base, 4, no_memory) == 3


def test_the_range_factor_scales_where_each_stage_starts() -> None:
    """--search-range-factor scales the memory model's largest micro-batch that guided starts a
    stage from (on a CPU the model allows thousands): the first trial of each stage lands
    in the scaled range."""
    first: dict[float, dict[int, int]] = {}
    for factor in (1.0, 0.1):
        m = method(
            "guided", zero_stages=(1, 2), max_concurrent_trials=4, search_range_factor=factor
        )
        first[factor] = {r.zero_stage: r.mbs for r in start_profile(m)}
        reach = {s: m.micro_batch_ceiling(s) for s in (1, 2)}
        assert all(mbs <= max(int(reach[s] * factor), 1) for s, mbs in first[factor].items())
    assert first[1.0].keys() == first[0.1].keys() == {1, 2}
    assert all(first[0.1][s] < first[1.0][s] for s in (1, 2))


@pytest.mark.parametrize("baseline_fits", [True, False])
def test_one_trial_at_a_time_searches_after_the_users_config(baseline_fits: bool) -> None:
    """With --max-concurrent-trials 1 the baseline took the only place when the profile ended,
    nothing was planned, and the search failed at once: "no configuration left to try"."""
    m = method("guided", max_concurrent_trials=1, baseline=True, max_trials=10)

    def perform(ds_config: dict[str, Any], slots: int) -> dict[str, Any]:
        profile = ds_config.get("autotuning", {}).get("model_info", {}).get("profile")
        user = not profile and ds_config["zero_optimization"]["stage"] == 1  # BASE_DS's, at 1
        if not baseline_fits and user and ds_config["train_micro_batch_size_per_gpu"] == 1:
            raise MemoryError("the user's own config, out of memory")
        return cliff_function(23)(ds_config, slots)

    run(m, perform)
    kinds = [r.kind for r in m.tracker.records]
    assert kinds[:2] == [TrialKind.MODEL_PROFILE, TrialKind.BASELINE]
    assert kinds.count(TrialKind.SEARCH) == 9 and m.tracker.best() is not None
    assert not m.search_failed


# HF's documented ZeRO-2 template: its Trainer fills each "auto" in the trial.
HF_ZERO2 = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "zero_optimization": {
        "stage": 2,
        "allgather_partitions": True,
        "allgather_bucket_size": "auto",
        "reduce_bucket_size": "auto",
        "overlap_comm": True,
        "contiguous_gradients": True,
    },
}


def test_an_hf_template_with_auto_bucket_sizes_is_searched_from_deepspeeds_defaults() -> None:
    """Guided stepped "auto" against numbers: a TypeError's traceback right after the model
    profile, for HF's own ZeRO-2 and ZeRO-3 templates."""
    m = make_search_method(
        MethodSettings(method="guided", zero_stages=(1, 2), confirm_top=0),
        spec(ds_config=HF_ZERO2),
    )
    driver = run(m, cliff_function(24))
    searched = [f for f in driver.history if f.outcome.status is TrialStatus.COMPLETED]
    assert len(searched) > 3
    for finished in driver.history[1:]:  # the model profile runs the user's section as it is
        zero = finished.ds_config["zero_optimization"]
        assert "auto" not in (zero.get("reduce_bucket_size"), zero.get("allgather_bucket_size"))


def test_a_zero_knob_the_users_overrides_set_is_where_the_search_starts() -> None:
    """Set in the experiment's overwrite_deepspeed_args, it was replaced by DeepSpeed's default
    in every search trial: only the model profile ran the user's value."""
    hparams = {
        "deepspeed_config": "ds.json",
        "overwrite_deepspeed_args": {"zero_optimization": {"reduce_bucket_size": 20_000_000}},
    }
    m = make_search_method(
        MethodSettings(method="guided", zero_stages=(1,), confirm_top=0),
        SearchSpec(hparams, dict(BASE_DS), 1),
    )
    driver = run(m, cliff_function(24))
    sizes = [f.ds_config["zero_optimization"]["reduce_bucket_size"] for f in driver.history]
    assert sizes[0] == sizes[1] == 20_000_000, sizes  # the model profile, then the search's first


@pytest.mark.parametrize("surface", ["bert_base_16xv100", "llama_7b_8xa100"])
def test_a_latency_search_hands_over_the_least_latency(surface: str) -> None:
    """A time is least at the smallest micro-batch; guided started each stage in the middle of
    its reach, as for a rate, and handed over 7.5x the least latency of bert_base (5 of 75
    seeds on the built-in surfaces within 2%)."""
    model = BUILTIN_MODELS[surface]
    least, _ = optimum(model, model.gpus, "latency", True, memory_margin=MARGIN)
    for seed in range(3):
        spec = SearchSpec({"deepspeed_config": "ds.json"}, {}, model.gpus)
        settings = MethodSettings(
            method="guided", metric=Metric.LATENCY, random_seed=seed, max_trials=50
        )
        m = make_search_method(settings, spec)
        SearchDriver(m, SimulatedRunner(model, model.gpus)).run()
        best = m.tracker.best()
        assert best is not None
        assert model.metrics(best.ds_config, model.gpus, noisy=False)["latency"] <= 1.02 * least
