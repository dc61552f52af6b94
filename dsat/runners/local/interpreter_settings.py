"""The interpreter's own process-wide settings a trial may change, put back once it ends: logging's
loggers and handlers, the warning filters, the Python signal handlers and the standard streams.

A trial host runs each trial as the script run anew (``process_reset``), and these outlive a
trial unless put back. A script that adds a handler to its logger at import would print each line
once more in every later trial of the host; ``logging.basicConfig`` would do nothing after the
first trial, whose handler (a file in that trial's directory, perhaps) would keep the root's
records; ``warnings.simplefilter("error")`` would fail later trials on warnings they never made an
error of; a SIGTERM handler a trial installed would run when dsat stops a later one; and a
recursion limit, umask or default socket timeout a trial set would be the next one's. A warning
shown once in an earlier trial is shown again in the next, as in a new interpreter.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import socket
import sys
import warnings
from collections.abc import Callable, Iterable
from typing import Any, cast

ROOT = ""  # the root logger's name here
STREAMS = ("stdin", "stdout", "stderr", "excepthook")


@dataclasses.dataclass(frozen=True)
class LoggerSettings:
    level: int
    handlers: tuple[logging.Handler, ...]
    propagate: bool
    disabled: bool
    filters: tuple[Any, ...]

    @classmethod
    def of(cls, logger: logging.Logger) -> LoggerSettings:
        return cls(
            logger.level,
            tuple(logger.handlers),
            logger.propagate,
            logger.disabled,
            tuple(logger.filters),
        )

    def apply(self, logger: logging.Logger) -> None:
        logger.level = self.level
        logger.handlers[:] = self.handlers
        logger.propagate = self.propagate
        logger.disabled = self.disabled
        logger.filters[:] = self.filters


# A logger as ``logging.getLogger`` makes it: what a trial's own logger is put back to.
NEW_LOGGER = LoggerSettings(logging.NOTSET, (), True, False, ())


@dataclasses.dataclass(frozen=True)
class HandlerSettings:
    level: int
    formatter: logging.Formatter | None
    filters: tuple[Any, ...]


@dataclasses.dataclass
class InterpreterSettings:
    """The settings as each trial must find them, taken with the host's baseline."""

    loggers: dict[str, LoggerSettings]
    handlers: dict[logging.Handler, HandlerSettings]
    logging_disabled: int
    warning_filters: list[Any]
    showwarning: Any
    # logging.captureWarnings(True) keeps the showwarning it replaced here, and does nothing
    # while it is set: a later trial's call would not capture.
    logging_showwarning: Any
    signal_handlers: dict[int, Any]
    streams: dict[str, Any]
    # What a script may set for its process beside: a later trial's files would be made with an
    # earlier one's umask, its sockets time out with its default timeout.
    recursion_limit: int
    umask: int
    socket_timeout: float | None

    @classmethod
    def capture(cls) -> InterpreterSettings:
        loggers = {name: LoggerSettings.of(logger) for name, logger in _loggers().items()}
        handlers = {
            handler: HandlerSettings(handler.level, handler.formatter, tuple(handler.filters))
            for settings in loggers.values()
            for handler in settings.handlers
        }
        return cls(
            loggers,
            handlers,
            logging.root.manager.disable,
            list(warnings.filters),
            warnings.showwarning,
            getattr(logging, "_warnings_showwarning", None),
            _signal_handlers(),
            {name: getattr(sys, name) for name in STREAMS},
            sys.getrecursionlimit(),
            _umask(),
            socket.getdefaulttimeout(),
        )

    def restore(self, trial_modules: Iterable[str] = ()) -> None:
        """Put the settings back. ``trial_modules``: the trial's own modules (the script is
        ``__main__``), whose loggers, made by the trial, are put back as new ones; the next
        trial imports the modules anew and sets their loggers up again. Other loggers made
        during the trial belong to libraries it imported, which stay imported: they keep what
        the library set up once."""
        self._restore_streams()
        owned = _owned_by({"__main__", *trial_modules})
        self._restore_logging(owned)
        warnings.resetwarnings()  # also forgets which warnings were shown once
        cast(list[Any], warnings.filters)[:] = self.warning_filters  # the list the C side reads
        warnings.showwarning = self.showwarning
        if hasattr(logging, "_warnings_showwarning"):
            logging._warnings_showwarning = self.logging_showwarning  # type: ignore[attr-defined]
        sys.setrecursionlimit(self.recursion_limit)
        os.umask(self.umask)
        socket.setdefaulttimeout(self.socket_timeout)
        for number, handler in self.signal_handlers.items():
            if signal.getsignal(number) is not handler:
                with contextlib.suppress(OSError, ValueError, TypeError):
                    signal.signal(number, handler)

    def _restore_streams(self) -> None:
        for name, saved in self.streams.items():
            current = getattr(sys, name)
            if current is saved:
                continue
            with contextlib.suppress(Exception):  # a stream of the trial's: its last lines
                current.flush()
            setattr(sys, name, saved)

    def _restore_logging(self, owned: Callable[[str], bool]) -> None:
        removed: list[logging.Handler] = []
        for name, logger in _loggers().items():
            saved = self.loggers.get(name)
            if saved is None and not owned(name):
                continue
            settings = saved or NEW_LOGGER
            removed.extend(h for h in logger.handlers if h not in settings.handlers)
            settings.apply(logger)
        for handler, kept in self.handlers.items():
            handler.level = kept.level
            handler.formatter = kept.formatter
            handler.filters[:] = kept.filters
        still_used = {h for logger in _loggers().values() for h in logger.handlers}
        for handler in removed:
            if handler not in still_used:
                with contextlib.suppress(Exception):  # a file handler's file, say
                    handler.close()
        logging.disable(self.logging_disabled)  # and forget the levels loggers cached


def _loggers() -> dict[str, logging.Logger]:
    """Every logger by name (the root as ``ROOT``), placeholders left out."""
    found: dict[str, logging.Logger] = {ROOT: logging.root}
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if isinstance(logger, logging.Logger):
            found[name] = logger
    return found


def _owned_by(modules: set[str]) -> Callable[[str], bool]:
    def owned(name: str) -> bool:
        return any(name == m or name.startswith(m + ".") for m in modules)

    return owned


def _umask() -> int:
    """The process's umask (only setting it tells what it was)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _signal_handlers() -> dict[int, Any]:
    """The handler of every signal Python can set one for (None, one set outside Python, left
    out: it cannot be put back from here)."""
    found: dict[int, Any] = {}
    for number in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError):
            handler = signal.getsignal(number)
            if handler is not None:
                found[int(number)] = handler
    return found
