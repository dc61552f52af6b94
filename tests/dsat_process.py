"""Running `python3 -m dsat` as a user does, with real trials on the CPU (end-to-end tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from dsat.experiment.settings import SEARCH_METHODS
from dsat.runners.local.entrypoint import interpreter_first
from tests.conftest import REPO_ROOT


def env(**extra: str) -> dict[str, str]:
    environ = {
        k: v for k, v in os.environ.items() if k not in ("DET_MASTER", "CUDA_VISIBLE_DEVICES")
    }
    environ.update({"PYTHONPATH": str(REPO_ROOT), "DS_ACCELERATOR": "cpu"})
    environ = interpreter_first(environ)
    environ.update(extra)
    return environ


def dsat(
    *args: str, timeout: float = 540, baseline: bool = False, **extra: str
) -> subprocess.CompletedProcess[str]:
    """``python3 -m dsat ARGS``; a new search without the user's-config baseline trial unless
    ``baseline`` (the tests that count a search's trials count those of the search); a resumed
    one keeps its settings."""
    if args and args[0] in SEARCH_METHODS and not baseline and "--resume" not in args:
        args = (*args, "--no-baseline")
    return subprocess.run(
        [sys.executable, "-m", "dsat", *args],
        capture_output=True,
        text=True,
        env=env(**extra),
        timeout=timeout,
    )


def trials(results: Path, confirmations: bool = False) -> list[dict[str, Any]]:
    """The rows of trials.jsonl: the search's own, or with ``confirmations`` only the runs of the
    confirmation round that follows it."""
    rows = [json.loads(line) for line in (results / "trials.jsonl").read_text().splitlines()]
    return [row for row in rows if (row["kind"] == "confirm") == confirmations]
