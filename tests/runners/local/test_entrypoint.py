"""Entrypoints to local commands: Determined's launch layers dropped, torchrun for several slots."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from dsat.errors import DsatError
from dsat.runners.local.entrypoint import (
    check_program,
    entrypoint_tokens,
    interpreter_first,
    strip_determined_launcher,
    trial_class,
    trial_command,
    trial_environment,
)


def test_entrypoint_as_string_or_list() -> None:
    assert entrypoint_tokens("python3 train.py --lr 0.1", "x.yaml") == [
        "python3",
        "train.py",
        "--lr",
        "0.1",
    ]
    assert entrypoint_tokens(["python3", "train.py", 3], "x.yaml") == ["python3", "train.py", "3"]


@pytest.mark.parametrize("bad", [None, "", "  ", [], "python3 'unclosed"])
def test_missing_or_unparsable_entrypoint_names_the_file(bad: object) -> None:
    with pytest.raises(DsatError, match="x.yaml"):
        entrypoint_tokens(bad, "x.yaml")  # type: ignore[arg-type]


@pytest.mark.parametrize("word", [None, True, ["train.py"], {"script": "train.py"}])
def test_an_entrypoint_item_that_is_no_word_is_one_line(word: object) -> None:
    """YAML's null in a list became the word "None", and the trial could not start."""
    with pytest.raises(DsatError) as raised:
        entrypoint_tokens(["python3", word, "3"], "x.yaml")  # type: ignore[list-item]
    assert str(raised.value) == (
        f"x.yaml: entrypoint item 2 is {word!r}; give each word of the command as a string"
    )


@pytest.mark.parametrize(
    "launcher",
    [
        "python3 -m determined.launch.deepspeed",
        "python3 -m determined.launch.torch_distributed --trial",
        "python -m determined.launch.deepspeed --autotuning",
    ],
)
def test_determined_launch_layers_are_dropped(launcher: str) -> None:
    tokens = entrypoint_tokens(f"{launcher} python3 train.py --x 1", "x.yaml")
    assert strip_determined_launcher(tokens) == ["python3", "train.py", "--x", "1"]


def test_other_modules_are_kept() -> None:
    tokens = ["python3", "-m", "mypackage.train", "--x"]
    assert strip_determined_launcher(tokens) == tokens


def test_single_slot_runs_the_script_with_this_interpreter() -> None:
    assert trial_command(["python3", "train.py"], 1, 1234) == [sys.executable, "train.py"]
    assert trial_command(["bash", "run.sh"], 1, 1234) == ["bash", "run.sh"]


def test_several_slots_run_under_torchrun_on_the_given_port() -> None:
    command = trial_command(
        ["python3", "-m", "determined.launch.deepspeed", "python3", "train.py"], 2, 4321
    )
    assert command[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert command[command.index("--nproc_per_node") + 1] == "2"
    assert command[command.index("--master_port") + 1] == "4321"
    assert command[-1] == "train.py" and "--no-python" not in command
    shell = trial_command(["bash", "run.sh"], 2, 4321)
    assert shell[-3:] == ["--no-python", "bash", "run.sh"]


def test_launcher_without_a_command_is_a_user_error() -> None:
    with pytest.raises(DsatError, match="no training command"):
        trial_command(["python3", "-m", "determined.launch.deepspeed"], 1, 1)


def test_a_program_that_is_not_there_is_one_line_before_any_trial(tmp_path: Path) -> None:
    """The model-profile trial failed on it, after the launch had passed the input."""
    model, tools = tmp_path / "model", tmp_path / "tools"  # --include ../tools: tools/go.sh
    for folder, script in ((model, "run.sh"), (tools, "go.sh")):
        folder.mkdir()
        (folder / script).write_text("#!/bin/sh\n")
    for command in (
        ["python3", "train.py"],
        ["./run.sh"],
        ["sh", "run.sh"],
        ["model_def:Trial"],
        ["tools/go.sh"],
        [str(tools / "go.sh")],
    ):
        check_program(command, model, [tools], "e.yaml")
    with pytest.raises(
        DsatError,
        match=r"^e.yaml: the entrypoint runs no_such_prog_x, which is "
        r"not on this machine's PATH; fix the command",
    ):
        check_program(["no_such_prog_x", "train.py"], model, [tools], "e.yaml")
    with pytest.raises(DsatError, match="runs ./gone.sh, which is not in MODEL_DIR nor any"):
        check_program(["./gone.sh"], model, [tools], "e.yaml")


@pytest.mark.parametrize(
    ("entrypoint", "expected"),
    [
        ("python3 -m determined.launch.deepspeed --trial model_def:MyTrial", "model_def:MyTrial"),
        ("python3 -m determined.launch.torch_distributed --trial=a.b:T", "a.b:T"),
        ("model_def:MyTrial", "model_def:MyTrial"),
        # Without --trial, and Determined's harness named directly: both ran the class name as
        # a command and failed with cause unknown.
        ("python3 -m determined.launch.deepspeed model_def:MyTrial", "model_def:MyTrial"),
        ("python3 -m determined.exec.harness model_def:MyTrial", "model_def:MyTrial"),
        ("python -m determined.exec.harness --trial model_def:T", "model_def:T"),
        ("python3 train.py --data s3://bucket/x", None),
        ("python3 -m determined.launch.deepspeed python3 train.py", None),
        ("./run.sh", None),
    ],
)
def test_trial_class_entrypoints_are_recognised(entrypoint: str, expected: str | None) -> None:
    assert trial_class(entrypoint_tokens(entrypoint, "x.yaml")) == expected


def test_trials_find_dsats_interpreter_tools_first_once() -> None:
    bin_dir = str(Path(sys.executable).parent)
    env = interpreter_first({"PATH": "/usr/bin:/bin", "X": "1"})
    assert env["PATH"] == f"{bin_dir}{os.pathsep}/usr/bin:/bin" and env["X"] == "1"
    assert interpreter_first(env) == env  # already first: left as it is
    assert interpreter_first({})["PATH"] == bin_dir


def test_trial_processes_write_their_output_unbuffered_unless_the_user_chose() -> None:
    """Both runners start a trial's processes with it (the local one, and Ray's node host)."""
    env = trial_environment({"PATH": "/usr/bin"})
    assert env["PYTHONUNBUFFERED"] == "1" and env["PATH"] == interpreter_first(env)["PATH"]
    assert trial_environment({"PYTHONUNBUFFERED": ""})["PYTHONUNBUFFERED"] == ""
