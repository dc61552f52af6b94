"""The HF Trainer example through dsat's local runner: real DeepSpeed and a real HF Trainer on the
CPU, a random-initialised GPT-2 on synthetic tokens, nothing downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, copy_example
from tests.dsat_process import dsat, trials

pytestmark = pytest.mark.slow
EXAMPLE = REPO_ROOT / "examples" / "hf_trainer"


def test_a_local_search_and_full_run_of_the_hf_trainer_example(tmp_path: Path) -> None:
    model_dir = tmp_path / "hf_trainer"
    copy_example(model_dir, EXAMPLE)
    results = tmp_path / "results"
    run = dsat(
        "binary",
        str(model_dir / "deepspeed.yaml"),
        str(model_dir),
        "--zero-stages",
        "2",
        "--max-trials",
        "3",
        "--max-slots",
        "1",
        "--search-range-factor",
        "0.002",
        "--results-dir",
        str(results),
        "--run-full-experiment",
        HF_HUB_OFFLINE="1",
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    rows = trials(results)
    assert [row["status"] for row in rows] == ["completed"] * 3
    assert rows[0]["kind"] == "model_profile"
    assert rows[0]["metrics"]["num_params"] > 100_000  # the GPT-2 really was profiled
    for row in rows[1:]:
        assert row["metrics"]["throughput"] > 0 and row["zero_stage"] == 2
    best = json.loads((results / "best_ds_config.json").read_text())
    assert best["zero_optimization"]["stage"] == 2 and "autotuning" not in best
    # The handed-over config is a leader that ran again in the confirmation round, and dsat
    # measured the HF trials itself (DeepSpeed's figures kept beside its own).
    confirmed = {row["mbs"] for row in trials(results, confirmations=True)}
    assert best["train_micro_batch_size_per_gpu"] in confirmed
    assert all(row["metrics"]["deepspeed_throughput"] > 0 for row in rows[1:])
    assert all(row["metrics"]["measured_steps"] > 0 for row in rows[1:])
    # HF's batch flag followed each trial's micro-batch (the YAML passes 4).
    for row in rows[1:]:
        (log,) = (results / "logs").glob(f"*-{row['request_id'][:8]}.log")
        assert f"HF per-device batch {row['mbs']}, DeepSpeed config ds_config.dsat.json" in (
            log.read_text()
        )
    # The full run trained all 20 HF steps with the best config.
    assert "trained 20 steps" in run.stdout
    assert "autotuning" not in (model_dir / "ds_config.json").read_text()  # user file untouched
