"""How dsat names the files it works with: absolute inside, short on the terminal.

Trials, the full run and a resumed search run in other working directories, so every path dsat
hands on is made absolute once, at the start; what the user reads is shortened to the directory
they started in when it lies below it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def absolute(path: str | Path) -> str:
    """``path`` against the current directory, normalised (symlinks kept as the user named them)."""
    return os.path.abspath(os.fspath(path))


def shown(path: str | Path) -> str:
    """``path`` as the user reads it: relative to the current directory when below it."""
    full = absolute(path)
    here = os.getcwd()
    try:
        relative = os.path.relpath(full, here)
    except ValueError:  # another drive (Windows)
        return full
    if relative == os.curdir:
        return relative
    return full if relative.startswith(os.pardir) else relative


def logs_where_they_are(value: Any, results_dir: Path) -> Any:
    """``value`` (a saved state, a row) with every trial's ``log`` named where it is now: a
    results directory moved since its search ran (renamed, copied off a cluster) names its logs
    where they were, and a resume would point the user at files that are gone."""
    if isinstance(value, list):
        return [logs_where_they_are(item, results_dir) for item in value]
    if not isinstance(value, dict):
        return value
    moved = {key: logs_where_they_are(item, results_dir) for key, item in value.items()}
    log = moved.get("log")
    if isinstance(log, str) and log:
        was = Path(log)
        here = results_dir / "logs" / was.name
        if was.parent.name == "logs" and not was.exists() and here.exists():
            moved["log"] = str(here)
    return moved
