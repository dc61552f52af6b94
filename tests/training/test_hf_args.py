"""HF Trainer arguments rewritten to carry a trial's DeepSpeed overrides."""

from __future__ import annotations

import json
import logging
import shlex
from pathlib import Path
from typing import Any

import pytest

from dsat import get_hf_args_with_overwrites
from dsat.constants import AUTOTUNING_KEY, ENV_HPARAMS_FILE
from dsat.errors import DsatError
from dsat.memory import Precision
from dsat.training.step_clock import current_clock, trial_precision

BASE = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "zero_optimization": {"stage": 1, "overlap_comm": True},
}


@pytest.fixture(autouse=True)
def in_a_trial_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run by hand, a trial's files go to the working directory: here, the test's own."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(ENV_HPARAMS_FILE, raising=False)


@pytest.fixture
def ds_path(tmp_path: Path) -> Path:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(BASE))
    return path


def _hparams(**overwrites: Any) -> dict[str, Any]:
    return {"deepspeed_config": "ds_config.json", "overwrite_deepspeed_args": overwrites}


def _value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_rewrites_flags_and_config(
    ds_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    caplog.set_level(logging.INFO)
    args = [
        "--output_dir",
        "out",
        "--deepspeed",
        str(ds_path),
        "--per_device_train_batch_size",
        "8",
    ]
    hparams = _hparams(
        train_micro_batch_size_per_gpu=3,
        gradient_accumulation_steps=2,
        train_batch_size=12,
        zero_optimization={"stage": 3},
    )
    new = get_hf_args_with_overwrites(args, hparams)
    assert _value(new, "--per_device_train_batch_size") == "3"
    assert _value(new, "--gradient_accumulation_steps") == "2"  # added: HF's default would be 1
    merged_path = Path(_value(new, "--deepspeed"))
    assert merged_path == Path("ds_config.dsat.json")  # in the working directory, by its name
    merged = json.loads(merged_path.read_text())
    assert merged["zero_optimization"] == {"stage": 3, "overlap_comm": True}
    assert merged["train_batch_size"] == 12
    assert json.loads(ds_path.read_text()) == BASE  # the user's file is untouched
    # Nothing else beside it: the merged file is written whole by each rank, with no lock file.
    assert sorted(p.name for p in ds_path.parent.iterdir()) == sorted(
        [ds_path.name, merged_path.name]
    )  # (the test's directory is both the trial's and the one --deepspeed names)
    assert _value(new, "--output_dir") == "out" and args[3] == str(ds_path)  # input list untouched
    assert "changing --per_device_train_batch_size from 8 to 3" in caplog.text
    # Said in the trial's log: its first line is the command with the user's own flags, and a
    # script that does not print its arguments left no trace of what the trial ran with.
    assert f"dsat: HF arguments as dsat sets them: {shlex.join(new)}" in capsys.readouterr().err


def test_a_search_trials_clock_knows_the_trainers_inputs_lead_with_the_batch(
    ds_path: Path,
) -> None:
    window = {AUTOTUNING_KEY: {"enabled": True, "start_profile_step": 3, "end_profile_step": 5}}
    get_hf_args_with_overwrites(["--deepspeed", str(ds_path)], _hparams(**window))
    clock = current_clock()
    assert clock is not None and clock.batch_first


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--bf16"], Precision.BF16),
        (["--fp16", "true"], Precision.FP16),
        ([], Precision.FP32),
        (["--bf16", "0"], Precision.FP32),  # HF's string_to_bool: 0, no, n, f, false are false
        (["--bf16=no", "--fp16", "--output_dir", "o"], Precision.FP16),
    ],
)
def test_a_model_profile_knows_the_precision_the_trainer_fills_in(
    tmp_path: Path, flags: list[str], expected: Precision
) -> None:
    """A JSON's "auto" precision is the Trainer's flag: the profile (no clock) still notes it."""
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({**BASE, "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}}))
    profile = {AUTOTUNING_KEY: {"enabled": True, "model_info": {"profile": True}}}
    get_hf_args_with_overwrites(["--deepspeed", str(path), *flags], _hparams(**profile))
    assert current_clock() is None
    assert trial_precision() is expected


def test_equals_forms_and_dash_spelling(ds_path: Path) -> None:
    args = [
        f"--deepspeed={ds_path}",
        "--per-device-train-batch-size=8",
        "--gradient_accumulation_steps=4",
    ]
    new = get_hf_args_with_overwrites(
        args, _hparams(train_micro_batch_size_per_gpu=5, gradient_accumulation_steps=1)
    )
    assert new[1:] == ["--per_device_train_batch_size=5", "--gradient_accumulation_steps=1"]
    assert new[0].startswith("--deepspeed=") and new[0].endswith("ds_config.dsat.json")


def test_a_flag_given_twice_is_read_and_set_where_hf_reads_it_the_last(
    ds_path: Path, tmp_path: Path
) -> None:
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**BASE, "zero_optimization": {"stage": 2}}))
    args = ["--deepspeed", str(other), "--per_device_train_batch_size", "4"]
    args += ["--deepspeed", str(ds_path), "--per_device_train_batch_size", "2"]
    new = get_hf_args_with_overwrites(args, _hparams(train_micro_batch_size_per_gpu=8))
    last = len(new) - 1 - new[::-1].index("--per_device_train_batch_size")
    assert new[last + 1] == "8"  # what argparse keeps
    merged = Path(new[len(new) - 1 - new[::-1].index("--deepspeed") + 1])
    assert merged.name == "ds_config.dsat.json"  # merged from the file HF loads
    assert json.loads(merged.read_text())["zero_optimization"] == BASE["zero_optimization"]


