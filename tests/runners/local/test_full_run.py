"""The full run's output, copied to its log as it comes."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from dsat.runners.local.full_run import _stream


def test_each_line_of_the_full_run_is_in_its_log_file_as_it_comes(
    tmp_path: Path, capfdbinary: pytest.CaptureFixture[bytes]
) -> None:
    """A dsat killed with SIGKILL left a log holding only the command line: the lines it had
    copied were still in the file object's buffer."""
    reader, writer = os.pipe()
    path = tmp_path / "full-experiment.log"
    output, log = os.fdopen(reader, "rb"), path.open("wb")
    copying = threading.Thread(target=_stream, args=(output, log), daemon=True)
    copying.start()
    try:
        os.write(writer, b"step 1 loss 0.9\n")
        deadline = time.monotonic() + 10
        while path.read_bytes() != b"step 1 loss 0.9\n":  # read as another process would
            assert time.monotonic() < deadline, path.read_bytes()
            time.sleep(0.05)
    finally:
        os.close(writer)  # the run's end: the copy ends, and its files close after it
        copying.join(timeout=10)
        log.close()
        output.close()
    assert b"step 1 loss 0.9\n" in capfdbinary.readouterr().out  # and on the terminal
