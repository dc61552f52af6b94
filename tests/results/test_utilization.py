"""Tokens/s and MFU: worked out from a trial's samples/s and FLOPS, in trials.jsonl, the summary
and the report."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dsat.results.directory import SUMMARY_FILE, TRIALS_FILE
from dsat.results.report import write_report
from dsat.results.utilization import Utilization
from dsat.runners.simulated.performance_models import BUILTIN_MODELS
from dsat.runners.simulated.runner import SimulatedRunner
from dsat.search.trial_builder import SearchSpec
from dsat.search_run import run_search
from tests.search.helpers import search_settings

METRICS = {"throughput": 50.0, "FLOPS_per_gpu": 1.5e14, "device_peak_flops": 3.12e14}


def test_tokens_per_second_and_mfu_from_a_trials_metrics() -> None:
    found = Utilization(seq_len=1024).derived(METRICS)
    assert found == {
        "tokens_per_second": 50.0 * 1024,
        "mfu": pytest.approx(1.5 / 3.12),
        "mfu_peak_flops": 3.12e14,
    }
    # --peak-tflops overrides the device's, and the metrics say which peak the MFU is against;
    # without a sequence length no tokens/s.
    assert Utilization(peak_flops=3e14).derived(METRICS) == {
        "mfu": pytest.approx(0.5),
        "mfu_peak_flops": 3e14,
    }
    assert Utilization().derived({"throughput": 50.0, "FLOPS_per_gpu": 1e12}) == {}
    line = Utilization(seq_len=1024).line(METRICS)
    assert (
        line
        == "handed-over throughput: 5.12e+04 tokens/s (sequence 1024), MFU 48.1% of 312 TFLOPS per GPU"
    )
    assert Utilization().line({"throughput": 50.0}) == ""


def test_the_sequence_length_comes_from_the_flag_or_a_hyperparameter() -> None:
    assert Utilization.of({"max_seq_length": 512}, None, None).seq_len == 512
    assert Utilization.of({"block_size": 128, "seq_len": 256}, None, None).seq_len == 256
    assert Utilization.of({"seq_len": 256}, 2048, 989.0) == Utilization(2048, 989e12)
    assert Utilization.of({"seq_len": "long"}, None, None).seq_len is None
    # An HF script's own flag, in the experiment's entrypoint.
    hf = "python3 train.py --deepspeed ds.json --max_seq_length 512 --output_dir out"
    assert Utilization.of({}, None, None, hf).seq_len == 512
    assert (
        Utilization.of({}, None, None, ["python3", "run_clm.py", "--block_size=128"]).seq_len == 128
    )
    assert Utilization.of({"seq_len": 64}, None, None, hf).seq_len == 64  # the hyperparameter first


def test_a_search_reports_them_in_its_rows_summary_and_report(tmp_path: Path) -> None:
    model = BUILTIN_MODELS["gpt_1b_knobs_16xethernet"]
    slots = model.gpus
    spec = SearchSpec(
        {"deepspeed_config": "ds.json", "seq_len": 2048},
        {"train_micro_batch_size_per_gpu": 1, **model.base_ds_config},
        slots,
    )
    run_search(
        search_settings("binary", max_trials=8), spec, SimulatedRunner(model, slots), tmp_path
    )
    rows = [json.loads(line) for line in (tmp_path / TRIALS_FILE).read_text().splitlines()]
    ran = [row for row in rows[1:] if row["status"] == "completed"]
    assert ran
    for row in ran:
        metrics = row["metrics"]
        assert metrics["tokens_per_second"] == pytest.approx(metrics["throughput"] * 2048)
        # As the search counted the FLOPs in the end (the row's value), not as they were counted
        # when the row was first written.
        assert metrics["mfu"] == pytest.approx(row["value"] / model.peak_flops)
        assert 0 < metrics["mfu"] < 1
    summary = (tmp_path / SUMMARY_FILE).read_text()
    # The handed-over configuration's runs, as the global row averages them (not one lucky run),
    # and tokens/s both the trial's whole and per GPU.
    handed = re.search(r"^\| global .*\| (\S+) \(handed over\) *\|$", summary, re.M)
    assert handed is not None
    runs = [r for r in rows if r["name"] == handed.group(1) and r["kind"] in ("search", "confirm")]
    tokens = sum(r["metrics"]["throughput"] for r in runs) / len(runs) * 2048
    line = re.search(
        r"^handed-over throughput(?: \(the mean of its (\d+) runs\))?: (\S+) tokens/s "
        r"\(sequence 2048, (\S+) per GPU\), MFU ",
        summary,
        re.M,
    )
    assert line is not None, summary
    assert int(line.group(1) or 1) == len(runs)
    assert float(line.group(2)) == pytest.approx(tokens, rel=1e-3)
    assert float(line.group(3)) == pytest.approx(tokens / slots, rel=1e-3)
    _, page = write_report(tmp_path)
    html = page.read_text()
    assert "<th>tokens/s</th><th>MFU</th>" in html
