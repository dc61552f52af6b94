"""The CLI surface: flags, defaults, runner choice, and one-line errors with exit status 2."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from dsat.cli import main, parse_settings
from dsat.errors import DsatError
from dsat.experiment.metric import Metric
from dsat.runners.local.setup import OPS_LOG
from tests.conftest import run_cli, write_experiment


def assert_one_line_error(
    capsys: pytest.CaptureFixture[str], argv: list[str], *needles: str
) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("dsat: error: ")
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# ---------------------------------------------------------------- flags and defaults


def test_defaults_match_the_reference(experiment_yaml: Path) -> None:
    common = [str(experiment_yaml), str(experiment_yaml.parent)]
    asha = parse_settings(["asha", *common])
    assert (asha.max_trials, asha.max_concurrent_trials, asha.max_slots) == (64, 16, None)
    assert asha.metric is Metric.FLOPS_PER_GPU
    assert asha.zero_stages == (1, 2, 3)
    assert (asha.start_profile_step, asha.end_profile_step, asha.random_seed) == (3, 5, 42)
    assert asha.search_runner_restarts == 5 and asha.max_search_runner_restarts is None
    assert (asha.max_rungs, asha.min_binary_search_trials, asha.asha_early_stopping) == (5, 3, 0)
    assert (asha.divisor, asha.search_range_factor) == (2, 1.0)
    assert asha.run_full_experiment is False
    random = parse_settings(["random", *common])
    assert (random.trials_per_random_config, random.early_stopping) == (5, None)
    assert parse_settings(["binary", *common]).search_range_factor == 1.0
    assert asha.runner == "auto"


def test_the_runner_flag_keeps_its_earlier_name(experiment_yaml: Path) -> None:
    common = [str(experiment_yaml), str(experiment_yaml.parent)]
    assert parse_settings(["asha", *common, "--backend", "simulated"]).runner == "simulated"
    assert parse_settings(["asha", *common, "--runner", "local"]).runner == "local"


def test_asha_flags_are_integers(experiment_yaml: Path) -> None:
    settings = parse_settings(
        [
            "asha",
            str(experiment_yaml),
            ".",
            "--max-rungs",
            "3",
            "--min-binary-search-trials",
            "4",
            "--asha-early-stopping",
            "1",
            "--divisor",
            "3",
        ]
    )
    values = (
        settings.max_rungs,
        settings.min_binary_search_trials,
        settings.asha_early_stopping,
        settings.divisor,
    )
    assert values == (3, 4, 1, 3)
    assert all(type(v) is int for v in values)


def test_short_flags_and_lists(experiment_yaml: Path) -> None:
    settings = parse_settings(
        [
            "random",
            str(experiment_yaml),
            ".",
            "-mt",
            "10",
            "-ms",
            "4",
            "-mct",
            "2",
            "-m",
            "latency",
            "-z",
            "3",
            "0",
            "3",
            "-r",
            "7",
            "-i",
            "a",
            "b",
            "--early-stopping",
            "6",
            "--run-full-experiment",
        ]
    )
    assert (settings.max_trials, settings.max_slots, settings.max_concurrent_trials) == (10, 4, 2)
    assert settings.metric is Metric.LATENCY and settings.smaller_is_better
    assert settings.zero_stages == (0, 3)
    assert settings.random_seed == 7
    assert settings.include == (os.path.abspath("a"), os.path.abspath("b"))
    assert settings.early_stopping == 6 and settings.run_full_experiment


def test_settings_round_trip_through_json(experiment_yaml: Path) -> None:
    settings = parse_settings(["asha", str(experiment_yaml), ".", "-m", "throughput", "-z", "2"])
    again = type(settings).from_json(settings.to_json())
    assert again == settings
    assert json.loads(settings.to_json())["metric"] == "throughput"


def test_help_shows_defaults() -> None:
    top = run_cli("--help")
    assert top.returncode == 0 and "asha" in top.stdout and "random" in top.stdout
    for method, expected in [
        ("asha", "--max-rungs"),
        ("binary", "--search-range-factor"),
        ("random", "--trials-per-random-config"),
    ]:
        result = run_cli(method, "--help")
        assert result.returncode == 0
        assert expected in result.stdout
        assert "(default: 64)" in result.stdout  # --max-trials
        assert "(default: FLOPS_per_gpu)" in result.stdout


def test_guided_takes_the_range_factor_and_a_switchs_help_shows_no_default(
    experiment_yaml: Path,
) -> None:
    """The local-runner guide recommends --search-range-factor on a CPU, for every method."""
    settings = parse_settings(
        ["guided", str(experiment_yaml), ".", "--search-range-factor", "0.05"]
    )
    assert settings.search_range_factor == 0.05
    helped = run_cli("guided", "--help").stdout
    assert "--no-baseline" in helped and "(default: True)" not in helped
    assert "(default: 1.0)" in helped  # the range factor's
    # A flag without a default says nothing, rather than "(default: None)" after a help that
    # says in words what happens without it.
    assert "(default: None)" not in helped
    assert "block_size, if any)\n" in helped


def test_a_flag_the_method_does_not_take_points_to_the_methods_help(
    capsys: pytest.CaptureFixture[str], experiment_yaml: Path
) -> None:
    assert_one_line_error(
        capsys,
        ["random", str(experiment_yaml), ".", "--max-rungs", "3"],
        "unrecognized arguments: --max-rungs 3",
        "`python3 -m dsat random --help`",
    )


# ---------------------------------------------------------------- runner choice


def test_auto_runner_is_local_without_det_master(experiment_yaml: Path, tmp_path: Path) -> None:
    # The fixture's train.py prints and exits without writing DeepSpeed's model-info file, so the
    # local runner really runs the profile trial, which then counts as failed.
    results = tmp_path / "results"
    result = run_cli(
        "asha",
        str(experiment_yaml),
        str(experiment_yaml.parent),
        "--results-dir",
        str(results),
    )
    assert "dsat: runner local (neither DET_MASTER nor RAY_ADDRESS is set)" in result.stdout
    assert result.returncode == 1
    # The trial's own reason, where its log is, and no advice to change the config.
    assert "the script exited without reporting metrics" in result.stderr
    assert "logs/001-" in result.stderr and "fix the config" not in result.stderr
    logs = list((results / "logs").glob("0*.log"))
    assert len(logs) == 1 and "training" in logs[0].read_text()
    # Saved as resolved: resumed from a shell where RAY_ADDRESS is set, it stays on this machine
    # (and one that ran on Ray by RAY_ADDRESS stays on that cluster, its address saved).
    assert json.loads((results / "settings.json").read_text())["runner"] == "local"
    again = run_cli("asha", "--resume", str(results), env={"RAY_ADDRESS": "127.0.0.1:9"})
    assert "dsat: runner local (as the search ran (settings.json))" in again.stdout, again.stderr


def test_auto_runner_is_determined_with_det_master(experiment_yaml: Path, tmp_path: Path) -> None:
    # Nothing listens on the discard port: the submission fails with one line, no traceback.
    result = run_cli(
        "asha",
        str(experiment_yaml),
        str(experiment_yaml.parent),
        env={"DET_MASTER": "http://127.0.0.1:9", "HOME": str(tmp_path)},
    )
    assert "dsat: runner determined (DET_MASTER is set)" in result.stdout
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "dsat: error: no Determined master answers at http://127.0.0.1:9; check DET_MASTER, or "
        "use --runner local"
    )
    assert "Traceback" not in result.stderr


def test_simulated_runner_needs_a_simulator(
    experiment_yaml: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert_one_line_error(
        capsys,
        ["asha", str(experiment_yaml), str(experiment_yaml.parent), "--runner", "simulated"],
        "--simulator",
    )


def test_full_experiment_needs_a_real_runner(
    experiment_yaml: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert_one_line_error(
        capsys,
        [
            "asha",
            str(experiment_yaml),
            str(experiment_yaml.parent),
            "--runner",
            "simulated",
            "--simulator",
            "dsat.runners.simulated.performance_models:gpt2_large_16xv100",
            "--run-full-experiment",
        ],
        "--run-full-experiment needs a runner that trains for real",
    )


def test_simulator_without_simulated_runner(
    experiment_yaml: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert_one_line_error(
        capsys,
        ["asha", str(experiment_yaml), str(experiment_yaml.parent), "--simulator", "json:dumps"],
        "--simulator only applies to --runner simulated",
    )


def test_ray_address_with_another_runner(
    experiment_yaml: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert_one_line_error(
        capsys,
        [
            "asha",
            str(experiment_yaml),
            str(experiment_yaml.parent),
            "--runner",
            "local",
            "--ray-address",
            "10.0.0.1:6379",
        ],
        "--ray-address only applies to --runner ray (the runner is local)",
    )


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--fresh-processes"], "--fresh-processes only applies to --runner local"),
        (["--no-trial-host"], "--no-trial-host only applies to --runner local"),
        (["--search-runner-config", "r.yaml"], "--search-runner-config only applies to --runner"),
        (["--max-search-runner-restarts", "2"], "--max-search-runner-restarts only applies to"),
        # The default's value, given: it was taken for not given, and ignored.
        (["--max-search-runner-restarts", "5"], "--max-search-runner-restarts only applies to"),
    ],
)
def test_a_flag_of_another_runner_is_refused_not_ignored(
    experiment_yaml: Path, capsys: pytest.CaptureFixture[str], flags: list[str], said: str
) -> None:
    """They were accepted and ignored with --runner simulated (and ray), as --ray-address and
    --simulator are not: the user trusted what did not happen."""
    (experiment_yaml.parent / "r.yaml").write_text("name: x\n")
    simulated = [
        "--runner",
        "simulated",
        "--simulator",
        "dsat.runners.simulated.performance_models:gpt2_large_16xv100",
    ]
    assert_one_line_error(
        capsys,
        ["asha", str(experiment_yaml), str(experiment_yaml.parent), *simulated]
        + [str(experiment_yaml.parent / f) if f == "r.yaml" else f for f in flags],
        said,
        "(the runner is simulated); drop it",
    )


# ---------------------------------------------------------------- errors: one line, exit 2 (subprocess)


def _assert_subprocess_error(result: object, *needles: str) -> None:
    assert result.returncode == 2
    err: str = result.stderr
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("dsat: error: ") and "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_cli_missing_config_file(tmp_path: Path) -> None:
    result = run_cli("asha", str(tmp_path / "nope.yaml"), str(tmp_path))
    _assert_subprocess_error(result, "nope.yaml", "config file not found")


def test_cli_yaml_that_does_not_parse(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nhyperparameters: [unclosed\n")
    result = run_cli("asha", str(bad), str(tmp_path))
    _assert_subprocess_error(result, "bad.yaml", "not valid YAML", "line")


def test_cli_max_trials_one(experiment_yaml: Path) -> None:
    result = run_cli("asha", str(experiment_yaml), str(experiment_yaml.parent), "--max-trials", "1")
    _assert_subprocess_error(result, "--max-trials", "model-profile")


def test_cli_unknown_metric(experiment_yaml: Path) -> None:
    result = run_cli("random", str(experiment_yaml), str(experiment_yaml.parent), "-m", "speed")
    _assert_subprocess_error(result, "--metric", "speed")


def test_cli_zero_stage_four(experiment_yaml: Path) -> None:
    result = run_cli("binary", str(experiment_yaml), str(experiment_yaml.parent), "-z", "1", "4")
    _assert_subprocess_error(result, "--zero-stages", "4")


def test_cli_entrypoint_names_a_different_config(tmp_path: Path) -> None:
    path = write_experiment(
        tmp_path / "m", config={"entrypoint": "python3 train.py --deepspeed other.json"}
    )
    result = run_cli("asha", str(path), str(path.parent))
    _assert_subprocess_error(result, "other.json", "ds_config.json", "same file")


def test_cli_entrypoint_script_not_there(tmp_path: Path) -> None:
    """Before any trial, and nothing written: a typo used to fail the model-profile trial."""
    path = write_experiment(tmp_path / "m", config={"entrypoint": "python3 trian.py"})
    result = run_cli("asha", str(path), str(path.parent), cwd=tmp_path)
    _assert_subprocess_error(result, "entrypoint runs trian.py", "not in MODEL_DIR")
    assert not (tmp_path / "dsat-results").exists()


def test_cli_entrypoint_script_that_does_not_parse(tmp_path: Path) -> None:
    """It ran the model-profile trial (after DeepSpeed's ops were built) to fail on it, and its
    one line named neither the file nor the line."""
    path = write_experiment(tmp_path / "m")
    script = path.parent / "train.py"
    script.write_text(script.read_text() + "\ndef broken() -> None\n    pass\n")
    line = len(script.read_text().splitlines()) - 1
    result = run_cli("asha", str(path), str(path.parent), cwd=tmp_path)
    _assert_subprocess_error(result, f"train.py, line {line}: SyntaxError: ", "does not parse")
    assert not (tmp_path / "dsat-results").exists()


def test_cli_unimportable_simulator(experiment_yaml: Path) -> None:
    result = run_cli(
        "asha",
        str(experiment_yaml),
        str(experiment_yaml.parent),
        "--runner",
        "simulated",
        "--simulator",
        "no_such_module_xyz:perf",
    )
    _assert_subprocess_error(result, "--simulator", "no_such_module_xyz", "cannot import")


# ---------------------------------------------------------------- errors: one line, exit 2 (in process)


def test_experiment_without_hyperparameters(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_experiment(tmp_path / "m")
    config = yaml.safe_load(path.read_text())
    del config["hyperparameters"]
    path.write_text(yaml.safe_dump(config))
    assert_one_line_error(
        capsys, ["asha", str(path), str(path.parent)], "no hyperparameters section"
    )


def test_missing_deepspeed_config_hparam(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_experiment(tmp_path / "m", config={"hyperparameters": {"lr": 0.1}})
    assert_one_line_error(
        capsys, ["asha", str(path), str(path.parent)], "hyperparameters.deepspeed_config is missing"
    )


def test_ds_json_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_experiment(
        tmp_path / "m", config={"hyperparameters": {"deepspeed_config": "gone.json"}}
    )
    assert_one_line_error(capsys, ["asha", str(path), str(path.parent)], "gone.json", "MODEL_DIR")


def test_ds_json_not_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_experiment(tmp_path / "m")
    (path.parent / "ds_config.json").write_text("{'single': quotes}")
    assert_one_line_error(
        capsys, ["asha", str(path), str(path.parent)], "ds_config.json", "not valid JSON", "line 1"
    )


def test_ds_json_not_an_object(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_experiment(tmp_path / "m")
    (path.parent / "ds_config.json").write_text("[1, 2]")
    assert_one_line_error(
        capsys, ["asha", str(path), str(path.parent)], "must be a JSON object", "list"
    )


def test_model_dir_missing(
    experiment_yaml: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert_one_line_error(
        capsys,
        ["asha", str(experiment_yaml), str(tmp_path / "nowhere")],
        "nowhere",
        "model directory not found",
    )


def test_paths_of_the_wrong_kind_say_what_they_are(
    experiment_yaml: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A directory given as CONFIG_PATH, a file as MODEL_DIR, a number as deepspeed_config and a
    missing --search-runner-config each read "not found", or "is missing", or named the wrong
    fix."""
    model = str(experiment_yaml.parent)
    assert_one_line_error(
        capsys, ["asha", model, model], f"{model}: a directory, not a file; pass the path of"
    )
    assert_one_line_error(
        capsys,
        ["asha", str(experiment_yaml), str(experiment_yaml)],
        "a file, not a directory; pass the folder with your code as MODEL_DIR",
    )
    path = write_experiment(tmp_path / "m", config={"hyperparameters": {"deepspeed_config": 3}})
    assert_one_line_error(
        capsys,
        ["asha", str(path), str(path.parent)],
        "hyperparameters.deepspeed_config is 3, not a path",
    )
    runner_yaml = tmp_path / "runner.yaml"
    assert_one_line_error(
        capsys,
        ["asha", str(experiment_yaml), model, "--search-runner-config", str(runner_yaml)],
        f"{runner_yaml}: config file not found; fix --search-runner-config",
    )


def test_an_hf_batch_that_does_not_make_the_configs_global_batch_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """train_batch_size 16 against --per_device_train_batch_size 4 x accumulation 2 on one slot:
    HF refuses the user's own run, while dsat searched, ran a baseline with accumulation 4 that
    the user never ran, and said nothing."""
    from dsat.experiment.config import load_experiment
    from dsat.search_launch import check_hf_global_batch

    entrypoint = (
        "python3 train.py --deepspeed ds_config.json --per_device_train_batch_size 4 "
        "--gradient_accumulation_steps 2"
    )
    auto = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}
    path = write_experiment(
        tmp_path / "m",
        config={"entrypoint": entrypoint},
        ds_config={**auto, "train_batch_size": 16},
    )
    assert_one_line_error(
        capsys,
        ["asha", str(path), str(path.parent)],
        "train_batch_size 16 is not what your HF Trainer run makes of it",
        "micro-batch 4 x accumulation 2 x 1 slot(s) = 8",
        'set train_batch_size to "auto", or pass --global-batch N',
    )
    settings = parse_settings(["asha", str(path), str(path.parent)])
    # Where they agree, nothing is said.
    (path.parent / "ds_config.json").write_text(json.dumps({**auto, "train_batch_size": 8}))
    check_hf_global_batch(load_experiment(path, path.parent), settings)
    # A number in the config that the entrypoint's flag contradicts: HF refuses the user's own
    # run as well (its baseline, 8 x 2, was run by dsat alone, and compared as theirs).
    for ds_config, said in (
        ({**auto, "train_batch_size": 16, "gradient_accumulation_steps": 4}, "accumulation"),
        ({**auto, "train_micro_batch_size_per_gpu": 8}, "micro-batch"),
    ):
        (path.parent / "ds_config.json").write_text(json.dumps(ds_config))
        key, flag, number, passed = {
            "accumulation": ("gradient_accumulation_steps", "--gradient_accumulation_steps", 4, 2),
            "micro-batch": (
                "train_micro_batch_size_per_gpu",
                "--per_device_train_batch_size",
                8,
                4,
            ),
        }[said]
        with pytest.raises(DsatError) as info:
            check_hf_global_batch(load_experiment(path, path.parent), settings)
        assert str(info.value).endswith(
            f"ds_config.json: {key} {number} is not the entrypoint's {flag} {passed}, and HF "
            f'refuses that run ("mismatch TrainingArguments values"): make them agree, or set '
            f'{key} to "auto"'
        )
    # A number in the JSON that no flag passes: HF's default in the user's own run, which HF
    # refuses unless the script sets it in code (nothing was said).
    entrypoint = "python3 train.py --deepspeed ds_config.json"
    for ds_config, said in (
        (
            {**auto, "gradient_accumulation_steps": 2},
            "gradient_accumulation_steps 2 against --gradient_accumulation_steps's default 1",
        ),
        (
            {**auto, "train_micro_batch_size_per_gpu": 4},
            "train_micro_batch_size_per_gpu 4 against --per_device_train_batch_size's default 8",
        ),
    ):
        bare = write_experiment(
            tmp_path / str(len(said)), config={"entrypoint": entrypoint}, ds_config=ds_config
        )
        note = check_hf_global_batch(load_experiment(bare, bare.parent), settings)
        assert note is not None and f"ds_config.json: {said}, which your entrypoint" in note
    # --global-batch searches at another batch on purpose.
    (path.parent / "ds_config.json").write_text(json.dumps({**auto, "train_batch_size": 16}))
    given = parse_settings(["asha", str(path), str(path.parent), "--global-batch", "16"])
    check_hf_global_batch(load_experiment(path, path.parent, global_batch=16), given)


