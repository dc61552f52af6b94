"""A search whose output's reader left (``dsat ... | head -1``) goes on to its end."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.dsat_process import env
from tests.test_search_launch import SIMULATED_ARGV


def test_a_search_whose_reader_left_draws_its_report_and_ends_as_it_would(
    tmp_path: Path,
) -> None:
    """Its first print after the reader left raised BrokenPipeError: a traceback, exit status 1
    and no report, after "Logging error" blocks for every log line before."""
    results = tmp_path / "r"
    searched = ["random", *SIMULATED_ARGV[1:-1], "12", "--results-dir", str(results)]
    command = [sys.executable, "-m", "dsat", *searched]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env()
    )
    assert process.stdout is not None and process.stderr is not None
    assert process.stdout.readline().startswith("dsat: ")
    process.stdout.close()  # as `| head -1` does
    err = process.stderr.read()
    assert process.wait(timeout=300) == 0, err[-3000:]
    assert "Traceback" not in err and "Logging error" not in err, err[-3000:]
    assert (results / "report.png").is_file() and (results / "summary.txt").is_file()
    # And its report, to a reader gone before it began.
    report = subprocess.Popen(
        [sys.executable, "-m", "dsat", "report", str(results)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env(),
    )
    assert report.stdout is not None and report.stderr is not None
    report.stdout.close()
    err = report.stderr.read()
    assert report.wait(timeout=300) == 0 and "Traceback" not in err, err[-3000:]
