"""From the model-profile trial to memory per GPU per ZeRO stage and a micro-batch ceiling.

Counts as DeepSpeed's own autotuner does: with mixed precision (fp16 or bf16) a parameter costs 2
bytes, its gradient 2, and the optimizer 16 (Adam's fp32 master copy, momentum and variance, plus
the fp32 gradient copy its step makes); in fp32 it is 4 + 4 + 8.
Stage 1 partitions the optimizer states across the trial's slots, stage 2 also the gradients,
stage 3 also the parameters. Offload moves the optimizer states (any stage from 1) or the
parameters (stage 3) off the GPU, to the CPU or NVMe. Activations grow linearly with the
micro-batch.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from dsat.constants import PRECISION_KEY

logger = logging.getLogger(__name__)

PROFILE_KEYS = ("num_params", "trainable_num_params", "activation_mem_per_gpu", "gpu_mem")
# A binary search above this micro-batch is never useful; it also bounds a zero activation estimate.
MAX_MICRO_BATCH = 2**14


class ModelProfileError(ValueError):
    """The model-profile trial did not report what the memory model needs."""


class Precision(str, enum.Enum):
    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"

    @classmethod
    def of(cls, ds_config: Mapping[str, Any]) -> Precision:
        for precision, key in ((cls.FP16, "fp16"), (cls.BF16, "bf16")):
            section = ds_config.get(key)
            if isinstance(section, Mapping) and section.get("enabled") is True:
                return precision
        return cls.FP32

    @classmethod
    def of_run(cls, metrics: Mapping[str, Any], ds_config: Mapping[str, Any]) -> Precision:
        """What a trial ran at, where it reported it (the model profile does: a JSON's
        ``"auto"``, which HF's Trainer fills in from its ``--bf16``/``--fp16``, reads as no
        mixed precision here), else what ``ds_config`` says."""
        reported = metrics.get(PRECISION_KEY)
        if reported in {member.value for member in cls}:
            return cls(reported)
        return cls.of(ds_config)

    @property
    def bytes_per_param(self) -> tuple[int, int, int]:
        """(parameter, gradient, optimizer states) bytes per parameter, with Adam."""
        return (4, 4, 8) if self is Precision.FP32 else (2, 2, 16)


@dataclasses.dataclass(frozen=True)
class Offload:
    """What a ZeRO section keeps off the GPU."""

    optimizer: bool = False
    params: bool = False

    @classmethod
    def of(cls, section: Mapping[str, Any] | None) -> Offload:
        """What ``section`` offloads and its stage uses (everything it offloads where it names
        no stage: a part of a section, to be merged into one)."""
        used = used_offloads(section)
        return cls("offload_optimizer" in used, "offload_param" in used)


# The lowest ZeRO stage that uses each offload. DeepSpeed takes either key at any stage: ZeRO-1
# and -2 leave the parameters on the GPU whatever offload_param says, and at stage 0 the CPU
# optimizer offload_optimizer brings meets them there and fails at the first step on a GPU.
OFFLOAD_FROM_STAGE = {"offload_optimizer": 1, "offload_param": 3}


def offloaded_keys(section: Mapping[str, Any] | None) -> set[str]:
    """The offload keys of ``section`` that name a device."""
    return {
        key
        for key in OFFLOAD_FROM_STAGE
        if isinstance(target := (section or {}).get(key), Mapping)
        and target.get("device") not in (None, "none")
    }


def unused_offloads(section: Mapping[str, Any] | None) -> set[str]:
    """The offload keys of ``section`` that name a device its stage does not use: a user's
    ZeRO-3 offload_param in a ZeRO-2 trial, merged in from their config."""
    stage = (section or {}).get("stage")
    if not isinstance(stage, int) or isinstance(stage, bool):
        return set()
    return {key for key in offloaded_keys(section) if stage < OFFLOAD_FROM_STAGE[key]}


def used_offloads(section: Mapping[str, Any] | None) -> set[str]:
    """The offload keys of ``section`` that name a device its stage uses (every one where it
    names no stage)."""
    return offloaded_keys(section) - unused_offloads(section)


def without_unused_offloads(section: dict[str, Any]) -> dict[str, Any]:
    """``section`` with each offload its stage does not use turned off (device "none"), not left
    out: a trial's section is merged into the user's config, where a left-out key stays on."""
    for key in unused_offloads(section):
        section = {**section, key: {**section[key], "device": "none"}}
    return section


@dataclasses.dataclass(frozen=True)
class ModelProfile:
    num_params: int
    trainable_num_params: int
    activation_mem_per_gpu: int  # bytes at micro-batch 1
    gpu_mem: int  # bytes

    @classmethod
    def from_metrics(cls, metrics: Mapping[str, Any]) -> ModelProfile:
        missing = [key for key in PROFILE_KEYS if not isinstance(metrics.get(key), (int, float))]
        if missing:
            raise ModelProfileError(f"model-profile trial reported no {', '.join(missing)}")
        return cls(**{key: int(metrics[key]) for key in PROFILE_KEYS})


def memory_per_gpu_per_stage(
    profile: ModelProfile, precision: Precision, slots: int, offload: Offload = Offload()
) -> dict[int, int]:
    """Bytes per GPU at micro-batch 1 for each ZeRO stage. What ``offload`` keeps off the GPU
    counts for nothing, as in DeepSpeed's own estimators: the optimizer's states, and from stage
    2 the gradients, which go to the CPU as they are reduced; the parameters (stage 3 only)."""
    param_bytes, grad_bytes, optim_bytes = precision.bytes_per_param
    model_states = partitioned_states(
        profile.num_params * param_bytes,
        profile.trainable_num_params * grad_bytes,
        profile.trainable_num_params * optim_bytes,
        slots,
        offload,
    )
    return {stage: mem + profile.activation_mem_per_gpu for stage, mem in model_states.items()}


def partitioned_states(
    params: int, grads: int, optim: int, slots: int, offload: Offload = Offload()
) -> dict[int, int]:
    """Model-state bytes per GPU for each ZeRO stage: 1 partitions the optimizer states across
    the slots, 2 the gradients too, 3 the parameters too. What ``offload`` keeps off the GPU
    counts for nothing: the optimizer's states, and with them from stage 2 the gradients, which
    go to the CPU as they are reduced (ZeRO-Offload); the parameters at stage 3."""
    if offload.optimizer:
        optim = 0
    reduced = 0 if offload.optimizer else grads  # the gradients a partition keeps, from stage 2
    gathered = 0 if offload.params else params  # the parameters a partition keeps at stage 3
    return {
        0: params + grads + optim,
        1: params + grads + optim // slots,
        2: params + (reduced + optim) // slots,
        3: (gathered + reduced + optim) // slots,
    }


def bucket_buffer_bytes(
    reduce_bucket: int,
    allgather_bucket: int,
    overlap_comm: bool,
    precision: Precision,
    num_params: int,
) -> int:
    """DeepSpeed's own estimate of ZeRO's bucket buffers (stage 1 and up): the reduce bucket in
    gradients, 4.5 of them with overlap, plus the all-gather bucket in parameters; no bucket is
    larger than the model."""
    param_bytes, grad_bytes, _ = precision.bytes_per_param
    copies = 4.5 if overlap_comm else 1.0
    reduce = min(reduce_bucket, num_params)
    gather = min(allgather_bucket, num_params)
    return int(reduce * grad_bytes * copies + gather * param_bytes)


def section_bucket_bytes(section: Mapping[str, Any], precision: Precision, num_params: int) -> int:
    """``bucket_buffer_bytes`` of a ZeRO section with every knob spelled out (none below stage
    1): what one configuration's buckets take, for comparing two. At stage 3 with
    ``stage3_prefetch_bucket_size`` set, the parameters fetched ahead count too."""
    if int(section.get("stage", 0)) < 1:
        return 0
    buckets = bucket_buffer_bytes(
        int(section.get("reduce_bucket_size", 0)),
        int(section.get("allgather_bucket_size", 0)),
        bool(section.get("overlap_comm")),
        precision,
        num_params,
    )
    prefetch = section.get("stage3_prefetch_bucket_size")
    if int(section.get("stage", 0)) == 3 and isinstance(prefetch, (int, float)):
        buckets += int(min(prefetch, num_params)) * precision.bytes_per_param[0]
    return buckets


def approx_max_micro_batch(
    profile: ModelProfile, precision: Precision, slots: int, offload: Offload = Offload()
) -> dict[int, int]:
    """The largest micro-batch per stage that fits by this model; at least 1."""
    return {
        stage: micro_batches_in(profile.gpu_mem - (mem - profile.activation_mem_per_gpu), profile)
        for stage, mem in memory_per_gpu_per_stage(profile, precision, slots, offload).items()
    }


def fits_at_one(
    profile: ModelProfile, precision: Precision, slots: int, offload: Offload = Offload()
) -> dict[int, bool]:
    """Whether each stage fits at micro-batch 1 by this model."""
    memory = memory_per_gpu_per_stage(profile, precision, slots, offload)
    return {stage: mem <= profile.gpu_mem for stage, mem in memory.items()}


def micro_batches_in(spare: int, profile: ModelProfile) -> int:
    """How many samples of the profile's activations ``spare`` bytes hold: at least 1, at most
    MAX_MICRO_BATCH."""
    activation = max(profile.activation_mem_per_gpu, 1)
    return int(min(max(spare // activation, 1), MAX_MICRO_BATCH))


def log_estimates(
    profile: ModelProfile,
    precision: Precision,
    slots: int,
    stages: Iterable[int],
    offload: Offload = Offload(),
) -> None:
    """The model and the memory model's figures for the ``stages`` the search may try (those
    outside ``--zero-stages`` read as if they would run)."""
    gib = 2**30
    memory = memory_per_gpu_per_stage(profile, precision, slots, offload)
    ceilings = approx_max_micro_batch(profile, precision, slots, offload)
    logger.info(
        "model: %.3g parameters (%.3g trainable), %s, %.3g GiB activations per sample, "
        "%.3g GiB per GPU",
        profile.num_params,
        profile.trainable_num_params,
        precision.value,
        profile.activation_mem_per_gpu / gib,
        profile.gpu_mem / gib,
    )
    for stage in sorted(set(stages) & set(memory)):
        if memory[stage] > profile.gpu_mem:  # "approx. max micro-batch 1" read as "fits at 1"
            logger.info(
                "ZeRO-%d: %.3g GiB per GPU at micro-batch 1, more than the device's %.3g GiB: "
                "does not fit by this estimate",
                stage,
                memory[stage] / gib,
                profile.gpu_mem / gib,
            )
            continue
        logger.info(
            "ZeRO-%d: %.3g GiB per GPU at micro-batch 1, approx. max micro-batch %d",
            stage,
            memory[stage] / gib,
            ceilings[stage],
        )


def determined_max_micro_batch(
    profile: ModelProfile, precision: Precision, slots: int, offload: Offload = Offload()
) -> dict[int, int]:
    """Determined DSAT's own estimate of the largest micro-batch per stage, for the methods kept
    as it defines them (asha, binary): their binary searches then start at its midpoints, and
    where a midpoint lands against the memory cliff decides much of what they find. It counts
    fp16 as 2 + 4 + 12 bytes a parameter and anything else, bf16 included, as 4 + 4 + 8, and
    keeps one sample of activations free (offloaded state, which the reference never supported,
    counts for nothing, as in dsat's own model). At least 1."""
    fp16 = precision is Precision.FP16
    model_states = partitioned_states(
        profile.num_params * (2 if fp16 else 4),
        profile.trainable_num_params * 4,
        profile.trainable_num_params * ((4 if fp16 else 0) + 8),
        slots,
        offload,
    )
    activation = max(profile.activation_mem_per_gpu, 1)  # as the reference divides by it
    return {
        stage: micro_batches_in(profile.gpu_mem - states - activation, profile)
        for stage, states in model_states.items()
    }
