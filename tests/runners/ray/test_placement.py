"""Where a trial's slots go on a Ray cluster: packed when one node can hold them, else an equal
share on each of the fewest nodes that can."""

from __future__ import annotations

import pytest

from dsat.errors import DsatError
from dsat.runners.ray.placement import (
    TrialLayout,
    node_capacities,
    slot_resource,
    trial_layout,
)


def test_a_trial_that_fits_one_node_is_packed_there() -> None:
    layout = trial_layout(4, [2, 8, 4], "GPU")
    assert layout == TrialLayout(1, 4, "GPU")
    assert layout.bundles == [{"GPU": 4.0}] and layout.strategy == "STRICT_PACK"


def test_a_trial_larger_than_any_node_is_spread_evenly_over_the_fewest_nodes() -> None:
    layout = trial_layout(8, [4, 4, 4], "GPU")
    assert layout == TrialLayout(2, 4, "GPU")
    assert layout.bundles == [{"GPU": 4.0}, {"GPU": 4.0}]
    assert layout.strategy == "STRICT_SPREAD"  # one bundle, one torchrun per node
    # 6 slots on nodes of 4 and 4: 2 nodes x 3 (torchrun runs as many processes on each node).
    assert trial_layout(6, [4, 4], "GPU") == TrialLayout(2, 3, "GPU")
    # Ones of 1 GPU: as many nodes as slots.
    assert trial_layout(2, [0, 1, 1], "GPU") == TrialLayout(2, 1, "GPU")


def test_a_trial_no_layout_can_hold_is_one_line_naming_the_setting() -> None:
    with pytest.raises(DsatError, match="slots_per_trial 8 cannot be placed.*4, 2 GPU"):
        trial_layout(8, [4, 2], "GPU")
    with pytest.raises(DsatError, match="slots_per_trial 3"):
        trial_layout(3, [2, 2], "GPU")  # 3 is prime: 3 nodes of 1, and there are 2
    with pytest.raises(DsatError, match="add nodes or resume this search where 8 are free"):
        trial_layout(8, [4, 2], "GPU", resumed=True)  # a resume refuses a changed experiment


def test_slots_are_gpus_where_a_live_node_has_one_else_cpus() -> None:
    nodes = [
        {"Alive": True, "Resources": {"CPU": 8.0}},
        {"Alive": True, "Resources": {"CPU": 16.0, "GPU": 4.0}},
        {"Alive": False, "Resources": {"CPU": 16.0, "GPU": 8.0}},
    ]
    assert slot_resource(nodes) == "GPU"
    assert node_capacities(nodes, "GPU") == [0, 4]  # the dead node counts for nothing
    assert slot_resource(nodes[:1]) == "CPU" and node_capacities(nodes[:1], "CPU") == [8]
