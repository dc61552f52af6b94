"""Keep third-party start-up chatter off the user's terminal.

DeepSpeed prints a warning when it picks its accelerator at import, above whatever dsat says next
(a one-line error included). Its logger writes through file descriptors 1 and 2 it grabbed at
import time, so redirecting ``sys.stdout`` is not enough: the descriptors themselves are pointed
at a temporary file while the noisy code runs, and what was written goes to dsat's debug log.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import Iterator

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def quiet_output(what: str) -> Iterator[None]:
    """Run the body with stdout and stderr captured at the descriptor level."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            sink.seek(0)
            text = sink.read().decode(errors="replace").strip()
            if text:
                logger.debug("%s printed:\n%s", what, text)
