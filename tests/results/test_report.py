"""The report of a simulated search: drawn at the end, on demand, after an interruption; one line
when matplotlib or the results are missing. (tests/runners/local/test_end_to_end.py checks the
report of a real local search.)"""

from __future__ import annotations

import base64
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from dsat.cli import main
from dsat.constants import STATE_FILE
from dsat.experiment.metric import Metric
from dsat.experiment.settings import DEFAULT_METRIC
from dsat.results.directory import SUMMARY_FILE, TRIALS_FILE
from dsat.results.report import REPORT_HTML, REPORT_PNG, load_results, picked_row
from tests.conftest import REPO_ROOT, run_cli
from tests.results.test_resume import STOPPING_SIMULATOR
from tests.test_cli import assert_one_line_error

SIMULATED = REPO_ROOT / "examples" / "simulated"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def simulated_search(tmp_path: Path, *flags: str) -> tuple[int, Path]:
    (tmp_path / "sim.py").write_text(STOPPING_SIMULATOR)
    results = tmp_path / "out"
    args = ["asha", str(SIMULATED / "gpt2_large.yaml"), str(SIMULATED), "--runner", "simulated"]
    args += ["--simulator", f"{tmp_path / 'sim.py'}:perf", "--results-dir", str(results)]
    code = main([*args, "--max-trials", "12", *flags])
    return code, results


def assert_report(results: Path) -> None:
    png = (results / REPORT_PNG).read_bytes()
    assert png.startswith(PNG_MAGIC)
    page = (results / REPORT_HTML).read_text()
    assert base64.b64encode(png).decode() in page  # self-contained: the picture inline
    for row in load_results(results).rows:
        assert f"<td>{row['name']}</td>" in page


def test_a_finished_search_draws_its_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, results = simulated_search(tmp_path)
    assert code == 0
    assert f"dsat: report: {results / REPORT_PNG}" in capsys.readouterr().out
    assert_report(results)
    picked = load_results(results).picked
    assert picked is not None and picked["status"] == "completed"
    best = json.loads((results / "best_ds_config.json").read_text())
    assert picked["mbs"] == best["train_micro_batch_size_per_gpu"]
    # The progress panel steps along the trials as they finished (a trial's number is its
    # launch's, out of order when trials run at once).
    finished = [count for count, _, _ in load_results(results).best_so_far()]
    assert finished == sorted(finished) and len(set(finished)) == len(finished)


def test_an_interrupted_search_is_reported_then_resumed_and_reported_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("STOP_AT_CALL", "6")
    code, results = simulated_search(tmp_path)
    assert code == 130 and not (results / SUMMARY_FILE).exists()
    capsys.readouterr()
    assert main(["report", str(results)]) == 0
    out = capsys.readouterr().out
    assert "| stage | trials |" in out and f"{results / REPORT_HTML}" in out
    assert_report(results)
    first = (results / REPORT_PNG).read_bytes()
    monkeypatch.delenv("STOP_AT_CALL")
    assert main(["asha", "--resume", str(results)]) == 0
    assert_report(results)
    assert load_results(results).picked_label == "picked"
    assert (results / REPORT_PNG).read_bytes() != first  # drawn again with every trial
    ends = [row["end"] for row in load_results(results).rows]
    assert ends == sorted(ends)  # the resumed run's clock carries on: progress runs forward
    (results / STATE_FILE).unlink()  # its summary says it handed over
    assert load_results(results).picked_label == "picked"


def test_an_interrupted_searchs_best_so_far_is_not_called_picked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """best_ds_metrics.json is written as a search goes: `dsat report` of an interrupted one
    said "picked: z2_mb3", and circled it so, though nothing was handed over."""
    monkeypatch.setenv("STOP_AT_CALL", "8")
    code, results = simulated_search(tmp_path, "--max-concurrent-trials", "1")
    assert code == 130
    capsys.readouterr()
    assert main(["report", str(results)]) == 0
    out = capsys.readouterr().out
    best = load_results(results).picked
    assert best is not None and f"\nbest so far: {best['name']}\n" in out and "picked" not in out
    # ... and the page says so as the terminal and the picture do (it named no trial).
    assert f"best so far: {best['name']}" in (results / REPORT_HTML).read_text()
    # Without its state (deleted, or a Determined checkpoint's files), the summary decides: an
    # interrupted search has none and was called "picked" again.
    (results / STATE_FILE).unlink()
    assert load_results(results).picked_label != "picked"


