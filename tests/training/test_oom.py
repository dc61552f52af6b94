"""Telling an out-of-memory failure from any other crash."""

from __future__ import annotations

import pytest
import torch

from dsat.training.oom import (
    allocator_says_out_of_memory,
    is_out_of_memory,
    text_shows_out_of_memory,
)


@pytest.mark.parametrize(
    "err",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        MemoryError(),
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:114] DefaultCPUAllocator: can't allocate memory"
        ),
        RuntimeError("CUDA error: out of memory"),
        RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
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


@pytest.mark.parametrize(
    "said",
    [
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
        "RuntimeError: CUDA error: out of memory",
        "Cuda failure 'out of memory'",  # NCCL's
        "terminate called after throwing an instance of 'c10::OutOfMemoryError'",
        "DefaultCPUAllocator: can't allocate memory: you tried to allocate 8589934592 bytes",
        "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
        "  what():  cudaErrorMemoryAllocation: out of memory",  # an abort from CUDA's runtime
    ],
)
def test_what_an_allocator_says_is_out_of_memory(said: str) -> None:
    """Said as a process's last words (an abort in C++), each is an OOM of its configuration."""
    assert allocator_says_out_of_memory(said) and text_shows_out_of_memory(said)


def test_a_tip_that_mentions_out_of_memory_is_not_an_allocators_word() -> None:
    tip = "tip: set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True if you run out of memory"
    assert text_shows_out_of_memory(tip) and not allocator_says_out_of_memory(tip)
