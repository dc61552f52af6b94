"""Atomic writes for files users keep: a reader sees the old file or the new one, never half."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any


def write_text_atomic(path: str | Path, text: str) -> None:
    write_bytes_atomic(path, text.encode())


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as err:
        _raise_naming(err, path)
        raise
    try:
        os.fchmod(fd, file_mode(path))  # mkstemp makes it 0600: others could not read results
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(err, OSError):
            _raise_naming(err, path)
        raise


def file_mode(path: Path) -> int:
    """The mode the file keeps: the one it has (a chmod the user made), else what the umask
    leaves of rw-rw-rw-, as for any new file."""
    with contextlib.suppress(OSError):
        return stat.S_IMODE(path.stat().st_mode)
    return 0o666 & ~current_umask()


def current_umask() -> int:
    """The process's umask, read without changing it where Linux says it (os.umask sets it:
    briefly wrong for other threads)."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as status:
        for line in status:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _raise_naming(err: OSError, path: Path) -> None:
    """``err`` again, naming the file being written: a full disk fails a write() or fsync(),
    which name no file, and a read-only one fails on the temporary file, which the user never
    sees. An error without an errno is left as it is (returns)."""
    if err.errno is not None:
        raise OSError(err.errno, err.strerror, str(path)) from err


def write_json_atomic(path: str | Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")
