"""Submitting to Determined, against a fake master (see fake_master.py: no real master runs here)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import responses

from dsat.cli import main
from dsat.errors import DsatError
from dsat.experiment.config import load_experiment
from dsat.experiment.settings import SearchSettings
from dsat.runners.determined.configs import SEARCH_RUNNER_ENTRYPOINT, SETTINGS_UPLOAD
from dsat.runners.determined.submit import (
    experiment_url,
    has_custom_searcher,
    require_client_custom_searcher,
    upload_names,
)
from tests.conftest import REPO_ROOT, copy_example
from tests.runners.fake_master import MASTER, FakeMaster, logged_in_environment


@pytest.fixture
def master(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FakeMaster]:
    """A fake 0.37 master, and the environment a logged-in user (or a task) has."""
    logged_in_environment(monkeypatch, tmp_path / "home")
    fake = FakeMaster()
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        fake.install(mock)
        yield fake


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    target = tmp_path / "work" / "mlp"
    copy_example(target)
    (target / "data").mkdir()
    (target / "data" / "tokens.txt").write_text("1 2 3\n")
    return target


def test_submission_creates_the_search_runner_and_uploads_the_tree(
    master: FakeMaster, model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    extra = tmp_path / "work" / "vocab.json"
    extra.write_text("{}")
    code = main(
        [
            "binary",
            str(model_dir / "deepspeed.yaml"),
            str(model_dir),
            "--include",
            str(extra),
            "--max-trials",
            "9",
            "--zero-stages",
            "2",
            "3",
            "--max-search-runner-restarts",
            "3",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert len(master.experiments) == 1
    created = master.experiments[0]
    assert f"Created experiment {created.id}" in out
    assert f"{MASTER}/det/experiments/{created.id}" in out
    config = created.config
    assert config["name"] == "(DSAT) core-api-mlp"
    assert config["entrypoint"] == SEARCH_RUNNER_ENTRYPOINT
    assert config["max_restarts"] == 3
    assert config["resources"]["slots_per_trial"] == 0
    assert config["searcher"]["name"] == "single"
    files = created.files
    # The user's tree under its own name, the YAML and the include at the top, dsat's package.
    assert "mlp/train.py" in files and "mlp/data/tokens.txt" in files
    assert "deepspeed.yaml" in files and "vocab.json" in files
    assert "dsat/runners/determined/search_runner.py" in files
    assert not any("__pycache__" in path for path in files)
    settings = SearchSettings.from_json(files[SETTINGS_UPLOAD].decode())
    assert settings.method == "binary" and settings.max_trials == 9
    assert settings.zero_stages == (2, 3)
    on_cluster = settings.on_cluster()
    assert (on_cluster.config_path, on_cluster.model_dir, on_cluster.include) == (
        "deepspeed.yaml",
        "mlp",
        ("vocab.json",),
    )
    assert not any(path.endswith(".pkl") for path in files)


def test_earlier_local_results_in_the_model_dir_are_said_to_be_uploaded(
    master: FakeMaster, model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`python3 -m dsat guided deepspeed.yaml .` leaves dsat-results/ in MODEL_DIR: Determined
    uploaded it, a copy of MODEL_DIR per trial in it, to the search runner and every trial,
    without a word; .detignore, which the client reads, is what leaves it out."""
    earlier = model_dir / "dsat-results" / "core-api-mlp-20261129T101010Z"
    earlier.mkdir(parents=True)
    (earlier / "trials.jsonl").write_text("")
    args = ["asha", str(model_dir / "deepspeed.yaml"), str(model_dir)]
    assert main(args) == 0
    assert "add a line dsat-results/ to" in capsys.readouterr().out
    assert (
        "mlp/dsat-results/core-api-mlp-20261129T101010Z/trials.jsonl" in master.experiments[0].files
    )
    (model_dir / ".detignore").write_text("data/\ndsat-results/\n")
    assert main(args) == 0
    assert "dsat-results" not in capsys.readouterr().out
    assert not any("dsat-results" in path for path in master.experiments[1].files)


