"""How dsat names the files it works with: absolute inside, short on the terminal.

Trials, the full run and a resumed search run in other working directories, so every path dsat
hands on is made absolute once, at the start; what the user reads is shortened to the directory
they started in when it lies below it.
"""

from __future__ import annotations

import os
from pathlib import Path


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
