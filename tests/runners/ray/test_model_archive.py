"""What travels to the nodes: the model dir as the local runner copies it, permissions kept."""

from __future__ import annotations

import os
from pathlib import Path

from dsat.runners.ray.model_archive import model_archive, unpack


def test_the_archive_holds_what_a_local_trial_copy_holds(tmp_path: Path) -> None:
    model = tmp_path / "model"
    (model / "data").mkdir(parents=True)
    (model / "train.sh").write_text("#!/bin/sh\necho hi\n")
    os.chmod(model / "train.sh", 0o755)
    (model / "data" / "x.txt").write_text("x")
    (model / "__pycache__").mkdir()
    (model / "__pycache__" / "m.pyc").write_bytes(b"\0")
    results = model / "dsat-results" / "run"  # a search's results inside MODEL_DIR
    results.mkdir(parents=True)
    (results / "trials.jsonl").write_text("{}\n")
    for left_by_a_run_by_hand in ("model_info.json", "autotuning_metric.json"):
        (model / left_by_a_run_by_hand).write_text('{"throughput": 999}')
    (model / "dsat_trial_outcome.json").write_text('{"status": "completed"}')
    extra = tmp_path / "shared.py"
    extra.write_text("SHARED = 1\n")

    target = tmp_path / "node"
    unpack(model_archive(model, (extra,), results), target)

    files = sorted(str(p.relative_to(target)) for p in target.rglob("*") if p.is_file())
    assert files == ["data/x.txt", "shared.py", "train.sh"]
    assert os.access(target / "train.sh", os.X_OK)  # an entrypoint may be an executable script