@pytest.mark.parametrize("line", ["ds_config.json", "*.py", "/train.py"])
def test_a_detignore_that_leaves_out_what_the_trials_need_is_one_line(
    master: FakeMaster, model_dir: Path, capsys: pytest.CaptureFixture[str], line: str
) -> None:
    """It submitted, then the search runner failed on the missing config (and Determined
    restarted it to fail alike), or every trial failed on the missing script."""
    (model_dir / ".detignore").write_text(f"data/\n{line}\n")
    code = main(["asha", str(model_dir / "deepspeed.yaml"), str(model_dir)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert ".detignore leaves it out of what Determined uploads, and the trials need it" in err[0]
    assert not master.experiments


def test_a_link_to_a_folder_in_the_model_dir_is_said_to_upload_empty(
    master: FakeMaster, model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Determined's client does not follow it: the trials found an empty folder, unsaid."""
    shared = tmp_path / "datasets" / "x"
    shared.mkdir(parents=True)
    (shared / "x.txt").write_text("x")
    (model_dir / "corpus").symlink_to(shared, target_is_directory=True)
    assert main(["asha", str(model_dir / "deepspeed.yaml"), str(model_dir)]) == 0
    assert f"{model_dir / 'corpus'} links to a folder, which Determined uploads empty" in (
        capsys.readouterr().out
    )
    assert not any("x.txt" in path for path in master.experiments[0].files)


def test_a_search_runner_config_file_replaces_the_generated_one(
    master: FakeMaster, model_dir: Path, tmp_path: Path
) -> None:
    runner_yaml = tmp_path / "runner.yaml"
    runner_yaml.write_text("name: my-runner\nresources: {slots_per_trial: 0}\n")
    code = main(
        [
            "asha",
            str(model_dir / "deepspeed.yaml"),
            str(model_dir),
            "--search-runner-config",
            str(runner_yaml),
        ]
    )
    assert code == 0
    config = master.experiments[0].config
    assert config["name"] == "my-runner"
    assert config["entrypoint"] == SEARCH_RUNNER_ENTRYPOINT  # filled in when the file has none
    assert "max_restarts" not in config  # the file's to say (Determined's default)


def test_max_search_runner_restarts_given_with_a_runner_config_file_is_taken(
    master: FakeMaster, model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It was dropped without a word: the file's experiment ran with Determined's default."""
    runner_yaml = tmp_path / "runner.yaml"
    runner_yaml.write_text("name: my-runner\nresources: {slots_per_trial: 0}\n")
    args = ["asha", str(model_dir / "deepspeed.yaml"), str(model_dir)]
    given = [*args, "--search-runner-config", str(runner_yaml), "--max-search-runner-restarts", "1"]
    assert main(given) == 0
    assert master.experiments[0].config["max_restarts"] == 1
    runner_yaml.write_text("name: my-runner\nmax_restarts: 3\n")
    assert main(given) == 2
    err = capsys.readouterr().err
    assert "--max-search-runner-restarts 1 and max_restarts 3 in" in err and "drop one" in err
    # Given as the default's value, it was taken for not given, and the file's 0 ran.
    runner_yaml.write_text("name: my-runner\nmax_restarts: 0\n")
    assert main([*given[:-1], "5"]) == 2
    assert "--max-search-runner-restarts 5 and max_restarts 0 in" in capsys.readouterr().err


def test_a_master_without_custom_searchers_gets_a_one_line_error(
    master: FakeMaster, model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    master.version = "0.38.1"
    code = main(["asha", str(model_dir / "deepspeed.yaml"), str(model_dir)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("dsat: error: the Determined master at http://fake-master:8080 ")
    assert "runs 0.38.1, which has no custom searcher" in err[-1]
    assert "determined 0.37 or earlier" in err[-1] and "--runner local" in err[-1]
    assert master.experiments == []  # nothing was submitted


def test_a_client_without_custom_searchers_gets_a_one_line_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import determined
    from determined import searcher

    monkeypatch.delattr(searcher, "RemoteSearchRunner")  # what determined 0.38 looks like
    monkeypatch.setattr(determined, "__version__", "0.38.0")
    with pytest.raises(DsatError) as caught:
        require_client_custom_searcher()
    message = str(caught.value)
    assert "determined 0.38.0 has no custom searcher" in message
    assert "pip install 'determined>=0.37,<0.38'" in message and "\n" not in message


@pytest.mark.parametrize(
    ("version", "ok"),
    [("0.37.0", True), ("0.26.4", True), ("0.38.0", False), ("1.0.0", False), ("dev", True)],
)
def test_versions_with_a_custom_searcher(version: str, ok: bool) -> None:
    assert has_custom_searcher(version) is ok


def test_upload_names_must_not_collide(tmp_path: Path) -> None:
    model = tmp_path / "dsat"  # would shadow dsat's own package in the context
    copy_example(model)
    experiment = load_experiment(model / "deepspeed.yaml", model)
    with pytest.raises(DsatError, match="uploads as 'dsat'"):
        upload_names(experiment)


@pytest.mark.parametrize("inside", ["dsat", "vocab.json"])
def test_a_name_the_trials_context_takes_twice_is_refused(tmp_path: Path, inside: str) -> None:
    """MODEL_DIR's files share the trials' context with dsat's package and each include: a
    clash submitted fine, then the search runner failed on the master's "duplicate path" as
    often as Determined restarted it."""
    model = tmp_path / "mlp"
    copy_example(model)
    (tmp_path / "vocab.json").write_text("{}")
    (model / inside).mkdir()
    experiment = load_experiment(
        model / "deepspeed.yaml", model, includes=(tmp_path / "vocab.json",)
    )
    with pytest.raises(DsatError, match=f"takes .* under the name '{inside}' beside MODEL_DIR"):
        upload_names(experiment)


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--results-dir", "r"], "--results-dir applies to the local, Ray and simulated runners"),
        (["--trial-timeout", "60"], "--trial-timeout applies to the local and Ray runners"),
        (["--fresh-processes"], "--fresh-processes applies to the local runner"),
        (["--no-trial-host"], "--no-trial-host applies to the local runner"),
    ],
)
def test_flags_of_other_runners_do_not_apply_to_determined(
    master: FakeMaster,
    model_dir: Path,
    capsys: pytest.CaptureFixture[str],
    flags: list[str],
    named: str,
) -> None:
    """Accepted and ignored, a --trial-timeout left a hung trial holding the search."""
    code = main(["asha", str(model_dir / "deepspeed.yaml"), str(model_dir), *flags])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0], err
    assert master.experiments == []


def test_a_master_that_refuses_the_user_is_one_line(
    master: FakeMaster, model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    master.refuse_create = (403, "user cannot create experiments in project 12")
    code = main(["asha", str(model_dir / "deepspeed.yaml"), str(model_dir)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("dsat: error: the Determined master refused: ")
    assert "permissions on the config's workspace and project" in err[0]


@pytest.mark.parametrize(
    ("status", "said"),
    [
        (400, "the Determined master rejected the search runner: bad searcher name\n"),
        (503, "could not take the search runner now (HTTP 503: bad searcher name); try again"),
    ],
)
def test_a_refusal_says_the_masters_words_and_whether_to_try_again(
    master: FakeMaster,
    model_dir: Path,
    capsys: pytest.CaptureFixture[str],
    status: int,
    said: str,
) -> None:
    """Both were the master's JSON body as it came, and a master busy or restarting read as a
    rejection of the config."""
    master.refuse_create = (status, "bad searcher name")
    code = main(["asha", str(model_dir / "deepspeed.yaml"), str(model_dir)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and said in err, err


@pytest.mark.parametrize("address", ["my-master:808O", "http://host:8080:8080", "https://[::1"])
def test_a_master_address_that_is_none_is_one_line(
    master: FakeMaster,
    model_dir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    address: str,
) -> None:
    """A typo in DET_MASTER was Python's ValueError traceback, after "runner determined"."""
    monkeypatch.setenv("DET_MASTER", address)
    code = main(["asha", str(model_dir / "deepspeed.yaml"), str(model_dir)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"DET_MASTER={address!r} is not a master's address" in err[0]


def test_experiment_url() -> None:
    assert experiment_url("http://m:8080/", 12) == "http://m:8080/det/experiments/12"
    assert json.loads(json.dumps(experiment_url(MASTER, 1)))  # a plain string


def test_an_upload_too_large_for_determined_is_a_one_line_error(
    master: FakeMaster,
    model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from determined.common import context

    # Determined's limit is 95 MB; lower it rather than write that much.
    includes_default, _limit = context.read_v1_context.__defaults__
    monkeypatch.setattr(context.read_v1_context, "__defaults__", (includes_default, 10_000))
    code = main(["asha", str(model_dir / "deepspeed.yaml"), str(model_dir)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and master.experiments == []
    assert "more than Determined uploads" in err[-1] and ".detignore" in err[-1]


@pytest.mark.parametrize(
    ("trial", "refused"),
    [
        ("model_def:NoSuchTrial", True),  # its module is MODEL_DIR's: the class is not there
        ("model_def:RegressorTrial", False),
        ("a_module_of_the_image:SomeTrial", False),  # not MODEL_DIR's: the cluster's to find
    ],
)
def test_a_trial_class_its_module_lacks_is_one_line_before_the_search_is_submitted(
    master: FakeMaster,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    trial: str,
    refused: bool,
) -> None:
    """Every trial would have failed on the cluster with an ImportError."""
    example = tmp_path / "deepspeed_trial"
    shutil.copytree(REPO_ROOT / "examples" / "deepspeed_trial", example)
    yaml_path = example / "deepspeed.yaml"
    text = yaml_path.read_text().replace("model_def:RegressorTrial", trial)
    yaml_path.write_text(text)
    code = main(["asha", str(yaml_path), str(example), "--runner", "determined"])
    err = capsys.readouterr().err
    assert (code == 2) is refused, err
    if refused:
        assert "defines no NoSuchTrial; fix the name" in err and len(err.splitlines()) == 1
        assert master.experiments == []
