"""Random search: bounds, lineage continuation and the early-stopping rules."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from dsat.cli import main
from dsat.constants import OVERWRITE_KEY
from dsat.search.random import RandomSearch
from dsat.trial import SearchRange, TrialKind, TrialRecord, TrialStatus
from tests.conftest import REPO_ROOT
from tests.search.helpers import (
    cliff_function,
    created_ids,
    finish,
    method,
    run,
    settings,
    spec,
    start_profile,
)


@pytest.mark.parametrize("seed", range(8))
def test_every_micro_batch_is_inside_its_range(seed: int) -> None:
    m = method("random", random_seed=seed, zero_stages=(1, 2, 3))
    run(m, cliff_function(23, {1: 0.1, 2: 0.05}))
    searched = [r for r in m.tracker.records if r.kind is TrialKind.SEARCH]
    assert len(searched) > 20
    for r in searched:
        assert r.search_range is not None and r.search_range.lo <= r.mbs <= r.search_range.hi


def test_lineage_continues_above_a_success_and_below_a_failure() -> None:
    m = method("random", zero_stages=(1,), max_concurrent_trials=1)
    (first,) = created_ids(start_profile(m))
    parent = m.tracker.get(first)
    (child_id,) = created_ids(finish(m, first, ok=True))
    child = m.tracker.get(child_id)
    # The first range ends one micro-batch below the memory model's ceiling (64 here).
    assert m.micro_batch_ceiling(1) == 64 and parent.search_range == SearchRange(1, 63)
    assert child.parent_id == first and child.search_range == SearchRange(parent.mbs + 1, 63)
    (grandchild_id,) = created_ids(finish(m, child_id, ok=False))
    grandchild = m.tracker.get(grandchild_id)
    assert grandchild.parent_id == child_id
    assert grandchild.search_range == SearchRange(parent.mbs + 1, child.mbs - 1)
    assert parent.mbs < grandchild.mbs < child.mbs


def test_the_doubling_above_a_used_up_range_stops_below_a_known_oom() -> None:
    """A success at the top of its range looks higher (the memory model was too cautious), but
    not up to a micro-batch where a configuration needing no more memory ran out of it."""
    m = method("random", zero_stages=(1,), max_concurrent_trials=1)
    (first,) = created_ids(start_profile(m))
    (child_id,) = created_ids(finish(m, first, ok=False))  # out of memory at the first's
    finish(m, child_id, ok=True)
    oom, child = m.tracker.get(first), m.tracker.get(child_id)
    assert m.room_above(child, 2 * (child.mbs + 1)) == oom.mbs - 1
    # A lineage of its own, of the configuration with larger buckets, at the top of its range.
    larger = child.zero_section["reduce_bucket_size"] * 2
    overwrites = copy.deepcopy(child.hparams[OVERWRITE_KEY])
    overwrites["zero_optimization"]["reduce_bucket_size"] = larger
    at_the_top = child.replace(
        hparams={**child.hparams, OVERWRITE_KEY: overwrites},
        ds_config={**child.ds_config, "zero_optimization": overwrites["zero_optimization"]},
        parent_id=None,
        lineage_id=child.request_id,
        search_range=SearchRange(1, child.mbs),
    )
    assert m.room_above(at_the_top, 2 * (child.mbs + 1)) == oom.mbs - 1
    higher = [r for r in m.after_success(at_the_top) if r.lineage_id == child.request_id]
    assert 2 * (child.mbs + 1) >= oom.mbs  # where the doubling alone would reach the OOM
    assert higher and all(r.search_range is not None for r in higher)
    assert all(child.mbs < r.mbs and r.search_range.hi < oom.mbs for r in higher)  # type: ignore[union-attr]


def test_stops_after_trials_per_random_config() -> None:
    m = method("random", zero_stages=(1,), trials_per_random_config=3, max_trials=40)
    run(m, cliff_function(1000))  # never OOMs: only the per-config limit ends lineages
    for lineage_id in m.tracker.lineage_ids():
        assert m.tracker.finished_in_lineage(lineage_id) <= 3
    assert any(m.tracker.finished_in_lineage(lid) == 3 for lid in m.tracker.lineage_ids())


def test_stops_after_failing_at_the_floor() -> None:
    m = method("random", zero_stages=(1,), max_concurrent_trials=1)
    (first,) = created_ids(start_profile(m))
    record = m.tracker.get(first)
    m.tracker.mark_finished(first, TrialStatus.OOM)
    at_floor = m.tracker.get(first).replace(search_range=SearchRange(record.mbs, 64))
    assert m.should_stop_lineage(at_floor)
    assert not m.should_stop_lineage(m.tracker.get(first))  # above its floor: keep searching


def test_stops_when_a_same_stage_trial_already_ran_above_its_ceiling() -> None:
    m = method("random", zero_stages=(1,), max_concurrent_trials=2)
    a, b = created_ids(start_profile(m))
    finish(m, a, ok=True, metrics={"FLOPS_per_gpu": 1.0})
    ran = m.tracker.get(a).mbs
    m.tracker.mark_finished(b, TrialStatus.OOM)
    failed = m.tracker.get(b)
    assert m.should_stop_lineage(failed.replace(search_range=SearchRange(1, ran)))
    assert not m.should_stop_lineage(failed.replace(search_range=SearchRange(1, ran + 1)))


def test_a_run_over_the_memory_margin_does_not_end_a_lineage_searching_below_it() -> None:
    """A run that left less than the margin free is as good as out of memory: the lineage that
    failed above it goes on looking for the largest micro-batch that may be handed over."""
    m = method("random", zero_stages=(1,), max_concurrent_trials=2, memory_margin=0.05)
    a, b = created_ids(start_profile(m))
    over = {"FLOPS_per_gpu": 1.0, "memory_peak_bytes": 99, "memory_total_bytes": 100}
    finish(m, a, ok=True, metrics=over)
    ran = m.tracker.get(a).mbs
    assert m.tracker.too_large(m.tracker.get(a))
    m.tracker.mark_finished(b, TrialStatus.OOM)
    failed = m.tracker.get(b)
    assert not m.should_stop_lineage(failed.replace(search_range=SearchRange(1, ran)))


def test_stage_three_is_pruned_once_stage_one_or_two_works() -> None:
    m = method("random", zero_stages=(1, 3), max_concurrent_trials=4, random_seed=0)
    ops = start_profile(m)
    ids = created_ids(ops)
    stage3 = [i for i in ids if m.tracker.get(i).zero_stage == 3]
    stage1 = [i for i in ids if m.tracker.get(i).zero_stage == 1]
    assert stage3 and stage1
    assert not m.should_stop_lineage(m.tracker.get(stage3[0]))
    finish(m, stage1[0], ok=True)
    assert m.should_stop_lineage(m.tracker.get(stage3[0]))
    assert all(m.choose_stage() == 1 for _ in range(20))


@pytest.mark.parametrize("offload", [False, True])
def test_stage_three_is_not_drawn_once_stages_one_and_two_ran_above_all_it_could_hold(
    offload: bool,
) -> None:
    """Stage 1 doubled past the memory model's estimate, above stage 3's whole range, before
    stage 3 had a configuration: "each stage once" drew it with an empty range, and the search
    died with a traceback (ValueError: n < 0), as did every resume of it."""
    m = method("random", zero_stages=(1, 3), max_concurrent_trials=1, offload=offload)
    seeds = iter(range(50))
    while (first := start_profile(m)[0]).zero_stage != 1:
        m = method(
            "random", zero_stages=(1, 3), max_concurrent_trials=1, offload=offload,
            random_seed=next(seeds),
        )  # fmt: skip
    highest = max(m.initial_range(3, m.offload_of(section)).hi for section in m.offload_space(3))
    above = m.make_trial(TrialKind.SEARCH, first.zero_section, highest + 100)
    assert above is not None and m.tracker.add(above)
    m.tracker.mark_running(m.tracker.dequeue(above.request_id).request_id)
    m.tracker.mark_finished(above.request_id, TrialStatus.COMPLETED, {"FLOPS_per_gpu": 9.0})
    assert m.untried_stage() is None
    started = finish(m, first.request_id, ok=True)
    assert started and all(r.zero_stage == 1 for r in started)
    assert all(r.search_range.lo <= r.mbs <= r.search_range.hi for r in started)  # type: ignore[union-attr]


def test_early_stopping() -> None:
    m = method("random", zero_stages=(1,), early_stopping=4, max_trials=64)
    run(m, cliff_function(8))
    assert m.shutdown_reason == (
        "early stopping (--early-stopping 4): no improvement in the last 4 trials"
    )
    assert len(m.tracker.finished) < 64
    assert m.tracker.trials_since_best >= 4


@pytest.mark.parametrize("seed", range(4))
def test_every_leader_is_run_again_and_no_search_trial_runs_in_the_confirmation_round(
    seed: int,
) -> None:
    # Two trials per configuration: the leaders' lineages have used theirs up by the end.
    m = method(
        "random", random_seed=seed, zero_stages=(1, 2), confirm_top=3, trials_per_random_config=2
    )
    run(m, cliff_function(23, {1: 0.1, 2: 0.05}))
    records = m.tracker.records
    confirms = [r for r in records if r.kind is TrialKind.CONFIRM]
    leaders = {r.parent_id for r in confirms}
    assert len(leaders) == 3
    runs = {leader: sum(r.parent_id == leader for r in confirms) for leader in leaders}
    assert len(set(runs.values())) == 1  # each leader as often as the others
    first = min(r.index for r in confirms)
    assert not [r.name for r in records if r.kind is TrialKind.SEARCH and r.index > first]
    assert all(r.status is TrialStatus.COMPLETED for r in confirms)


def test_stage_three_stays_while_stages_one_and_two_hit_memory_below_its_reach() -> None:
    m = method("random", zero_stages=(1, 3), max_concurrent_trials=4, random_seed=0)
    ids = created_ids(start_profile(m))
    stage3 = [m.tracker.get(i) for i in ids if m.tracker.get(i).zero_stage == 3]
    stage1 = [i for i in ids if m.tracker.get(i).zero_stage == 1]
    assert stage3 and len(stage1) >= 2
    finish(m, stage1[0], ok=True)
    ran = m.tracker.get(stage1[0]).mbs
    finish(m, stage1[1], ok=False)  # stage 1 runs out of memory (above or below ``ran``)
    # Stage 3 may reach above what stage 1 ran: it stays, searched only above that.
    assert m.stage_three_reaches_further()
    assert m.initial_range(3).lo == ran + 1
    above = stage3[0].replace(search_range=SearchRange(1, ran + 10))
    assert not m.should_stop_lineage(above)
    assert {m.choose_stage() for _ in range(40)} == {1, 3}
    # A stage-3 lineage that cannot get above what stage 1 ran stops.
    assert m.should_stop_lineage(stage3[0].replace(search_range=SearchRange(1, ran)))
    # Once a stage-3 trial ran above stage 1 and lost, no new stage-3 configuration is drawn.
    loser = m.make_trial(TrialKind.SEARCH, {"stage": 3}, ran + 1).replace(request_id="loser")
    m.tracker.add(loser, queue=False)
    m.tracker.mark_finished("loser", TrialStatus.COMPLETED, {"FLOPS_per_gpu": 1e-3})
    assert all(m.choose_stage() == 1 for _ in range(20))


def test_the_memory_check_runs_and_no_new_configuration_runs_in_its_place(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The check is a search trial of no lineage: random dropped it as a lineage that should
    stop, and a new random configuration ran in the confirmation round instead."""
    simulated = REPO_ROOT / "examples" / "simulated"
    argv = ["random", str(simulated / "gpt2_large.yaml"), str(simulated), "--runner", "simulated"]
    argv += ["--simulator", "dsat.runners.simulated.performance_models:gpt_760m_aligned_8xa100"]
    assert main([*argv, "-r", "2", "--results-dir", str(tmp_path)]) == 0
    check = re.search(
        r"memory check: (\S+)'s configuration at micro-batch (\d+)", capsys.readouterr().out
    )
    assert check is not None  # the case this test is about
    rows = [json.loads(line) for line in (tmp_path / "trials.jsonl").read_text().splitlines()]
    first = next(i for i, row in enumerate(rows) if row["kind"] == "confirm")
    late = [row for row in rows[first:] if row["kind"] == "search"]
    leader_knobs = check.group(1).split("_", 2)[2]
    assert [row["name"] for row in late] == [f"z1_mb{check.group(2)}_{leader_knobs}"]


