"""Load a function named as ``MODULE_OR_FILE:FUNCTION`` (as ``--simulator`` takes it)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from dsat.errors import DsatError
from dsat.paths import absolute


def _import_file(path: Path, flag: str, spec: str) -> ModuleType:
    if not path.is_file():
        raise DsatError(f"{flag} {spec}: file {path} not found")
    module_name = f"dsat_user_{path.stem}_{abs(hash(str(path.resolve())))}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise DsatError(f"{flag} {spec}: {path} is not a Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def names_a_file(target: str) -> bool:
    """Whether ``MODULE_OR_FILE`` is a file's path (else a module's dotted name)."""
    return target.endswith(".py") or "/" in target


def with_absolute_file(spec: str) -> str:
    """``spec`` with a file's path made absolute against the working directory (a module's name
    as it is): a search started with ``intr.py:perf`` could not be resumed from elsewhere."""
    target, sep, function_name = spec.rpartition(":")
    if not sep or not target or not names_a_file(target):
        return spec
    return f"{absolute(target)}:{function_name}"


def load_callable(spec: str, flag: str = "--simulator") -> Callable[..., Any]:
    """The function ``spec`` names; any failure is a one-line ``DsatError`` naming ``flag``."""
    target, sep, function_name = spec.rpartition(":")
    if not sep or not target or not function_name:
        raise DsatError(
            f"{flag} {spec}: expected MODULE_OR_FILE:FUNCTION, e.g. my_model.py:simulate"
        )
    try:
        if names_a_file(target):
            module = _import_file(Path(target), flag, spec)
        else:
            module = importlib.import_module(target)
    except DsatError:
        raise
    except Exception as err:  # the user's module may fail in any way while it is imported
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise DsatError(
            f"{flag} {spec}: cannot import {target} ({type(err).__name__}: {first_line})"
        ) from None
    function = getattr(module, function_name, None)
    if function is None:
        raise DsatError(f"{flag} {spec}: {target} has no attribute {function_name}")
    if not callable(function):
        raise DsatError(f"{flag} {spec}: {target}.{function_name} is not callable")
    return function  # type: ignore[no-any-return]
