"""The one user-facing error type.

Every mistake a user can make (a missing file, a bad flag, an inconsistent config) becomes a
``DsatError``; the CLI prints its message as a single line and exits with status 2. Failures of
trials are data, never a ``DsatError``.
"""

from __future__ import annotations

USAGE_EXIT_CODE = 2


class DsatError(Exception):
    """A user mistake, described in one line that names the file/key/flag and the fix."""

    def __init__(self, message: str) -> None:
        # Collapse newlines so the CLI can always print exactly one line.
        super().__init__(" ".join(message.split()))