def test_hf_evaluation_or_saving_within_a_trials_steps_is_a_note(tmp_path: Path) -> None:
    """--eval_steps 1 read every trial's FLOPS 100x low (the ratio against the user's config
    was then eval time's noise), and --save_steps 1 kept a checkpoint a step in every trial's
    copy, with nothing said."""
    from dsat.experiment.config import load_experiment
    from dsat.search_launch import hf_periodic_work_note

    base = "python3 train.py --deepspeed ds_config.json"

    def note(flags: str) -> str | None:
        path = write_experiment(
            tmp_path / str(len(flags)), config={"entrypoint": f"{base} {flags}"}
        )
        settings = parse_settings(["asha", str(path), str(path.parent)])
        return hf_periodic_work_note(load_experiment(path, path.parent), settings)

    both = note("--eval_strategy steps --eval_steps 1 --save_steps=2")
    assert both is not None and both.startswith("dsat: note: ")
    assert (
        "the entrypoint evaluates every 1 step(s) (--eval_steps 1) and saves a checkpoint " in both
    )
    assert "every 2 step(s) (--save_steps 2), within the " in both
    assert both.endswith("turn them off for the search (--eval_strategy no, --save_strategy no)")
    # Evaluation by epoch, saving turned off, or either beyond the measured steps: nothing.
    for quiet in (
        "--evaluation_strategy epoch --eval_steps 1",
        "--save_strategy no --save_steps 1",
        "--eval_strategy steps --eval_steps 500 --save_steps 500",
    ):
        assert note(quiet) is None, quiet