def test_a_resume_runs_again_every_trial_the_interrupt_stopped(tmp_path: Path) -> None:
    """With many in flight, a resume judged the trials it put back by results that came after
    they started, and dropped some (6 of 16): the uninterrupted search ran them, and new draws
    took their places, so every later trial differed too."""
    from dsat.runners.simulated.performance_models import gpt2_large_16xv100
    from dsat.runners.simulated.runner import SimulatedRunner
    from dsat.search_run import run_search
    from tests.search.helpers import search_settings
    from tests.search.helpers import spec as make_spec

    ds = {"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": True}}
    chosen = search_settings("random", max_trials=40, max_concurrent_trials=16)
    dropped = 0
    for stop_after in (18, 20, 24):
        results = tmp_path / str(stop_after)
        stopped = run_search(
            chosen, make_spec(16, ds), SimulatedRunner(gpt2_large_16xv100, 16), results, stop_after
        )
        running = {r.request_id for r in stopped.tracker.running}
        assert running, "the interrupt stopped no trial"
        resumed = run_search(
            chosen, make_spec(16, ds), SimulatedRunner(gpt2_large_16xv100, 16), results
        )
        finished = {r.request_id for r in resumed.tracker.finished}
        dropped += len(running - finished)
    assert dropped == 0


@pytest.mark.parametrize("seed", range(10))
def test_one_trial_at_a_time_the_search_ends_with_a_reason_and_a_hand_over(seed: int) -> None:
    """Stages 1 and 2 ran with no memory limit, then stage 3 was drawn as untried, dropped at
    its turn as not worth running, drawn again: after 50 draws the search stopped with nothing
    running, no reason and no confirmation round (3 of these 10 seeds), and so did every
    resume."""
    m = method(
        "random",
        max_trials=6,
        trials_per_random_config=2,
        random_seed=seed,
        max_concurrent_trials=1,
        confirm_top=3,
    )
    run(m, cliff_function(10**6))
    assert (m.shutdown_reason or "").startswith("--max-trials used up (6); confirmed ")
    assert m.tracker.confirmed_id is not None and not m.tracker.queue


class NothingWorthRunning(RandomSearch):
    def worth_running(self, record: TrialRecord) -> bool:
        return record.kind is not TrialKind.SEARCH or record.index < 3


def test_a_search_whose_queue_holds_nothing_worth_running_ends_with_the_stop_rules() -> None:
    m = NothingWorthRunning(settings("random", max_trials=10, confirm_top=3), spec())
    run(m, cliff_function(10**6))
    assert (m.shutdown_reason or "").startswith("no configuration left to try; confirmed ")
    assert m.tracker.confirmed_id is not None and not m.tracker.queue
