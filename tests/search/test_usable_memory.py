"""Where the OOMs place the usable memory, and what the tracker then lets be handed over."""

from __future__ import annotations

import dataclasses
from typing import Any

from dsat.constants import MEMORY_RAN_OUT
from dsat.experiment.metric import Metric
from dsat.search.tracker import TrialTracker
from dsat.search.usable_memory import PeakModel, fills_device, memory_check, usable_memory
from dsat.trial import TrialKind, TrialRecord, TrialStatus

GIB = 2**30
TOTAL = 80 * GIB
# A parameter count for the bucket estimate: with fp32, 4 bytes of gradient a bucket element.
PARAMS = 10**9


def record(
    index: int,
    mbs: int,
    peak_gib: float | None,
    status: TrialStatus = TrialStatus.COMPLETED,
    kind: TrialKind = TrialKind.SEARCH,
    parent: str | None = None,
    **zero: Any,
) -> TrialRecord:
    section = {"stage": 2, **zero}
    metrics: dict[str, Any] = {"FLOPS_per_gpu": float(mbs)}
    if peak_gib is not None:
        metrics |= {"memory_peak_bytes": int(peak_gib * GIB), "memory_total_bytes": TOTAL}
    return TrialRecord(
        request_id=f"t{index}",
        index=index,
        kind=kind,
        hparams={"overwrite_deepspeed_args": {"mbs": mbs, "zero": section, "index": index}},
        ds_config={"train_micro_batch_size_per_gpu": mbs, "zero_optimization": section},
        zero_stage=2,
        mbs=mbs,
        gas=1,
        lineage_id="l",
        parent_id=parent,
        status=status,
        metrics=metrics if status is TrialStatus.COMPLETED else {},
    )


def profile() -> TrialRecord:
    return TrialRecord(
        request_id="p",
        index=0,
        kind=TrialKind.MODEL_PROFILE,
        hparams={},
        ds_config={"train_micro_batch_size_per_gpu": 1},
        zero_stage=0,
        mbs=1,
        gas=1,
        lineage_id="p",
        status=TrialStatus.COMPLETED,
        metrics={
            "num_params": PARAMS,
            "trainable_num_params": PARAMS,
            "activation_mem_per_gpu": GIB,
            "gpu_mem": TOTAL,
        },
    )


def test_no_oom_places_nothing() -> None:
    assert usable_memory([profile(), record(1, 10, 40.0), record(2, 20, 60.0)]) is None


def test_an_oom_is_placed_by_its_configurations_peaks_and_what_ran_below_it() -> None:
    # 1.5 GiB a sample, fitted from micro-batches 10, 20 and 36: micro-batch 38 needs 62 GiB.
    records = [profile(), record(1, 10, 20.0), record(2, 20, 35.0), record(3, 36, 59.0)]
    records.append(record(4, 38, None, TrialStatus.OOM))
    assert PeakModel(records).needed(records[-1]) == 62 * GIB
    usable = usable_memory(records)
    assert usable is not None
    assert usable.failed == 62 * GIB
    assert usable.ran == 59 * GIB  # the most a run completed with: what a run may count on
    assert usable.bytes == 59 * GIB
    # An OOM that needed more than the device has says nothing its total does not.
    beyond = [*records[:-1], record(5, 50, None, TrialStatus.OOM)]
    assert usable_memory(beyond) is None


def test_an_oom_of_the_hosts_memory_on_a_gpu_says_nothing_of_the_gpus() -> None:
    """The kernel's OOM killer ended it (optimizer state offloaded to the host, several trials
    beside each other): 62 GiB of the GPU may be usable all the same."""
    records = [profile(), record(1, 10, 20.0), record(2, 20, 35.0), record(3, 36, 59.0)]
    host = dataclasses.replace(
        record(4, 38, None, TrialStatus.OOM), metrics={MEMORY_RAN_OUT: "host"}
    )
    assert usable_memory([*records, host]) is None
    assert usable_memory([*records, record(4, 38, None, TrialStatus.OOM)]) is not None


def test_an_oom_of_another_configuration_is_moved_by_its_bucket_memory() -> None:
    # Same stage and switches, a reduce bucket 10^8 elements larger: 4 bytes each in fp32.
    small = {"reduce_bucket_size": 10**8, "overlap_comm": False}
    large = {"reduce_bucket_size": 2 * 10**8, "overlap_comm": False}
    records = [profile(), record(1, 10, 40.0, **small), record(2, 20, 60.0, **small)]
    records.append(record(3, 20, None, TrialStatus.OOM, **large))
    assert PeakModel(records).needed(records[-1]) == 60 * GIB + 4 * 10**8
    # A configuration that differs in a knob the bucket estimate does not see is not used.
    other = record(4, 20, None, TrialStatus.OOM, contiguous_gradients=False)
    assert PeakModel([*records, other]).needed(other) is None