def test_without_matplotlib_the_search_runs_and_report_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    code, results = simulated_search(tmp_path)
    assert code == 0 and (results / "best_ds_config.json").is_file()
    assert "no report drawn: the report needs matplotlib" in capsys.readouterr().out
    assert not (results / REPORT_PNG).exists()
    assert_one_line_error(capsys, ["report", str(results)], "pip install matplotlib")


def test_a_missing_or_damaged_results_dir_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert_one_line_error(capsys, ["report", str(tmp_path)], TRIALS_FILE, "no ")
    assert_one_line_error(capsys, ["report", str(tmp_path / "gone")], "no such directory")
    (tmp_path / "a-file").write_text("")
    assert_one_line_error(capsys, ["report", str(tmp_path / "a-file")], "not a directory")
    code, results = simulated_search(tmp_path)
    assert code == 0
    good = (results / TRIALS_FILE).read_text()
    # Rows edited into shapes dsat never writes were tracebacks (TypeError, KeyError, ...).
    for damaged, said in (
        (good + "{not json\n", "is not JSON"),
        (good + "null\n", "(a JSON NoneType, not an object)"),
        (good.replace('"end": ', '"end": null, "x": ', 1), "line 1 is not a trial's row ('end' is"),
        (re.sub(r'"slots": \d+', '"slots": "sixteen"', good, count=1), "'slots' is \"sixteen\""),
        (good.replace('"zero_stage": ', '"stage": ', 1), "no 'zero_stage'"),
        (good.replace('"metrics": {', '"metrics": [1], "m": {', 1), "'metrics' is [1]"),
        # Values of the right type that no search writes: each was taken, and kept by a resume.
        (re.sub(r'"status": "\w+"', '"status": "bogus"', good, count=1), "'status' is \"bogus\""),
        (re.sub(r'"kind": "\w+"', '"kind": "foo"', good, count=1), "'kind' is \"foo\", not one"),
        (re.sub(r'"zero_stage": \d', '"zero_stage": 7', good, count=1), "'zero_stage' is 7"),
        (re.sub(r'"mbs": \d+', '"mbs": -3', good, count=1), "'mbs' is -3"),
        (re.sub(r'"end": [\d.e+]+', '"end": 1e300', good, count=1), "'end' 1e+300"),
        (good + good.splitlines()[2] + "\n", "repeats trial "),  # pasted twice: counted twice
    ):
        (results / TRIALS_FILE).write_text(damaged)
        assert_one_line_error(capsys, ["report", str(results)], TRIALS_FILE, said)
    # A row deleted from the middle: the trial it was, by name (the line said only "removed,
    # emptied or cut", and left the user to find which).
    kept = good.splitlines()
    lost = json.loads(kept.pop(3))
    (results / TRIALS_FILE).write_text("\n".join(kept) + "\n")
    assert_one_line_error(
        capsys,
        ["report", str(results)],
        f"have no row there (trial {lost['trial']} {lost['name']}: the file",
    )
    # trials.jsonl gone while the state names the trials it finished: not "no trial has
    # finished yet", which it said.
    (results / TRIALS_FILE).unlink()
    line = assert_one_line_error(capsys, ["report", str(results)], TRIALS_FILE, "have no row")
    assert line.endswith("put it back as dsat wrote it to report the search")
    # A search interrupted in its first trial wrote no trials.jsonl: it is a search's directory
    # (it said "pass a directory a dsat search wrote").
    (results / STATE_FILE).unlink()
    assert_one_line_error(capsys, ["report", str(results)], "no trial has finished yet")


