"""The machine's slots: GPUs as CUDA_VISIBLE_DEVICES says, CPU slots without one."""

from __future__ import annotations

import os

import pytest

from dsat.errors import DsatError
from dsat.runners.local.slots import SlotPool, claimable_slots


def test_gpu_pool_respects_cuda_visible_devices_and_max_slots() -> None:
    pool = SlotPool.for_machine(2, None, {"CUDA_VISIBLE_DEVICES": "3,5,7"})
    assert pool.on_gpu and pool.slots == ["3", "5", "7"]
    assert SlotPool.for_machine(1, 2, {"CUDA_VISIBLE_DEVICES": "3,5,7"}).slots == ["3", "5"]
    first, second = pool.take(2), pool.take(1)
    assert set(first).isdisjoint(second) and pool.size == 0
    pool.give_back(first)
    assert sorted(pool.slots) == ["3", "5"]


def test_trial_larger_than_the_machine_is_a_user_error() -> None:
    with pytest.raises(DsatError, match="slots_per_trial is 4 but this machine has 3 visible"):
        SlotPool.for_machine(4, None, {"CUDA_VISIBLE_DEVICES": "0,1,2"})
    with pytest.raises(DsatError, match="no GPU.*; lower slots_per_trial$"):
        SlotPool.for_machine(10_000, None, {"CUDA_VISIBLE_DEVICES": ""})


def test_a_resumed_search_short_of_slots_is_not_told_to_lower_them() -> None:
    """Its trials were measured on that many, and a resume refuses a changed experiment: the
    fix it was given led to a second refusal."""
    for environ in ({"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": ""}):
        with pytest.raises(DsatError) as caught:
            SlotPool.for_machine(10_000, None, environ, resumed=True)
        assert str(caught.value).endswith(
            "resume this search where 10000 are free (its trials ran on 10000), or start a new "
            "one with a lower slots_per_trial"
        )


def test_cpu_pool_runs_one_trial_at_a_time_unless_max_slots_says_more() -> None:
    no_gpu = {"CUDA_VISIBLE_DEVICES": ""}
    assert SlotPool.for_machine(1, None, no_gpu).slots == ["cpu0"]
    assert not SlotPool.for_machine(1, None, no_gpu).on_gpu
    cores = os.cpu_count() or 1
    assert SlotPool.for_machine(1, 2, no_gpu).size == min(2, cores)


def test_a_search_claims_its_number_of_the_visible_gpus_or_every_core() -> None:
    visible = {"CUDA_VISIBLE_DEVICES": "3,5,7"}
    assert claimable_slots(SlotPool.for_machine(1, 2, visible), visible) == (["3", "5", "7"], 2)
    cores = os.cpu_count() or 1
    cpu = {"CUDA_VISIBLE_DEVICES": ""}
    everything = ([f"cpu{i}" for i in range(cores)], cores)
    assert claimable_slots(SlotPool.for_machine(1, None, cpu), cpu) == everything
