"""The DeepSpeedTrial example. Determined 0.37 runs DeepSpeedTrial only on a cluster with GPUs, so
this tests what runs here: the trial's config merging, its model code under real DeepSpeed on the
CPU with a dsat trial's overrides, and the local runner's refusal of a Trial-class entrypoint."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import dsat
from dsat.errors import DsatError
from dsat.experiment.config import load_experiment, validate_with_deepspeed
from dsat.experiment.settings import SearchSettings
from dsat.runners.determined.configs import custom_experiment_config
from dsat.runners.determined.searcher_adapter import DsatSearcher
from dsat.search import MethodSettings, make_search_method
from dsat.search.trial_builder import SearchSpec
from tests.conftest import REPO_ROOT

EXAMPLE = REPO_ROOT / "examples" / "deepspeed_trial"


def cluster_trial_hparams(stage: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The hyperparameters of the model-profile trial and of a first search trial, exactly as the
    search runner would create them on a cluster."""
    settings = SearchSettings(
        method="binary",
        config_path=str(EXAMPLE / "deepspeed.yaml"),
        model_dir=str(EXAMPLE),
        zero_stages=(stage,),
        baseline=False,  # the first trial after the profile is then a search trial
    )
    experiment = load_experiment(settings.config_path, settings.model_dir)
    config = custom_experiment_config(experiment.config, settings, runner_experiment_id=1)
    spec = SearchSpec(config["hyperparameters"], experiment.ds_config, experiment.slots_per_trial)
    method = DsatSearcher(make_search_method(MethodSettings.from_settings(settings), spec))
    ops = method.initial_operations(None)
    profile = json.loads(ops[0].hparams)
    method.on_validation_completed(
        None,
        ops[0].request_id,
        {
            "num_params": 8_400_000,
            "trainable_num_params": 8_400_000,
            "activation_mem_per_gpu": 2_000_000,
            "gpu_mem": 80 * 2**30,
        },
        1,
    )
    search_ops = method.on_trial_closed(None, ops[0].request_id)
    return profile, json.loads(search_ops[0].hparams)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_trials_deepspeed_config_is_what_deepspeed_accepts(stage: int) -> None:
    profile, search = cluster_trial_hparams(stage)
    assert search["_use_dsat_mode"] is True  # DeepSpeedTrial's autotuning path
    profile_config = dsat.get_ds_config_from_hparams(profile, base_dir=EXAMPLE)
    assert profile_config["train_micro_batch_size_per_gpu"] == 1
    assert profile_config["autotuning"]["model_info"] == {"profile": True}
    config = dsat.get_ds_config_from_hparams(search, base_dir=EXAMPLE)
    assert config["zero_optimization"]["stage"] == stage
    assert config["optimizer"]["type"] == "Adam" and config["fp16"] == {"enabled": True}
    micro = config["train_micro_batch_size_per_gpu"]
    assert micro > 1 and config["train_batch_size"] == micro * 2  # 2 slots per trial
    assert validate_with_deepspeed(config, 2, "trial config")


# Runs in its own process, as a trial does (DeepSpeed initialises torch.distributed for good).
TRAIN_WITH_TRIAL_OVERRIDES = """
import deepspeed, determined as det, torch
import dsat
from model import Regressor, SyntheticRegression, train_step
from model_def import RegressorTrial

assert issubclass(RegressorTrial, det.pytorch.deepspeed.DeepSpeedTrial)
config = dsat.get_ds_config_from_hparams(dsat.get_hparams())
# On the CPU: one process, bf16 for the config's fp16 (which the CPU lacks; half precision
# either way: the batch must be cast as on a GPU), DeepSpeed's Adam through torch (no JIT build).
assert config.pop("fp16") == {"enabled": True}
config.update(
    bf16={"enabled": True},
    optimizer={"type": "Adam", "params": {"lr": 0.001, "torch_adam": True}},
)
model = Regressor(width=32, depth=2)
engine, _, _, _ = deepspeed.initialize(
    model=model, model_parameters=model.parameters(), config=config
)
data = torch.utils.data.DataLoader(SyntheticRegression(256, 32), batch_size=4)
core_context = det.core._dummy_init()
op = next(iter(core_context.searcher.operations()))
with dsat.dsat_reporting_context(core_context, op):
    for batch in data:  # the trial's train_batch, as model_def.py runs it
        train_step(engine, batch)
raise AssertionError("DeepSpeed's autotuning did not end the trial")
"""


@pytest.mark.slow
def test_the_model_code_trains_under_deepspeed_with_a_trials_overrides(tmp_path: Path) -> None:
    _, search = cluster_trial_hparams(2)
    # One process on the CPU, at a micro-batch it runs in seconds: the trial's own batch sizes,
    # which the engine must run as they are (the trial is the script's error otherwise).
    search["overwrite_deepspeed_args"].update(
        train_micro_batch_size_per_gpu=4, train_batch_size=4, gradient_accumulation_steps=1
    )
    shutil.copy(EXAMPLE / "ds_config.json", tmp_path / "ds_config.json")
    (tmp_path / "hparams.json").write_text(json.dumps(search))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(EXAMPLE)]),
        "DS_ACCELERATOR": "cpu",
        "DSAT_HPARAMS_FILE": str(tmp_path / "hparams.json"),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "0",  # one process, as dsat runs it: its store binds a free port
    }
    env.pop("DET_MASTER", None)
    result = subprocess.run(
        [sys.executable, "-c", TRAIN_WITH_TRIAL_OVERRIDES],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((tmp_path / "autotuning_metric.json").read_text())
    assert metrics["throughput"] > 0 and metrics["FLOPS_per_gpu"] > 0
    outcome = json.loads((tmp_path / "dsat_trial_outcome.json").read_text())
    assert outcome["status"] == "completed" and outcome["kind"] == "metrics"
    # dsat timed the DeepSpeedTrial's steps itself; DeepSpeed's figure is kept beside.
    assert outcome["values"]["measured_steps"] > 0
    assert outcome["values"]["deepspeed_throughput"] == metrics["throughput"]


def test_the_local_runner_refuses_a_trial_class_with_the_way_out(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from dsat.cli import main

    code = main(["binary", str(EXAMPLE / "deepspeed.yaml"), str(EXAMPLE), "--runner", "local"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert "runs the Trial class model_def:RegressorTrial" in err[-1]
    assert "--runner determined" in err[-1]


def test_trial_class_message_names_the_class_and_the_runner() -> None:
    from dsat.runners.local.entrypoint import require_command

    with pytest.raises(DsatError) as caught:
        require_command(
            ["python3", "-m", "determined.launch.deepspeed", "--trial", "model_def:RegressorTrial"],
            "deepspeed.yaml",
        )
    assert "Trial class model_def:RegressorTrial" in str(caught.value)
    assert "--runner determined" in str(caught.value)
