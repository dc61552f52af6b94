"""A trial's actor on a node, as a plain object here: what it starts and with which interpreter."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from dsat.runners.local.entrypoint import NODE_PYTHON, trial_command
from dsat.runners.ray.model_archive import model_archive
from dsat.runners.ray.node_host import TrialNodeHost


def test_a_command_built_on_the_driver_runs_with_the_nodes_own_interpreter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """dsat's interpreter path on the machine it runs on (a laptop's venv) need not exist on the
    cluster's nodes: the driver names none, each node runs its own."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "job.py").write_text("import sys\nprint('ran by', sys.executable)\n")
    command = trial_command(["python3", "job.py"], 1, 0, python=NODE_PYTHON)
    assert command == [NODE_PYTHON, "job.py"] and sys.executable not in command
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "node-tmp"))
    (tmp_path / "node-tmp").mkdir()
    host = TrialNodeHost("search/001-node0")
    host.prepare(model_archive(model, (), tmp_path / "results"), {})
    host.start(command, {})
    deadline = time.monotonic() + 60
    while host.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    log = host.read_log(0, 1 << 20).decode()
    assert host.poll() == 0, log
    assert f"ran by {sys.executable}" in log and NODE_PYTHON not in log
    host.clean()
