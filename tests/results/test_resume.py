"""--resume continues the same search: its saved settings, its budget, its printed command.

An interrupted search is made by a simulator that raises KeyboardInterrupt at a chosen call, which
is what Ctrl-C does to dsat mid-search.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from dsat.cli import main, parse_settings
from dsat.constants import SETTINGS_FILE, STATE_FILE
from dsat.errors import DsatError
from dsat.paths import shown
from dsat.results.directory import TRIALS_FILE
from dsat.results.directory_lock import results_directory_lock
from tests.conftest import REPO_ROOT
from tests.test_cli import assert_one_line_error

SIMULATED = REPO_ROOT / "examples" / "simulated"
STOPPING_SIMULATOR = """
import os
from dsat.runners.simulated.performance_models import gpt2_large_16xv100

calls = 0


def perf(ds_config, slots):
    global calls
    calls += 1
    if calls == int(os.environ.get("STOP_AT_CALL", "0")):
        raise KeyboardInterrupt  # Ctrl-C while this trial runs
    return gpt2_large_16xv100(ds_config, slots)
"""
ORIGINAL_FLAGS = [
    "--max-trials",
    "14",
    "--zero-stages",
    "0",
    "1",
    "2",
    "3",
    "--search-range-factor",
    "0.5",
    "--metric",
    "throughput",
    "--max-concurrent-trials",
    "1",
]


def rows(results: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (results / TRIALS_FILE).read_text().splitlines()]


def interrupt_at(
    call: int,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    experiment: Path = SIMULATED,
    *extra: str,
) -> int:
    """A search of ``experiment``'s GPT2-large run from tmp_path into ``out``, Ctrl-C'd in its
    ``call``-th trial; returns dsat's exit code."""
    (tmp_path / "sim.py").write_text(STOPPING_SIMULATOR)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("STOP_AT_CALL", str(call))
    args = ["asha", str(experiment / "gpt2_large.yaml"), str(experiment), "--runner", "simulated"]
    try:
        return main(
            [*args, "--simulator", "sim.py:perf", "--results-dir", "out", *ORIGINAL_FLAGS, *extra]
        )
    finally:
        monkeypatch.delenv("STOP_AT_CALL")


@pytest.fixture
def interrupted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> tuple[Path, str]:
    """A search interrupted a few trials in, started with relative paths from tmp_path; returns
    its results dir and the resume command dsat printed."""
    code = interrupt_at(6, tmp_path, monkeypatch)
    err = capsys.readouterr().err
    assert code == 130 and 2 <= len(rows(tmp_path / "out")) < 14, err
    hint = err.strip().splitlines()[-1]
    assert "Resume with: " in hint
    return tmp_path / "out", hint.split("Resume with: ", 1)[1]


