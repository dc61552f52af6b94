"""What it takes to fit: the rungs dsat climbs when the model does not run at micro-batch 1 as
submitted, instead of ending the search.

ZeRO-3 first (or the highest stage ``--zero-stages`` allows), then activation checkpointing where
the training script has the switch (the ``gradient_checkpointing`` hyperparameter, HF Trainer's
name), then the optimizer's states on the CPU, then the parameters too, then both on NVMe when the
user gives a path: each rung needs less GPU memory and trains slower, in the order DeepSpeed's and
HF's own guidance climbs it. Each rung keeps what the rungs below it set. The model profile runs
again on each rung until one fits; the search then tries only configurations with that rung's
settings, at the stages that can carry them. ``--offload`` puts the offload rungs' settings in the
search space even when the model fits (they free memory for a larger micro-batch).

Nothing here is saved: the rung a search is on is how many model profiles it ran, so a resumed
search climbs the same ladder.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from dsat.constants import CHECKPOINTING_HPARAM
from dsat.memory import Offload, used_offloads

__all__ = [
    "CHECKPOINTING_HPARAM",
    "FitRung",
    "ladder",
    "offload_choices",
    "offload_level",
    "what_it_takes",
    "with_offload_of",
]
# A rung's stages: parameter offload needs ZeRO-3, optimizer offload any stage from 1.
_OFFLOAD_STAGES = (1, 2, 3)


@dataclasses.dataclass(frozen=True)
class FitRung:
    """One way of fitting: what it sets in every trial, and the stages that can carry it."""

    name: str  # what the summary says it took, e.g. "ZeRO-3, optimizer states on the CPU"
    zero: dict[str, Any]  # merged into every trial's zero_optimization (no stage: see stages)
    hparams: dict[str, Any]  # merged into every trial's hyperparameters
    stages: tuple[int, ...]  # the ZeRO stages this rung can run at
    profile_stage: int | None  # the stage its model profile runs at; None: the user's own

    @property
    def offload(self) -> Offload:
        return Offload.of(self.zero)


def offload_level(section: Mapping[str, Any] | None) -> int:
    """How much a ZeRO section keeps off the GPU (of what its stage uses): 0 nothing, 1 the
    optimizer's states, 2 the parameters too, 3 both on NVMe."""
    used = used_offloads(section)
    if any((section or {})[key].get("device") == "nvme" for key in used):
        return 3
    return 2 if "offload_param" in used else 1 if "offload_optimizer" in used else 0


def with_offload_of(section: dict[str, Any], rung: Mapping[str, Any]) -> dict[str, Any]:
    """``section`` keeping at least what ``rung`` (a rung's part of a ZeRO section) keeps off the
    GPU: as it is where it keeps as much or more, else with the rung's offload."""
    if offload_level(section) >= offload_level(rung):
        return section
    return with_offload(section, rung)


def with_offload(section: Mapping[str, Any], offload: Mapping[str, Any]) -> dict[str, Any]:
    """``section`` offloading as ``offload`` (a part of a ZeRO section) says, keeping what the
    user set of an offload to the same device (``pin_memory: false``, ``fast_init``,
    ``buffer_count``): each was replaced by dsat's whole choice, pinned memory on."""
    merged = {**section, **offload}
    for key, choice in offload.items():
        mine = section.get(key)
        if isinstance(mine, Mapping) and isinstance(choice, Mapping):
            if mine.get("device") == choice.get("device"):
                merged[key] = {**choice, **mine}
    return merged


OFFLOADED = (
    "",
    "optimizer states on the CPU",
    "optimizer states and parameters on the CPU",
    "optimizer states and parameters on NVMe",
)


def what_it_takes(section: Mapping[str, Any], hparams: Mapping[str, Any]) -> str:
    """What a configuration needs to fit, in the summary's words: its stage, what it offloads,
    and activation checkpointing when the fit ladder turned it on."""
    parts = [f"ZeRO-{int(section.get('stage', 0))}", OFFLOADED[offload_level(section)]]
    if hparams.get(CHECKPOINTING_HPARAM) is True:
        parts.append("activation checkpointing")
    return ", ".join(p for p in parts if p)


def _device(device: str, nvme_path: str | None = None) -> dict[str, Any]:
    if device == "nvme":
        return {"device": "nvme", "nvme_path": nvme_path, "pin_memory": True}
    return {"device": device, "pin_memory": True}


def ladder(
    user_config: Mapping[str, Any],
    hparams: Mapping[str, Any],
    zero_stages: tuple[int, ...],
    nvme_path: str | None = None,
) -> list[FitRung]:
    """The rungs in the order they are tried; the first is the user's config as submitted (at
    every stage of ``--zero-stages``). Parameter offload needs stage 3 in ``--zero-stages``; a
    rung that keeps no more off the GPU than the user's own config, at no higher a stage, is
    left out."""
    section = user_config.get("zero_optimization")
    user_section = section if isinstance(section, Mapping) else {}
    user = (offload_level(user_section), int(user_section.get("stage", 0)))
    top = max(zero_stages)
    switch = {CHECKPOINTING_HPARAM: True} if hparams.get(CHECKPOINTING_HPARAM) is False else {}
    offload_stages = tuple(s for s in zero_stages if s in _OFFLOAD_STAGES)

    # The highest stage allowed, plain: without stage 3, ZeRO-2's partitioned gradients may be
    # all it takes, and offload would slow every step for nothing.
    steps: list[tuple[str, dict[str, Any], dict[str, Any], tuple[int, ...]]] = [
        (f"ZeRO-{top}", {}, {}, tuple(zero_stages) if top >= 1 else ())
    ]
    if switch:
        steps.append((f"ZeRO-{top}, activation checkpointing", {}, switch, tuple(zero_stages)))
    with_switch = ", activation checkpointing" if switch else ""
    # The offload rungs keep off the GPU what the choices at their level do (offload_choices).
    offloads = {offload_level(c): c for c in offload_choices(3, 1, nvme_path)}
    steps.append((f"ZeRO-{top}, {OFFLOADED[1]}{with_switch}", offloads[1], switch, offload_stages))
    if top == 3:
        steps.append((f"ZeRO-3, {OFFLOADED[2]}{with_switch}", offloads[2], switch, (3,)))
        if nvme_path:
            name = f"ZeRO-3, {OFFLOADED[3]} ({nvme_path}){with_switch}"
            steps.append((name, offloads[3], switch, (3,)))

    rungs = [FitRung("as submitted", {}, {}, tuple(zero_stages), None)]
    for name, zero, switches, stages in steps:
        level = offload_level(zero)
        if not stages or level < user[0] or (not switches and (level, stages[-1]) <= user):
            continue
        rungs.append(FitRung(name, zero, switches, stages, stages[-1]))
    return rungs


def offload_choices(
    stage: int, min_level: int, nvme_path: str | None = None
) -> list[dict[str, Any]]:
    """What a configuration at ``stage`` may keep off the GPU, keeping at least ``min_level``
    (offload_level) off: nothing, the optimizer's states (from stage 1), the parameters too
    (stage 3), both on NVMe (stage 3, given a path). Each is a part of a ZeRO section."""
    cpu = _device("cpu")
    choices: list[dict[str, Any]] = [{}]
    if stage >= 1:
        choices.append({"offload_optimizer": cpu})
    if stage == 3:
        choices.append({"offload_optimizer": cpu, "offload_param": cpu})
        if nvme_path:
            nvme = _device("nvme", nvme_path)
            choices.append({"offload_optimizer": nvme, "offload_param": nvme})
    return [c for c in choices if offload_level(c) >= min_level]