def test_bucket_memory_counts_at_the_precision_the_profile_ran() -> None:
    """A JSON's "auto" precision (HF's --bf16 fills it in) is what the profile reports: 2 bytes
    a bucket element, not fp32's 4."""
    small = {"reduce_bucket_size": 10**8, "overlap_comm": False}
    large = {"reduce_bucket_size": 2 * 10**8, "overlap_comm": False}
    bf16 = profile()
    bf16.metrics["precision"] = "bf16"
    records = [bf16, record(1, 10, 40.0, **small), record(2, 20, 60.0, **small)]
    records.append(record(3, 20, None, TrialStatus.OOM, **large))
    assert PeakModel(records).needed(records[-1]) == 60 * GIB + 2 * 10**8


def test_a_limit_known_to_a_sample_is_checked_when_the_leaders_next_sample_turns_on_it() -> None:
    """2 GiB a sample; 60 GiB ran, 62 GiB did not. Whether micro-batch 29 (58 GiB) leaves 5%
    free turns on where in that gap the limit lies (57 GiB if at 60, 58.9 if at 62): a check
    aims at its middle, with buckets moving memory by less than a sample. With the leader
    further below, the gap does not matter."""
    buckets = {"reduce_bucket_size": 5 * 10**8, "allgather_bucket_size": 5 * 10**8}
    ran = [record(i, 10 * i, 20.0 * i, overlap_comm=False, **buckets) for i in (1, 2, 3)]
    oom = record(4, 31, None, TrialStatus.OOM, overlap_comm=False, **buckets)
    for leader_mbs, checked in ((28, True), (27, False), (26, False)):
        leader = record(5, leader_mbs, 2.0 * leader_mbs, overlap_comm=False, **buckets)
        records = [profile(), *ran, oom, leader]
        usable = usable_memory(records)
        assert usable is not None and (usable.bytes, usable.failed) == (60 * GIB, 62 * GIB)
        check = memory_check(records, usable, leader, 0.05)
        assert (check is not None) is checked
        if check is not None:
            section, mbs = check
            probe = leader.replace(
                mbs=mbs, ds_config={**leader.ds_config, "zero_optimization": section}
            )
            need = PeakModel(records).needed(probe)
            assert need is not None and 60 * GIB < need < 62 * GIB


def test_the_margin_applies_to_what_the_ooms_show_is_usable() -> None:
    tracker = TrialTracker(Metric.FLOPS_PER_GPU, 64, 4, None, 1, memory_margin=0.05)
    for r in (profile(), record(1, 10, 40.0), record(2, 20, 60.0), record(3, 35, 74.0)):
        tracker.add(r, queue=False)
    # No OOM yet and nothing ran above 74 GiB: 5% of that is left free (below).
    assert not tracker.may_hand_over(tracker.get("t3"))
    tracker.add(record(4, 36, None, TrialStatus.QUEUED), queue=False)
    tracker.mark_finished("t4", TrialStatus.OOM)
    # 74 GiB ran, about 76 GiB did not: 5% of 74 GiB is left free at 70.3 GiB and below.
    usable = tracker.usable_memory
    assert usable is not None and usable.ran == 74 * GIB and 75 * GIB < usable.failed < 77 * GIB
    assert tracker.memory_limit(TOTAL) == 0.95 * 74 * GIB
    assert not tracker.may_hand_over(tracker.get("t3"))
    assert tracker.too_large(tracker.get("t3"))
    assert tracker.may_hand_over(tracker.get("t2"))
    assert tracker.best() is tracker.get("t2")


