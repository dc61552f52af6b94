"""The machine's slots for trials: GPUs, or CPU slots when there is none."""

from __future__ import annotations

import os
from dataclasses import dataclass

from dsat.errors import DsatError
from dsat.runners.trial_runner import fewer_slots_fix


def visible_gpus(environ: dict[str, str]) -> list[str]:
    """The GPUs trials may use: CUDA_VISIBLE_DEVICES when set, else every one torch sees."""
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip() and d.strip() != "-1"]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


@dataclass
class SlotPool:
    """The machine's slots: GPU ids, or CPU slots named cpu0, cpu1, ..."""

    slots: list[str]
    on_gpu: bool

    @classmethod
    def for_machine(
        cls,
        slots_per_trial: int,
        max_slots: int | None,
        environ: dict[str, str],
        resumed: bool = False,
    ) -> SlotPool:
        gpus = visible_gpus(environ)
        fix = fewer_slots_fix(slots_per_trial, resumed)
        if gpus:
            if slots_per_trial > len(gpus):
                raise DsatError(
                    f"resources.slots_per_trial is {slots_per_trial} but this machine has "
                    f"{len(gpus)} visible GPU(s); make more visible (CUDA_VISIBLE_DEVICES) or "
                    f"{fix}"
                )
            count = min(len(gpus), max_slots) if max_slots else len(gpus)
            return cls(gpus[:count], on_gpu=True)
        cores = os.cpu_count() or 1
        if slots_per_trial > cores:
            raise DsatError(
                f"resources.slots_per_trial is {slots_per_trial} but this machine has no GPU and "
                f"{cores} CPU core(s); {fix}"
            )
        # Without GPUs one trial runs at a time unless --max-slots allows more.
        count = max(slots_per_trial, min(max_slots or slots_per_trial, cores))
        return cls([f"cpu{i}" for i in range(count)], on_gpu=False)

    def take(self, count: int) -> list[str]:
        if count > len(self.slots):
            raise RuntimeError("the search started more trials than there are free slots")
        taken, self.slots = self.slots[:count], self.slots[count:]
        return taken

    def give_back(self, slots: list[str]) -> None:
        self.slots.extend(slots)

    @property
    def size(self) -> int:
        return len(self.slots)


def claimable_slots(pool: SlotPool, environ: dict[str, str]) -> tuple[list[str], int]:
    """What a search with ``pool`` claims on this machine, and how many of them: on a GPU any
    ``pool.size`` of the visible GPUs; on the CPU every core's slot, since each trial's threads
    share all the cores (``OMP_NUM_THREADS`` = cores / pool size)."""
    if pool.on_gpu:
        return visible_gpus(environ), pool.size
    cores = os.cpu_count() or 1
    return [f"cpu{i}" for i in range(cores)], cores