def test_an_hf_batch_that_holds_only_with_a_number_the_script_may_set_is_a_note(
    tmp_path: Path,
) -> None:
    """train_batch_size 16 and --per_device_train_batch_size 4 with no accumulation anywhere:
    HF's default of 1 refuses the user's own run unless the script sets it in code, and dsat
    said nothing while its baseline ran with an accumulation of 4 the user never gave."""
    from dsat.experiment.config import load_experiment
    from dsat.search_launch import check_hf_global_batch

    auto = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}
    path = write_experiment(
        tmp_path / "m",
        config={"entrypoint": "python3 train.py --deepspeed ds_config.json "
                "--per_device_train_batch_size 4"},
        ds_config={**auto, "train_batch_size": 16},
    )  # fmt: skip
    settings = parse_settings(["asha", str(path), str(path.parent)])
    note = check_hf_global_batch(load_experiment(path, path.parent), settings)
    assert note is not None and note.startswith("dsat: note: ")
    assert "train_batch_size 16" in note
    assert "--gradient_accumulation_steps (HF's default 1)" in note
    assert "micro-batch 4 x accumulation 1 x 1 slot(s) = 4" in note
    # HF's defaults agree (8 x 1 x 2 slots): nothing to say.
    path = write_experiment(
        tmp_path / "n",
        config={"entrypoint": "python3 train.py --deepspeed ds_config.json",
                "resources": {"slots_per_trial": 2}},
        ds_config={**auto, "train_batch_size": 16},
    )  # fmt: skip
    settings = parse_settings(["asha", str(path), str(path.parent)])
    assert check_hf_global_batch(load_experiment(path, path.parent), settings) is None


