"""What a finished trial's copy of MODEL_DIR keeps: what it wrote, not the user's large files.

Every trial runs in a copy of MODEL_DIR (and each ``--include``), so a 300 MB data file there
cost 300 MB per trial, about 20 GB for a search at the defaults, in a directory kept after the
search. Once a trial has ended, a large file it left as it was copied is removed from its copy
(the original is still where it was); what the trial wrote or changed is kept.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from dsat.runners.local.entrypoint import LAUNCHER_LOGS

# Files of the copy from this size up are dropped when unchanged; smaller ones cost little and
# keep the copy readable (the script, its config).
LARGE_FILE_BYTES = 2**20


def drop_unchanged_copies(directory: Path, model_dir: Path, includes: tuple[Path, ...]) -> int:
    """Remove from the trial's ``directory`` the large files still as they were copied from
    ``model_dir`` or an include (same size and modification time: the copy keeps the original's);
    returns the bytes freed."""
    freed = 0
    for root, _, names in os.walk(directory):
        for name in names:
            copy = Path(root, name)
            relative = copy.relative_to(directory)
            with contextlib.suppress(OSError):
                kept = copy.lstat()
                if copy.is_symlink() or kept.st_size < LARGE_FILE_BYTES:
                    continue
                if any(
                    same_file(kept, source) for source in sources(relative, model_dir, includes)
                ):
                    copy.unlink()
                    freed += kept.st_size
    return freed


def sources(relative: Path, model_dir: Path, includes: tuple[Path, ...]) -> list[Path]:
    """Where a file at ``relative`` in a trial's copy may have been copied from."""
    found = [model_dir / relative]
    for include in includes:
        if relative.parts[0] == include.name:
            found.append(include.parent / relative)
    return found


def same_file(copy: os.stat_result, source: Path) -> bool:
    with contextlib.suppress(OSError):
        original = source.stat()
        return copy.st_size == original.st_size and copy.st_mtime_ns == original.st_mtime_ns
    return False


def drop_empty_launcher_logs(directory: Path) -> None:
    """torchrun's folders in the trial's ``directory``, where they hold no file (its error
    files, which a failing rank may write, stay)."""
    logs = directory / LAUNCHER_LOGS
    if logs.is_dir() and not any(p.is_file() for p in logs.rglob("*")):
        shutil.rmtree(logs, ignore_errors=True)