def test_with_no_oom_only_what_ran_counts_near_the_total() -> None:
    """A memory check may not reach the device's total (a sample can be half the device; with a
    fixed batch the micro-batch above is twice as large), so before any OOM a configuration near
    the total must leave the margin of what the search's runs completed with; further below, the
    limit does not matter."""
    tracker = TrialTracker(Metric.FLOPS_PER_GPU, 64, 4, None, 1, memory_margin=0.05)
    for r in (profile(), record(1, 8, 40.0), record(2, 16, 70.0), record(3, 32, 74.0)):
        tracker.add(r, queue=False)
    assert not tracker.may_hand_over(tracker.get("t3"))  # 74 GiB is all that is known to fit
    # 5% of 74 GiB left free, but never less than two margins below the device's total.
    assert tracker.memory_limit(TOTAL) == max(0.95 * 74 * GIB, 0.90 * TOTAL)
    assert tracker.may_hand_over(tracker.get("t2")) and tracker.best() is tracker.get("t2")
    # A run that completed at 78 GiB (a check) shows that 74 GiB leaves the margin.
    tracker.add(record(4, 16, 78.0, reduce_bucket_size=5 * 10**9), queue=False)
    tracker.mark_finished("t4", TrialStatus.COMPLETED, tracker.get("t4").metrics)
    assert tracker.may_hand_over(tracker.get("t3"))
    # Below two margins of the total, nothing ran that high is needed.
    low = TrialTracker(Metric.FLOPS_PER_GPU, 64, 4, None, 1, memory_margin=0.05)
    for r in (profile(), record(1, 8, 30.0), record(2, 16, 50.0)):
        low.add(r, queue=False)
    assert low.may_hand_over(low.get("t2"))


def test_a_configuration_that_ran_out_of_memory_when_run_again_is_not_handed_over() -> None:
    tracker = TrialTracker(Metric.FLOPS_PER_GPU, 64, 4, None, 1, memory_margin=0.05)
    for r in (profile(), record(1, 10, 40.0), record(2, 20, 60.0)):
        tracker.add(r, queue=False)
    assert tracker.best() is tracker.get("t2")
    again = record(3, 20, None, TrialStatus.OOM, kind=TrialKind.CONFIRM, parent="t2")
    tracker.add(again, queue=False)
    assert tracker.ran_out_of_memory_again(tracker.get("t2"))
    assert tracker.best() is tracker.get("t1")


def test_an_oom_far_below_the_device_says_nothing_of_its_memory() -> None:
    """A run that failed needing a tenth of the device did not run out of this configuration's
    memory (another process, a leak, an OOM injected on the CPU): no margin is taken from it."""
    records = [profile(), record(1, 1, 4.0), record(2, 2, 4.1), record(3, 5, None, TrialStatus.OOM)]
    assert usable_memory(records) is None


def test_an_oom_needing_under_half_the_device_says_nothing_of_its_memory() -> None:
    """1 GiB a sample: micro-batch 34 needs 38 GiB (47.5% of the device), 38 needs 42 GiB."""
    ran = [profile(), record(1, 10, 14.0), record(2, 20, 24.0)]
    assert usable_memory([*ran, record(3, 34, None, TrialStatus.OOM)]) is None
    placed = usable_memory([*ran, record(3, 38, None, TrialStatus.OOM)])
    assert placed is not None and placed.failed == 42 * GIB


def test_an_oom_of_a_confirmation_run_places_the_limit_too() -> None:
    ran = [profile(), record(1, 10, 20.0), record(2, 20, 35.0), record(3, 36, 59.0)]
    again = record(4, 38, None, TrialStatus.OOM, kind=TrialKind.CONFIRM, parent="t3")
    usable = usable_memory([*ran, again])
    assert usable is not None and usable.failed == 62 * GIB


def test_a_run_fills_the_device_only_within_half_a_margin_of_its_total() -> None:
    """77 of 80 GiB leaves 3 GiB that no run showed usable: 5% of 77 GiB is left free, and a
    75 GiB configuration is not handed over; 78.5 GiB shows the total usable."""
    assert not fills_device(77 * GIB, 0.05, TOTAL) and fills_device(78 * GIB, 0.05, TOTAL)
    tracker = TrialTracker(Metric.FLOPS_PER_GPU, 64, 4, None, 1, memory_margin=0.05)
    for r in (profile(), record(1, 20, 40.0), record(2, 30, 75.0), record(3, 31, 77.0)):
        tracker.add(r, queue=False)
    assert tracker.memory_limit(TOTAL) == 0.95 * 77 * GIB
    assert not tracker.may_hand_over(tracker.get("t2"))
    tracker.add(record(4, 32, 78.5), queue=False)  # finished already: counted as added
    assert tracker.memory_limit(TOTAL) == 0.95 * TOTAL
    assert tracker.may_hand_over(tracker.get("t2"))


