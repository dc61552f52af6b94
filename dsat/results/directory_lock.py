"""One search at a time in a results directory.

Two `--resume DIR` at once both ran every remaining trial, each rewriting the other's files, and
on a GPU they would have competed for the devices and blamed the configurations for the OOMs. An
advisory lock on a file in the directory, held while the search runs, makes the second one line;
the kernel lets go of it when the process ends, however it ends.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from dsat.errors import DsatError
from dsat.paths import shown

LOCK_FILE = ".dsat-search.lock"


class DirectoryInUse(DsatError):
    """Another dsat search holds the results directory."""


def lock_or_refuse(fd: int, mode: int, results_dir: Path, flag: str) -> None:
    """Take the lock file ``fd`` in ``mode`` (flock's), or raise DirectoryInUse naming the
    search that holds it."""
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "another process"
        raise DirectoryInUse(
            f"{flag} {shown(results_dir)} is in use by another dsat search (pid {holder}); "
            "wait for it to end, or choose another directory"
        ) from None


def refuse_if_in_use(results_dir: Path, flag: str) -> None:
    """Raise DirectoryInUse now where a running search holds ``results_dir``: before anything is
    printed or read, and before "continue it with --resume", which that lock then refused."""
    try:
        fd = os.open(results_dir / LOCK_FILE, os.O_RDONLY)
    except OSError:  # no lock file: no search ran there, or it cannot be read (said later)
        return
    try:
        lock_or_refuse(fd, fcntl.LOCK_SH, results_dir, flag)
    finally:
        os.close(fd)  # lets go of the shared lock


@contextlib.contextmanager
def results_directory_lock(results_dir: Path, flag: str = "--results-dir") -> Iterator[None]:
    """Hold the directory's lock, or raise DsatError naming the process that holds it."""
    created = not results_dir.exists()
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        lock_or_refuse(fd, fcntl.LOCK_EX, results_dir, flag)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        if created and [p.name for p in results_dir.iterdir()] == [LOCK_FILE]:
            # Nothing began there (a cluster that could not be reached): leave no empty folder.
            with contextlib.suppress(OSError):
                path.unlink()
                results_dir.rmdir()
        os.close(fd)  # releases the lock
