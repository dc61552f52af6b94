"""A finished trial's log, cut to its first and last part where it wrote more than a search
should keep: a script that prints every step (or NCCL_DEBUG=INFO on many ranks) otherwise leaves
its size on the disk per trial, for every trial of the search, and twice where a failure in a
trial host runs again fresh. Its start says how it began, its end why it ended: what dsat reads
(the last traceback, torchrun's summary) lies within the end kept."""

from __future__ import annotations

from pathlib import Path

from dsat.atomic_file import write_bytes_atomic

LOG_CAP_BYTES = 64 * 2**20  # a log larger than this is cut
KEEP_HEAD_BYTES = 4 * 2**20
KEEP_TAIL_BYTES = 32 * 2**20  # at least trial_outcome's LOG_SEARCH_BYTES


def cap_log(path: Path) -> int:
    """Cut the log at ``path`` to its first ``KEEP_HEAD_BYTES`` and last ``KEEP_TAIL_BYTES``
    (whole lines), with a line saying so between, where it is over ``LOG_CAP_BYTES``; returns
    the bytes cut (0: it was kept whole). Written atomically: a reader sees the whole log or the
    cut one. A failure to write it (a full disk) leaves the log as it is."""
    try:
        size = path.stat().st_size
        if size <= LOG_CAP_BYTES:
            return 0
        with path.open("rb") as log:
            head = log.read(KEEP_HEAD_BYTES)
            head = head[: head.rfind(b"\n") + 1] or head
            log.seek(size - KEEP_TAIL_BYTES)
            log.readline()  # the rest of a line cut in two
            tail = log.read()
        cut = size - len(head) - len(tail)
        note = (
            f"\ndsat: {cut / 2**20:.0f} MiB of this trial's output cut here: it wrote "
            f"{size / 2**20:.0f} MiB, and dsat keeps a log's first {KEEP_HEAD_BYTES // 2**20} "
            f"MiB and its last {KEEP_TAIL_BYTES // 2**20} MiB\n\n"
        )
        write_bytes_atomic(path, head + note.encode() + tail)
    except OSError:
        return 0
    return cut
