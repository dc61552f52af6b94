"""The interpreter's process-wide settings a trial changed, put back for the next trial of a host."""

from __future__ import annotations

import io
import logging
import signal
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsat.runners.local.interpreter_settings import InterpreterSettings


@pytest.fixture
def settings() -> Iterator[InterpreterSettings]:
    """The settings as the test found them; put back however it ends."""
    found = InterpreterSettings.capture()
    try:
        yield found
    finally:
        found.restore()


def test_loggers_and_handlers_are_put_back(settings: InterpreterSettings, tmp_path: Path) -> None:
    existing = logging.getLogger("dsat_test.existing")  # made before the capture below
    settings = InterpreterSettings.capture()
    root_handlers = list(logging.root.handlers)
    disabled = logging.root.manager.disable
    # The trial: basicConfig's file, its script's and its module's loggers, a library it imports.
    trial_file = logging.FileHandler(tmp_path / "trial.log")
    logging.root.addHandler(trial_file)
    logging.root.setLevel(logging.DEBUG)
    existing.setLevel(logging.ERROR)
    existing.propagate = False
    logging.getLogger("__main__").addHandler(logging.StreamHandler())
    logging.getLogger("trial_module.part").setLevel(logging.INFO)
    library_handler = logging.StreamHandler()
    logging.getLogger("dsat_test_library").addHandler(library_handler)
    logging.disable(logging.CRITICAL)

    settings.restore(["trial_module"])

    assert logging.root.handlers == root_handlers
    assert trial_file.stream is None  # closed: the trial's file is not kept open
    assert (existing.level, existing.propagate) == (logging.NOTSET, True)
    assert logging.getLogger("__main__").handlers == []
    assert logging.getLogger("trial_module.part").level == logging.NOTSET
    # A library imported by the trial stays imported, and keeps what it set up once.
    assert logging.getLogger("dsat_test_library").handlers == [library_handler]
    assert logging.root.manager.disable == disabled


def test_a_handlers_level_and_format_are_put_back(settings: InterpreterSettings) -> None:
    handler = logging.StreamHandler(io.StringIO())
    kept = logging.getLogger("dsat_test.with_handler")
    kept.addHandler(handler)
    try:
        settings = InterpreterSettings.capture()
        handler.setLevel(logging.ERROR)
        handler.setFormatter(logging.Formatter("%(message)s!"))
        settings.restore()
        assert (handler.level, handler.formatter) == (logging.NOTSET, None)
    finally:
        kept.removeHandler(handler)


def test_warning_filters_streams_and_signal_handlers_are_put_back(
    settings: InterpreterSettings,
) -> None:
    filters = list(warnings.filters)
    stdout, excepthook = sys.stdout, sys.excepthook
    sigterm = signal.getsignal(signal.SIGTERM)
    trial_stdout = io.StringIO()
    warnings.simplefilter("error")
    sys.stdout = trial_stdout
    sys.excepthook = lambda *args: None
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.captureWarnings(True)

    settings.restore()

    assert list(warnings.filters) == filters
    assert sys.stdout is stdout and sys.excepthook is excepthook
    assert signal.getsignal(signal.SIGTERM) is sigterm
    # captureWarnings works again in the next trial (it does nothing while it thinks it is on).
    logging.captureWarnings(True)
    assert warnings.showwarning is not settings.showwarning


def test_recursion_limit_umask_and_socket_timeout_are_put_back(
    settings: InterpreterSettings, tmp_path: Path
) -> None:
    import os
    import socket

    limit, timeout = sys.getrecursionlimit(), socket.getdefaulttimeout()
    sys.setrecursionlimit(limit + 500)
    os.umask(0o077)
    socket.setdefaulttimeout(3.0)

    settings.restore()

    assert sys.getrecursionlimit() == limit and socket.getdefaulttimeout() == timeout
    made = tmp_path / "made"
    made.touch(mode=0o666)
    assert made.stat().st_mode & 0o777 == 0o666 & ~settings.umask
    assert settings.umask != 0o077
