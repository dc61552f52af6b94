"""Stops the process groups dsat hands it when dsat dies without stopping them.

A trial host runs the user's code in itself, so a trial can take over its signals: one that
ignores SIGTERM (a checkpoint-on-preemption handler) outlived a dsat killed by SIGKILL or by
the kernel's OOM killer, holding its GPU, and so did processes the trial started in its group.
dsat writes ``+PGID`` to this process's stdin when it starts such a group and ``-PGID`` when it
has ended; when the pipe closes (dsat is gone, however it ended) every group still listed gets
SIGTERM, then SIGKILL after a grace period. No signal handler of a trial's can stop that.

It is run as a file and imports nothing from dsat: it starts in milliseconds.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

GRACE_SECONDS = 5.0


def alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def stop(groups: set[int]) -> None:
    """SIGTERM to every group, then SIGKILL to those still there after the grace period."""
    for group in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_SECONDS
    while any(alive(group) for group in groups) and time.monotonic() < deadline:
        time.sleep(0.1)
    for group in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is dsat's to handle, then it closes
    groups: set[int] = set()
    for line in sys.stdin:
        text = line.strip()
        if text[:1] in "+-" and text[1:].isdigit():
            (groups.add if text[0] == "+" else groups.discard)(int(text[1:]))
    stop(groups)


if __name__ == "__main__":
    main()
