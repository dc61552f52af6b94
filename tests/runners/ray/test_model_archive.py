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

    os.chmod(model / "train.sh", 0o555)  # a read-only model dir: its copy takes the trial's files
    unpack(model_archive(model, (), results), tmp_path / "again")
    assert os.stat(tmp_path / "again" / "train.sh").st_mode & 0o777 == 0o755


def test_a_link_to_a_folder_travels_as_the_local_copy_takes_it(tmp_path: Path) -> None:
    """``data -> /datasets/x`` in the model dir: the local runner's copy follows it, and the Ray
    runner's archive left it out, so the trial failed on Ray alone (FileNotFoundError). A link
    back to a folder above it is not walked round and round."""
    shared = tmp_path / "datasets" / "x"
    shared.mkdir(parents=True)
    (shared / "x.txt").write_text("x")
    model = tmp_path / "model"
    model.mkdir()
    (model / "train.py").write_text("print(open('data/x.txt').read())\n")
    (model / "data").symlink_to(shared, target_is_directory=True)
    (model / "loop").mkdir()
    (model / "loop" / "back").symlink_to(model, target_is_directory=True)

    target = tmp_path / "node"
    unpack(model_archive(model, (), tmp_path / "results"), target)

    files = sorted(str(p.relative_to(target)) for p in target.rglob("*") if p.is_file())
    assert files == ["data/x.txt", "train.py"]
    assert (target / "data" / "x.txt").read_text() == "x"
