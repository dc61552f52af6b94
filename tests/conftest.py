"""Shared fixtures: a small valid experiment on disk and a way to run the real CLI."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from dsat.runners.local.entrypoint import interpreter_first
from dsat.training.step_clock import MEASURED_STEPS, MIN_MEASURED_STEPS, stop_clock

REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_DIR = REPO_ROOT / "examples" / "core_api_mlp"

os.environ.setdefault("DS_ACCELERATOR", "cpu")
# Every process the tests start finds this venv's tools first, as dsat's trials do: one ninja
# builds DeepSpeed's ops, so they are built once, not again each time two ninjas alternate.
os.environ["PATH"] = interpreter_first(os.environ)["PATH"]
# The searches the tests start claim slots among themselves (inherited by every subprocess), not
# against searches running on the machine, nor against another test session's or pytest worker's.
os.environ["DSAT_LOCK_DIR"] = tempfile.mkdtemp(prefix="dsat-test-locks-")
atexit.register(shutil.rmtree, os.environ["DSAT_LOCK_DIR"], ignore_errors=True)
# The searches the tests stop with SIGINT start as a terminal's foreground job does, with SIGINT
# at its default, also where the suite itself runs in the background (`make test &`): such a job
# ignores SIGINT, its children inherit that, and dsat keeps an ignored signal ignored (as nohup
# asks). A Python handler, unlike an ignored signal, is reset to the default by exec.
signal.signal(signal.SIGINT, signal.default_int_handler)


def copy_example(target: Path, source: Path = EXAMPLE_DIR) -> Path:
    """A copy of an example as a user has it: without the results of searches run in it."""
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "dsat-results"))
    return target


@pytest.fixture(autouse=True)
def no_trial_clock_between_tests() -> Iterator[None]:
    """A test that builds a trial's config starts dsat's step clock in this process; the next
    test starts without it, as a new trial process would."""
    yield
    stop_clock()


def measured_a_window(metrics: dict[str, Any]) -> bool:
    """Whether a trial's metrics come from a window of the length dsat's rule allows: more
    than MIN_MEASURED_STEPS (closed early, its mean known) up to MEASURED_STEPS, with the
    standard error it reached."""
    steps = metrics.get("measured_steps", 0)
    return MIN_MEASURED_STEPS < steps <= MEASURED_STEPS and metrics["step_time_stderr"] >= 0


def gpu_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if gpu_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; the CPU suite covers the logic")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def write_experiment(
    directory: Path,
    *,
    config: dict[str, Any] | None = None,
    ds_config: dict[str, Any] | None = None,
) -> Path:
    """A model dir with deepspeed.yaml + ds_config.json; returns the YAML's path."""
    directory.mkdir(parents=True, exist_ok=True)
    experiment = {
        "name": "tiny",
        "entrypoint": "python3 train.py",
        "hyperparameters": {"deepspeed_config": "ds_config.json"},
        "resources": {"slots_per_trial": 1},
    }
    experiment.update(config or {})
    ds = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}}
    if ds_config is not None:
        ds = ds_config
    (directory / "ds_config.json").write_text(json.dumps(ds))
    (directory / "train.py").write_text("print('training')\n")
    path = directory / "deepspeed.yaml"
    path.write_text(yaml.safe_dump(experiment))
    return path


@pytest.fixture
def experiment_yaml(tmp_path: Path) -> Path:
    return write_experiment(tmp_path / "model")


def run_cli(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """`python3 -m dsat ...` as a user runs it."""
    full_env = {k: v for k, v in os.environ.items() if k not in ("DET_MASTER", "RAY_ADDRESS")}
    full_env["PYTHONPATH"] = str(REPO_ROOT)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "dsat", *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=cwd,
        timeout=120,
    )
