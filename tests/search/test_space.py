"""The ZeRO knob space."""

from __future__ import annotations

import numpy as np

from dsat.search.space import neighbour_zero_config, random_zero_config, space_size, zero_knobs


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


def test_neighbour_changes_exactly_one_knob() -> None:
    rng = np.random.default_rng(0)
    base = random_zero_config(3, rng)
    for _ in range(30):
        near = neighbour_zero_config(base, rng)
        assert sum(near[k] != base[k] for k in base) == 1
    assert neighbour_zero_config({"stage": 0}, rng) == {"stage": 0}