def test_auto_values_are_left_to_hf(ds_path: Path) -> None:
    args = ["--deepspeed", str(ds_path), "--per_device_train_batch_size", "8"]
    new = get_hf_args_with_overwrites(args, _hparams(zero_optimization={"stage": 2}))
    assert _value(new, "--per_device_train_batch_size") == "8"
    assert "--gradient_accumulation_steps" not in new


def test_the_trials_config_goes_to_its_own_directory_whatever_the_path_to_yours(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--deepspeed /abs/ds_config.json`` had every trial write ds_config.dsat.json beside the
    user's file, in their model dir, and trials running at once shared that one file."""
    mine = tmp_path / "model" / "ds_config.json"
    mine.parent.mkdir()
    mine.write_text(json.dumps(BASE))
    written = []
    for name in ("001-a", "002-b"):
        trial = tmp_path / "trials" / name
        trial.mkdir(parents=True)
        monkeypatch.setenv(ENV_HPARAMS_FILE, str(trial / "dsat_hparams.json"))
        new = get_hf_args_with_overwrites(
            ["--deepspeed", str(mine)], _hparams(train_micro_batch_size_per_gpu=len(written) + 2)
        )
        written.append(Path(_value(new, "--deepspeed")))
    assert written == [tmp_path / "trials" / n / "ds_config.dsat.json" for n in ("001-a", "002-b")]
    assert [json.loads(w.read_text())["train_micro_batch_size_per_gpu"] for w in written] == [2, 3]
    assert sorted(p.name for p in mine.parent.iterdir()) == ["ds_config.json"]


def test_no_overwrites_is_a_no_op(ds_path: Path) -> None:
    args = ["--deepspeed", str(ds_path)]
    assert get_hf_args_with_overwrites(args, {"deepspeed_config": "ds_config.json"}) == args
    assert not (ds_path.parent / "ds_config.dsat.json").exists()


def test_calling_twice_gives_the_same_result(ds_path: Path) -> None:
    args = ["--deepspeed", str(ds_path)]
    hparams = _hparams(train_micro_batch_size_per_gpu=2)
    first = get_hf_args_with_overwrites(args, hparams)
    assert get_hf_args_with_overwrites(args, hparams) == first  # e.g. once per rank


def test_missing_deepspeed_flag(ds_path: Path) -> None:
    with pytest.raises(DsatError, match="no --deepspeed PATH"):
        get_hf_args_with_overwrites(
            ["--output_dir", "x"], _hparams(train_micro_batch_size_per_gpu=2)
        )
    with pytest.raises(DsatError, match="no --deepspeed PATH"):
        get_hf_args_with_overwrites(["--deepspeed"], _hparams(train_micro_batch_size_per_gpu=2))


def test_a_deepspeed_path_that_is_not_there_leaves_no_lock_file(tmp_path: Path) -> None:
    args = ["--deepspeed", str(tmp_path / "nope.json")]
    with pytest.raises(DsatError, match="nope.json"):
        get_hf_args_with_overwrites(args, _hparams(train_micro_batch_size_per_gpu=2))
    assert list(tmp_path.iterdir()) == []


def test_the_fit_ladders_checkpointing_rung_turns_on_hf_gradient_checkpointing(
    ds_path: Path,
) -> None:
    args = ["--deepspeed", str(ds_path), "--gradient_checkpointing", "false"]
    on = {**_hparams(zero_optimization={"stage": 3}), "gradient_checkpointing": True}
    assert _value(get_hf_args_with_overwrites(args, on), "--gradient_checkpointing") == "true"
    off = {**_hparams(zero_optimization={"stage": 3}), "gradient_checkpointing": False}
    assert _value(get_hf_args_with_overwrites(args, off), "--gradient_checkpointing") == "false"


@pytest.mark.parametrize("at_end", [False, True])
def test_a_bare_checkpointing_switch_keeps_the_words_after_it(ds_path: Path, at_end: bool) -> None:
    """`--gradient_checkpointing --max_steps 20` became `--gradient_checkpointing true 20`, and
    at the end the switch ate the batch size dsat had just added: HF refused both."""
    rest = ["--max_steps", "20"]
    args = ["--deepspeed", str(ds_path), *(rest if at_end else [])]
    args += ["--gradient_checkpointing", *([] if at_end else rest)]
    on = {**_hparams(train_micro_batch_size_per_gpu=16), "gradient_checkpointing": True}
    got = get_hf_args_with_overwrites(args, on)
    assert _value(got, "--gradient_checkpointing") == "true"
    assert _value(got, "--max_steps") == "20"
    assert _value(got, "--per_device_train_batch_size") == "16"


def test_the_newer_checkpointing_switch_is_turned_on_where_the_user_passes_it(
    ds_path: Path,
) -> None:
    """transformers 5 reads --gradient_checkpointing only where --activation_checkpointing is
    unset: with the user's `--activation_checkpointing false` the rung trained without it."""
    args = ["--deepspeed", str(ds_path), "--activation_checkpointing", "false"]
    on = {**_hparams(zero_optimization={"stage": 3}), "gradient_checkpointing": True}
    got = get_hf_args_with_overwrites(args, on)
    assert _value(got, "--activation_checkpointing") == "true"
    assert _value(got, "--gradient_checkpointing") == "true"
    # Not added where the user does not pass it: an older transformers refuses it.
    plain = get_hf_args_with_overwrites(["--deepspeed", str(ds_path)], on)
    assert "--activation_checkpointing" not in plain


def test_arguments_in_a_file_are_named_where_no_deepspeed_flag_is_found(ds_path: Path) -> None:
    with pytest.raises(DsatError, match=r"arguments in args\.json are read by the script"):
        get_hf_args_with_overwrites(["args.json"], _hparams(train_micro_batch_size_per_gpu=2))


def test_deepspeeds_own_switch_is_no_hf_trainers_flag() -> None:
    """A plain DeepSpeed script started as DeepSpeed's examples are (`--deepspeed
    --deepspeed_config ds.json`, deepspeed.add_config_arguments) was told, when it ignored the
    trial's config, to build HF TrainingArguments."""
    from dsat.training.hf_args import passes_deepspeed

    assert passes_deepspeed(["--deepspeed", "ds.json", "--output_dir", "out"])
    assert passes_deepspeed(["--deepspeed=ds.json"])
    assert not passes_deepspeed(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert not passes_deepspeed(["--lr", "1", "--deepspeed"])
    assert not passes_deepspeed(["--deepspeed_config", "ds.json"])
