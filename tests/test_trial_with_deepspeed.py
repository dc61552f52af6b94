"""The trial side end to end: the Core API example trains with real DeepSpeed on the CPU, DeepSpeed's
autotuning hook ends it, and dsat_reporting_context reports what DeepSpeed measured."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dsat.constants import ENV_HPARAMS_FILE, OVERWRITE_KEY, TRIAL_OUTCOME_FILE
from dsat.memory import ModelProfile
from dsat.runners.local.entrypoint import DETERMINED_PORT_VARIABLES, interpreter_first
from dsat.search import MethodSettings, make_search_method
from dsat.search.fit_ladder import offload_choices, offload_level
from dsat.search.trial_builder import SearchSpec
from dsat.trial import TrialKind
from dsat.zero_space import random_zero_config
from tests.conftest import EXAMPLE_DIR, REPO_ROOT, copy_example, measured_a_window

pytestmark = pytest.mark.slow

WIDTH, DEPTH = 32, 2
TINY_MLP_PARAMS = DEPTH * (WIDTH * WIDTH + WIDTH) + WIDTH + 1


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_example_trial(
    directory: Path,
    overwrites: dict[str, Any],
    nproc: int = 1,
    script_edit: tuple[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run the Core API example's trial with dsat's ``overwrites``; ``script_edit`` replaces one
    piece of its train.py first."""
    copy_example(directory)
    if script_edit is not None:
        script = directory / "train.py"
        old, new = script_edit
        assert old in script.read_text()
        script.write_text(script.read_text().replace(old, new))
    hparams = {
        "deepspeed_config": "ds_config.json",
        "width": WIDTH,
        "depth": DEPTH,
        "steps": 30,
        "overwrite_deepspeed_args": overwrites,
    }
    (directory / "hparams.json").write_text(json.dumps(hparams))
    env = interpreter_first(os.environ)
    env.update(
        {
            ENV_HPARAMS_FILE: str(directory / "hparams.json"),
            "DS_ACCELERATOR": "cpu",
            "PYTHONPATH": str(REPO_ROOT),
            "OMP_NUM_THREADS": "1",
        }
    )
    if nproc == 1:
        env.update(
            {
                "RANK": "0",
                "LOCAL_RANK": "0",
                "WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "0",  # as dsat runs one process: its store binds a free port
            }
        )
        command = [sys.executable, "train.py"]
    else:
        # Determined's DistributedContext listens on two fixed ports unless told otherwise, as
        # dsat's runner tells each trial (rendezvous_environment): another test's trial, or
        # anything else on the machine, may hold them.
        env.update({name: str(_free_port()) for name in DETERMINED_PORT_VARIABLES})
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(nproc),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(_free_port()),
            "train.py",
        ]
    return subprocess.run(
        command, cwd=directory, env=env, capture_output=True, text=True, timeout=300
    )


