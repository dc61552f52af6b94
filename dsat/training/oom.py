"""How an out-of-memory failure looks, as an exception and in a trial's log.

The trial side and the runners share these signatures so that an OOM is told apart from any
other crash: an OOM lowers the micro-batch ceiling of a search, a crash does not.
"""

from __future__ import annotations

from dsat.constants import OOM_MARKER

# Substrings of messages from PyTorch's CUDA and CPU allocators and from cuBLAS.
OOM_MESSAGE_SIGNATURES = (
    "out of memory",
    "OutOfMemoryError",
    "can't allocate memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
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
