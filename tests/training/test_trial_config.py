"""Trial-side config and hyperparameter access."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import dsat
from dsat.constants import ENV_HPARAMS_FILE
from dsat.errors import DsatError


def test_get_ds_config_from_hparams_merges_overrides(tmp_path: Path) -> None:
    (tmp_path / "ds.json").write_text(
        json.dumps({"zero_optimization": {"stage": 1, "overlap_comm": True}, "x": 1})
    )
    hparams = {
        "deepspeed_config": "ds.json",
        "overwrite_deepspeed_args": {"zero_optimization": {"stage": 3}},
    }
    config = dsat.get_ds_config_from_hparams(hparams, base_dir=tmp_path)
    assert config == {"zero_optimization": {"stage": 3, "overlap_comm": True}, "x": 1}


def test_get_ds_config_from_hparams_without_overrides(tmp_path: Path) -> None:
    (tmp_path / "ds.json").write_text('{"a": 1}')
    assert dsat.get_ds_config_from_hparams({"deepspeed_config": "ds.json"}, str(tmp_path)) == {
        "a": 1
    }


def test_get_ds_config_from_hparams_needs_the_key() -> None:
    with pytest.raises(DsatError, match="hyperparameters.deepspeed_config is missing"):
        dsat.get_ds_config_from_hparams({"lr": 1})
    # The reference's DeepSpeedTrial page puts a config inline: "is missing" of a key that is there.
    with pytest.raises(DsatError, match=r"deepspeed_config is a dict, not a path; set it to the"):
        dsat.get_ds_config_from_hparams({"deepspeed_config": {"train_batch_size": 8}})


def test_get_ds_config_from_hparams_missing_file(tmp_path: Path) -> None:
    with pytest.raises(DsatError, match="not found"):
        dsat.get_ds_config_from_hparams({"deepspeed_config": "nope.json"}, tmp_path)


def test_a_script_that_changed_directory_is_told_so_not_to_fix_a_right_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After ``os.chdir('/tmp')`` it said "ds_config.json: DeepSpeed config not found ...; fix
    the path", of the YAML's path dsat had checked at launch."""
    (tmp_path / "trial").mkdir()
    (tmp_path / "trial" / "ds_config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)  # the script's os.chdir, away from its trial directory
    with pytest.raises(DsatError) as err:
        dsat.get_ds_config_from_hparams({"deepspeed_config": "ds_config.json"})
    message = str(err.value)
    assert f"not in the working directory {tmp_path}" in message and "base_dir=" in message
    assert "fix the path" not in message
    config = dsat.get_ds_config_from_hparams({"deepspeed_config": "ds_config.json"}, "trial")
    assert config == {}


def test_overwrite_deepspeed_config_takes_a_dict_or_a_path(tmp_path: Path) -> None:
    base = {"optimizer": {"type": "Adam", "params": {"lr": 0.1, "eps": 1e-8}}}
    overwrites = {"optimizer": {"params": {"lr": 0.005}}, "train_batch_size": 16}
    expected = {
        "optimizer": {"type": "Adam", "params": {"lr": 0.005, "eps": 1e-8}},
        "train_batch_size": 16,
    }
    assert dsat.overwrite_deepspeed_config(base, overwrites) == expected
    (tmp_path / "ds.json").write_text(json.dumps(base))
    assert dsat.overwrite_deepspeed_config(tmp_path / "ds.json", overwrites) == expected
    assert dsat.overwrite_deepspeed_config(str(tmp_path / "ds.json"), overwrites) == expected


def test_get_hparams_from_a_dsat_runner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hparams = {
        "deepspeed_config": "ds.json",
        "overwrite_deepspeed_args": {"train_micro_batch_size_per_gpu": 3},
    }
    (tmp_path / "hp.json").write_text(json.dumps(hparams))
    monkeypatch.setenv(ENV_HPARAMS_FILE, str(tmp_path / "hp.json"))
    assert dsat.get_hparams() == hparams


def test_get_hparams_unreadable_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "hp.json").write_text("[1]")
    monkeypatch.setenv(ENV_HPARAMS_FILE, str(tmp_path / "hp.json"))
    with pytest.raises(DsatError, match="JSON object"):
        dsat.get_hparams()
    monkeypatch.setenv(ENV_HPARAMS_FILE, str(tmp_path / "missing.json"))
    with pytest.raises(DsatError, match="cannot read"):
        dsat.get_hparams()


