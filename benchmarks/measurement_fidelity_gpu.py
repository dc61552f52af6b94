"""Does what dsat hands over train fastest on a real GPU? Re-measures a finished search of the HF
Trainer example sized as GPT-2 medium (random-initialised, bf16) with a plain loop.

The search is run first, on the GPU machine, as a user runs it (see benchmarks/README.md, "GPU").
This script then takes the configurations the search completed, the one it handed over and the
leading others by dsat's metric, and times each with a loop that knows nothing of dsat, the HF
Trainer or DeepSpeed's autotuning: the same model and DeepSpeed config with torch's AdamW, warm-up
steps, then steps timed end to end with the device synchronised, one process per measurement,
repeated and interleaved across configurations. Reports the handed-over configuration's
re-measured throughput over the best re-measured one, and the rank correlation (Spearman) of the
re-measured throughput with dsat's metric and with DeepSpeed's own autotuning figure. Prints a
table; writes JSON.

    python3 benchmarks/measurement_fidelity_gpu.py RESULTS_DIR [--top 6] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from measurement_fidelity import spearman  # benchmarks/, next to this script

from dsat.atomic_file import write_json_atomic
from dsat.results.directory import BEST_CONFIG_FILE, TRIALS_FILE
from dsat.runners.local.runner import HPARAMS_FILE

RESULTS = Path(__file__).resolve().parent / "results" / "measurement_fidelity_gpu.json"

# One measurement: the GPT-2 of the example's hyperparameters, DeepSpeed with the config, WARMUP
# steps, then STEPS timed; prints samples per second and the peak memory.
PLAIN_LOOP = """
import json, sys, time
import deepspeed, torch
from transformers import GPT2Config, GPT2LMHeadModel
config = json.load(open(sys.argv[1]))
hp = json.loads(sys.argv[2])
warmup, steps = int(sys.argv[3]), int(sys.argv[4])
deepspeed.init_distributed()
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(
    vocab_size=hp["vocab_size"], n_positions=hp["seq_len"], n_embd=hp["n_embd"],
    n_layer=hp["n_layer"], n_head=hp["n_head"], bos_token_id=0, eos_token_id=0))
optimizer = torch.optim.AdamW(model.parameters(), lr=5e-4)
engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
mbs = engine.train_micro_batch_size_per_gpu()
tokens = torch.randint(0, hp["vocab_size"], (mbs, hp["seq_len"]), device=engine.device)
def step():
    loss = engine(input_ids=tokens, labels=tokens).loss
    engine.backward(loss)
    engine.step()
for _ in range(warmup):
    step()
torch.cuda.synchronize()
start = time.perf_counter()
for _ in range(steps):
    step()
torch.cuda.synchronize()
seconds = time.perf_counter() - start
print("RESULT " + json.dumps({"samples_per_s": mbs * steps / seconds,
      "peak_bytes": torch.cuda.max_memory_allocated()}), flush=True)
"""


def rank_correlation(a: list[float], b: list[float]) -> float | None:
    """measurement_fidelity's Spearman; None for fewer than three configurations."""
    return spearman(a, b) if len(a) >= 3 else None


