"""Telling an out-of-memory failure from any other crash."""

from __future__ import annotations

import pytest
import torch

from dsat.training.oom import is_out_of_memory, text_shows_out_of_memory


@pytest.mark.parametrize(
    "err",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        MemoryError(),
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:114] DefaultCPUAllocator: can't allocate memory"
        ),
        RuntimeError("CUDA error: out of memory"),
    ],
)
def test_oom_errors(err: BaseException) -> None:
    assert is_out_of_memory(err)


@pytest.mark.parametrize(
    "err", [ValueError("out of memory"), RuntimeError("shape mismatch"), KeyError("x")]
)
def test_other_errors(err: BaseException) -> None:
    assert not is_out_of_memory(err)


def test_log_signatures() -> None:
    assert text_shows_out_of_memory("torch.OutOfMemoryError: CUDA out of memory.")
    assert not text_shows_out_of_memory("ZeroDivisionError: division by zero")
