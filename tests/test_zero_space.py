"""The ZeRO knob space."""

from __future__ import annotations

import numpy as np

from dsat.zero_space import (
    explicit_zero_config,
    knob_steps,
    needs_no_less_memory,
    random_zero_config,
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
