"""The last lines a user reads: how to train with what was handed over, as their script takes it."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsat.runners.simulated.runner import SimulatedRunner
from dsat.search.trial_builder import SearchSpec
from dsat.search_launch import closing_lines
from dsat.search_run import run_search
from tests.search.helpers import cliff_function, search_settings

USER = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 1}}


@pytest.mark.parametrize(
    ("entrypoint", "how"),
    [
        ("python3 train.py", "pass it as your DeepSpeed config (deepspeed.initialize(..., config="),
        (
            "python3 train.py --deepspeed ds.json --per_device_train_batch_size 4",
            "train with --deepspeed {path} --per_device_train_batch_size {mbs} "
            "--gradient_accumulation_steps {gas} (HF refuses flags that differ from it)",
        ),
        # DeepSpeed's own launcher arguments: a bare --deepspeed switch, the JSON elsewhere.
        (
            "deepspeed train.py --deepspeed --deepspeed_config ds.json",
            "pass it as your DeepSpeed config (deepspeed.initialize(..., config=",
        ),
    ],
)
def test_the_next_step_is_said_as_the_users_script_takes_a_config(
    tmp_path: Path, entrypoint: str, how: str
) -> None:
    """An HF Trainer checks --per_device_train_batch_size and --gradient_accumulation_steps
    against the JSON and refuses a mismatch: passing the file alone, with the flags the user ran
    with, fails."""
    spec = SearchSpec({"deepspeed_config": "ds.json"}, USER, 1, entrypoint)
    settings = search_settings("guided", max_trials=8, zero_stages=(1,))
    method = run_search(settings, spec, SimulatedRunner(cliff_function(24), 1), tmp_path)
    best = method.tracker.best()
    assert best is not None
    path = tmp_path / "best_ds_config.json"
    expected = how.format(path=path, mbs=best.mbs, gas=best.gas)
    next_line = closing_lines(method, tmp_path, full_run=False)[2]
    assert next_line.startswith(f"dsat: next: {expected}"), next_line
    assert next_line.endswith("--run-full-experiment")
    assert (
        closing_lines(method, tmp_path, full_run=False, trains=False)[2]
        == (next_line.split(", or have dsat train with it")[0])
    )
