"""The confirmation round: leaders run again, interleaved; the winner of that round is handed
over, with memory headroom deciding among equals and a margin no configuration may break."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dsat.results.directory import confirmation_table
from dsat.runners.simulated.runner import SimulatedRunner
from dsat.search.confirmation import (
    EXTRA_ROUNDS,
    allowed_rounds,
    decide,
    next_round,
    rounds_note,
    search_trials,
)
from dsat.search_run import run_search
from dsat.trial import TrialKind, TrialStatus
from tests.search.helpers import PROFILE, method, run, search_settings, spec

GiB = 2**30


def performance(
    lucky_mbs: int | None = None, memory: Callable[[int], float] = lambda mbs: 0.02 * mbs
) -> Callable[..., dict[str, Any]]:
    """Throughput rising with the micro-batch up to an OOM above 40; the first measurement of
    ``lucky_mbs`` comes out 60% high (a noisy short trial); ``memory`` gives the peak memory as
    a fraction of the device (by default 80% at 40: the OOM above it shows that about that much
    is usable, and the margin leaves 5% of it free, so 38 is the largest that may be handed
    over)."""
    calls: Counter[int] = Counter()

    def perform(ds_config: dict[str, Any], slots: int) -> dict[str, Any]:
        if ds_config.get("autotuning", {}).get("model_info", {}).get("profile"):
            return dict(PROFILE)
        mbs = ds_config["train_micro_batch_size_per_gpu"]
        if mbs > 40:
            raise MemoryError("too big")
        calls[mbs] += 1
        throughput = float(mbs) * (1.6 if mbs == lucky_mbs and calls[mbs] == 1 else 1.0)
        return {
            "throughput": throughput,
            "FLOPS_per_gpu": throughput * 1e9,
            "latency": 1000 / throughput,
            "memory_peak_bytes": int(memory(mbs) * 16 * GiB),
            "memory_total_bytes": 16 * GiB,
        }

    return perform


def search(function: Callable[..., dict[str, Any]], **overrides: Any) -> Any:
    overrides.setdefault("confirm_top", 3)
    overrides.setdefault("max_trials", 12)
    m = method("binary", zero_stages=(1,), max_concurrent_trials=1, **overrides)
    run(m, function)
    return m


def confirm_runs(m: Any) -> list[Any]:
    return [r for r in m.tracker.records if r.kind is TrialKind.CONFIRM]


def test_a_lucky_measurement_is_not_handed_over() -> None:
    m = search(performance(lucky_mbs=32))
    searched_best = m.tracker.best_of(m.tracker.records)
    assert searched_best is not None and searched_best.mbs == 32  # 51.2 measured once
    best = m.tracker.best()
    assert best is not None and best.mbs == 38 and best.kind is TrialKind.SEARCH
    runs = confirm_runs(m)
    assert runs and {r.parent_id for r in runs} >= {searched_best.request_id, best.request_id}
    assert "confirmed z1_mb38" in (m.shutdown_reason or "")
    said = m.ending.handover_reason  # the round's verdict, said as it decided
    assert said.startswith(f"{best.name}: the fastest") and "no leader ran again" not in said
    assert not m.search_failed


def test_a_search_that_handed_over_resumes_as_it_ended() -> None:
    """Resumed (for a full run, or by mistake), an ended search starts nothing and keeps its
    words: the summary it rewrites still says what the round confirmed."""
    ended = search(performance(lucky_mbs=32))
    assert ended.ending.handed_over(ended)
    resumed = method("binary", zero_stages=(1,), max_concurrent_trials=1, max_trials=12)
    resumed.load_state_json(json.loads(json.dumps(ended.state_json())))
    resumed.resume()
    assert resumed.ending.handed_over(resumed)
    assert resumed.suggest() is None and resumed.finished
    assert resumed.shutdown_reason == ended.shutdown_reason
    assert resumed.tracker.confirmed_id == ended.tracker.confirmed_id


def measured(
    m: Any,
    mbs: int,
    values: list[float],
    memory: float,
    searched: float = 1.0,
    steps_spread: float | None = None,
) -> Any:
    """A finished search trial at ``mbs`` measuring ``searched`` and its confirmation runs
    measuring ``values`` (their steps varying by ``steps_spread`` within a run, where given)."""
    metrics: dict[str, Any] = {"memory_peak_bytes": int(memory * GiB), "memory_total_bytes": GiB}
    if steps_spread is not None:
        metrics["step_time_spread"] = steps_spread
    leader = m.make_trial(TrialKind.SEARCH, {"stage": 1}, mbs).replace(request_id=f"at-{mbs}")
    m.tracker.add(leader, queue=False)
    m.tracker.mark_finished(
        leader.request_id, TrialStatus.COMPLETED, {"throughput": searched, **metrics}
    )
    for number, value in enumerate(values):
        run = leader.replace(
            request_id=f"{leader.request_id}-{number}",
            kind=TrialKind.CONFIRM,
            parent_id=leader.request_id,
        )
        m.tracker.add(run, queue=False)
        m.tracker.mark_finished(
            run.request_id, TrialStatus.COMPLETED, {"throughput": value, **metrics}
        )
    return m.tracker.get(leader.request_id)


def test_among_equals_the_one_with_more_memory_headroom_wins() -> None:
    m = method("binary", metric="throughput")
    fast = measured(m, 40, [100.0, 104.0], memory=0.9)  # its runs differ by 4%: the noise
    roomy = measured(m, 32, [102.0, 101.5], memory=0.6)  # 0.25% slower, within that noise
    slow = measured(m, 24, [90.0, 91.0], memory=0.3)  # 11% slower: not an equal
    assert decide(m.tracker, [fast, roomy, slow]).chosen is roomy
    # 1.5% slower is within that noise too, but more than a user gives for headroom (0.5%).
    wide = method("binary", metric="throughput")
    fast = measured(wide, 40, [100.0, 104.0], memory=0.9)
    roomy = measured(wide, 32, [101.0, 100.0], memory=0.6)
    assert decide(wide.tracker, [fast, roomy]).chosen is fast
    steady = method("binary", metric="throughput")
    # No noise measured: the runs tell them apart, even 0.5% apart, and the faster one wins.
    fast = measured(steady, 40, [100.5, 100.5], memory=0.9)
    roomy = measured(steady, 32, [100.0, 100.0], memory=0.6)
    assert decide(steady.tracker, [fast, roomy]).chosen is fast
    # Level in estimate and runs (0.2%), but hardly more headroom (2% of the device): the
    # faster one stays; with 30% more, the roomier one wins.
    for fast_memory, roomier_wins in ((0.62, False), (0.9, True)):
        close = method("binary", metric="throughput")
        fast = measured(close, 40, [100.0, 104.0], memory=fast_memory, searched=100.0)
        roomy = measured(close, 32, [102.0, 101.5], memory=0.60, searched=100.0)
        assert (decide(close.tracker, [fast, roomy]).chosen is roomy) is roomier_wins


def test_a_leader_whose_run_again_failed_is_not_decided_on_its_search_trial_alone() -> None:
    """Its one measurement, 50% ahead, is the lucky one the round is there to catch."""
    m = method("binary", metric="throughput")
    lucky = measured(m, 40, [], memory=0.5, searched=150.0)
    again = lucky.replace(
        request_id=f"{lucky.request_id}-0", kind=TrialKind.CONFIRM, parent_id=lucky.request_id
    )
    m.tracker.add(again, queue=False)
    m.tracker.mark_finished(again.request_id, TrialStatus.ERROR, {})
    steady = measured(m, 32, [100.0, 100.0], memory=0.5, searched=100.0)
    assert decide(m.tracker, [lucky, steady]).chosen is steady


def test_headroom_wins_only_where_the_runs_are_level_too() -> None:
    def estimated(values: dict[str, float]) -> Callable[[Any], float]:
        return lambda record: values[record.request_id]

    # The estimate calls them level (0.2% apart), but the roomier one's runs measured 1.5%
    # slower, more than a user gives for headroom: the faster one is handed over.
    m = method("binary", metric="throughput")
    fast = measured(m, 40, [103.0, 104.0], memory=0.9, searched=100.0)
    roomy = measured(m, 32, [101.0, 101.5], memory=0.6, searched=100.0)
    score = estimated({fast.request_id: 100.0, roomy.request_id: 99.8})
    assert decide(m.tracker, [fast, roomy], score).chosen is fast
    # Runs level as well: the roomier one.
    level = method("binary", metric="throughput")
    fast = measured(level, 40, [103.0, 104.0], memory=0.9, searched=100.0)
    roomy = measured(level, 32, [103.5, 103.0], memory=0.6, searched=100.0)
    score = estimated({fast.request_id: 100.0, roomy.request_id: 99.8})
    verdict = decide(level.tracker, [fast, roomy], score)
    assert verdict.chosen is roomy and "more of the device's memory free" in verdict.reason


def test_a_configuration_that_leaves_too_little_memory_is_never_handed_over() -> None:
    m = search(performance(memory=lambda mbs: 0.97 if mbs >= 36 else 0.5))
    best = m.tracker.best()
    assert best is not None and best.mbs < 36
    assert all(r.mbs < 36 for r in confirm_runs(m))
    unsafe = search(performance(memory=lambda mbs: 0.99))
    assert unsafe.search_failed  # nothing that ran leaves the margin free
    assert "--memory-margin" in (unsafe.shutdown_reason or "")


def test_the_round_is_a_small_share_of_the_search() -> None:
    leaders = list(range(3))
    assert allowed_rounds(leaders, 63) == 2  # type: ignore[arg-type]
    assert allowed_rounds(leaders, 13) == 1  # type: ignore[arg-type]
    assert allowed_rounds(leaders[:1], 63) == 0  # type: ignore[arg-type]


def test_a_second_round_only_where_the_first_did_not_repeat_the_measurements() -> None:
    def leaders(runs: list[list[float]]) -> tuple[Any, list[Any]]:
        m = method("binary", metric="throughput")
        return m, [
            measured(m, 40 - i, values, memory=0.5, searched=100.0 - i)
            for i, values in enumerate(runs)
        ]

    # Before any run: the first round, every leader once.
    m, fresh = leaders([[], [], []])
    assert next_round(m.tracker, fresh, 63) == fresh
    # Each leader's run within 0.3% of its search trial: a quiet machine, no second round.
    m, quiet = leaders([[100.2], [98.8], [98.3]])
    assert next_round(m.tracker, quiet, 63) == []
    # Runs 3-4% off their search trials: once more, where the share of the search allows it.
    m, noisy = leaders([[104.0], [95.0], [98.0]])
    assert next_round(m.tracker, noisy, 63) == noisy
    assert next_round(m.tracker, noisy, 13) == []
    # Two rounds at the most.
    m, twice = leaders([[104.0, 96.0], [95.0, 103.0], [98.0, 97.0]])
    assert next_round(m.tracker, twice, 63) == []


def test_a_quiet_machine_confirms_in_one_round_a_noisy_one_in_two() -> None:
    """Exact repeats (this performance function's runs measure what the search trials did):
    each leader runs again once, and the verdict follows; where every other run of a
    configuration measures 6% lower, the leaders run twice."""
    m = search(performance(), max_trials=64)
    searched = [r for r in m.tracker.finished if r.kind is TrialKind.SEARCH]
    runs = confirm_runs(m)
    leaders = [m.tracker.get(r.parent_id) for r in runs]
    assert allowed_rounds(leaders, len(searched)) == 2
    assert len(runs) == 3 and len({r.parent_id for r in runs}) == 3
    assert "confirmed" in (m.shutdown_reason or "")
    assert "one run's spread, search trials and runs: 0.0% (within 1%: one round is enough)" in (
        confirmation_table(m.tracker)
    )

    quiet = performance()
    calls: Counter[str] = Counter()

    def noisy(ds_config: dict[str, Any], slots: int) -> dict[str, Any]:
        result = quiet(ds_config, slots)
        if "throughput" in result:
            key = repr(ds_config)
            calls[key] += 1
            result["throughput"] *= 1.0 if calls[key] % 2 else 0.94
        return result

    m = search(noisy, max_trials=64)
    runs = confirm_runs(m)
    assert len(runs) == 6 and Counter(r.parent_id for r in runs) == Counter(
        {parent: 2 for parent in {r.parent_id for r in runs}}
    )
    assert "one run's spread, search trials and runs: 3." in confirmation_table(m.tracker)
    assert "(2 rounds: the leaders run again where the first round did not" in (
        confirmation_table(m.tracker)
    )


def test_the_summary_says_when_the_share_of_the_search_allowed_one_round_only() -> None:
    """Runs 3-4% off their search trials after a search of three trials: a second round would
    take more than the round's share, so there is none, and the summary does not promise one."""
    m = method("binary", metric="throughput")
    noisy = [
        measured(m, 40 - i, [value], memory=0.5, searched=100.0 - i)
        for i, value in enumerate([104.0, 95.0, 98.0])
    ]
    assert next_round(m.tracker, noisy, search_trials(m.tracker)) == []
    note = rounds_note(m.tracker, noisy)
    assert note is not None and "above 1%, but a second round would take more than 15% of " in note
    assert "the search's 3 trials: one round)" in note
    # Not "a larger --max-trials allows two": a search that ended with nothing left to try,
    # 38 of 63 trials run, would run no more with a larger budget.
    assert "--max-trials" not in note


def test_the_summary_says_which_leaders_ran_again_where_the_estimate_and_runs_disagreed() -> None:
    """Two leaders ran three times, one once: "one round is enough" alone read as if none had
    run again."""
    m = method("binary", metric="throughput")
    leaders = [
        measured(m, 40, [100.0, 100.0, 100.0], memory=0.5, searched=100.0),
        measured(m, 32, [100.0], memory=0.5, searched=100.0),
        measured(m, 24, [101.0, 101.0, 101.0], memory=0.5, searched=101.0),
    ]
    note = rounds_note(m.tracker, leaders)
    assert note is not None and note.startswith(
        "one run's spread, search trials and runs: 0.0%; z1_mb40 and z1_mb24 ran 2 more "
        "time(s), where the estimate and their runs disagreed"
    ), note


def test_confirm_top_2_runs_the_two_leaders_again() -> None:
    m = search(performance(lucky_mbs=32), confirm_top=2)
    assert len({r.parent_id for r in confirm_runs(m)}) == 2
    assert m.tracker.best().mbs == 38  # the lucky 32 did not repeat its luck


@pytest.mark.parametrize("confirm_top", [0, 1])
def test_no_round_with_confirm_top_0_or_1(confirm_top: int) -> None:
    m = search(performance(lucky_mbs=32), confirm_top=confirm_top)
    assert confirm_runs(m) == [] and m.tracker.best().mbs == 32
    assert m.ending.handover_reason == (
        f"{m.tracker.best().name}: the best of the search (--confirm-top {confirm_top}: no "
        "confirmation round)"
    )


@pytest.mark.parametrize("stop_after", [8, 11, 12])
def test_a_search_interrupted_in_its_confirmation_round_resumes_to_the_same_winner(
    tmp_path: Path, stop_after: int
) -> None:
    chosen = search_settings(
        "binary", zero_stages=(1,), max_concurrent_trials=1, max_trials=12, confirm_top=3
    )
    # Measurements that do not change between runs: a resumed round sees what a whole one does.
    whole = run_search(chosen, spec(), SimulatedRunner(performance(), 1), tmp_path / "a")
    run_search(
        chosen, spec(), SimulatedRunner(performance(), 1), tmp_path / "b", max_events=stop_after
    )
    resumed = run_search(chosen, spec(), SimulatedRunner(performance(), 1), tmp_path / "b")
    assert whole.tracker.best() is not None and resumed.tracker.best() is not None
    assert resumed.tracker.best().request_id == whole.tracker.best().request_id
    assert (tmp_path / "a" / "best_ds_config.json").read_text() == (
        tmp_path / "b" / "best_ds_config.json"
    ).read_text()
    assert "confirmation round" in (tmp_path / "b" / "summary.txt").read_text()


def test_runs_that_disagree_with_the_estimate_are_measured_again_then_decide() -> None:
    """The estimate (pooled with neighbours) prefers ``pooled``, but ``fast`` measured faster in
    every run, by more than the noise: the round does not overrule the measurements. With rounds
    to spare both run again; after that, the runs decide, and the reason says so."""
    m = method("binary", metric="throughput")
    pooled = measured(m, 40, [100.0, 101.0], memory=0.5, searched=100.0)
    fast = measured(m, 32, [110.0, 111.0], memory=0.5, searched=109.0)
    estimate = {pooled.request_id: 120.0, fast.request_id: 105.0}

    def score(record: Any) -> float:
        return estimate[record.request_id]

    again = decide(m.tracker, [pooled, fast], score, measure_again=True)
    assert again.chosen is None and {r.request_id for r in again.again} == {"at-40", "at-32"}
    verdict = decide(m.tracker, [pooled, fast], score)
    assert verdict.chosen is fast
    assert "faster than z1_mb40" in verdict.reason and "noise" in verdict.reason

    def level_pair(runs_40: list[float], runs_32: list[float]) -> Any:
        """The verdict on z1_mb40 (ahead by the estimate) and z1_mb32, each run as given
        (its search trial first); asserts the estimate's leader is chosen."""
        pair = method("binary", metric="throughput")
        pooled = measured(pair, 40, runs_40[1:], memory=0.5, searched=runs_40[0])
        level = measured(pair, 32, runs_32[1:], memory=0.5, searched=runs_32[0])
        estimate.update({pooled.request_id: 120.0, level.request_id: 105.0})
        verdict = decide(pair.tracker, [pooled, level], score, measure_again=True)
        assert verdict.chosen is pooled
        return verdict

    # Runs within the noise of each other: the estimate decides, as before.
    verdict = level_pair([102.0, 100.0, 104.0], [103.0, 101.0, 103.0])
    assert "ahead of z1_mb32" in verdict.reason
    # ... and says that the other measured faster in its runs, within the noise: the table
    # beside it shows that much.
    assert "; z1_mb32 measured 0.3% faster over its 3 runs, within the noise (" in verdict.reason
    assert "did not show" not in verdict.reason  # these runs do spread by about that much
    # Faster by less than the shown digit: "measured 0.0% faster" beside "ahead" read as a
    # contradiction.
    verdict = level_pair([102.0, 100.0, 104.0], [102.01, 102.01, 102.01])
    assert "; z1_mb32 measured as fast over its 3 runs, within the noise (" in verdict.reason
    # Runs that repeat exactly, apart by less than the noise dsat assumes: the reason says the
    # runs did not show that noise, and why the estimate decides all the same.
    verdict = level_pair([100.0, 100.0, 100.0], [101.5, 101.5, 101.5])
    assert verdict.reason.endswith(
        "which these runs did not show (0.0%): a few runs cannot rule out what the search's "
        "other trials say, and the estimate decides"
    ), verdict.reason


def test_leaders_run_again_at_most_extra_rounds_times_then_the_runs_decide() -> None:
    """Where every extra run again contradicts the estimate, the search does not go on measuring
    for ever: ``EXTRA_ROUNDS`` more runs of the two, then the measurements decide."""
    m = method("binary", metric="throughput")
    pooled = measured(m, 40, [100.0, 101.0], memory=0.5, searched=100.0)
    fast = measured(m, 32, [110.0, 111.0], memory=0.5, searched=109.0)
    estimate = {pooled.request_id: 120.0, fast.request_id: 105.0}
    m.leader_score = lambda: lambda record: estimate[record.request_id]  # type: ignore[method-assign]
    m.ending.confirmation_candidates = [pooled.request_id, fast.request_id]
    m.ending.search_end_reason = "--max-trials used up (12)"
    extra, budget = 0, m.tracker.max_trials
    while not m.ending.should_shutdown(m):
        queued = [m.tracker.get(i) for i in list(m.tracker.queue)]
        assert sorted(r.parent_id for r in queued) == sorted(estimate)  # both, once each
        assert m.tracker.max_trials == budget + 2 * (extra + 1)  # on top of --max-trials
        for again in queued:
            m.tracker.dequeue(again.request_id)
            m.tracker.mark_running(again.request_id)
            value = 100.0 if again.parent_id == pooled.request_id else 110.0
            m.tracker.mark_finished(again.request_id, TrialStatus.COMPLETED, {"throughput": value})
        extra += 1
        assert extra <= EXTRA_ROUNDS
    assert extra == EXTRA_ROUNDS == m.ending.extra_rounds
    assert m.tracker.confirmed_id == fast.request_id
    assert m.shutdown_reason == "--max-trials used up (12); confirmed z1_mb32"


def test_the_reason_names_what_the_leaders_differ_in() -> None:
    m = method("binary", metric="throughput")
    fast = measured(m, 40, [100.0, 104.0], memory=0.9)
    roomy = measured(m, 32, [102.0, 101.5], memory=0.6)
    verdict = decide(m.tracker, [fast, roomy])
    assert verdict.chosen is roomy
    assert verdict.reason.startswith("level with z1_mb40 within the noise")
    assert "30% more of the device's memory free" in verdict.reason
    # Two leaders that share a stage and micro-batch are told apart by their knobs.
    a = fast.replace(ds_config={**fast.ds_config, "zero_optimization": {"stage": 1}})
    b = fast.replace(
        ds_config={**fast.ds_config, "zero_optimization": {"stage": 1, "reduce_bucket_size": 10**7}}
    )
    assert (a.name, b.name) == ("z1_mb40", "z1_mb40_rb1e7")


def test_a_lead_every_run_shows_is_not_called_noise_however_much_the_steps_varied() -> None:
    """The HF example's verdict read "47.7% ahead of z2_mb4 (within the noise: a run's steps
    varied by up to 69.7%; either is as good)" where every run of the one was 40% above every
    run of the other: a run's mean varies far less than its steps do."""
    m = method("binary", metric="throughput")
    fast = measured(m, 40, [105.0, 105.0], memory=0.5, searched=105.0, steps_spread=0.7)
    slow = measured(m, 32, [100.0, 100.0], memory=0.5, searched=100.0, steps_spread=0.7)
    verdict = decide(m.tracker, [fast, slow])
    assert verdict.chosen is fast
    assert verdict.reason == "the fastest in its runs: 5.0% ahead of z1_mb32"


def test_a_lead_within_the_noise_of_the_runs_says_that_noise() -> None:
    """ "11.6% ahead of z0_mb416 (within the noise: either is as good)" stood beside the
    summary's "one run's spread: 4.4%": the sentence names the noise it judged by, that of a
    run, and how many runs each side had."""
    m = method("binary", metric="throughput")
    fast = measured(m, 40, [110.0, 100.0], memory=0.5, searched=105.0)
    slow = measured(m, 32, [104.0, 96.0], memory=0.5, searched=100.0)
    reason = decide(m.tracker, [fast, slow]).reason
    assert reason.startswith("the fastest in its runs: 5.0% ahead of z1_mb32 (within the noise: ")
    assert reason.endswith("% a run, over 3 and 3 runs; either is as good)"), reason


def test_a_noise_the_runs_did_not_show_is_said_to_be_the_searchs() -> None:
    """ "one run's spread: 0.0%" stood above "within the noise: 1.1% a run" on the simulator,
    whose repeats are exact: the noise was the prior's and the other trials', unsaid."""
    m = method("binary", metric="throughput")
    fast = measured(m, 40, [101.0, 101.0], memory=0.5, searched=101.0)
    slow = measured(m, 32, [100.0, 100.0], memory=0.5, searched=100.0)
    reason = decide(m.tracker, [fast, slow]).reason
    assert "% a run by the search's trials (these runs: 0.0%), over 3 and 3 runs" in reason, reason


def test_where_no_leader_runs_again_the_best_of_the_search_is_handed_over_and_said() -> None:
    """Every confirmation run crashed: the round shows nothing, and the search's own best that
    may be handed over is, with that said."""
    measured = performance()
    ran: Counter[int] = Counter()

    def crashes_when_run_again(ds_config: dict[str, Any], slots: int) -> dict[str, Any]:
        if not ds_config.get("autotuning", {}).get("model_info", {}).get("profile"):
            mbs = ds_config["train_micro_batch_size_per_gpu"]
            ran[mbs] += 1
            if ran[mbs] > 1:
                raise RuntimeError("the run again crashed")
        return measured(ds_config, slots)

    m = search(crashes_when_run_again)
    runs = confirm_runs(m)
    assert runs and all(r.status is TrialStatus.ERROR for r in runs)
    best = m.tracker.best()
    assert best is not None and best.mbs == 38 and not m.search_failed
    assert m.ending.handover_reason == (
        f"{best.name}: no leader ran again safely; the best of the search that may be handed over"
    )


def test_every_leader_that_measured_faster_than_the_hand_over_is_named() -> None:
    """ "1.0% ahead of z1_mb114" of a rival whose runs measured faster, and only the fastest
    (z1_mb77) named as measuring faster: the table showed both above the hand-over."""
    m = method("binary", metric="throughput")
    chosen = measured(m, 116, [100.0, 100.0], memory=0.5, searched=100.0)
    second = measured(m, 114, [100.2, 100.2], memory=0.5, searched=100.2)
    fastest = measured(m, 77, [101.0, 101.0], memory=0.5, searched=101.0)
    estimate = {chosen.request_id: 120.0, second.request_id: 118.0, fastest.request_id: 110.0}
    verdict = decide(m.tracker, [chosen, second, fastest], lambda r: estimate[r.request_id])
    assert verdict.chosen is chosen and "ahead of z1_mb114" in verdict.reason
    assert (
        "; z1_mb77 measured 1.0% faster over its 3 runs, z1_mb114 measured 0.2% faster over "
        in (verdict.reason)
    )
