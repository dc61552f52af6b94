"""How an out-of-memory failure looks, as an exception and in a trial's log.

The trial side and the runners share these signatures so that an OOM is told apart from any
other crash: an OOM lowers the micro-batch ceiling of a search, a crash does not.
"""

from __future__ import annotations

import re

from dsat.constants import OOM_MARKER

# Substrings of messages from PyTorch's CUDA and CPU allocators and from cuBLAS.
OOM_MESSAGE_SIGNATURES = (
    "out of memory",
    "OutOfMemoryError",
    "can't allocate memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    OOM_MARKER,
)


# What only an allocator prints, not a tip or a note that mentions out of memory: what a process
# that ended without an exception (an abort from C++) must have said for its end to be an OOM.
ALLOCATOR_SIGNATURES = (
    "out of memory. Tried to allocate",  # torch's caching allocators (CUDA, HIP, XPU)
    "CUDA error: out of memory",
    "'out of memory'",  # NCCL's "Cuda failure 'out of memory'"
    "OutOfMemoryError",  # c10::OutOfMemoryError, in an abort's "terminate called ..."
    "can't allocate memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "cudaErrorMemoryAllocation",
    OOM_MARKER,
)


def is_out_of_memory(err: BaseException) -> bool:
    if isinstance(err, MemoryError):
        return True
    # torch.OutOfMemoryError (an alias of torch.cuda.OutOfMemoryError) without importing torch.
    if any(cls.__name__ == "OutOfMemoryError" for cls in type(err).__mro__):
        return True
    return isinstance(err, RuntimeError) and text_shows_out_of_memory(str(err))


def text_shows_out_of_memory(text: str) -> bool:
    return any(signature in text for signature in OOM_MESSAGE_SIGNATURES)


def allocator_says_out_of_memory(text: str) -> bool:
    return any(signature in text for signature in ALLOCATOR_SIGNATURES)


# What only the host's memory running out says, in an OOM's one-line reason: torch's CPU
# allocator, Python's MemoryError, numpy's (``numpy.core._exceptions._ArrayMemoryError: Unable to
# allocate ...``). (A process the kernel's OOM killer ended ran the host out too: its runner knows
# that from how it died, not from its output.)
HOST_MEMORY = re.compile(r"can't allocate memory|\b_?(?:Array)?MemoryError\b")  # not OutOfMemory...

# An exception line of a MemoryError: Python's or numpy's, with its module or not, and with its
# message or not (a bare ``MemoryError`` says nothing else). torch's OutOfMemoryError is not one.
MEMORY_ERROR_LINE = re.compile(r"^(?:[\w.]+\.)?(?:_ArrayMemoryError|MemoryError)(?::|$)")


def host_memory_ran_out(reason: str) -> bool:
    return HOST_MEMORY.search(reason) is not None


def memory_error_line(line: str) -> bool:
    """Whether ``line`` (an exception that ended a process) is a MemoryError: out of memory
    wherever it was raised, inside ``dsat_reporting_context`` or before it (data, model)."""
    return MEMORY_ERROR_LINE.match(line.strip()) is not None