def refused_entrypoint(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    entrypoint: str | list[str],
    *needles: str,
) -> Path:
    """An experiment with ``entrypoint``, refused in one line saying ``needles``; its YAML."""
    path = write_experiment(tmp_path / "m", config={"entrypoint": entrypoint})
    assert_one_line_error(capsys, ["asha", str(path), str(path.parent)], *needles)
    return path


@pytest.mark.parametrize(
    ("entrypoint", "launcher"),
    [
        ("torchrun --nproc_per_node 2 train.py", "torchrun"),
        ("deepspeed train.py --deepspeed_config ds_config.json", "deepspeed"),
        ("accelerate launch train.py", "accelerate"),
        (
            "python3 -m torch.distributed.run --nproc_per_node 1 train.py",
            "python3 -m torch.distributed.run",
        ),
        ("python3 -m determined.launch.torch_distributed torchrun train.py", "torchrun"),
    ],
)
def test_an_entrypoint_that_starts_its_own_launcher_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], entrypoint: str, launcher: str
) -> None:
    """torchrun --nproc_per_node 2 at one slot ended the search with "fix the DeepSpeed config",
    and a launcher's fixed port 29500 made two trials at once fail each other."""
    refused_entrypoint(
        tmp_path,
        capsys,
        entrypoint,
        f"the entrypoint starts {launcher}",
        "run the script directly, `python3 train.py ...`",
    )


def test_hf_arguments_in_a_file_are_one_line_before_any_trial(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """HF's `python3 run_clm.py args.json`: dsat rewrites the command line, found no --deepspeed
    there, and every trial failed after the launch had passed. A Core API script's own config
    file, without HF's keys, is its business."""
    path = write_experiment(tmp_path / "m", config={"entrypoint": "python3 train.py args.json"})
    args = {"deepspeed": "ds_config.json", "per_device_train_batch_size": 4}
    (path.parent / "args.json").write_text(json.dumps(args))
    assert_one_line_error(
        capsys,
        ["asha", str(path), str(path.parent)],
        "passes its HF arguments in args.json",
        "`python3 train.py --deepspeed ds_config.json --per_device_train_batch_size N ...`",
    )
    (path.parent / "args.json").write_text(json.dumps({"layers": 4}))
    from dsat.experiment.config import check_hf_args_file, load_experiment

    check_hf_args_file(load_experiment(path, path.parent), ["python3", "train.py", "args.json"])


def test_a_deepspeed_config_given_as_json_text_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It was called a file name that differs from hyperparameters.deepspeed_config."""
    entrypoint = ["python3", "train.py", "--deepspeed", '{"zero_optimization": {"stage": 2}}']
    refused_entrypoint(
        tmp_path,
        capsys,
        entrypoint,
        "passes its DeepSpeed config as JSON text",
        "--deepspeed ds_config.json",
    )


def test_an_hf_entrypoint_training_fewer_steps_than_a_trial_measures_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every trial failed with "stopped after 10 steps; it needs 15"; the guide had said
    --max_steps must only exceed --end-profile-step."""
    entrypoint = "python3 train.py --deepspeed ds_config.json --max_steps 10"
    path = refused_entrypoint(
        tmp_path,
        capsys,
        entrypoint,
        "the entrypoint passes --max_steps 10, but a trial measures up to optimizer step 15",
        "give --max_steps 15 or more",
    )
    # A later --end-profile-step asks for more.
    path.write_text(path.read_text().replace("--max_steps 10", "--max_steps 15"))
    assert_one_line_error(
        capsys,
        ["asha", str(path), str(path.parent), "--end-profile-step", "20"],
        "give --max_steps 21 or more",
    )


def test_end_profile_step_not_after_start(
    experiment_yaml: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "asha",
        str(experiment_yaml),
        ".",
        "--start-profile-step",
        "5",
        "--end-profile-step",
        "5",
    ]
    assert_one_line_error(capsys, argv, "--end-profile-step", "--start-profile-step")


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--max-concurrent-trials", "0"),
        ("-mct", "-2"),
        ("--max-slots", "0"),
        ("--max-trials", "-5"),
        ("--trial-timeout", "0"),
        ("--max-rungs", "0"),
        ("--min-binary-search-trials", "-1"),
        ("--divisor", "0"),
        ("--asha-early-stopping", "-1"),
        ("--search-range-factor", "-0.5"),
        ("--max-search-runner-restarts", "-1"),
        ("--max-trials", "lots"),
        ("--random-seed", "-1"),
        ("--trial-timeout", "nan"),
        ("--search-range-factor", "inf"),
        ("--peak-tflops", "nan"),
        ("--memory-margin", "1"),
        ("--offload-nvme", "nvme"),
    ],
)
def test_bad_count_flags(
    experiment_yaml: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    assert_one_line_error(capsys, ["asha", str(experiment_yaml), ".", flag, value], flag, value)


@pytest.mark.parametrize(
    ("method", "flag"), [("random", "--trials-per-random-config"), ("random", "--early-stopping")]
)
def test_bad_random_count_flags(
    experiment_yaml: Path, capsys: pytest.CaptureFixture[str], method: str, flag: str
) -> None:
    assert_one_line_error(capsys, [method, str(experiment_yaml), ".", flag, "0"], flag)


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        # 0 said "a positive integer", then 1 was refused as "at least 2".
        (["--max-trials", "0"], "an integer of 2 or more (it counts the model-profile trial)"),
        (["--max-trials", "1"], "an integer of 2 or more"),
        (["--trial-timeout", "inf"], "a positive, finite number"),  # "positive" alone: inf is
        (["--zero-stages=1,2"], "separate the stages with spaces: --zero-stages 1 2"),
        (["--offload", "--zero-stages", "0"], "--offload needs a ZeRO stage of 1 or more"),
        # NVMe is the ladder's ZeRO-3 rung: without stage 3 the path went unused, unsaid.
        (["--offload-nvme", "/tmp", "-z", "1", "2"], "--offload-nvme needs ZeRO-3 in --zero-st"),
        # "$HEAD" unset: "--ray-address only applies to --runner ray", of the flag it was given
        (["--ray-address", ""], "--ray-address is empty (an unset shell variable?)"),
        (["--runner", "ray", "--ray-address", " "], "give the head node's address, HOST:6379"),
    ],
)
def test_a_refused_value_says_what_would_be_taken(
    experiment_yaml: Path, capsys: pytest.CaptureFixture[str], flags: list[str], said: str
) -> None:
    assert_one_line_error(capsys, ["asha", str(experiment_yaml), ".", *flags], said)


def test_divisor_one_is_rejected(experiment_yaml: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert_one_line_error(
        capsys, ["asha", str(experiment_yaml), ".", "--divisor", "1"], "--divisor", "at least 2"
    )


def test_flag_of_another_method(experiment_yaml: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert_one_line_error(
        capsys, ["binary", str(experiment_yaml), ".", "--max-rungs", "3"], "--max-rungs"
    )


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["-i", "extra.py"], "--include took every path after it (extra.py deepspeed.yaml .)"),
        (["-z", "1", "2"], "--zero-stages: invalid int value: 'deepspeed.yaml'"),
    ],
)
def test_a_flag_of_several_values_before_the_positionals_says_to_put_them_first(
    capsys: pytest.CaptureFixture[str], flags: list[str], said: str
) -> None:
    """It took CONFIG_PATH and MODEL_DIR as its own values: "CONFIG_PATH and MODEL_DIR are
    required" to a user who had passed them."""
    assert_one_line_error(
        capsys,
        ["binary", *flags, "deepspeed.yaml", "."],
        said,
        "put CONFIG_PATH and MODEL_DIR before the flags, e.g. `python3 -m dsat binary "
        "deepspeed.yaml . --include data`",
    )