def test_get_hparams_off_cluster_without_a_runner(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_HPARAMS_FILE, raising=False)
    with pytest.raises(DsatError, match="launch this script with"):
        dsat.get_hparams()


def test_get_hparams_on_a_cluster_reads_the_trials_cluster_info(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from determined import _info

    from tests.runners.fake_master import trial_cluster_info

    hparams = {"deepspeed_config": "ds.json", "_use_dsat_mode": True}
    monkeypatch.delenv(ENV_HPARAMS_FILE, raising=False)
    monkeypatch.setattr(_info, "_info", trial_cluster_info(7, hparams))
    assert dsat.get_hparams() == hparams


def test_importing_dsat_loads_neither_torch_nor_deepspeed() -> None:
    import subprocess
    import sys

    code = "import sys, dsat; print('torch' in sys.modules, 'deepspeed' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_op_length_is_the_trials_whenever_the_script_makes_its_context(tmp_path: Path) -> None:
    """A script ported from Determined may call det.core.init() before dsat.get_hparams(); its
    operation still has the trial's length, and a process running trial after trial (a trial
    host) gives each its own. Without a dsat trial's environment nothing changes."""
    import os
    import subprocess
    import sys

    from dsat.constants import ENV_TRIAL_LENGTH

    code = (
        "import os, dsat, determined as det\n"
        "def length():\n"
        "    with det.core.init(checkpoint_storage=os.getcwd()) as context:\n"
        "        return next(context.searcher.operations()).length\n"
        "first = length()\n"
        f"os.environ[{ENV_TRIAL_LENGTH!r}] = '7'  # the host's next trial\n"
        "print(first, length())\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in (ENV_HPARAMS_FILE, ENV_TRIAL_LENGTH)}
    run = [sys.executable, "-c", code]
    in_trial = subprocess.run(
        run, env={**env, ENV_TRIAL_LENGTH: "15"}, cwd=tmp_path, capture_output=True, text=True
    )
    assert in_trial.stdout.split() == ["15", "7"], in_trial.stderr
    by_hand = subprocess.run(
        [sys.executable, "-c", "import sys, dsat; print('determined' in sys.modules)"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert by_hand.stdout.split() == ["False"]  # nothing of Determined's loaded, nothing patched


def test_overrides_that_are_not_a_mapping_are_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / "ds.json").write_text("{}")
    hparams = {"deepspeed_config": "ds.json", "overwrite_deepspeed_args": "stage=2"}
    with pytest.raises(DsatError, match="overwrite_deepspeed_args must be a mapping"):
        dsat.get_ds_config_from_hparams(hparams, tmp_path)
    with pytest.raises(DsatError, match="overwrite_deepspeed_args must be a mapping"):
        dsat.get_hf_args_with_overwrites(["--deepspeed", str(tmp_path / "ds.json")], hparams)


def test_an_older_python_is_told_what_dsat_needs_in_one_line() -> None:
    """On a cluster the uploaded package runs on the task image's Python, which pip never
    checked: 3.8 failed deep in an import, and the search runner's restarts replayed it."""
    import subprocess
    import sys

    code = "import sys; sys.version_info = (3, 9, 18, 'final', 0); import dsat"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 1
    assert run.stderr.strip().splitlines() == [
        f"dsat needs Python 3.10 or later; {sys.executable} is {sys.version.split()[0]}: on "
        "Determined, give the experiment an image with Python 3.10+ (environment.image)"
    ]
