"""Whether a search can keep its results: checked before the first trial, and recognised when a
write fails during the search (a full disk, a quota, a file system gone read-only), so that both
end in one line, never in a traceback.

Before the search, the results directory must take a file and have room for what the search
writes at least: ``RESULTS_FLOOR_BYTES`` for logs and results files, plus what the runner copies
there per trial (the local runner: the model dir, for the model-profile trial and the next). That
is a floor, not a forecast: a search that outgrows its disk stops cleanly when it does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from dsat.errors import DsatError
from dsat.paths import shown

# Room for what every search writes besides copies of the model dir: a log per trial (KBs to a
# few MB), trials.jsonl, the state, the report (about 1 MB).
RESULTS_FLOOR_BYTES = 64 * 2**20
# The local runner copies the model dir per trial: room for the model-profile trial's copy and
# the next one's.
COPIES_AT_START = 2
# A full disk or a quota: freeing space is the fix.
SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
# Failures of the disk itself, whichever file was being written.
DISK_ERRNOS = SPACE_ERRNOS | {errno.EROFS, errno.EIO, errno.EFBIG}
PROBE_PREFIX = ".dsat-write-probe-"
_STRERROR = re.compile(r"\[Errno (\d+)\] ([^:]+)")

Ignore = Callable[[str, list[str]], Iterable[str]]


# Limits of this process rather than of the disk: the fix is the shell's limit, not the disk.
LIMIT_REMEDIES = {
    errno.EFBIG: "raise the file-size limit (`ulimit -f unlimited`)",
    errno.EMFILE: "raise the open-files limit (`ulimit -n`, e.g. 65536)",
    errno.ENFILE: "close other programs' files (the system's open-files table is full)",
}


@dataclasses.dataclass(frozen=True)
class WriteFailure:
    """A file of the results that could not be written, and the OS's reason."""

    path: Path
    reason: str
    number: int | None = None  # the OS's errno, where known

    @property
    def space(self) -> bool:
        """A full disk or a quota."""
        return self.number in SPACE_ERRNOS

    def remedy(self) -> str:
        if self.space:
            return "free some space there"
        return LIMIT_REMEDIES.get(self.number or 0, "make it writable")


def _mib(size: int) -> str:
    return f"{size / 2**20:.0f} MiB"


def _inside(path: str | os.PathLike[str], directory: Path) -> bool:
    full, root = os.path.abspath(path), os.path.abspath(directory)
    return full == root or full.startswith(os.path.join(root, ""))


def write_failure(err: BaseException, results_dir: Path) -> WriteFailure | None:
    """``err`` as a failure to write the results, or None when it is something else (which keeps
    its traceback): an OSError about a path in ``results_dir``, a ``shutil.copytree`` that
    failed there (a trial's copy of the model dir), or a full, read-only or failing disk."""
    if isinstance(err, shutil.Error) and err.args and isinstance(err.args[0], list):
        for entry in err.args[0]:  # copytree's (source, destination, message) per file
            if len(entry) == 3 and _inside(str(entry[1]), results_dir):
                found = _STRERROR.search(str(entry[2]))
                reason = found.group(2) if found else str(entry[2])
                number = int(found.group(1)) if found else None
                return WriteFailure(Path(entry[1]), reason, number)
        return None
    if not isinstance(err, OSError):
        return None
    named = isinstance(err.filename, (str, os.PathLike)) and _inside(err.filename, results_dir)
    if not named and err.errno not in DISK_ERRNOS | LIMIT_REMEDIES.keys():
        return None
    reason = err.strerror or str(err)
    path = Path(err.filename) if named else results_dir
    return WriteFailure(path, reason, err.errno)


def files_bytes(files: Iterable[Path]) -> int:
    """The bytes of ``files`` (``tree_files``': symlinked folders are not followed there, so
    this errs low)."""
    total = 0
    for path in files:
        with contextlib.suppress(OSError):
            total += path.stat().st_size
    return total


def tree_files(roots: Iterable[Path], ignore: Ignore) -> Iterator[Path]:
    """The files ``shutil.copytree(root, ..., ignore=ignore)`` copies, for each of ``roots`` (a
    file is its own)."""
    for root in roots:
        if root.is_file():
            yield root
            continue
        for directory, folders, files in os.walk(root):
            ignored = set(ignore(directory, folders + files))
            folders[:] = [name for name in folders if name not in ignored]
            yield from (Path(directory, name) for name in files if name not in ignored)


def _missing_parents(directory: Path) -> list[Path]:
    """``directory`` and each parent that does not exist yet, deepest first."""
    missing: list[Path] = []
    for path in (directory, *directory.parents):
        if path.exists():
            break
        missing.append(path)
    return missing


def _probe(directory: Path) -> int:
    """Create ``directory``, write a file there and remove it; returns the bytes free there."""
    directory.mkdir(parents=True, exist_ok=True)
    fd, probe = tempfile.mkstemp(dir=directory, prefix=PROBE_PREFIX)
    try:
        os.write(fd, b"dsat")
        os.fsync(fd)
    finally:
        os.close(fd)
        os.unlink(probe)
    return shutil.disk_usage(directory).free


def check_results_dir(results_dir: Path, named_by: str, needed_bytes: int) -> None:
    """One line (a ``DsatError``) unless a search can write ``results_dir`` and has
    ``needed_bytes`` free there. ``named_by``: the flag that chose it (``--results-dir``,
    ``--resume``), or "" for the default. Leaves no trace: what it creates, it removes."""
    where = f"{named_by} {shown(results_dir)}" if named_by else shown(results_dir)
    if results_dir.exists() and not results_dir.is_dir():
        raise DsatError(f"{where} is a file, not a directory; {_launch_fix(named_by, None)}")
    created = _missing_parents(results_dir)
    try:
        free = _probe(results_dir)
    except OSError as err:
        raise DsatError(
            f"{where}: cannot write the results there ({err.strerror or err}); "
            f"{_launch_fix(named_by, err.errno)}"
        ) from None
    finally:
        for path in created:
            with contextlib.suppress(OSError):
                path.rmdir()
    if free < needed_bytes:
        raise DsatError(
            f"{where}: only {_mib(free)} free there, and a search needs at least "
            f"{_mib(needed_bytes)} (logs, results, a copy of the model dir per trial); "
            f"{_launch_fix(named_by, errno.ENOSPC)}"
        )


def _launch_fix(named_by: str, number: int | None) -> str:
    """The fix for a results directory that failed its check with the OS's error ``number``: a
    limit of this process (``ulimit -n``, ``-f``) is not fixed by another directory."""
    if number in LIMIT_REMEDIES:
        return f"{LIMIT_REMEDIES[number]}, then run the same command again"
    space = number in SPACE_ERRNOS
    if named_by == "--resume":
        remedy = "free some space there" if space else "make it writable"
        return f"{remedy}, then run the same command again"
    if space:
        return "free some space there or choose another directory with --results-dir"
    if named_by:
        return "choose a writable directory with --results-dir"
    return "run dsat from a writable directory or choose one with --results-dir"