def test_unknown_runner(experiment_yaml: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert_one_line_error(
        capsys, ["asha", str(experiment_yaml), ".", "--runner", "k8s"], "--runner", "k8s"
    )


def test_missing_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    assert_one_line_error(capsys, [], "asha")


def test_max_slots_below_slots_per_trial(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_experiment(tmp_path / "m", config={"resources": {"slots_per_trial": 4}})
    assert_one_line_error(
        capsys,
        ["asha", str(path), str(path.parent), "-ms", "2"],
        "--max-slots 2",
        "slots_per_trial 4",
    )


def test_deepspeed_rejects_the_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_experiment(
        tmp_path / "m",
        ds_config={
            "train_micro_batch_size_per_gpu": 2,
            "zero_optimization": {"stage": 1, "bogus": 1},
        },
    )
    assert_one_line_error(
        capsys, ["asha", str(path), str(path.parent)], "DeepSpeed rejects this config", "bogus"
    )


@pytest.mark.parametrize(
    ("section", "said"),
    [
        (
            {"optimizer": {"type": "Adamm"}},
            "optimizer type 'Adamm' is none of DeepSpeed's (adagrad, adam",
        ),
        ({"scheduler": {"type": "WarmupLRR"}}, "scheduler type 'WarmupLRR' is none of DeepSpeed's"),
        (
            {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
            "zero_optimization.offload_param goes to nvme with no nvme_path; set one",
        ),
    ],
)
def test_what_deepspeed_s_engine_refuses_in_every_trial_is_one_line_before_any(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], section: dict[str, Any], said: str
) -> None:
    """DeepSpeed's parser takes these and its engine refuses them: the model profile failed
    with DeepSpeed's words, exit 1."""
    ds = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}, **section}
    path = write_experiment(tmp_path / "m", ds_config=ds)
    assert_one_line_error(
        capsys, ["asha", str(path), str(path.parent)], "DeepSpeed rejects this config", said
    )
    # Their right spellings pass: torch.optim's and DeepSpeed's own names, any case DeepSpeed takes.
    for good in ({"type": "SGD"}, {"type": "AdamW"}):
        ds["optimizer"] = good
        ds.pop("scheduler", None)
        ds["zero_optimization"] = {"stage": 1}
        (path.parent / "ds_config.json").write_text(json.dumps(ds))
        from dsat.experiment.ds_config_check import engine_config_error

        assert engine_config_error(ds) is None


