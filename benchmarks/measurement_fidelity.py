"""Does the metric dsat ranks by order configurations as real training does?

Runs a real local search of the CPU example (`--metric throughput`), then re-measures every
completed configuration with a plain training loop that knows nothing of dsat or DeepSpeed's
autotuning: the same model and config, warm-up steps, then steps timed end to end with the device
synchronised, repeated and interleaved across configurations so machine noise hits all alike.
Reports the rank correlation (Spearman) of re-measured throughput with dsat's metric and with
DeepSpeed's own autotuning figure, and the re-measured throughput of the configuration dsat hands
over relative to the best one it tried. Prints a table; writes
benchmarks/results/measurement_fidelity_cpu.json.

    python3 benchmarks/measurement_fidelity.py [--max-trials 16] [--repeats 2] [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from dsat.atomic_file import write_json_atomic
from dsat.constants import AUTOTUNING_KEY
from dsat.experiment.config import deep_merge
from dsat.results.directory import BEST_CONFIG_FILE, TRIALS_FILE

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "core_api_mlp"
RESULTS = Path(__file__).resolve().parent / "results" / "measurement_fidelity_cpu.json"
WIDTH, DEPTH = 256, 4  # the example's hyperparameters

# The plain loop, run in a process of its own per measurement: deepspeed.initialize with the
# config, WARMUP steps, then STEPS steps timed end to end; prints samples per second.
PLAIN_LOOP = """
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
import deepspeed, torch
from deepspeed.accelerator import get_accelerator
from model import TinyMLP, synthetic_batch
config = json.load(open(sys.argv[2]))
warmup, steps, width, depth = (int(a) for a in sys.argv[3:7])
deepspeed.init_distributed()
torch.manual_seed(0)
model = TinyMLP(width, depth)
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
generator = torch.Generator().manual_seed(0)
loss_fn = torch.nn.MSELoss()
def step():
    for _ in range(engine.gradient_accumulation_steps()):
        x, y = synthetic_batch(engine.train_micro_batch_size_per_gpu(), width, generator)
        engine.backward(loss_fn(engine(x), y))
        engine.step()
for _ in range(warmup):
    step()
get_accelerator().synchronize()
start = time.perf_counter()
for _ in range(steps):
    step()
get_accelerator().synchronize()
print("samples_per_s", engine.train_batch_size() * steps / (time.perf_counter() - start))
"""


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DET_MASTER", "CUDA_VISIBLE_DEVICES")}
    env.update(
        {
            "DS_ACCELERATOR": "cpu",
            "PYTHONPATH": str(REPO),
            "OMP_NUM_THREADS": str(os.cpu_count() or 1),  # as a one-slot trial gets
            "RANK": "0",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29517",
        }
    )
    return env


def search(results: Path, max_trials: int) -> float:
    command = [sys.executable, "-m", "dsat", "asha", str(EXAMPLE / "deepspeed.yaml"), str(EXAMPLE)]
    command += ["--zero-stages", "0", "1", "2", "3", "--max-trials", str(max_trials)]
    command += ["--search-range-factor", "0.05", "--metric", "throughput"]
    command += ["--results-dir", str(results)]
    start = time.perf_counter()
    run = subprocess.run(command, env=environment(), capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"the search failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    return time.perf_counter() - start


def remeasure(config: dict[str, Any], work: Path, warmup: int, steps: int) -> float:
    path = work / "config.json"
    path.write_text(json.dumps(config))
    run = subprocess.run(
        [sys.executable, "-c", PLAIN_LOOP, str(EXAMPLE), str(path)]
        + [str(n) for n in (warmup, steps, WIDTH, DEPTH)],
        env=environment(),
        capture_output=True,
        text=True,
    )
    for line in run.stdout.splitlines():
        if line.startswith("samples_per_s "):
            return float(line.split()[1])
    raise SystemExit(f"the plain loop failed:\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}")


def spearman(a: list[float], b: list[float]) -> float:
    ranks_a = np.argsort(np.argsort(a)).astype(float)
    ranks_b = np.argsort(np.argsort(b)).astype(float)
    return float(np.corrcoef(ranks_a, ranks_b)[0, 1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-trials", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    base = json.loads((EXAMPLE / "ds_config.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        search_seconds = search(work / "results", args.max_trials)
        rows = [
            json.loads(line) for line in (work / "results" / TRIALS_FILE).read_text().splitlines()
        ]
        handed_over = json.loads((work / "results" / BEST_CONFIG_FILE).read_text())
        tried = [r for r in rows if r["kind"] == "search" and r["status"] == "completed"]
        configs = []
        for row in tried:
            overwrites = {k: v for k, v in row["overwrites"].items() if k != AUTOTUNING_KEY}
            configs.append(deep_merge(base, overwrites))
        measured: list[list[float]] = [[] for _ in tried]
        start = time.perf_counter()
        for _ in range(args.repeats):  # interleaved: every config once per round
            for index, config in enumerate(configs):
                measured[index].append(remeasure(config, work, args.warmup, args.steps))
        remeasure_seconds = time.perf_counter() - start
    truth = [statistics.fmean(m) for m in measured]
    ours = [float(r["metrics"]["throughput"]) for r in tried]
    deepspeeds = [float(r["metrics"].get("deepspeed_throughput", "nan")) for r in tried]
    handed_index = next(
        (i for i, c in enumerate(configs) if c == without_autotuning(handed_over)),
        int(np.argmax(ours)),
    )
    repeat_gap = [abs(m[0] - m[-1]) / statistics.fmean(m) for m in measured if len(m) > 1]
    summary = {
        "configs": len(tried),
        "search_seconds": round(search_seconds, 1),
        "remeasure_seconds": round(remeasure_seconds, 1),
        "spearman_dsat_metric": round(spearman(ours, truth), 3),
        "spearman_deepspeed_metric": round(spearman(deepspeeds, truth), 3),
        "handed_over_vs_best_remeasured": round(truth[handed_index] / max(truth), 3),
        "median_repeat_gap": round(statistics.median(repeat_gap), 3) if repeat_gap else None,
    }
    print("| config | dsat metric | DeepSpeed's metric | re-measured (samples/s) |")
    print("| --- | ---: | ---: | ---: |")
    for index, row in sorted(enumerate(tried), key=lambda item: -truth[item[0]]):
        mark = " (handed over)" if index == handed_index else ""
        print(
            f"| {row['name']}{mark} | {ours[index]:.0f} | {deepspeeds[index]:.0f} | "
            f"{' / '.join(f'{m:.0f}' for m in measured[index])} |"
        )
    print(json.dumps(summary, indent=2))
    write_json_atomic(
        args.output,
        {
            "summary": summary,
            "trials": [
                {
                    "name": row["name"],
                    "overwrites": row["overwrites"],
                    "dsat_metric": ours[i],
                    "deepspeed_metric": deepspeeds[i],
                    "remeasured": measured[i],
                }
                for i, row in enumerate(tried)
            ],
        },
    )


def without_autotuning(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k != AUTOTUNING_KEY}


if __name__ == "__main__":
    main()
