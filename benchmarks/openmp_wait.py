"""How a CPU trial's OpenMP threads should wait: torch's default against dsat's short spin.

A CPU trial gets cores / slots OpenMP threads. libgomp (torch's OpenMP on Linux) lets a thread
that waits for its partners spin some milliseconds before it sleeps; when another process keeps
one of the cores busy, the partner is not running and each parallel op waits out a time slice.
This times training steps of two models in a fresh interpreter each run: a small one (many short
ops, as the HF example's) and a large one (few long matmuls, as the core-API example's), each way
of waiting once per round (the order turned every round), on a quiet machine and then with a
busy-loop process beside them. Prints a table; writes benchmarks/results/openmp_wait.json.

    python3 benchmarks/openmp_wait.py [--rounds 3] [--threads 2] [--output F]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from dsat.atomic_file import write_json_atomic
from dsat.runners.local.entrypoint import OPENMP_SPIN_TURNS

STEPS = """
import sys, time, torch
torch.manual_seed(0)
big = sys.argv[1] == "large"
width, rows, steps = (512, 640, 20) if big else (64, 128, 200)
model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(8)])
x = torch.randn(rows, width)
for _ in range(5):
    model(x).sum().backward()
start = time.perf_counter()
for _ in range(steps):
    model(x).sum().backward()
print(time.perf_counter() - start)
"""

BUSY = "while True:\n    pass\n"


def waits(threads: int) -> dict[str, dict[str, str]]:
    """Each way of waiting, as the environment a trial's process gets."""
    return {
        "torch's default": {"OMP_NUM_THREADS": str(threads)},
        "dsat's (short spin)": {
            "OMP_NUM_THREADS": str(threads),
            "GOMP_SPINCOUNT": str(OPENMP_SPIN_TURNS),
        },
        "passive (no spin)": {"OMP_NUM_THREADS": str(threads), "OMP_WAIT_POLICY": "PASSIVE"},
        "one thread": {"OMP_NUM_THREADS": "1"},
    }


def timed(model: str, extra: dict[str, str]) -> float:
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    done = subprocess.run(
        [sys.executable, "-c", STEPS, model],
        env={**base, **extra},
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    return float(done.stdout.strip())


def measure(rounds: int, threads: int, busy: bool) -> dict[str, dict[str, list[float]]]:
    ways = waits(threads)
    seconds: dict[str, dict[str, list[float]]] = {
        model: {name: [] for name in ways} for model in ("small", "large")
    }
    loop = subprocess.Popen([sys.executable, "-c", BUSY]) if busy else None
    try:
        for round_ in range(rounds):
            order = list(ways.items())
            for name, extra in order[round_ % len(order) :] + order[: round_ % len(order)]:
                for model in seconds:
                    seconds[model][name].append(timed(model, extra))
    finally:
        if loop is not None:
            loop.kill()
            loop.wait()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--output", type=Path, default=Path(__file__).parent / "results" / "openmp_wait.json"
    )
    args = parser.parse_args()
    results: dict[str, Any] = {
        "threads": args.threads,
        "cores": os.cpu_count(),
        "rounds": args.rounds,
    }
    print(
        "| machine | way of waiting | small model s | large model s | small / quiet default | large / quiet default |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    quiet: dict[str, float] = {}
    for busy in (False, True):
        machine = "one core busy" if busy else "quiet"
        seconds = measure(args.rounds, args.threads, busy)
        results[machine] = seconds
        for name in waits(args.threads):
            small = statistics.median(seconds["small"][name])
            large = statistics.median(seconds["large"][name])
            if not busy and name == "torch's default":
                quiet = {"small": small, "large": large}
            print(
                f"| {machine} | {name} | {small:.3f} | {large:.3f} | "
                f"{small / quiet['small']:.2f} | {large / quiet['large']:.2f} |"
            )
    write_json_atomic(args.output, results)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