def test_inconsistent_batch_triple(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_experiment(
        tmp_path / "m",
        config={"resources": {"slots_per_trial": 2}},
        ds_config={
            "train_batch_size": 8,
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
        },
    )
    assert_one_line_error(
        capsys, ["asha", str(path), str(path.parent)], "train_batch_size 8", "2 slots"
    )


@pytest.mark.parametrize(
    ("global_batch", "flags", "where", "fix"),
    [
        (
            9,
            [],
            "ds_config.json: train_batch_size 9",
            'multiple of 2, or set train_batch_size to "auto"',
        ),
        (
            None,
            ["--global-batch", "1"],
            "--global-batch: train_batch_size 1",
            "raise it to 2, or drop --global-batch",
        ),
    ],
)
def test_a_global_batch_no_configuration_can_keep(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    global_batch: int | None,
    flags: list[str],
    where: str,
    fix: str,
) -> None:
    """Said in one line before any trial, naming the file or flag and the fix."""
    ds_config: dict[str, object] = {"train_micro_batch_size_per_gpu": "auto"}
    if global_batch is not None:
        ds_config["train_batch_size"] = global_batch
    path = write_experiment(
        tmp_path / "m", config={"resources": {"slots_per_trial": 2}}, ds_config=ds_config
    )
    assert_one_line_error(capsys, ["asha", str(path), str(path.parent), *flags], where, fix)


def test_missing_include(
    experiment_yaml: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["asha", str(experiment_yaml), str(experiment_yaml.parent), "-i", str(tmp_path / "gone")]
    assert_one_line_error(capsys, argv, "--include", "gone")


def test_search_runner_config_missing(
    experiment_yaml: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "asha",
        str(experiment_yaml),
        str(experiment_yaml.parent),
        "--search-runner-config",
        str(tmp_path / "r.yaml"),
    ]
    assert_one_line_error(capsys, argv, "r.yaml", "not found")


def test_resume_missing_dir(
    experiment_yaml: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "asha",
        str(experiment_yaml),
        str(experiment_yaml.parent),
        "--resume",
        str(tmp_path / "old"),
    ]
    assert_one_line_error(capsys, argv, "--resume", "old")


def test_resume_and_results_dir_conflict(
    experiment_yaml: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["asha", str(experiment_yaml), ".", "--resume", "a", "--results-dir", "b"]
    assert_one_line_error(capsys, argv, "--resume", "--results-dir")


# ---------------------------------------------------------------- the simulated runner end to end

SIMULATED = Path(__file__).resolve().parents[1] / "examples" / "simulated"
GPT2 = "dsat.runners.simulated.performance_models:gpt2_large_16xv100"


def run_simulated(
    method: str, experiment: str, simulator: str, results: Path, *extra: str
) -> subprocess.CompletedProcess[str]:
    """The CLI on an examples/simulated experiment, its trials run by ``simulator``."""
    return run_cli(
        method,
        str(SIMULATED / experiment),
        str(SIMULATED),
        "--runner",
        "simulated",
        "--simulator",
        simulator,
        "--results-dir",
        str(results),
        *extra,
    )


def test_simulated_search_prints_the_summary_and_leaves_results(tmp_path: Path) -> None:
    results = tmp_path / "results"
    args = [
        "asha",
        str(SIMULATED / "gpt2_large.yaml"),
        str(SIMULATED),
        "--runner",
        "simulated",
        "--simulator",
        GPT2,
        "--results-dir",
        str(results),
    ]
    first = run_cli(*args)
    assert first.returncode == 0, first.stderr
    assert "| tuning_space | num_experiments | best_metric_val | best_exp_name" in first.stdout
    assert "approx. max micro-batch" in first.stdout  # the memory model's estimates are logged
    assert f"best DeepSpeed config: {results / 'best_ds_config.json'}" in first.stdout
    # The last lines say what was found, against the user's own config, and what to do next.
    *_, found, path_line, next_line = first.stdout.splitlines()
    best = json.loads((results / "best_ds_config.json").read_text())
    stage, mbs = best["zero_optimization"]["stage"], best["train_micro_batch_size_per_gpu"]
    assert re.match(
        rf"^dsat: found ZeRO-{stage} micro-batch {mbs}( \(.+\))?"
        r"(: [\d.]+x your config's FLOPS_per_gpu(; .+)?|: your own config; .+)?$",
        found,
    ), found
    assert path_line == f"dsat: best DeepSpeed config: {results / 'best_ds_config.json'}"
    # An HF Trainer entrypoint (--deepspeed PATH) is told the batch flags HF checks the JSON
    # against; a simulated search trains nothing, so no full run is offered.
    path, gas = results / "best_ds_config.json", best["gradient_accumulation_steps"]
    assert next_line == (
        f"dsat: next: train with --deepspeed {path} --per_device_train_batch_size {mbs} "
        f"--gradient_accumulation_steps {gas} (HF refuses flags that differ from it)"
    )
    # What the search cost, 16 simulated GPUs per trial (tests/results/test_cost.py checks it).
    assert re.search(r"^cost: \d+ trials .* GPU-hours \(16 GPUs per trial x ", first.stdout, re.M)
    assert re.search(r"^dsat: \d+ trials, [\d.]+ GPU-hours; search ended: ", first.stdout, re.M)
    # Why the handed-over configuration won, in plain words, named as the summary names it.
    handed = re.search(r"^handed over: (z\d_mb[\w.-]+)[ :]", first.stdout, re.M)
    assert handed and f"{handed.group(1)} (handed over)" in first.stdout
    assert "handed over: " in (results / "summary.txt").read_text()
    for name in (
        "trials.jsonl",
        "best_ds_config.json",
        "best_ds_metrics.json",
        "summary.txt",
        "dsat_search_state.json",
    ):
        assert (results / name).is_file(), name
    kinds = [
        json.loads(line)["kind"] for line in (results / "trials.jsonl").read_text().splitlines()
    ]
    assert len([k for k in kinds if k != "confirm"]) == 64  # then the confirmation round
    assert 2 <= kinds.count("confirm") <= 6
    again = run_cli(*args)
    _assert_subprocess_error(again, "already holds a search", "--resume")
    resumed = run_cli(*args[:-2], "--resume", str(results))
    assert resumed.returncode == 0 and len(
        (results / "trials.jsonl").read_text().splitlines()
    ) == len(kinds)


def test_fresh_processes_and_a_trial_host_together_are_one_line(
    experiment_yaml: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Both were taken, and nothing said which one ran."""
    common = ["guided", str(experiment_yaml), str(experiment_yaml.parent), "--fresh-processes"]
    assert_one_line_error(capsys, [*common, "--trial-host"], "drop one of the two")
    assert parse_settings([*common, "--no-trial-host"]).fresh_processes


def test_a_results_dir_holding_other_files_is_refused_and_left_as_it_was(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A project's folder, or MODEL_DIR itself, named by --results-dir: a search would write
    summary.txt and the rest over the user's files (and copy MODEL_DIR into itself)."""
    theirs = tmp_path / "out"
    theirs.mkdir()
    (theirs / "summary.txt").write_text("keep\n")
    base = ["asha", str(SIMULATED / "gpt2_large.yaml"), str(SIMULATED), "--runner", "simulated"]
    simulated = ["--simulator", GPT2]
    for folder in (theirs, SIMULATED):
        before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
        line = assert_one_line_error(
            capsys, [*base, *simulated, "--results-dir", str(folder)], "--results-dir"
        )
        assert "holds files that are not a dsat search's" in line and "new or empty" in line
        assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before
    # An empty directory, or one a launch that failed left its lock file in, is taken.
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / ".dsat-search.lock").write_text("")
    assert main([*base, *simulated, "--results-dir", str(empty), "--max-trials", "4"]) == 0
    assert (empty / "summary.txt").is_file()


def test_a_results_dir_named_settings_json_but_not_dsats_or_without_its_state_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file named settings.json does not make a folder a search's: an editor's is the user's,
    and an earlier search whose state is gone would have its trials mixed with the new ones and
    its best_ds_config.json replaced."""
    base = ["asha", str(SIMULATED / "gpt2_large.yaml"), str(SIMULATED), "--runner", "simulated"]
    simulated = ["--simulator", GPT2, "--max-trials", "4"]
    editor = tmp_path / "project"
    editor.mkdir()
    (editor / "settings.json").write_text('{"editor.tabSize": 4}\n')
    (editor / "notes.txt").write_text("mine\n")
    earlier = tmp_path / "earlier"
    assert main([*base, *simulated, "--results-dir", str(earlier)]) == 0
    (earlier / "dsat_search_state.json").unlink()
    for folder, said in (
        (editor, "holds files that are not a dsat search's"),
        (earlier, "holds an earlier search's files but not its saved state"),
    ):
        before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
        line = assert_one_line_error(
            capsys, [*base, *simulated, "--results-dir", str(folder)], "--results-dir", said
        )
        assert "new or empty directory" in line
        assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before
    # What a search stopped before its first trial leaves (its settings, an empty folder) is
    # taken: nothing there to lose.
    stopped = tmp_path / "stopped"
    (stopped / "logs").mkdir(parents=True)
    (stopped / "settings.json").write_bytes((earlier / "settings.json").read_bytes())
    assert main([*base, *simulated, "--results-dir", str(stopped)]) == 0
    assert (stopped / "summary.txt").is_file()
    # So is what a kill -9 during DeepSpeed's op build leaves: the same command then runs. Its
    # logs/ with any other file stays refused.
    building = tmp_path / "building"
    (building / "logs").mkdir(parents=True)
    (building / "logs" / OPS_LOG).write_text("dsat-build start deepspeed_shm_comm 0\n")
    assert main([*base, *simulated, "--results-dir", str(building)]) == 0
    other = tmp_path / "other"
    (other / "logs").mkdir(parents=True)
    (other / "logs" / OPS_LOG).write_text("x\n")
    (other / "logs" / "mine.txt").write_text("mine\n")
    assert_one_line_error(
        capsys, [*base, *simulated, "--results-dir", str(other)], "--results-dir", "(logs)"
    )


def test_a_model_dir_file_that_cannot_be_read_is_one_line_before_any_trial(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The first trial's copy of MODEL_DIR failed on it, and the message blamed the results
    directory ("cannot write .../train.py ... make it writable"). Root reads any file, so the
    check is made to see it as a user does."""
    path = write_experiment(tmp_path / "m")
    (path.parent / "data").mkdir()
    (path.parent / "data" / "secret.bin").write_bytes(b"x")
    access = os.access

    def user_access(target: Any, mode: int, **kwargs: Any) -> bool:
        return Path(target).name != "secret.bin" and access(target, mode, **kwargs)

    monkeypatch.setattr(os, "access", user_access)
    results = tmp_path / "r"
    line = assert_one_line_error(
        capsys, ["asha", str(path), str(path.parent), "--results-dir", str(results)]
    )
    assert "m/data/secret.bin cannot be read" in line and "make it readable" in line, line
    assert not results.exists()


def test_a_named_pipe_in_the_model_dir_is_one_line_before_any_trial(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Determined's upload of it waited for a writer for ever; a trial's copy failed on it."""
    path = write_experiment(tmp_path / "m")
    os.mkfifo(path.parent / "events")
    line = assert_one_line_error(capsys, ["asha", str(path), str(path.parent)])
    assert "m/events is a named pipe, not a file a copy of MODEL_DIR" in line, line


def test_a_global_batch_that_replaces_the_configs_is_said_at_launch(tmp_path: Path) -> None:
    """--global-batch replaced the file's batch without a word, and "your config" then ran at
    another micro-batch than the file's."""
    result = run_simulated(
        "binary",
        "bert_base.yaml",
        "dsat.runners.simulated.performance_models:bert_base_16xv100",
        tmp_path / "r",
        "--max-trials",
        "4",
        "--global-batch",
        "256",
    )
    assert result.returncode == 0, result.stderr
    assert (
        "dsat: --global-batch 256 replaces your batch (micro-batch 32 x accumulation 1 x 16 "
        "slot(s) = 512, as ds_bert_base.json sets it): every trial, your config's own run (the "
        "baseline) and the hand-over train at 256"
    ) in result.stdout.replace("examples/simulated/", ""), result.stdout
    best = json.loads((tmp_path / "r" / "best_ds_config.json").read_text())
    assert best["train_batch_size"] == 256


def test_a_search_stopped_for_trials_failing_alike_says_why_once(tmp_path: Path) -> None:
    """Its last line said the failure twice: "none of the 3 search trials succeeded; 3 ended
    with: X (the machine failed the last 3 trials ...: X ...)"."""
    sim = tmp_path / "sim.py"
    sim.write_text(
        "from dsat.runners.simulated.performance_model import is_model_profile\n"
        "from dsat.runners.simulated.performance_models import bert_base_16xv100\n"
        "def perf(ds_config, slots):\n"
        "    if not is_model_profile(ds_config):\n"
        "        raise ConnectionError('the GPU fell off the bus')\n"
        "    return bert_base_16xv100(ds_config, slots)\n"
    )
    result = run_simulated(
        "binary", "bert_base.yaml", f"{sim}:perf", tmp_path / "r", "--max-trials", "20"
    )
    assert result.returncode == 1, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("dsat: search failed: the machine failed the last "), line
    assert line.count("the GPU fell off the bus") == 1 and "none of the" not in line, line
    # Resumed once that was fixed, it said the same and ran nothing: say that it needs a new one.
    again = run_cli("binary", "--resume", str(tmp_path / "r"))
    assert again.returncode == 1, again.stderr
    (line,) = again.stderr.strip().splitlines()
    assert line.count("the GPU fell off the bus") == 1, line
    assert (
        "; a failed search stays failed when resumed: once that is fixed, start a new one: " in line
    )
    config, model_dir = line.split(" -m dsat binary ")[1].split()
    assert (Path(config).resolve(), Path(model_dir).resolve()) == (
        SIMULATED / "bert_base.yaml",
        SIMULATED,
    ), line


ILLEGAL_ACCESS_SIMULATOR = (
    "from dsat.runners.simulated.performance_model import is_model_profile\n"
    "from dsat.runners.simulated.performance_models import bert_base_16xv100\n"
    "def perf(ds_config, slots):\n"
    "    if not is_model_profile(ds_config):\n"
    "        raise RuntimeError('CUDA error: an illegal memory access')\n"
    "    return bert_base_16xv100(ds_config, slots)\n"
)


def illegal_access_search(tmp_path: Path, max_trials: int) -> str:
    """A binary search whose every search trial crashes alike; its one line on stderr."""
    sim = tmp_path / "sim.py"
    sim.write_text(ILLEGAL_ACCESS_SIMULATOR)
    result = run_simulated(
        "binary", "bert_base.yaml", f"{sim}:perf", tmp_path / "r", "--max-trials", str(max_trials)
    )
    assert result.returncode == 1, result.stderr
    (line,) = result.stderr.strip().splitlines()
    return line


def test_a_search_whose_every_search_trial_failed_says_so_and_why(tmp_path: Path) -> None:
    """It ended with "search failed: --max-trials used up (8)", and its summary did not say
    that nothing was handed over."""
    line = illegal_access_search(tmp_path, 4)
    assert line.startswith(
        "dsat: search failed: none of the 3 search trials succeeded; 3 ended "
        "with: RuntimeError: CUDA error: an illegal memory access"
    ), line
    assert line.endswith("(--max-trials used up (4))"), line
    summary = (tmp_path / "r" / "summary.txt").read_text()
    assert "handed over: nothing: none of the 3 search trials succeeded" in summary
    # More trials for it would run none (its queue went with its end): one line, not taken.
    again = run_cli("binary", "--resume", str(tmp_path / "r"), "--max-trials", "20")
    _assert_subprocess_error(
        again,
        "that search has ended and handed over nothing (--max-trials used up (4)); --max-trials "
        "changes only a search still searching: start a new search with --max-trials 20",
    )
    assert json.loads((tmp_path / "r" / "settings.json").read_text())["max_trials"] == 4


def test_trials_crashing_alike_whatever_their_configuration_end_the_search(
    tmp_path: Path,
) -> None:
    """The same crash of no known kind in every search trial ran the whole budget (64 trials,
    each a GPU's start-up), to say at the end that none succeeded."""
    line = illegal_access_search(tmp_path, 40)
    assert re.match(
        r"dsat: search failed: the last 5 trials failed alike over ZeRO stages (\d, )+\d at "
        r"micro-batch(es \d+ to)? \d+, and none has succeeded: RuntimeError: CUDA error: an illegal "
        r"memory access; no configuration seems to be the cause: fix the training script",
        line,
    ), line
    rows = (tmp_path / "r" / "trials.jsonl").read_text().splitlines()
    assert len(rows) == 6  # the model profile and the five
    # The summary says why as the last line does: "none of the 5 search trials succeeded" read
    # as a budget spent.
    summary = (tmp_path / "r" / "summary.txt").read_text()
    assert f"handed over: nothing: {line.removeprefix('dsat: search failed: ')}\n" in summary


def test_search_with_no_working_config_exits_1(tmp_path: Path) -> None:
    sim = tmp_path / "sim.py"
    sim.write_text("def perf(ds_config, slots):\n    raise MemoryError('nothing fits')\n")
    result = run_simulated("binary", "bert_base.yaml", f"{sim}:perf", tmp_path / "r")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "dsat: search failed: the model does not fit at micro-batch 1 in any way dsat tried (as "
        "submitted; ZeRO-3; ZeRO-3, optimizer states on the CPU; ZeRO-3, optimizer states and "
        "parameters on the CPU): the last ran out of memory (MemoryError: nothing fits); "
        "--offload-nvme PATH (NVMe offload was not tried), give each trial more GPUs "
        "(resources.slots_per_trial), or a smaller model"
    ]


def test_a_model_that_fits_only_with_offload_is_handed_over_with_it(tmp_path: Path) -> None:
    results = tmp_path / "r"
    result = run_simulated(
        "guided",
        "llama_70b.yaml",
        "dsat.runners.simulated.performance_models:llama_70b_offload_8xh100",
        results,
        "--max-trials",
        "16",
    )
    assert result.returncode == 0, result.stderr
    assert "dsat: the model fits at micro-batch 1 with ZeRO-3, optimizer states on the CPU" in (
        result.stdout + result.stderr
    )
    summary = (results / "summary.txt").read_text()
    assert "to fit: ZeRO-3, optimizer states" in summary
    assert "ran out of memory as submitted and with ZeRO-3)" in summary
    assert "your config: not run (it ran out of memory at micro-batch 1" in summary
    best = json.loads((results / "best_ds_config.json").read_text())
    assert best["zero_optimization"]["stage"] == 3
    assert best["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


def test_zero3_knobs_reach_the_handed_over_config(tmp_path: Path) -> None:
    results = tmp_path / "r"
    result = run_simulated(
        "guided",
        "gpt_20b.yaml",
        "dsat.runners.simulated.performance_models:gpt_20b_zero3_knobs_32xa100",
        results,
    )
    assert result.returncode == 0, result.stderr
    zero = json.loads((results / "best_ds_config.json").read_text())["zero_optimization"]
    assert zero["stage"] == 3
    # Stepped from where the hidden size (6144, the experiment's hyperparameter) starts them.
    assert zero["stage3_param_persistence_threshold"] in (1_000, 61_440)
    assert zero["stage3_prefetch_bucket_size"] > 50_000_000


def test_sigusr1_prints_where_each_thread_is_and_dsat_goes_on(
    capfd: pytest.CaptureFixture[str],
) -> None:
    import faulthandler
    import signal

    from dsat.cli import dump_stacks_on_request

    dump_stacks_on_request()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
    finally:
        faulthandler.unregister(signal.SIGUSR1)
    err = capfd.readouterr().err
    assert "test_sigusr1_prints_where_each_thread_is_and_dsat_goes_on" in err
    assert "Current thread" in err or "Thread 0x" in err


@pytest.mark.parametrize("argv", [["report"], ["report", "a", "b"], ["report", "--bogus", "a"]])
def test_report_usage_mistakes_are_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    assert_one_line_error(capsys, argv, "report --help")


def test_an_nvme_directory_this_machines_trials_cannot_use_is_one_line(
    experiment_yaml: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["guided", str(experiment_yaml), str(experiment_yaml.parent), "--runner", "local"]
    missing = tmp_path / "no-such-disk"
    assert_one_line_error(capsys, [*argv, "--offload-nvme", str(missing)], "does not exist")
    (tmp_path / "a-file").write_text("")
    assert_one_line_error(
        capsys, [*argv, "--offload-nvme", str(tmp_path / "a-file")], "is not a directory"
    )


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_stopped_search_exits_with_the_shells_code_for_its_signal(
    monkeypatch: pytest.MonkeyPatch, experiment_yaml: Path, sig: signal.Signals
) -> None:
    """130 for Ctrl-C, 143 for SIGTERM (it was 130 for both): a scheduler that preempts a job
    tells a stop from a failure by it."""
    import dsat.search_launch

    def stopped_while_searching(settings: Any, environ: Any) -> None:
        signal.raise_signal(sig)
        raise AssertionError("the signal did not stop the search")

    monkeypatch.setattr(dsat.search_launch, "launch", stopped_while_searching)
    assert main(["asha", str(experiment_yaml), str(experiment_yaml.parent)]) == 128 + sig


def test_once_dsat_has_said_how_it_ended_a_second_ctrl_c_is_ignored(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A second Ctrl-C landed in torch's exit handlers and printed a traceback after dsat's
    own "interrupted" line."""
    import dsat.cli
    from dsat.search_run import STOP_SIGNALS

    handlers = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    monkeypatch.setattr(dsat.cli, "main", lambda: 130)
    try:
        with pytest.raises(SystemExit) as ended:
            dsat.cli.main_exit()
        assert ended.value.code == 130
        assert all(signal.getsignal(s) is signal.SIG_IGN for s in handlers)
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


@pytest.mark.parametrize("when", ["before the plan", "between the plan and the lock"])
def test_a_results_directory_dsat_named_that_another_search_holds_is_passed_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], when: str
) -> None:
    """Two searches started in the same second named the same directory; the second was refused
    "--results-dir ... is in use", a flag it was never given."""
    import contextlib

    import dsat.search_launch
    from dsat.results.directory_lock import results_directory_lock

    simulated = Path(__file__).resolve().parents[1] / "examples" / "simulated"
    named = tmp_path / "dsat-results" / "gpt2-large-20261127T193846Z"
    monkeypatch.setattr(dsat.search_launch, "default_results_dir", lambda name, now: named)
    argv = ["asha", str(simulated / "gpt2_large.yaml"), str(simulated), "--runner", "simulated"]
    argv += ["--simulator", "dsat.runners.simulated.performance_models:gpt2_large_16xv100"]
    with contextlib.ExitStack() as other_search:
        if when == "before the plan":
            other_search.enter_context(results_directory_lock(named))
        else:
            planned = dsat.search_launch.plan_search

            def taken_after_the_plan(*args: Any, **kwargs: Any) -> Any:
                plan = planned(*args, **kwargs)
                other_search.enter_context(results_directory_lock(plan.results_dir))
                return plan

            monkeypatch.setattr(dsat.search_launch, "plan_search", taken_after_the_plan)
        assert main([*argv, "--max-trials", "6"]) == 0
    out = capsys.readouterr().out
    assert f"results in {named.name}-2" in out.replace(str(named.parent) + "/", "")
    assert (named.parent / f"{named.name}-2" / "summary.txt").is_file()
    assert not (named / "summary.txt").exists()


def test_an_hf_json_with_a_trailing_comma_is_a_note(tmp_path: Path) -> None:
    """DeepSpeed and dsat read it (hjson); HF's Trainer reads it with Python's json and fails:
    the user's own run failed while the search said nothing and called their config the best."""
    from dsat.experiment.config import load_experiment
    from dsat.search_launch import hf_strict_json_note

    entrypoint = "python3 train.py --deepspeed ds_config.json"
    path = write_experiment(tmp_path / "m", config={"entrypoint": entrypoint})
    assert hf_strict_json_note(load_experiment(path, path.parent)) is None
    (path.parent / "ds_config.json").write_text('{"train_micro_batch_size_per_gpu": 2,}\n')
    note = hf_strict_json_note(load_experiment(path, path.parent))
    assert note is not None and "ds_config.json is not plain JSON (" in note
    assert "line 1, column" in note and "HF's Trainer does not" in note
    core = write_experiment(tmp_path / "c")  # not an HF entrypoint: DeepSpeed reads it itself
    (core.parent / "ds_config.json").write_text('{"train_micro_batch_size_per_gpu": 2,}\n')
    assert hf_strict_json_note(load_experiment(core, core.parent)) is None


def test_checkpointing_on_in_the_entrypoint_and_off_in_the_hyperparameter_is_a_note(
    tmp_path: Path,
) -> None:
    """The fit ladder's checkpointing rung sets the hyperparameter; an entrypoint that turns
    checkpointing on itself made every trial checkpoint and the rung change nothing, unsaid."""
    from dsat.experiment.config import load_experiment
    from dsat.search_launch import checkpointing_switch_note

    hparams = {"deepspeed_config": "ds_config.json", "gradient_checkpointing": False}
    said = {}
    for tail in (
        "--gradient_checkpointing",
        "--gradient_checkpointing true --seed 1",
        "--gradient-checkpointing=True",
        "--gradient_checkpointing false",
        "",
    ):
        entrypoint = f"python3 train.py --deepspeed ds_config.json {tail}".strip()
        config = {"entrypoint": entrypoint, "hyperparameters": hparams}
        path = write_experiment(tmp_path / str(len(said)), config=config)
        said[tail] = checkpointing_switch_note(load_experiment(path, path.parent))
    on = [t for t, note in said.items() if note is not None]
    assert on == [
        "--gradient_checkpointing",
        "--gradient_checkpointing true --seed 1",
        "--gradient-checkpointing=True",
    ]
    note = said["--gradient_checkpointing"]
    assert note is not None and "hyperparameters.gradient_checkpointing is false but the " in note


def test_a_search_whose_every_trial_ran_out_of_memory_names_the_range_flag(
    tmp_path: Path,
) -> None:
    """--search-range-factor 100 sent every binary search above what fits: "none of the 7
    search trials succeeded; 7 ended with: MemoryError ..." and no word of the flag."""
    model = "dsat.runners.simulated.performance_models:bert_base_16xv100"
    result = run_simulated(
        "binary", "bert_base.yaml", model, tmp_path / "r", "--max-trials", "8",
        "--search-range-factor", "100",
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "search trials succeeded" in line and "out of memory" in line, line
    assert "(--max-trials used up (8)); lower --search-range-factor (100 here), or " in line
    assert ", or raise --max-trials, or " in line  # the budget ended it


def test_a_search_whose_stages_cannot_fit_names_the_stage_the_users_config_ran_at(
    tmp_path: Path,
) -> None:
    """--zero-stages 0 1 of a model that needs ZeRO-2: "raise --max-trials" with 10 of 12 left
    and "no configuration left to try", while the user's own ZeRO-2 run had completed."""
    model = "dsat.runners.simulated.performance_models:llama_14b_no_low_stages_8xa100"
    result = run_simulated(
        "guided", "llama_7b.yaml", model, tmp_path / "r", "--zero-stages", "0", "1",
        "--max-trials", "12",
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "(no configuration left to try); search the stage your config ran at (ZeRO-2 " in line
    assert "--zero-stages 0 1 2" in line and "--max-trials" not in line.partition(")")[2], line
