"""The ZeRO knob space."""

from __future__ import annotations

import numpy as np

from dsat.zero_space import (
    auto_size_tags,
    explicit_zero_config,
    knob_steps,
    knob_tags,
    needs_no_less_memory,
    random_zero_config,
    setting_tags,
    size_text,
    space_size,
    zero_knobs,
)


def test_knobs_accumulate_by_stage() -> None:
    assert zero_knobs(0) == {}
    assert set(zero_knobs(1)) == {"reduce_bucket_size", "allgather_bucket_size"}
    assert set(zero_knobs(2)) == set(zero_knobs(1)) | {
        "overlap_comm",
        "reduce_scatter",
        "contiguous_gradients",
    }
    assert set(zero_knobs(3)) == set(zero_knobs(2)) | {"allgather_partitions"}
    assert [space_size(s) for s in range(4)] == [1, 64, 512, 1024]


def test_random_config_is_seeded_and_in_space() -> None:
    a = [random_zero_config(3, np.random.default_rng(1)) for _ in range(2)]
    assert a[0] == a[1]
    for _ in range(50):
        config = random_zero_config(2, np.random.default_rng(_))
        assert config["stage"] == 2
        for knob, choices in zero_knobs(2).items():
            assert config[knob] in choices
            assert type(config[knob]) in (int, bool)  # JSON-friendly, never numpy scalars


def test_explicit_config_spells_out_deepspeeds_defaults() -> None:
    config = explicit_zero_config({"reduce_bucket_size": 10**7}, 3)
    assert config["reduce_bucket_size"] == 10**7
    assert config["allgather_bucket_size"] == 500_000_000
    assert config["overlap_comm"] is True  # DeepSpeed's default at stage 3 only
    assert explicit_zero_config({}, 2)["overlap_comm"] is False
    assert set(config) == {"stage", *zero_knobs(3)}


def test_knob_steps_move_one_knob_one_or_two_rungs() -> None:
    config = explicit_zero_config({}, 2)
    steps = knob_steps(config)
    assert ("reduce_bucket_size", 10**8) in steps and ("reduce_bucket_size", 5 * 10**7) in steps
    assert ("reduce_bucket_size", 10**9) in steps and ("reduce_bucket_size", 5 * 10**9) in steps
    assert ("overlap_comm", True) in steps
    assert ("reduce_scatter", False) in steps
    top = {**config, "allgather_bucket_size": max(zero_knobs(2)["allgather_bucket_size"])}
    assert all(
        value <= top["allgather_bucket_size"]
        for k, value in knob_steps(top)
        if k == "allgather_bucket_size"
    )


def test_memory_order_covers_buckets_and_overlap_only() -> None:
    base = explicit_zero_config({}, 2)
    bigger = {**base, "reduce_bucket_size": 10**9, "overlap_comm": True}
    assert needs_no_less_memory(bigger, base) and not needs_no_less_memory(base, bigger)
    assert needs_no_less_memory(base, base)
    other_switch = {**bigger, "contiguous_gradients": False}
    assert not needs_no_less_memory(other_switch, base)  # its memory effect is not known
    assert not needs_no_less_memory(explicit_zero_config({}, 3), base)  # another stage


def test_a_trial_name_shows_every_knob_set_apart_from_deepspeeds_defaults() -> None:
    """Two configurations a search ran never share a name: knob_tags shows what differs from
    DeepSpeed's defaults (nothing at stage 0, where no ZeRO knob acts)."""
    section = explicit_zero_config(
        {
            "reduce_bucket_size": 50_000_000,
            "overlap_comm": True,
            "contiguous_gradients": False,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
        },
        2,
    )
    assert knob_tags(section, 2) == ["rb5e7", "overlap", "no-contiguous", "offload-opt-cpu"]
    assert knob_tags(explicit_zero_config({}, 2), 2) == []
    stage3 = explicit_zero_config(
        {"overlap_comm": False, "stage3_param_persistence_threshold": 90_880}, 3
    )
    assert knob_tags(stage3, 3) == ["persist9.09e4", "no-overlap"]
    assert knob_tags({"reduce_bucket_size": 1}, 0) == []
    # DeepSpeed's ZeRO-1 overlaps too: a user's overlap kept at stage 1 read as dropped.
    assert knob_tags(explicit_zero_config({"overlap_comm": True}, 1), 1) == ["overlap"]
    assert [size_text(v) for v in (5e8, 1_000, 150_000, 1e6)] == ["5e8", "1000", "1.5e5", "1e6"]
    # What the throughput model pools: the knob settings, not the offload (a curve of its own).
    assert setting_tags({**section, "stage": 2}) == ("rb5e7", "overlap", "no-contiguous")
    assert setting_tags({"stage": 0, "reduce_bucket_size": 1}) == ()


def test_a_bucket_left_to_hfs_auto_is_named_on_both_sides_of_a_comparison() -> None:
    """ "ZeRO-2 micro-batch 4 -> ZeRO-1 micro-batch 8" said nothing of a reduce bucket that went
    from HF's hidden-size fill to DeepSpeed's default 5e8 (which knob_tags leaves unsaid)."""
    yours = {"stage": 2, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto"}
    assert auto_size_tags(yours, 2) == ["rb auto"]  # the prefetch bucket acts at ZeRO-3 only
    handed = {"stage": 1, "reduce_bucket_size": 5e8}
    assert knob_tags(handed, 1) == []
    assert auto_size_tags(yours, 1, handed) == ["rb5e8"]
    assert auto_size_tags(yours, 3, {"reduce_bucket_size": "auto"}) == ["rb auto"]
    assert auto_size_tags(yours, 0, handed) == []