def test_of_two_measured_kin_the_least_estimate_is_what_an_oom_needed() -> None:
    """Two configurations that differ from the one that failed only in bucket sizes, each moved
    by its bucket memory (4 bytes an element): 60 GiB + 0.4e9 B and 61 GiB - 0.4e9 B."""
    small = {"reduce_bucket_size": 10**8, "overlap_comm": False}
    large = {"reduce_bucket_size": 3 * 10**8, "overlap_comm": False}
    records = [profile(), record(1, 10, 40.0, **small), record(2, 20, 60.0, **small)]
    records += [record(3, 10, 41.0, **large), record(4, 20, 61.0, **large)]
    oom = record(5, 20, None, TrialStatus.OOM, reduce_bucket_size=2 * 10**8, overlap_comm=False)
    assert PeakModel([*records, oom]).needed(oom) == 60 * GIB + 4 * 10**8


def test_bytes_a_sample_is_the_median_of_the_configurations_rising_slopes() -> None:
    """1, 2 and 4 GiB a sample (their mean, 2.33, is pulled by one); a configuration whose peak
    fell as its micro-batch rose (noise, or a knob) says nothing of it; with no slope, the
    profile's activations (1 GiB) stand in."""
    records = [profile()]
    for index, (slope, group) in enumerate(((1.0, 1), (2.0, 2), (4.0, 3), (-3.0, 4))):
        records += [
            record(2 * index + 1, 10, 40.0, sub_group_size=group),
            record(2 * index + 2, 12, 40.0 + 2 * slope, sub_group_size=group),
        ]
    assert PeakModel(records).per_sample(2) == 2 * GIB
    assert PeakModel([profile(), record(1, 10, 40.0)]).per_sample(2) == GIB


def scaled_runs(per_sample_gib: float, leader_mbs: int) -> tuple[list[TrialRecord], TrialRecord]:
    """Runs at micro-batches 2 and 4 and a leader, ``per_sample_gib`` a sample, no OOM."""
    leader = record(3, leader_mbs, per_sample_gib * leader_mbs)
    ran = [record(i, 2 * i, per_sample_gib * 2 * i) for i in (1, 2)]
    return [profile(), *ran, leader], leader


def test_with_no_oom_a_check_runs_only_for_a_leader_within_two_margins_of_the_total() -> None:
    for leader_mbs, checked in ((35, False), (36, True)):  # 70 and 72 GiB: 90% of 80 GiB
        records, leader = scaled_runs(2.0, leader_mbs)
        assert (memory_check(records, None, leader, 0.05) is not None) is checked


def test_no_check_while_a_run_near_its_aim_is_on_its_way() -> None:
    """It aims at 99% of the device (79.2 GiB): a queued run needing 79.75 GiB will tell; one
    needing 79 GiB will not."""
    records, leader = scaled_runs(0.25, 296)
    assert memory_check(records, None, leader, 0.05) is not None
    for queued_mbs, checked in ((319, False), (316, True)):
        queued = record(4, queued_mbs, None, TrialStatus.QUEUED)
        assert (memory_check([*records, queued], None, leader, 0.05) is not None) is checked


def test_no_check_where_none_comes_near_its_aim() -> None:
    """4 GiB a sample, the leader at 72 GiB: its next micro-batch needs 76 GiB, 3.2 GiB short of
    the aim (79.2 GiB), the one after all the device; a model of 10^6 parameters, whose buckets
    move a few MB."""
    records, leader = scaled_runs(4.0, 18)
    small_model = profile()
    small_model.metrics["num_params"] = 10**6
    assert memory_check([small_model, *records[1:]], None, leader, 0.05) is None
    records, leader = scaled_runs(2.0, 37)
    assert memory_check(records, None, leader, 0.05) is not None


def test_with_a_fixed_batch_a_check_runs_what_shows_the_margin_and_fits_the_device() -> None:
    """Micro-batches 4, 8, 16 and 32 only; 2 GiB a sample. The leader, at 74 GiB, leaves 5%
    free if 77.9 GiB is usable: its own buckets reach 77.7 GiB at most, which shows nothing;
    another configuration's micro-batch 32 needs 78 GiB, which does; a third's, 80 GiB, more
    than the device has."""
    leader = record(3, 32, 74.0)
    records = [profile(), record(1, 4, 18.0), record(2, 8, 26.0), leader]
    for index, (group, base) in enumerate(((2, 22.0), (3, 24.0))):
        records += [
            record(10 + 2 * index, 4, base, sub_group_size=group),
            record(11 + 2 * index, 8, base + 8.0, sub_group_size=group),
        ]
    allowed = [4, 8, 16, 32]
    check = memory_check(records, None, leader, 0.05, allowed)
    assert check is not None and check[1] == 32 and check[0].get("sub_group_size") == 2
    # Without the configuration that shows it, none is run.
    mine = [r for r in records if r.zero_section.get("sub_group_size") != 2]
    assert memory_check(mine, None, leader, 0.05, allowed) is None
