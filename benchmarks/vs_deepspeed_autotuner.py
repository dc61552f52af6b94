"""dsat's local runner vs DeepSpeed's own autotuner, on the CPU example, side by side in one run.

DeepSpeed's autotuner runs as its tutorial says (`deepspeed --autotuning tune train.py
--deepspeed_config ds_config.json`, fast mode, all ZeRO stages, metric throughput), on the same
model written the way it expects (benchmarks/deepspeed_autotuner/train.py); dsat runs `asha` on
examples/core_api_mlp with the same metric, all ZeRO stages, the same profile steps and as many
trials as DeepSpeed launched. Each tool's own best-throughput claim comes from a different search
on a noisy machine, so both best configs are then measured again by one script, alternating, and
that ratio decides "at least as fast".

What makes DeepSpeed's autotuner run on one CPU machine: no hostfile (it then uses local
resources), the venv's bin first on PATH (its scheduler calls a bare `deepspeed`),
DS_ACCELERATOR=cpu, LOCAL_SIZE = ranks per trial. `pdsh` is missing here, so it prints a harmless
traceback after each experiment.

    python3 benchmarks/vs_deepspeed_autotuner.py [--max-slots 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from dsat.atomic_file import write_json_atomic
from dsat.runners.local.runner import COPY_IGNORE

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "core_api_mlp"
DS_SCRIPT = Path(__file__).resolve().parent / "deepspeed_autotuner" / "train.py"
RESULTS = Path(__file__).resolve().parent / "results" / "vs_deepspeed_autotuner.json"
VENV_BIN = Path(sys.executable).parent
START_PROFILE_STEP, END_PROFILE_STEP = 3, 5  # dsat's defaults, given to both
MEASURE_STEPS = (5, 25)  # the re-measurement's profile window: longer, so less noisy


def environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DET_MASTER", "CUDA_VISIBLE_DEVICES")}
    env.update(
        {
            "PATH": f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
            "PYTHONPATH": str(REPO),
            "DS_ACCELERATOR": "cpu",
        }
    )
    env.update(extra)
    return env


def base_ds_config() -> dict[str, Any]:
    config: dict[str, Any] = json.loads((EXAMPLE / "ds_config.json").read_text())
    return config


def run_deepspeed_autotuner(work: Path) -> dict[str, Any]:
    directory = work / "deepspeed"
    directory.mkdir()
    shutil.copy(DS_SCRIPT, directory / "train.py")
    shutil.copy(EXAMPLE / "model.py", directory / "model.py")
    config = base_ds_config()
    config["zero_optimization"] = {"stage": [0, 1, 2, 3]}
    config["autotuning"] = {
        "enabled": True,
        "fast": True,
        "metric": "throughput",
        "start_profile_step": START_PROFILE_STEP,
        "end_profile_step": END_PROFILE_STEP,
    }
    (directory / "ds_config.json").write_text(json.dumps(config, indent=2))
    command = [
        str(VENV_BIN / "deepspeed"),
        "--autotuning",
        "tune",
        "train.py",
        "--deepspeed_config",
        "ds_config.json",
    ]
    start = time.perf_counter()
    run = subprocess.run(
        command, cwd=directory, env=environment(LOCAL_SIZE="1"), capture_output=True, text=True
    )
    seconds = time.perf_counter() - start
    (work / "deepspeed_autotuner.log").write_text(run.stdout + run.stderr)
    optimal = directory / "autotuning_results" / "ds_config_optimal.json"
    if not optimal.is_file():
        raise SystemExit(
            f"DeepSpeed's autotuner wrote no optimal config; see {work}/deepspeed_autotuner.log"
        )
    summary = (directory / "autotuning_results" / "summary.txt").read_text()
    global_row = next(line for line in summary.splitlines() if line.startswith("| global"))
    cells = [cell.strip() for cell in global_row.strip("|").split("|")]
    output = run.stdout + run.stderr
    return {
        "seconds": seconds,
        # Experiments it started, the model-info profile included; results it already had are
        # skipped without a launch.
        "trials": len(re.findall(r"Launching exp_id", output)),
        "experiments_in_summary": int(cells[1]),
        "best_throughput_reported": float(cells[2]),
        "best_name": cells[3],
        "best_config": json.loads(optimal.read_text()),
    }


def run_dsat(work: Path, max_trials: int, max_slots: int) -> dict[str, Any]:
    model_dir = work / "dsat_model"
    shutil.copytree(EXAMPLE, model_dir, ignore=COPY_IGNORE)  # not a dsat-results/ left there
    results = work / "dsat_results"
    command = [
        sys.executable,
        "-m",
        "dsat",
        "asha",
        str(model_dir / "deepspeed.yaml"),
        str(model_dir),
        "--zero-stages",
        "0",
        "1",
        "2",
        "3",
        "--metric",
        "throughput",
        "--start-profile-step",
        str(START_PROFILE_STEP),
        "--end-profile-step",
        str(END_PROFILE_STEP),
        "--max-trials",
        str(max_trials),
        "--max-slots",
        str(max_slots),
        "--results-dir",
        str(results),
    ]
    start = time.perf_counter()
    run = subprocess.run(command, env=environment(), capture_output=True, text=True)
    seconds = time.perf_counter() - start
    (work / "dsat.log").write_text(run.stdout + run.stderr)
    if run.returncode != 0:
        raise SystemExit(f"dsat failed (exit {run.returncode}); see {work}/dsat.log")
    trials = (results / "trials.jsonl").read_text().splitlines()
    best = json.loads((results / "best_ds_metrics.json").read_text())
    best_config = json.loads((results / "best_ds_config.json").read_text())
    stage = best_config.get("zero_optimization", {}).get("stage", 0)
    return {
        "seconds": seconds,
        "trials": len(trials),
        "best_throughput_reported": float(best["throughput"]),
        "best_name": (
            f"z{stage}_gas{best_config.get('gradient_accumulation_steps', 1)}"
            f"_tmbspg{best_config['train_micro_batch_size_per_gpu']}"
        ),
        "best_config": best_config,
    }


def measure(work: Path, config: dict[str, Any], tag: str) -> float:
    """Throughput of ``config`` over a longer window, one process with every core."""
    directory = work / f"measure-{tag}"
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir()
    shutil.copy(DS_SCRIPT, directory / "train.py")
    shutil.copy(EXAMPLE / "model.py", directory / "model.py")
    measured = copy.deepcopy(config)
    measured["autotuning"] = {
        "enabled": True,
        "metric": "throughput",
        "start_profile_step": MEASURE_STEPS[0],
        "end_profile_step": MEASURE_STEPS[1],
        "metric_path": str(directory / "metric.json"),
    }
    (directory / "ds_config.json").write_text(json.dumps(measured))
    env = environment(
        OMP_NUM_THREADS=str(os.cpu_count() or 1),
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29541",
    )
    subprocess.run(
        [
            sys.executable,
            "train.py",
            "--deepspeed_config",
            "ds_config.json",
            "--steps",
            str(MEASURE_STEPS[1] + 2),
        ],
        cwd=directory,
        env=env,
        capture_output=True,
        check=False,
    )
    metric = directory / "metric.json"
    if not metric.is_file():
        raise SystemExit(f"measuring {tag}'s best config wrote no metric (in {directory})")
    return float(json.loads(metric.read_text())["throughput"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-slots", type=int, default=2, help="dsat's --max-slots")
    parser.add_argument("--repeats", type=int, default=3, help="re-measurements per best config")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="dsat-vs-ds-") as tmp:
        work = Path(tmp)
        print("running DeepSpeed's autotuner (fast mode, ZeRO 0-3) ...", flush=True)
        ds = run_deepspeed_autotuner(work)
        print(f"  {ds['seconds']:.0f} s, {ds['trials']} trials, best {ds['best_name']}", flush=True)
        print(f"running dsat asha with --max-trials {ds['trials']} ...", flush=True)
        ours = run_dsat(work, ds["trials"], args.max_slots)
        print(f"  {ours['seconds']:.0f} s, {ours['trials']} trials, best {ours['best_name']}")
        print(f"measuring both best configs again, {args.repeats} times each ...", flush=True)
        for result in (ds, ours):
            result["remeasured"] = []
        for _ in range(args.repeats):
            ds["remeasured"].append(measure(work, ds["best_config"], "deepspeed"))
            ours["remeasured"].append(measure(work, ours["best_config"], "dsat"))

    for result in (ds, ours):
        result["remeasured_median"] = statistics.median(result["remeasured"])
    wall_ratio = ours["seconds"] / ds["seconds"]
    speed_ratio = ours["remeasured_median"] / ds["remeasured_median"]
    print()
    print(
        "| autotuner | wall s | trials | best config | throughput it reported "
        "| throughput re-measured (median) |"
    )
    print("| --- | ---: | ---: | --- | ---: | ---: |")
    for name, result in (("DeepSpeed --autotuning tune (fast)", ds), ("dsat asha, local", ours)):
        print(
            f"| {name} | {result['seconds']:.0f} | {result['trials']} | {result['best_name']} "
            f"| {result['best_throughput_reported']:.0f} | {result['remeasured_median']:.0f} |"
        )
    print(f"wall-clock dsat / DeepSpeed = {wall_ratio:.2f} (target at most 0.5)")
    print(f"re-measured best throughput dsat / DeepSpeed = {speed_ratio:.2f} (target at least 1)")
    report = {
        "machine_cpus": os.cpu_count(),
        "dsat_max_slots": args.max_slots,
        "deepspeed": ds,
        "dsat": ours,
        "wall_ratio": wall_ratio,
        "remeasured_throughput_ratio": speed_ratio,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(RESULTS, report)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
