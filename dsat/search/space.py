"""The ZeRO knobs a search draws at random, per stage.

Each stage adds knobs to those of the stages below it, as in Determined's DSAT. Bucket sizes span
1e6..5e9 elements; overlap and scatter switches are on/off.
"""

from __future__ import annotations

from typing import Any

import numpy as np

BUCKET_SIZES = tuple(n * 10**m for m in range(6, 10) for n in (1, 5))

_STAGE_KNOBS: dict[int, dict[str, tuple[Any, ...]]] = {
    0: {},
    1: {"reduce_bucket_size": BUCKET_SIZES, "allgather_bucket_size": BUCKET_SIZES},
    2: {
        "overlap_comm": (True, False),
        "reduce_scatter": (True, False),
        "contiguous_gradients": (True, False),
    },
    3: {"allgather_partitions": (True, False)},
}


def zero_knobs(stage: int) -> dict[str, tuple[Any, ...]]:
    """Every knob that applies at ``stage`` with its choices, in a fixed order."""
    knobs: dict[str, tuple[Any, ...]] = {}
    for lower in range(1, stage + 1):
        knobs.update(_STAGE_KNOBS[lower])
    return knobs


def random_zero_config(stage: int, rng: np.random.Generator) -> dict[str, Any]:
    """A ``zero_optimization`` section for ``stage`` with every knob drawn uniformly."""
    config: dict[str, Any] = {"stage": stage}
    for knob, choices in zero_knobs(stage).items():
        value = choices[int(rng.integers(len(choices)))]
        config[knob] = value.item() if isinstance(value, np.generic) else value
    return config


def space_size(stage: int) -> int:
    size = 1
    for choices in zero_knobs(stage).values():
        size *= len(choices)
    return size


def neighbour_zero_config(config: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    """``config`` with one of its stage's knobs redrawn to a different value."""
    stage = int(config.get("stage", 0))
    knobs = zero_knobs(stage)
    if not knobs:
        return dict(config)
    names = list(knobs)
    knob = names[int(rng.integers(len(names)))]
    others = [v for v in knobs[knob] if v != config.get(knob)] or list(knobs[knob])
    value = others[int(rng.integers(len(others)))]
    return {**config, knob: value.item() if isinstance(value, np.generic) else value}