def test_the_pick_is_found_where_its_derived_mfu_differs_between_the_files(
    tmp_path: Path,
) -> None:
    """best_ds_metrics.json is written when a trial becomes the best, its row when it finished:
    a trial between them can lower the least FLOPs a sample, and with it the MFU beside each."""
    measured = {"throughput": 40.0, "FLOPS_per_gpu": 8e13, "device_peak_flops": 1e15}
    rows = [
        {"name": "z1_mb4", "kind": "search", "metrics": {**measured, "throughput": 30.0}},
        {"name": "z1_mb8", "kind": "search", "metrics": {**measured, "mfu": 0.08}},
    ]
    best = tmp_path / "best.json"
    best.write_text(json.dumps({**measured, "mfu": 0.06}))
    picked = picked_row(rows, best)
    assert picked is not None and picked["name"] == "z1_mb8"


def test_of_two_trials_that_measured_alike_the_pick_is_the_one_best_ds_config_json_holds(
    tmp_path: Path,
) -> None:
    """On a simulated surface two configurations measured the same to the last digit, and the
    report circled the later one, not the one handed over."""
    measured = {"throughput": 40.0, "FLOPS_per_gpu": 8e13}

    def row(name: str, prefetch: float) -> dict[str, Any]:
        zero = {"stage": 3, "stage3_prefetch_bucket_size": prefetch}
        overwrites = {"zero_optimization": zero, "autotuning": {"enabled": True}}
        return {"name": name, "kind": "search", "metrics": measured, "overwrites": overwrites}

    rows = [row("z3_prefetch5e6", 5e6), row("z3_prefetch1e7", 1e7)]
    (tmp_path / "best_ds_metrics.json").write_text(json.dumps(measured))
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": rows[0]["overwrites"]["zero_optimization"],
    }
    (tmp_path / "best_ds_config.json").write_text(json.dumps(config))
    picked = picked_row(rows, tmp_path / "best_ds_metrics.json")
    assert picked is not None and picked["name"] == "z3_prefetch5e6"


