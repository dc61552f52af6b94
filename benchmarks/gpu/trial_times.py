"""Per-trial times of a search's results directory, for the GPU check (benchmarks/README.md).

"in trial" is a trial's own start to end; "cost" runs from the previous trial's end to its own,
so it also holds what happened between them (a trial host replaced and started again). The trial
logs say whether a host was replaced after a trial.

    python3 benchmarks/gpu/trial_times.py RESULTS_DIR [RESULTS_DIR ...]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

REPLACED = "dsat: this trial host is replaced: "


def rows(results: Path) -> list[dict[str, object]]:
    found: list[dict[str, object]] = []
    previous_end: float | None = None
    for line in (results / "trials.jsonl").read_text().splitlines():
        trial = json.loads(line)
        metrics = trial.get("metrics") or {}
        log = results / "logs" / Path(str(trial.get("log") or "")).name
        text = log.read_text(errors="replace") if log.is_file() else ""
        replaced = [ln[len(REPLACED) :] for ln in text.splitlines() if ln.startswith(REPLACED)]
        found.append(
            {
                "trial": trial["trial"],
                "name": trial["name"],
                "status": trial["status"],
                "in_trial_s": round(trial["end"] - trial["start"], 1),
                "cost_s": None if previous_end is None else round(trial["end"] - previous_end, 1),
                "tflops": round(metrics["FLOPS_per_gpu"] / 1e12, 3)
                if "FLOPS_per_gpu" in metrics
                else None,
                "throughput": metrics.get("throughput"),
                "peak_mib": round(metrics["memory_peak_bytes"] / 2**20)
                if "memory_peak_bytes" in metrics
                else None,
                "host_replaced": "; ".join(replaced) or None,
            }
        )
        previous_end = trial["end"]
    return found


def main(directories: list[str]) -> None:
    for directory in directories:
        table = rows(Path(directory))
        print(f"{directory}:")
        for row in table:
            print("  " + json.dumps(row))
        costs = [float(r["cost_s"]) for r in table if isinstance(r["cost_s"], float)]
        if costs:
            print(f"  median cost per trial after the first: {statistics.median(costs):.1f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