def plain_config(zero: dict[str, Any], mbs: int) -> dict[str, Any]:
    """The DeepSpeed config a trial of the example ran with, as the plain loop gets it."""
    return {
        "train_micro_batch_size_per_gpu": mbs,
        "gradient_accumulation_steps": 1,
        "train_batch_size": mbs,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def candidates(results: Path, top: int) -> list[dict[str, Any]]:
    """The handed-over configuration, then the others by dsat's metric, best first."""
    rows = [json.loads(line) for line in (results / TRIALS_FILE).read_text().splitlines()]
    done = [r for r in rows if r["kind"] == "search" and r["status"] == "completed"]
    best = json.loads((results / BEST_CONFIG_FILE).read_text())
    chosen: dict[str, dict[str, Any]] = {}
    for row in sorted(done, key=lambda r: -r["metrics"]["throughput"]):
        zero = row["overwrites"]["zero_optimization"]
        key = json.dumps([zero, row["mbs"]], sort_keys=True)
        handed = row["mbs"] == best["train_micro_batch_size_per_gpu"] and all(
            best["zero_optimization"].get(k) == v for k, v in zero.items()
        )
        entry = chosen.setdefault(
            key,
            {
                "zero": zero,
                "mbs": row["mbs"],
                "dsat": row["metrics"]["throughput"],
                "deepspeed": row["metrics"].get("deepspeed_throughput"),
                "handed_over": False,
            },
        )
        entry["handed_over"] = entry["handed_over"] or handed
    ranked = list(chosen.values())
    handed_over = [c for c in ranked if c["handed_over"]]
    others = [c for c in ranked if not c["handed_over"]]
    return (handed_over + others)[: max(top, len(handed_over))]


def measure(
    config: dict[str, Any], hparams: dict[str, Any], warmup: int, steps: int, port: int
) -> dict[str, Any] | None:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(config, handle)
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
    }
    command = [sys.executable, "-c", PLAIN_LOOP, handle.name, json.dumps(hparams)]
    run = subprocess.run(
        [*command, str(warmup), str(steps)], capture_output=True, text=True, env=env, timeout=600
    )
    os.unlink(handle.name)
    for line in run.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[len("RESULT ") :]))
    print(run.stdout[-2000:], run.stderr[-2000:], file=sys.stderr)
    return None  # out of memory, or a crash: shown above


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="a finished search of the GPT-2 example")
    parser.add_argument(
        "--experiment", type=Path, help="the searched deepspeed.yaml, if RESULTS has no trials/"
    )
    parser.add_argument("--top", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()

    # The model's size as the trials had it: their hyperparameters (written by the local runner),
    # or the experiment's when the trial directories did not come back from the GPU machine.
    written = sorted((args.results / "trials").glob(f"*/{HPARAMS_FILE}"))
    if written:
        source = json.loads(written[0].read_text())
    else:
        source = yaml.safe_load(args.experiment.read_text())["hyperparameters"]
    model_keys = ("vocab_size", "seq_len", "n_embd", "n_layer", "n_head")
    hparams = {k: int(source[k]) for k in model_keys}
    chosen = candidates(args.results, args.top)
    started = time.monotonic()
    port = 29600
    for _ in range(args.repeats):  # interleaved: machine drift hits every configuration alike
        for entry in chosen:
            port += 1
            result = measure(
                plain_config(entry["zero"], entry["mbs"]), hparams, args.warmup, args.steps, port
            )
            entry.setdefault("plain", []).append(result["samples_per_s"] if result else None)
            print(f"z{entry['zero'].get('stage')} mbs {entry['mbs']}: {result}", flush=True)
            if result:
                entry["peak_bytes"] = result["peak_bytes"]
    measured = [c for c in chosen if all(v is not None for v in c["plain"])]
    for c in measured:
        c["plain_mean"] = float(np.mean(c["plain"]))
    best = max((c["plain_mean"] for c in measured), default=None)
    handed = next((c for c in measured if c["handed_over"]), None)
    truth = [c["plain_mean"] for c in measured]
    report = {
        "model": hparams,
        "configs": chosen,
        "handed_over_vs_best_remeasured": handed["plain_mean"] / best if handed and best else None,
        "spearman_dsat": rank_correlation([c["dsat"] for c in measured], truth),
        "spearman_deepspeed": rank_correlation([c["deepspeed"] or 0.0 for c in measured], truth),
        "repeats": args.repeats,
        "warmup": args.warmup,
        "steps": args.steps,
        "seconds": time.monotonic() - started,
    }
    print("| config | dsat's metric | DeepSpeed's figure | re-measured (samples/s) |")
    print("| --- | ---: | ---: | ---: |")
    for c in chosen:
        name = f"z{c['zero'].get('stage')} mbs {c['mbs']}" + (
            " (handed over)" if c["handed_over"] else ""
        )
        again = " / ".join(f"{v:.2f}" if v else "failed" for v in c["plain"])
        ds_figure = f"{c['deepspeed']:.2f}" if c["deepspeed"] else "-"
        print(f"| {name} | {c['dsat']:.2f} | {ds_figure} | {again} |")
    print(
        f"handed over / best re-measured: {report['handed_over_vs_best_remeasured']}; Spearman "
        f"dsat {report['spearman_dsat']}, DeepSpeed {report['spearman_deepspeed']}"
    )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(args.output, report)


if __name__ == "__main__":
    main()