def test_the_stage_table_ranks_as_the_summary_does_leaving_out_runs_over_the_margin(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run that left less than the memory margin free is no stage's best in the summary; the
    report said it was (ZeRO-2 micro-batch 4 at 96.7% of the memory, against the summary's 3)."""
    results = tmp_path / "out"
    argv = ["guided", str(SIMULATED / "gpt2_large.yaml"), str(SIMULATED), "--runner", "simulated"]
    argv += ["--simulator", "dsat.runners.simulated.performance_models:gpt2_large_16xv100"]
    assert main([*argv, "--max-trials", "12", "--results-dir", str(results)]) == 0
    rows = load_results(results).rows
    over = [
        r
        for r in rows
        if r["status"] == "completed" and r["may_hand_over"] is False and r["kind"] == "search"
    ]
    assert over  # the case this test is about happened
    # The model profile and the user's own run are never handed over.
    assert all(not r["may_hand_over"] for r in rows if r["kind"] in ("model_profile", "baseline"))
    capsys.readouterr()
    assert main(["report", str(results)]) == 0
    table = capsys.readouterr().out
    summary = (results / SUMMARY_FILE).read_text()
    for stage in {r["zero_stage"] for r in rows if r["kind"] == "search"}:
        cells = [c.strip() for c in summary.split(f"| z{stage} ", 1)[1].split("\n")[0].split("|")]
        named = [c.strip() for c in table.split(f"\n| {stage} |", 1)[1].split("\n")[0].split("|")]
        assert named[-2] == cells[-2], (stage, table, summary)
    for row in over:
        assert f"| {row['name']} |" not in table


def test_a_report_that_cannot_be_written_is_one_line_after_its_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A directory in the page's place was a traceback, and left a new picture beside the old
    page; the table, which needs no file, was not shown."""
    code, results = simulated_search(tmp_path)
    assert code == 0
    picture = (results / REPORT_PNG).read_bytes()
    (results / REPORT_HTML).unlink()
    (results / REPORT_HTML).mkdir()
    (results / SUMMARY_FILE).write_bytes(b"\xff\xfe not UTF-8")  # read as it is, no traceback
    capsys.readouterr()
    error = assert_one_line_error(capsys, ["report", str(results)], REPORT_HTML, "move away")
    assert "Is a directory" in error or "not a file" in error
    assert (results / REPORT_PNG).read_bytes() == picture


def test_what_the_report_cannot_know_it_says(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Damaged settings ranked a latency search by throughput without a word; an empty
    trials.jsonl drew an empty table and a cost of "0 trials ()". The search's state names its
    metric too (a Determined checkpoint has no settings.json): it ranked one by FLOPS."""
    code, results = simulated_search(tmp_path, "--metric", "latency")
    assert code == 0
    (results / "settings.json").write_text("{oops")
    capsys.readouterr()
    assert main(["report", str(results)]) == 0
    assert "settings.json is missing" not in capsys.readouterr().out
    assert load_results(results).metric is Metric.LATENCY
    state = (results / STATE_FILE).read_text()
    (results / STATE_FILE).unlink()
    assert main(["report", str(results)]) == 0
    said = capsys.readouterr().out
    assert (
        f"settings.json is missing or damaged: the trials are ranked by {DEFAULT_METRIC.value}"
        in said
    )
    (results / STATE_FILE).write_text(state)
    (results / TRIALS_FILE).write_text("")  # emptied, while the state names its trials
    assert_one_line_error(capsys, ["report", str(results)], "15 of the 15 trials", "no row")


def test_the_picks_label_stays_inside_its_panel(tmp_path: Path) -> None:
    """A pick at the top of the panel had its label drawn over the panel's title."""
    from dsat.results.report import draw_throughput, import_pyplot

    code, results_dir = simulated_search(tmp_path)
    assert code == 0
    results = load_results(results_dir)
    assert results.picked is not None
    # As it is, and with an offload search's name, which ran off the panel's side in one line.
    long_name = "z3_mb20_ag1e9_prefetch1e8_persist9.09e4_offload-opt-cpu_offload-param-cpu"
    for name in (results.picked["name"], long_name):
        results.picked["name"] = name
        figure, ax = import_pyplot().subplots()
        draw_throughput(ax, results)
        figure.canvas.draw()
        (label,) = [text for text in ax.texts if text.get_text().startswith("picked: ")]
        assert label.get_text().replace("\n", "_") == f"picked: {name}"
        box = label.get_window_extent().transformed(ax.transAxes.inverted())
        assert box.y1 <= 1.0 and box.y0 >= 0.0 and box.x0 >= 0.0 and box.x1 <= 1.0, (name, box)


def test_peaks_measured_without_the_devices_total_are_drawn_not_said_to_be_missing(
    tmp_path: Path,
) -> None:
    """A simulator of the user's gave each trial's peak and not the device's total: the panel
    drew the peaks, then wrote "no search trial measured its peak memory" over them."""
    from dsat.results.report import draw_memory, import_pyplot

    code, results_dir = simulated_search(tmp_path)
    assert code == 0
    results = load_results(results_dir)
    for gib, row in enumerate(results.search_rows, start=1):
        metrics = {k: v for k, v in (row.get("metrics") or {}).items() if "memory" not in k}
        row["metrics"] = {**metrics, "memory_peak_bytes": gib * 2**30}
    _, ax = import_pyplot().subplots()
    draw_memory(ax, results)
    assert ax.collections and not ax.texts  # the peaks, and no word that there are none
    assert not ax.lines  # no device line: its total is not known
    for row in results.search_rows:  # and where none measured one, it says so
        row["metrics"].pop("memory_peak_bytes")
    _, ax = import_pyplot().subplots()
    draw_memory(ax, results)
    assert [text.get_text() for text in ax.texts] == ["no search trial measured its peak memory"]


def test_a_path_the_terminal_cannot_encode_is_escaped_not_a_traceback(tmp_path: Path) -> None:
    """Under ``PYTHONIOENCODING=ascii`` the report of a non-ASCII directory raised
    UnicodeEncodeError at its last print, after the files were written."""
    code, results = simulated_search(tmp_path)
    assert code == 0
    moved = results.rename(tmp_path / "résultats")
    run = run_cli("report", str(moved), env={"PYTHONIOENCODING": "ascii"})
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
    assert f"dsat: report: {tmp_path}/r\\xe9sultats/{REPORT_PNG}" in run.stdout
