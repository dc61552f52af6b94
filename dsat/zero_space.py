"""The ZeRO knobs a search draws at random, per stage.

Each stage adds knobs to those of the stages below it, as in Determined's DSAT. Bucket sizes span
1e6..5e9 elements; overlap and scatter switches are on/off.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from dsat.memory import without_unused_offloads

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


# ZeRO-3's own knobs, which guided steps (the reference's methods draw only the knobs above):
# how many parameter elements are fetched ahead of use, and below what size a parameter is not
# partitioned at all (stage3_knobs.py says where they start).
PREFETCH_SIZES = (1_000_000, 5_000_000, 10_000_000, 50_000_000, 100_000_000, 500_000_000)


def stage3_ladders(hidden: int) -> dict[str, tuple[Any, ...]]:
    """ZeRO-3's knobs and their ladders for a model of hidden size ``hidden``. The persistence
    threshold matters only where it crosses a tensor's size, so its rungs lie past those sizes
    in a decoder: persist nothing, the vectors (HF's 10 h), also the attention matrices (h^2),
    every matrix (the MLP's 4 h^2); twice the size, so that a hidden size estimated 30% off
    still crosses the same tensors."""
    return {
        "stage3_prefetch_bucket_size": PREFETCH_SIZES,
        "stage3_param_persistence_threshold": (
            min(1_000, hidden - 1),
            10 * hidden,
            2 * hidden * hidden,
            8 * hidden * hidden,
        ),
    }


# DeepSpeed's values for knobs a config leaves out (overlap_comm is on by default at stage 3).
DEEPSPEED_DEFAULTS: dict[str, Any] = {
    "reduce_bucket_size": 500_000_000,
    "allgather_bucket_size": 500_000_000,
    "reduce_scatter": True,
    "contiguous_gradients": True,
    "allgather_partitions": True,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_param_persistence_threshold": 100_000,
}
# Knobs whose larger value (or True) never needs less memory: bucket buffers, overlap's copies,
# the prefetched and the persistent (unpartitioned) parameters.
MEMORY_MONOTONE_KNOBS = (
    "reduce_bucket_size",
    "allgather_bucket_size",
    "overlap_comm",
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
)


# How a trial's name shows a knob that differs from DeepSpeed's default.
_SIZE_TAGS = {
    "reduce_bucket_size": "rb",
    "allgather_bucket_size": "ag",
    "stage3_prefetch_bucket_size": "prefetch",
    "stage3_param_persistence_threshold": "persist",
}
_SWITCH_TAGS = {
    "overlap_comm": "overlap",
    "reduce_scatter": "reduce-scatter",
    "contiguous_gradients": "contiguous",
    "allgather_partitions": "allgather-partitions",
}


def knob_tags(section: dict[str, Any], stage: int) -> list[str]:
    """What a ZeRO section changes from DeepSpeed's defaults, one short tag a knob (``rb5e7``,
    ``overlap``, ``no-contiguous``, ``offload-opt-cpu``), so that two configurations a search
    ran never look alike. Empty at stage 0, where no ZeRO knob acts."""
    if stage == 0:
        return []
    tags = []
    for knob, tag in _SIZE_TAGS.items():
        value = section.get(knob)
        if knob.startswith("stage3_") and stage != 3:
            continue
        if isinstance(value, (int, float)) and value != DEEPSPEED_DEFAULTS[knob]:
            tags.append(f"{tag}{size_text(value)}")
    for knob, tag in _SWITCH_TAGS.items():
        default = stage == 3 if knob == "overlap_comm" else DEEPSPEED_DEFAULTS[knob]
        # Overlap is searched from stage 2, but DeepSpeed's ZeRO-1 uses it too: a user's
        # overlap kept at stage 1 read as dropped.
        acts = knob in zero_knobs(stage) or knob == "overlap_comm"
        if acts and knob in section and bool(section[knob]) != default:
            tags.append(tag if section[knob] else f"no-{tag}")
    for knob, tag in (("offload_optimizer", "offload-opt"), ("offload_param", "offload-param")):
        device = (
            section.get(knob, {}).get("device") if isinstance(section.get(knob), dict) else None
        )
        if device not in (None, "none"):
            tags.append(f"{tag}-{device}")
    return tags


def auto_size_tags(
    section: dict[str, Any], stage: int, filled: dict[str, Any] | None = None
) -> list[str]:
    """The size knobs ``section`` leaves to HF's "auto" fill (``rb auto``), or with ``filled``,
    the value ``filled`` gives each of them instead (``rb5e8``, even at DeepSpeed's default,
    which ``knob_tags`` leaves unsaid): what a comparison of the two must name."""
    tags: list[str] = []
    if stage == 0:
        return tags  # no ZeRO knob acts
    for knob, tag in _SIZE_TAGS.items():
        if section.get(knob) != "auto" or (knob.startswith("stage3_") and stage != 3):
            continue
        value = section[knob] if filled is None else filled.get(knob)
        if value == "auto":
            tags.append(f"{tag} auto")
        elif isinstance(value, (int, float)):
            tags.append(f"{tag}{size_text(value)}")
    return tags


def setting_tags(section: dict[str, Any]) -> tuple[str, ...]:
    """The knob settings that shift a configuration's throughput by a factor (knob_tags without
    the offload, which gives a curve of its own): what the throughput model pools across
    configurations."""
    tags = knob_tags(section, int(section.get("stage", 0)))
    return tuple(t for t in tags if not t.startswith("offload-"))


def size_text(value: float) -> str:
    """A bucket size or threshold as a user writes it: 5e7, 1.5e5, 1000."""
    if value < 10_000:
        return f"{value:g}"
    mantissa, exponent = f"{value:.2e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def searchable_section(section: dict[str, Any], stage: int) -> dict[str, Any]:
    """The user's ZeRO section as the start of ``stage``'s search, without a knob's value of
    another kind than the knob's: HF's "auto", which its Trainer fills in the trial (a step
    from it compared a string with numbers, and the search ended in a traceback). DeepSpeed's
    default stands in for it, as where the user set none."""
    knobs = zero_knobs(stage)
    return {
        key: value
        for key, value in section.items()
        if key not in knobs or _of_the_knobs_kind(value, knobs[key])
    }


def _of_the_knobs_kind(value: Any, choices: tuple[Any, ...]) -> bool:
    if all(isinstance(c, bool) for c in choices):
        return isinstance(value, bool)
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def explicit_zero_config(section: dict[str, Any], stage: int) -> dict[str, Any]:
    """``section`` at ``stage`` with every knob of that stage spelled out, DeepSpeed's defaults
    where the user set none, so that one step changes one known value, and no offload the stage
    does not use."""
    config: dict[str, Any] = {**section, "stage": stage}
    for knob in zero_knobs(stage):
        if knob not in config:
            config[knob] = stage == 3 if knob == "overlap_comm" else DEEPSPEED_DEFAULTS[knob]
    return without_unused_offloads(config)


def section_key(section: dict[str, Any]) -> str:
    """A ZeRO section's identity (every knob spelled out: TrialRecord.zero_section), so that
    two sections compare by their knobs."""
    return json.dumps(section, sort_keys=True)


def knob_steps(
    config: dict[str, Any], stage3: dict[str, tuple[Any, ...]] | None = None
) -> list[tuple[str, Any]]:
    """Every single-knob step from ``config``: a bucket size one or two rungs up or down the
    ladder, a switch flipped; at stage 3 also ZeRO-3's own knobs that ``config`` sets, on the
    ladders ``stage3`` gives (stage3_ladders). Returned as (knob, new value)."""
    steps: list[tuple[str, Any]] = []
    stage = int(config.get("stage", 0))
    knobs = zero_knobs(stage)
    if stage == 3:
        knobs.update({k: v for k, v in (stage3 or {}).items() if k in config})
    for knob, choices in knobs.items():
        value = config.get(knob)
        if all(isinstance(c, bool) for c in choices):
            steps.append((knob, not bool(value)))
            continue
        below = sorted((c for c in choices if c < value), reverse=True)
        above = sorted(c for c in choices if c > value)
        steps += [(knob, c) for c in below[:2] + above[:2]]
    return steps


def needs_no_less_memory(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether config ``a`` needs at least the memory of ``b`` at every micro-batch: same stage
    and switches, and buckets and overlap no smaller. An OOM of ``b`` then rules ``a`` out."""
    if a.get("stage") != b.get("stage") or set(a) != set(b):
        return False
    for knob in a:
        if knob in MEMORY_MONOTONE_KNOBS:
            if a[knob] < b[knob]:
                return False
        elif a[knob] != b[knob]:
            return False
    return True
