"""A search outlives the reader of its output (``dsat ... | head``, a ``tee`` that died).

Its first print after the reader left raised BrokenPipeError: a search that had run to its end
died in a traceback before it drew its report, and every log line before that printed a
"Logging error" block. Once stdout's reader is gone, what dsat says goes nowhere and the search
goes on, its results files unaffected.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any, TextIO


class ReaderlessStdout:
    """``stream``, which drops what it is given once its reader has gone (descriptor 1 is then
    pointed at /dev/null, so the buffered rest, and anything written there later, goes too)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            self._reader_gone()
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except BrokenPipeError:
            self._reader_gone()

    def _reader_gone(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.stream.fileno())
            os.close(devnull)
        with contextlib.suppress(OSError, ValueError):
            self.stream.flush()  # what it buffered, now into /dev/null

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


@contextlib.contextmanager
def stdout_without_reader() -> Iterator[None]:
    """sys.stdout as a ``ReaderlessStdout`` for the block."""
    before = sys.stdout
    guarded = ReaderlessStdout(before)
    sys.stdout = guarded  # type: ignore[assignment]
    try:
        yield
    finally:
        # What it still buffers, now: flushed at the interpreter's exit into a pipe whose reader
        # left, it failed there ("Exception ignored ... BrokenPipeError", exit status 120).
        guarded.flush()
        sys.stdout = before
