"""What a search cost, from trials.jsonl's rows: every trial that ran (the model profile, the
search, the confirmation round, failed trials) times the slots it held; and the summary, the
report and the terminal's last line all say it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dsat.cli import main
from dsat.results.cost import search_cost
from dsat.results.directory import SUMMARY_FILE, TRIALS_FILE
from dsat.results.report import REPORT_HTML
from dsat.runners.local.runner import LocalRunner
from dsat.runners.local.slots import SlotPool
from dsat.runners.local.trial_timeout import TrialTimeout
from dsat.runners.simulated.performance_models import gpt2_large_16xv100
from dsat.runners.simulated.runner import SimulatedRunner
from tests.conftest import REPO_ROOT

SIMULATED = REPO_ROOT / "examples" / "simulated"
GPT2 = "dsat.runners.simulated.performance_models:gpt2_large_16xv100"


def row(kind: str, status: str, start: float, end: float, **extra: Any) -> dict[str, Any]:
    return {"kind": kind, "status": status, "start": start, "end": end, **extra}


# A 4-GPU search: the model profile, three search trials (one out of memory: it held its GPUs
# all the same), and two confirmation runs; 900 s of trials in all.
ROWS = [
    row("model_profile", "completed", 0.0, 100.0, slots=4, slot_kind="GPU"),
    row("search", "completed", 100.0, 300.0, slots=4, slot_kind="GPU"),
    row("search", "oom", 100.0, 150.0, slots=4, slot_kind="GPU"),
    row("search", "completed", 300.0, 450.0, slots=4, slot_kind="GPU"),
    row("confirm", "completed", 450.0, 650.0, slots=4, slot_kind="GPU"),
    row("confirm", "error", 650.0, 850.0, slots=4, slot_kind="GPU"),
]


def test_every_trial_that_ran_counts_slots_times_its_time() -> None:
    cost = search_cost(ROWS)
    assert cost.trial_seconds == 900.0 and cost.slot_seconds == 3600.0
    assert cost.slot_hours == 1.0 and cost.trials == 6 and cost.failed == 2
    assert cost.kinds == (("model_profile", 1), ("search", 3), ("confirm", 2))
    assert cost.line() == (
        "cost: 6 trials (1 model profile, 3 search, 2 confirmation runs; 2 failed), "
        "1.00 GPU-hours (4 GPUs per trial x 15.0 min of trials)"
    )
    assert cost.hours_text() == "1.00 GPU-hours"


def test_a_tiny_cpu_search_in_cpu_slot_hours_with_its_seconds() -> None:
    rows = [
        row("model_profile", "completed", 0.0, 6.0, slots=1, slot_kind="CPU"),
        row("search", "completed", 6.0, 7.6, slots=1, slot_kind="CPU"),
    ]
    assert search_cost(rows).line() == (
        "cost: 2 trials (1 model profile, 1 search), 0.00211 CPU slot-hours "
        "(1 CPU slot per trial x 7.60 s of trials)"
    )


def test_rows_from_before_slots_were_recorded() -> None:
    old = [{k: v for k, v in r.items() if k not in ("slots", "slot_kind")} for r in ROWS]
    assert search_cost(old, slots=4).slot_hours == 1.0  # the tracker says how many
    unknown = search_cost(old)
    assert unknown.slot_hours is None and unknown.hours_text() == "15.0 min of trials"
    assert unknown.line().endswith("15.0 min of trials (slots per trial not recorded)")


def test_a_resumed_search_on_other_slots_says_so() -> None:
    cost = search_cost([*ROWS, row("search", "timeout", 850.0, 1750.0, slots=1, slot_kind="CPU")])
    assert cost.slot_seconds == 3600.0 + 900.0
    assert cost.line().endswith(", 1.25 slot-hours (1 or 4 slots per trial x 30.0 min of trials)")


def test_slots_are_gpus_unless_the_local_runner_has_only_cpus(tmp_path: Path) -> None:
    assert SimulatedRunner(gpt2_large_16xv100, 16).slot_kind == "GPU"  # simulated GPUs

    def local(pool: SlotPool) -> LocalRunner:
        command = ["python3", "train.py"]
        return LocalRunner(command, tmp_path, (), tmp_path, pool, 1, TrialTimeout(None), warm=False)

    assert local(SlotPool(["cpu0", "cpu1"], on_gpu=False)).slot_kind == "CPU"
    assert local(SlotPool(["0", "1"], on_gpu=True)).slot_kind == "GPU"


def simulated_search(results: Path, *flags: str) -> int:
    args = ["asha", str(SIMULATED / "gpt2_large.yaml"), str(SIMULATED), "--runner", "simulated"]
    args += ["--simulator", GPT2, "--results-dir", str(results), "--max-trials", "12"]
    return main([*args, *flags])


def test_the_summary_the_report_and_the_last_line_carry_the_cost(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = tmp_path / "out"
    assert simulated_search(results) == 0
    out = capsys.readouterr().out
    rows = [json.loads(line) for line in (results / TRIALS_FILE).read_text().splitlines()]
    kinds = {r["kind"] for r in rows}
    assert kinds == {"model_profile", "search", "confirm"}  # the confirmation round counts too
    seconds = sum(r["end"] - r["start"] for r in rows)
    cost = search_cost(rows)
    assert cost.slot_seconds == pytest.approx(16 * seconds)  # gpt2_large.yaml: 16 GPUs a trial
    line = cost.line()
    assert line.startswith(f"cost: {len(rows)} trials (1 model profile, ")
    assert "GPU-hours (16 GPUs per trial x " in line
    assert (results / SUMMARY_FILE).read_text().splitlines()[-1] == line
    assert html_line(results) == line
    assert f"\n{line}\n" in out  # the summary, printed
    assert f"dsat: {len(rows)} trials, {cost.hours_text()}; search ended: " in out

    assert main(["report", str(results)]) == 0
    assert line in capsys.readouterr().out.splitlines()


def test_an_interrupted_search_is_reported_with_its_cost_so_far(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = tmp_path / "out"
    assert simulated_search(results) == 0
    (results / SUMMARY_FILE).unlink()  # as a search stopped before its end leaves it
    capsys.readouterr()
    assert main(["report", str(results)]) == 0
    rows = [json.loads(line) for line in (results / TRIALS_FILE).read_text().splitlines()]
    assert html_line(results) == search_cost(rows).line()


def html_line(results: Path) -> str:
    """The page's cost line."""
    page = (results / REPORT_HTML).read_text()
    return next(line for line in page.splitlines() if line.startswith("cost: "))


def test_the_factors_multiply_to_the_total_as_shown() -> None:
    """8 GPUs x 5.2 h read as 41.6 beside a total of 42.0 (5.244 h of trials)."""
    rows = [row("search", "completed", 0.0, 5.244 * 3600, slots=8, slot_kind="GPU")]
    line = search_cost(rows).line()
    assert line.endswith("42.0 GPU-hours (8 GPUs per trial x 5.24 h of trials)"), line