def _outcome(directory: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((directory / TRIAL_OUTCOME_FILE).read_text())
    return data


def dsat_overrides(
    kind: TrialKind, slots: int, stage: int | None = None, mbs: int = 1
) -> dict[str, Any]:
    """The overrides dsat's search gives such a trial: batch triple, ZeRO knobs, autotuning block."""
    ds_config = json.loads((EXAMPLE_DIR / "ds_config.json").read_text())
    search = make_search_method(
        MethodSettings(
            method="binary",
            random_seed=stage or 0,
            start_profile_step=2,
            end_profile_step=4,
        ),
        SearchSpec({"deepspeed_config": "ds_config.json"}, ds_config, slots),
    )
    zero = None if stage is None else random_zero_config(stage, np.random.default_rng(stage))
    overrides: dict[str, Any] = search.make_trial(kind, zero, mbs).hparams[OVERWRITE_KEY]
    return overrides


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_search_trial_at_every_zero_stage(tmp_path: Path, stage: int) -> None:
    result = run_example_trial(
        tmp_path / "trial", dsat_overrides(TrialKind.SEARCH, 1, stage, mbs=4)
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    outcome = _outcome(tmp_path / "trial")
    assert outcome["status"] == "completed" and outcome["kind"] == "metrics"
    values = outcome["values"]
    assert values["throughput"] > 0 and values["FLOPS_per_gpu"] > 0 and values["latency"] > 0
    assert {"fwd", "bwd", "step"} <= set(values)
    # dsat's own wall-clock measurement over its window, DeepSpeed's figures kept beside it.
    assert measured_a_window(values)
    assert values["throughput"] == pytest.approx(4 * 1000.0 / values["latency"])
    assert values["deepspeed_throughput"] > 0 and values["deepspeed_latency"] > 0
    flops_per_step = values["deepspeed_FLOPS_per_gpu"] * values["deepspeed_latency"] / 1e6
    assert values["FLOPS_per_gpu"] == pytest.approx(flops_per_step * 1000.0 / values["latency"])
    assert 0 <= values["step_time_spread"] < 5
    assert 0 < values["memory_peak_bytes"] < values["memory_total_bytes"]
    assert "full_batch_share" not in values  # every step was fed a full batch


def test_a_trial_fed_short_batches_counts_the_samples_it_ran(tmp_path: Path) -> None:
    """As a data loader that keeps an epoch's last batch does with too few samples: every third
    step's batch holds one sample."""
    short = (
        "engine.train_micro_batch_size_per_gpu(), width, generator",
        "engine.train_micro_batch_size_per_gpu() if engine.global_steps % 3 else 1, width, "
        "generator",
    )
    result = run_example_trial(
        tmp_path / "trial", dsat_overrides(TrialKind.SEARCH, 1, 1, mbs=8), script_edit=short
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    values = _outcome(tmp_path / "trial")["values"]
    assert measured_a_window(values)
    first = values["warmup_steps"]
    window = range(first, first + values["measured_steps"])  # steps done before each forward
    share = sum(8 if done % 3 else 1 for done in window) / (8 * len(window))
    assert values["full_batch_share"] == pytest.approx(share)
    assert values["throughput"] == pytest.approx(8 * share * 1000.0 / values["latency"])


def test_model_profile_trial(tmp_path: Path) -> None:
    result = run_example_trial(tmp_path / "trial", dsat_overrides(TrialKind.MODEL_PROFILE, 1))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    outcome = _outcome(tmp_path / "trial")
    assert outcome["kind"] == "model_info"
    assert outcome["values"]["num_params"] == TINY_MLP_PARAMS
    assert outcome["values"]["trainable_num_params"] == TINY_MLP_PARAMS
    assert outcome["values"]["gpu_mem"] > 0
    # The memory model takes this profile as it comes.
    assert ModelProfile.from_metrics(outcome["values"]).num_params == TINY_MLP_PARAMS


def test_two_process_trial(tmp_path: Path) -> None:
    overrides = dsat_overrides(TrialKind.SEARCH, 2, stage=3, mbs=2)
    assert overrides["train_batch_size"] == 4  # 2 per rank x 2 ranks
    result = run_example_trial(tmp_path / "trial", overrides, nproc=2)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    outcome = _outcome(tmp_path / "trial")
    assert outcome["kind"] == "metrics" and outcome["values"]["throughput"] > 0
    assert outcome["values"]["rank"] == 0
    assert measured_a_window(outcome["values"])
    # Both ranks' samples count: the global batch over the measured time per iteration.
    assert outcome["values"]["throughput"] == pytest.approx(
        4 * 1000.0 / outcome["values"]["latency"]
    )


@pytest.mark.parametrize("kind", [TrialKind.MODEL_PROFILE, TrialKind.SEARCH])
def test_a_config_asked_for_and_not_used_is_said_so(tmp_path: Path, kind: TrialKind) -> None:
    """The script asked for the trial's config and built its engine from its own JSON (an HF
    script that parsed sys.argv, not what dsat returned): it was told "train inside
    dsat.dsat_reporting_context", which it did. The engine's steps show it had no autotuning
    block."""
    own = ("config=ds_config\n", 'config=__import__("json").load(open("ds_config.json"))\n')
    result = run_example_trial(tmp_path / "trial", dsat_overrides(kind, 1, 1), script_edit=own)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert _outcome(tmp_path / "trial") == {
        "status": "config_not_taken",
        "taken": True,
        "hf": False,
    }


def test_full_run_without_autotuning_trains(tmp_path: Path) -> None:
    """Without an autotuning block the loop runs to the end and reports a loss, not a profile."""
    batch = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "train_batch_size": 4,
    }
    result = run_example_trial(tmp_path / "trial", batch)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert not (tmp_path / "trial" / TRIAL_OUTCOME_FILE).exists()


@pytest.mark.parametrize("level", [1, 2])
def test_the_fit_ladders_offload_runs_with_deepspeed_on_the_cpu(tmp_path: Path, level: int) -> None:
    """A search trial with what the offload rungs set (the optimizer's states, then the
    parameters too, on the CPU) trains and reports like any other."""
    offload = next(c for c in offload_choices(3, level) if offload_level(c) == level)
    overrides = dsat_overrides(TrialKind.SEARCH, 1, stage=3, mbs=4)
    overrides["zero_optimization"] = {**overrides["zero_optimization"], **offload}
    result = run_example_trial(tmp_path / "trial", overrides)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    outcome = _outcome(tmp_path / "trial")
    assert outcome["status"] == "completed" and outcome["values"]["throughput"] > 0
    assert measured_a_window(outcome["values"])