def test_the_printed_resume_command_works_as_printed_and_keeps_the_settings(
    interrupted: tuple[Path, str], tmp_path: Path
) -> None:
    results, command = interrupted
    saved = (results / SETTINGS_FILE).read_text()
    assert json.loads(saved)["max_trials"] == 14
    assert shlex.split(command)[-2:] == ["--resume", "out"]  # as the user named it
    # Pasted into the shell it was printed in: the same PATH, nothing else of the environment.
    env = {"PYTHONPATH": str(REPO_ROOT), "PATH": os.environ["PATH"]}
    resumed = subprocess.run(
        command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert resumed.returncode == 0, resumed.stderr
    finished = [row for row in rows(results) if row["kind"] != "confirm"]
    assert len(finished) == 14  # the original budget, not the default 64
    assert len({row["request_id"] for row in finished}) == 14
    assert {row["zero_stage"] for row in finished[1:]} <= {0, 1, 2, 3}
    assert "best_metric_val" in resumed.stdout
    assert (results / SETTINGS_FILE).read_text() == saved  # what the search ran with, kept


def test_a_changed_flag_is_refused_and_a_safe_one_applied(
    interrupted: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    results, _ = interrupted
    error = assert_one_line_error(
        capsys, ["asha", "--resume", str(results), "-z", "1"], "--zero-stages", SETTINGS_FILE
    )
    assert "0 1 2 3" in error
    # A switch is named, not its value.
    switched = assert_one_line_error(
        capsys, ["asha", "--resume", str(results), "--no-baseline"], "--no-baseline differs from"
    )
    assert "False" not in switched and "True" not in switched
    # A value the search ran without is said so, not as Python's None.
    unset = assert_one_line_error(
        capsys, ["asha", "--resume", str(results), "--global-batch", "64"], "--global-batch 64"
    )
    assert "the saved search ran without it" in unset and "None" not in unset
    assert "(a batch it kept is your config's train_batch_size" in unset
    assert_one_line_error(capsys, ["binary", "--resume", str(results)], "`asha`", "--resume")
    # Named as the user typed it, not by the flag's hidden earlier name (--backend).
    runner = assert_one_line_error(
        capsys, ["asha", "--resume", str(results), "--runner", "local"], "--runner local differs"
    )
    assert "--backend" not in runner
    # Giving the original value again is no change.
    assert (
        main(["asha", "--resume", str(results), "--max-trials", "16", "--metric", "throughput"])
        == 0
    )
    assert len([row for row in rows(results) if row["kind"] != "confirm"]) == 16
    saved = json.loads((results / SETTINGS_FILE).read_text())
    assert saved["max_trials"] == 16 and saved["fresh_processes"] is False
    # Resumed once it has handed over (as for --run-full-experiment), it keeps saying why.
    summary = (results / "summary.txt").read_text()
    assert "handed over: " in summary
    assert main(["asha", "--resume", str(results)]) == 0
    assert (results / "summary.txt").read_text() == summary
    # The search has handed over now: more trials would run none, and that is said, not ignored.
    finished = len(rows(results))
    assert_one_line_error(
        capsys,
        ["asha", "--resume", str(results), "--max-trials", "20"],
        "has ended and handed over its config",
        "start a new search with --max-trials 20",
    )
    assert len(rows(results)) == finished


def test_settings_saved_under_the_flags_earlier_name_resume(
    interrupted: tuple[Path, str],
) -> None:
    """A results dir from before --backend became --runner keeps its runner."""
    results, _ = interrupted
    (results / ".trials.jsonl.x1y2.tmp").write_text("half a file a kill -9 left")
    saved = json.loads((results / SETTINGS_FILE).read_text())
    saved["backend"] = saved.pop("runner")
    (results / SETTINGS_FILE).write_text(json.dumps(saved))
    assert main(["asha", "--resume", str(results)]) == 0
    assert json.loads((results / SETTINGS_FILE).read_text())["runner"] == "simulated"
    assert len([row for row in rows(results) if row["kind"] != "confirm"]) == 14
    assert not list(results.glob(".*.tmp"))  # cleared on resume


def test_how_trials_start_may_change_on_resume(
    interrupted: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """A local runner's flag, taken on resume; this search's runner (the simulator) starts no
    process, so there it is refused rather than ignored."""
    results, _ = interrupted
    assert parse_settings(["asha", "--resume", str(results), "--fresh-processes"]).fresh_processes
    capsys.readouterr()
    assert main(["asha", "--resume", str(results), "--fresh-processes"]) == 2
    assert "--fresh-processes only applies to --runner local" in capsys.readouterr().err
    assert json.loads((results / SETTINGS_FILE).read_text())["fresh_processes"] is False


def tracker_edited(text: str, **changes: object) -> str:
    state = json.loads(text)
    return json.dumps({**state, "tracker": {**state["tracker"], **changes}})


def record_edited(text: str, number: int, **changes: object) -> str:
    state = json.loads(text)
    records = state["tracker"]["records"]
    records[number] = {**records[number], **changes}
    return json.dumps(state)


@pytest.mark.parametrize(
    ("name", "damage", "needle"),
    [
        (STATE_FILE, lambda text: text[: len(text) // 2], "damaged search state"),
        (
            STATE_FILE,
            lambda text: json.dumps({**json.loads(text), "method": "random"}),
            "'random', not 'asha'",
        ),
        (STATE_FILE, lambda text: json.dumps({**json.loads(text), "rng": 7}), "damaged"),
        # Ids that name no trial: a KeyError's traceback, from inside the search.
        (STATE_FILE, lambda text: tracker_edited(text, confirmed_id="nope"), "'nope' names no"),
        (STATE_FILE, lambda text: tracker_edited(text, queue=["nope"]), "'nope' names no trial"),
        # Values of the wrong kind, edited by hand: a RuntimeError's or TypeError's traceback.
        (
            STATE_FILE,
            lambda text: json.dumps({**json.loads(text), "next_index": -1}),
            "next_index -1 is not past the last trial's",
        ),
        (STATE_FILE, lambda text: record_edited(text, 2, mbs="big"), "mbs is 'big'"),
        (STATE_FILE, lambda text: record_edited(text, 2, gas=0), "gas is 0"),
        (STATE_FILE, lambda text: record_edited(text, 1, metrics=[]), "metrics is []"),
        (
            STATE_FILE,
            lambda text: json.dumps({**json.loads(text), "version": 99}),
            "written by a newer dsat (state version 99",
        ),
        (SETTINGS_FILE, lambda text: "{", "damaged search settings"),
        # Python's words of the first comparison to fail ("'<=' not supported between ..."),
        # naming no key.
        (
            SETTINGS_FILE,
            lambda text: json.dumps({**json.loads(text), "max_trials": "8"}),
            "'max_trials' is \"8\", not an integer",
        ),
        (
            SETTINGS_FILE,
            lambda text: json.dumps({**json.loads(text), "zero_stages": 2}),
            "'zero_stages' is 2, not a list of integers",
        ),
        (SETTINGS_FILE, lambda text: "[1]", "search settings are a JSON list, not an object"),
        (
            SETTINGS_FILE,
            lambda text: json.dumps({**json.loads(text), "new_knob": 1}),
            "written by a newer dsat, or edited",
        ),
        (STATE_FILE, lambda text: json.dumps({**json.loads(text), "tracker": None}), "not a dsat"),
        (TRIALS_FILE, lambda text: text + "{not json\n", "is not JSON"),
        (TRIALS_FILE, lambda text: text.replace('"end": ', '"end": null, "was": ', 1), "'end' is"),
        (TRIALS_FILE, lambda text: "[1, 2]\n" + text, "line 1 is not a trial's row (a JSON list"),
        # A row lost: the resume rewrote the summary's cost and numbered trials from what was left.
        (TRIALS_FILE, lambda text: "", "have no row there"),
        (TRIALS_FILE, lambda text: text.split("\n", 1)[1], "1 of the"),
    ],
)
def test_a_damaged_or_foreign_results_dir_is_one_line(
    interrupted: tuple[Path, str],
    capsys: pytest.CaptureFixture[str],
    name: str,
    damage: object,
    needle: str,
) -> None:
    results, _ = interrupted
    path = results / name
    path.write_text(damage(path.read_text()))  # type: ignore[operator]
    before = {file.name: file.read_bytes() for file in results.iterdir() if file.is_file()}
    assert_one_line_error(capsys, ["asha", "--resume", str(results)], name, needle)
    assert {file.name: file.read_bytes() for file in results.iterdir() if file.is_file()} == before


def test_a_torn_trials_file_is_said_before_the_runner_opens(
    interrupted: tuple[Path, str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It was said only once the slots were claimed and DeepSpeed's ops built."""
    from dsat.runners.simulated.setup import SimulatedSetup

    def opened(*args: object) -> None:
        raise AssertionError("the runner opened before the damaged file was said")

    monkeypatch.setattr(SimulatedSetup, "open", opened)
    results, _ = interrupted
    path = results / TRIALS_FILE
    path.write_text(path.read_text() + '{"trial": 9, "kind"\n')  # cut mid-row
    line = assert_one_line_error(capsys, ["asha", "--resume", str(results)], TRIALS_FILE)
    assert "is not JSON" in line and line.endswith(
        "put back the file as dsat wrote it to resume, or start a new search"
    )


def test_a_results_file_that_is_a_directory_says_to_move_it(
    interrupted: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """ "make it writable", said before, was no fix."""
    results, _ = interrupted
    (results / TRIALS_FILE).unlink()
    (results / TRIALS_FILE).mkdir()
    error = assert_one_line_error(capsys, ["asha", "--resume", str(results)], TRIALS_FILE)
    assert "is not a file: move it away" in error


def test_a_search_stopped_during_its_first_trial_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code = interrupt_at(1, tmp_path, monkeypatch)  # Ctrl-C during the model-profile trial
    assert code == 130 and "Resume with: " in capsys.readouterr().err
    assert not (tmp_path / "out" / TRIALS_FILE).exists()  # nothing finished
    assert main(["asha", "--resume", "out"]) == 0
    finished = [row for row in rows(tmp_path / "out") if row["kind"] != "confirm"]
    assert len(finished) == 14 and finished[0]["kind"] == "model_profile"


def test_config_and_model_dir_are_required_without_resume(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert_one_line_error(capsys, ["asha"], "CONFIG_PATH", "--resume")


def test_a_new_search_into_a_held_directory_names_the_search_it_holds(
    interrupted: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """It said `guided --resume out` of an asha search (this command's method), which was then
    refused; and offered to continue a search that had ended."""
    results, command = interrupted
    settings = json.loads((results / SETTINGS_FILE).read_text())
    new_search = [
        "guided", settings["config_path"], settings["model_dir"], "--runner", "simulated",
        "--simulator", settings["simulator"],
        "--results-dir", "out",
    ]  # fmt: skip
    assert main(new_search) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "dsat: error: --results-dir out already holds a search; continue it with "
        f"`{command}` or choose another directory"
    )
    state = json.loads((results / STATE_FILE).read_text())
    (results / STATE_FILE).write_text(json.dumps({**state, "shutdown_reason": "ended"}))
    assert main(new_search) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dsat: error: --results-dir out already holds a search, which has ended")
    assert err.endswith(f"`{command}` shows them again); choose another directory")


def test_a_directory_another_search_runs_in_is_one_line(
    interrupted: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Two resumes at once both ran every remaining trial, each rewriting the other's files."""
    results, _ = interrupted
    before = (results / TRIALS_FILE).read_text()
    settings = json.loads((results / SETTINGS_FILE).read_text())
    new_search = ["asha", settings["config_path"], settings["model_dir"], "--results-dir"]
    with results_directory_lock(results, "--resume"):  # as a search running there holds it
        for argv, flag in (
            (["asha", "--resume", str(results)], "--resume"),
            # It said "already holds a search; continue it with --resume", which then refused.
            ([*new_search, str(results)], "--results-dir"),
        ):
            assert main(argv) == 2
            out, err = capsys.readouterr()
            assert out == ""  # it printed its runner and experiment first
            assert err.strip() == (
                f"dsat: error: {flag} {shown(results)} is in use by another dsat search (pid "
                f"{os.getpid()}); wait for it to end, or choose another directory"
            )
    assert (results / TRIALS_FILE).read_text() == before
    assert main(["asha", "--resume", str(results)]) == 0  # once it has ended, it resumes


def test_a_results_directory_nothing_began_in_is_not_left_behind(tmp_path: Path) -> None:
    """A Ray cluster that could not be reached left dsat-results/<name>-<time>/ holding only the
    lock; a directory that was there before, or where a search wrote, stays."""
    fresh = tmp_path / "dsat-results" / "tiny-20261127T000000Z"
    with pytest.raises(DsatError), results_directory_lock(fresh):
        raise DsatError("the cluster did not answer")
    assert not fresh.exists() and (tmp_path / "dsat-results").is_dir()
    with results_directory_lock(fresh):
        (fresh / "settings.json").write_text("{}")
    assert (fresh / "settings.json").is_file()
    kept = tmp_path / "mine"
    kept.mkdir()
    with results_directory_lock(kept):
        pass
    assert kept.is_dir()


def test_more_trials_for_a_search_in_its_confirmation_round_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Taken and saved, and no trial more ran: the round ends the search whatever the budget."""
    # 14 trials and the baseline, then the round
    assert interrupt_at(17, tmp_path, monkeypatch) == 130
    assert any(row["kind"] == "confirm" for row in rows(tmp_path / "out"))
    capsys.readouterr()
    assert_one_line_error(
        capsys,
        ["asha", "--resume", "out", "--max-trials", "20"],
        "is in its confirmation round",
        "start a new search with --max-trials 20",
    )
    assert json.loads((tmp_path / "out" / SETTINGS_FILE).read_text())["max_trials"] == 14
    assert main(["asha", "--resume", "out"]) == 0  # as it was, it finishes


def test_an_experiment_edited_since_the_search_began_is_refused_on_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Trials at 16 GPUs and at 8 were ranked together, silently."""
    import shutil

    experiment = tmp_path / "simulated"
    shutil.copytree(SIMULATED, experiment)
    assert interrupt_at(6, tmp_path, monkeypatch, experiment) == 130
    capsys.readouterr()
    yaml_path = experiment / "gpt2_large.yaml"
    original = yaml_path.read_text()
    yaml_path.write_text(original.replace("slots_per_trial: 16", "slots_per_trial: 8"))
    before = rows(tmp_path / "out")
    assert_one_line_error(
        capsys,
        ["asha", "--resume", "out"],
        "the experiment changed since the search began (resources.slots_per_trial (16 -> 8))",
        "put it back as it was, or start a new search",
    )
    # Refused before anything is said: it printed the runner and "if stopped, resume with" first.
    assert main(["asha", "--resume", "out"]) == 2
    assert capsys.readouterr().out == ""
    assert rows(tmp_path / "out") == before
    yaml_path.write_text(original)  # put back
    # Another project's copy named on the command line is refused too, and leaves the settings
    # as they were: the plain resume still finds the search's own project.
    other = tmp_path / "other"
    shutil.copytree(experiment, other)
    (other / "gpt2_large.yaml").write_text(
        original.replace("slots_per_trial: 16", "slots_per_trial: 8")
    )
    settings = (tmp_path / "out" / SETTINGS_FILE).read_bytes()
    assert_one_line_error(
        capsys,
        ["asha", str(other / "gpt2_large.yaml"), str(other), "--resume", "out"],
        "the experiment changed since the search began",
    )
    assert (tmp_path / "out" / SETTINGS_FILE).read_bytes() == settings
    assert main(["asha", "--resume", "out"]) == 0


def test_a_project_that_moved_resumes_from_its_new_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its paths are saved absolute: the old one was "config file not found", and the new one,
    given, was refused as a changed flag; only editing settings.json by hand got it going."""
    import shutil

    old, new = tmp_path / "old", tmp_path / "new"
    shutil.copytree(SIMULATED, old)
    assert interrupt_at(6, tmp_path, monkeypatch, old) == 130
    capsys.readouterr()
    old.rename(new)
    assert_one_line_error(
        capsys,
        ["asha", "--resume", "out"],
        f"the search's config {old / 'gpt2_large.yaml'} is not there any more",
        "pass its new CONFIG_PATH and MODEL_DIR with --resume",
    )
    # One of the two was paired with the other's saved place, and a typo blamed the saved one.
    assert_one_line_error(
        capsys,
        ["asha", str(new / "gpt2_large.yaml"), "--resume", "out"],
        "with CONFIG_PATH alone: pass both CONFIG_PATH and MODEL_DIR",
    )
    assert_one_line_error(
        capsys,
        ["asha", str(new / "gpt2.yaml"), str(new), "--resume", "out"],
        f"CONFIG_PATH {new / 'gpt2.yaml'}: not found",
    )
    assert main(["asha", str(new / "gpt2_large.yaml"), str(new), "--resume", "out"]) == 0
    assert json.loads((tmp_path / "out" / SETTINGS_FILE).read_text())["model_dir"] == str(new)


def test_a_project_that_moved_with_its_includes_resumes_with_them_in_their_new_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--include at its new place was refused as a changed flag, so the moved project could not
    be resumed at all; a file of another name is still a change."""
    import shutil

    old, new = tmp_path / "old", tmp_path / "new"
    shutil.copytree(SIMULATED, old / "model")
    (old / "shared").mkdir()
    (old / "shared" / "tokens.txt").write_text("a b c\n")
    included = ["--include", str(old / "shared" / "tokens.txt")]
    assert interrupt_at(6, tmp_path, monkeypatch, old / "model", *included) == 130
    capsys.readouterr()
    old.rename(new)
    moved = ["asha", str(new / "model" / "gpt2_large.yaml"), str(new / "model"), "--resume", "out"]
    (new / "shared" / "vocab.txt").write_text("a b c\n")
    assert_one_line_error(
        capsys,
        [*moved, "--include", str(new / "shared" / "vocab.txt")],
        "--include",
        "differs from the saved search's",
    )
    assert main([*moved, "--include", str(new / "shared" / "tokens.txt")]) == 0
    saved = json.loads((tmp_path / "out" / SETTINGS_FILE).read_text())
    assert saved["include"] == [str(new / "shared" / "tokens.txt")]


def test_a_second_ctrl_c_while_the_trials_stop_still_says_how_to_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from dsat.runners.simulated.runner import SimulatedRunner

    def impatient(self: SimulatedRunner) -> list[object]:
        raise KeyboardInterrupt  # the user presses Ctrl-C again while trials stop

    monkeypatch.setattr(SimulatedRunner, "stop_all", impatient)
    assert interrupt_at(6, tmp_path, monkeypatch) == 130
    assert "Resume with: " in capsys.readouterr().err.strip().splitlines()[-1]


def test_max_trials_below_what_ran_is_refused_and_leaves_the_search_resumable(
    interrupted: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """It was taken: the search ended with no room for its confirmation round, handed over an
    unconfirmed config, and every later resume was refused as "in its confirmation round"."""
    results, _ = interrupted
    settings = (results / SETTINGS_FILE).read_text()
    state = json.loads((results / STATE_FILE).read_text())
    started = sum(1 for r in state["tracker"]["records"] if r["status"] != "queued")
    started -= state["added_trials"]  # a baseline run
    error = assert_one_line_error(
        capsys, ["asha", "--resume", str(results), "--max-trials", "2"], "--max-trials 2"
    )
    assert f"below the {started} trials" in error and f"give {started} to start no new one" in error
    # Those the interruption stopped hold their places, and run again first: said, not "end it".
    stopped = sum(1 for r in state["tracker"]["records"] if r["status"] == "running")
    assert stopped and f"(the {stopped} the interruption stopped run again first)" in error
    assert (results / SETTINGS_FILE).read_text() == settings
    assert main(["asha", "--resume", str(results), "--max-trials", str(started)]) == 0
    assert "handed over: " in (results / "summary.txt").read_text()


def test_a_directory_without_its_state_says_its_trials_can_still_be_reported(
    interrupted: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    results, _ = interrupted
    (results / STATE_FILE).unlink()
    error = assert_one_line_error(capsys, ["asha", "--resume", str(results)], STATE_FILE)
    assert "is missing" in error and "`dsat report out` still draws its trials" in error
    (results / SETTINGS_FILE).unlink()  # read first: it said only that it was missing
    error = assert_one_line_error(capsys, ["asha", "--resume", str(results)], SETTINGS_FILE)
    assert "is missing" in error and "`dsat report out` still draws its trials" in error


def test_a_results_dir_that_moved_names_its_logs_where_they_are_now(
    interrupted: tuple[Path, str], tmp_path: Path
) -> None:
    """A state and rows name each log where the search ran: renamed (or copied off a cluster)
    and resumed, the rows and the failure lines pointed at files that were gone."""
    results, _ = interrupted
    (results / "logs").mkdir(exist_ok=True)
    (results / "logs" / "001-moved.log").write_text("a trial's output\n")
    moved_log = str(results / "logs" / "001-moved.log")
    lost_log = str(results / "logs" / "002-lost.log")  # not in the directory: left as named
    state = json.loads((results / STATE_FILE).read_text())
    state["tracker"]["records"][0]["log"] = moved_log
    state["tracker"]["records"][1]["log"] = lost_log
    (results / STATE_FILE).write_text(json.dumps(state))
    lines = rows(results)
    lines[0]["log"] = moved_log
    lines[0]["machine_failed"] = [{"start": 0.0, "end": 1.0, "error": "x", "log": moved_log}]
    (results / TRIALS_FILE).write_text("".join(json.dumps(line) + "\n" for line in lines))
    new = tmp_path / "renamed"
    results.rename(new)

    assert main(["asha", "--resume", str(new)]) == 0
    kept = json.loads((new / STATE_FILE).read_text())["tracker"]["records"]
    assert kept[0]["log"] == str(new / "logs" / "001-moved.log")
    assert kept[1]["log"] == lost_log
    first = rows(new)[0]
    assert first["log"] == str(new / "logs" / "001-moved.log")
    assert first["machine_failed"][0]["log"] == first["log"]
    # Moved again once it has ended: a plain resume runs no trial, and renames them all the same.
    again = tmp_path / "renamed again"
    new.rename(again)
    assert main(["asha", "--resume", str(again)]) == 0
    assert rows(again)[0]["log"] == str(again / "logs" / "001-moved.log")
    kept = json.loads((again / STATE_FILE).read_text())["tracker"]["records"]
    assert kept[0]["log"] == rows(again)[0]["log"]


def test_resume_of_a_file_says_it_is_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It said "no such results directory" of a path that is there."""
    given = tmp_path / "deepspeed.yaml"
    given.write_text("name: x\n")
    assert_one_line_error(
        capsys, ["asha", "--resume", str(given)], "a file, not a results directory"
    )
    assert_one_line_error(
        capsys, ["asha", "--resume", str(tmp_path / "gone")], "no such results directory"
    )
