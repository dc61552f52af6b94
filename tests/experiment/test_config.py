"""Experiment/DeepSpeed config loading, deep merge, entrypoint checks, DeepSpeed validation."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsat.constants import OVERWRITE_KEY
from dsat.errors import DsatError
from dsat.experiment.config import (
    OLD_OFFLOAD_NAMES,
    autotuning_enabled_note,
    check_entrypoint_script,
    deep_merge,
    entrypoint_ds_config,
    entrypoint_script,
    full_run_length_note,
    load_experiment,
    searcher_length,
    trial_ready_config,
    validate_with_deepspeed,
)
from dsat.experiment.ds_config_check import deepspeed_config_error
from tests.conftest import write_experiment

json_leaf = st.one_of(st.integers(), st.booleans(), st.text(max_size=5), st.none())
json_tree = st.recursive(
    json_leaf,
    lambda children: st.one_of(
        st.lists(children, max_size=3), st.dictionaries(st.text(max_size=3), children, max_size=3)
    ),
    max_leaves=10,
)
json_object = st.dictionaries(st.text(max_size=3), json_tree, max_size=4)


def test_deep_merge_merges_dicts_and_replaces_the_rest() -> None:
    base = {
        "zero_optimization": {"stage": 1, "overlap_comm": True},
        "lr": [1, 2],
        "fp16": {"enabled": True},
    }
    overrides = {"zero_optimization": {"stage": 3}, "lr": [3], "fp16": False}
    merged = deep_merge(base, overrides)
    assert merged == {
        "zero_optimization": {"stage": 3, "overlap_comm": True},
        "lr": [3],
        "fp16": False,
    }
    assert base["zero_optimization"] == {"stage": 1, "overlap_comm": True}  # inputs untouched
    merged["lr"].append(9)
    assert overrides["lr"] == [3]


def _leaves(tree: dict[str, Any], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    out: dict[tuple[str, ...], Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_leaves(value, (*prefix, key)))
        else:
            out[(*prefix, key)] = value
    return out


def _get(tree: dict[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


@given(json_object, json_object)
def test_deep_merge_properties(base: dict[str, Any], overrides: dict[str, Any]) -> None:
    merged = deep_merge(base, overrides)
    assert deep_merge(base, {}) == base
    assert deep_merge(merged, overrides) == merged  # idempotent
    for path, value in _leaves(overrides).items():
        if isinstance(value, dict):  # an empty override dict keeps what base had there
            assert isinstance(_get(merged, path), dict)
        else:
            assert _get(merged, path) == value
    assert set(merged) == set(base) | set(overrides)


@pytest.mark.parametrize(
    ("entrypoint", "expected"),
    [
        ("python3 train.py", None),
        ("python3 train.py --deepspeed ds.json", "ds.json"),
        ("python3 train.py --deepspeed=./ds.json --x 1", "./ds.json"),
        ("python3 train.py --deepspeed --deepspeed_config conf/ds.json", "conf/ds.json"),
        (["python3", "train.py", "--deepspeed_config", "a.json"], "a.json"),
        ("python3 train.py --deepspeed a.json --deepspeed b.json", "b.json"),  # argparse's
        (
            "python3 -m determined.launch.deepspeed python3 train.py --deepspeed-config b.json",
            "b.json",
        ),
        (None, None),
    ],
)
def test_entrypoint_ds_config(entrypoint: Any, expected: str | None) -> None:
    assert entrypoint_ds_config(entrypoint) == expected


@pytest.mark.parametrize(
    ("entrypoint", "expected"),
    [
        ("python3 train.py", "train.py"),
        ("python3 -u src/train.py --deepspeed ds.json", "src/train.py"),
        ("deepspeed --num_gpus 2 train.py --deepspeed_config ds.json", "train.py"),
        ("torchrun --nproc_per_node=2 train.py", "train.py"),
        ("python3 -m determined.launch.deepspeed python3 train.py --deepspeed ds.json", "train.py"),
        (["python3", "run.py", "--config", "settings.py"], "run.py"),
        ("python3 launch.py --config settings.py", "launch.py"),
        ("python3 --config settings.py", None),  # a flag's value, not what runs
        ("python3 -m determined.launch.deepspeed --trial model_def:Trial", None),
        ("python3 -m mypkg.train", None),
        ("python3 /opt/app/train.py", None),  # may be in a cluster's image
        ("python3 $HOME/train.py", None),
        ("python3 ~/train.py", None),
        (None, None),
    ],
)
def test_entrypoint_script(entrypoint: Any, expected: str | None) -> None:
    assert entrypoint_script(entrypoint) == expected


def test_an_entrypoint_script_that_is_not_there_is_one_line_before_any_trial(
    tmp_path: Path,
) -> None:
    """A typo in the script's name used to run the model-profile trial, fail it with Python's
    "can't open file", and end the search with exit 1."""
    path = write_experiment(tmp_path / "m", config={"entrypoint": "python3 trian.py"})
    experiment = load_experiment(path, path.parent)  # the simulator runs no script
    with pytest.raises(DsatError) as raised:
        check_entrypoint_script(experiment)
    message = str(raised.value)
    assert "the entrypoint runs trian.py, which is not in MODEL_DIR" in message
    assert "fix the script's path in the entrypoint" in message and "\n" not in message


@pytest.mark.parametrize("entrypoint", [5, {"cmd": "python3 train.py"}, True])
def test_an_entrypoint_that_is_no_command_is_one_line(tmp_path: Path, entrypoint: Any) -> None:
    """A number failed as a TypeError's traceback; a mapping was called "no entrypoint"."""
    path = write_experiment(tmp_path / "m", config={"entrypoint": entrypoint})
    with pytest.raises(DsatError) as raised:
        load_experiment(path, path.parent)
    message = str(raised.value)
    assert f"entrypoint is {entrypoint!r}, not a command" in message and "\n" not in message


def test_a_model_dir_that_cannot_be_read_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Looking for the DeepSpeed config in it raised PermissionError's traceback (as root, any
    folder can be read: ``os.access`` is what dsat asks, and is asked here)."""
    path = write_experiment(tmp_path / "m")
    real_access = os.access
    monkeypatch.setattr(
        os, "access", lambda p, mode: False if Path(p) == path.parent else real_access(p, mode)
    )
    with pytest.raises(DsatError, match=r"/m: MODEL_DIR cannot be read; .*make it readable"):
        load_experiment(path, path.parent)


def test_a_deepspeed_config_outside_model_dir_is_one_line_before_any_trial(
    tmp_path: Path,
) -> None:
    """``../shared/ds.json`` exists here, but not in a trial's copy of MODEL_DIR: the model
    profile failed with "DeepSpeed config not found" about a file that exists."""
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 2}))
    path = write_experiment(
        tmp_path / "m", config={"hyperparameters": {"deepspeed_config": "../shared/ds.json"}}
    )
    with pytest.raises(DsatError) as raised:
        load_experiment(path, path.parent)
    message = str(raised.value)
    assert "names ../shared/ds.json, outside MODEL_DIR" in message and "\n" not in message
    assert "move it into MODEL_DIR, or --include its folder and name it <folder>/<file>" in message
    # As the message says: its folder included, named under it.
    included = {"hyperparameters": {"deepspeed_config": "shared/ds.json"}}
    path = write_experiment(tmp_path / "m", config=included)
    assert load_experiment(path, path.parent, [shared]).ds_config_path == shared / "ds.json"


def test_a_deepspeed_config_is_read_as_deepspeed_reads_it(tmp_path: Path) -> None:
    """Comments and trailing commas, which DeepSpeed's reader (hjson) takes, are taken; a key
    given twice, which it refuses (json kept the last, silently), is one line."""
    path = write_experiment(tmp_path / "m")
    ds_path = path.parent / "ds_config.json"
    ds_path.write_text(
        '{\n  // tuned by hand\n  "train_micro_batch_size_per_gpu": 8,\n'
        '  "zero_optimization": {"stage": 2,},\n}\n'
    )
    experiment = load_experiment(path, path.parent)
    assert experiment.ds_config == {
        "train_micro_batch_size_per_gpu": 8,
        "zero_optimization": {"stage": 2},
    }
    ds_path.write_text('{"zero_optimization": {"stage": 1}, "zero_optimization": {"stage": 3}}')
    with pytest.raises(DsatError) as raised:
        load_experiment(path, path.parent)
    assert str(raised.value) == (
        f"{ds_path}: key 'zero_optimization' given twice in one object (DeepSpeed refuses such "
        "a config); keep one"
    )
    ds_path.write_text('{"zero_optimization": {"stage": 1, "stage": 3}}')  # nested too
    with pytest.raises(DsatError, match="key 'stage' given twice"):
        load_experiment(path, path.parent)


@pytest.mark.parametrize("unreadable", ["deepspeed.yaml", "ds_config.json"])
def test_an_unreadable_config_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, unreadable: str
) -> None:
    """Root reads a file of mode 000 anyway: the read is made to fail as it does for a user."""
    path = write_experiment(tmp_path / "m")
    read_text = Path.read_text

    def denied(self: Path, *args: Any, **kwargs: Any) -> str:
        if self.name == unreadable:
            raise PermissionError(13, "Permission denied", str(self))
        return read_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", denied)
    with pytest.raises(DsatError) as raised:
        load_experiment(path, path.parent)
    assert str(raised.value) == (
        f"{path.parent / unreadable}: cannot read it (Permission denied); make it readable by "
        "the user running dsat"
    )


def test_an_entrypoint_script_from_an_include_is_found(tmp_path: Path) -> None:
    """An included folder lands at the trial's root under its own name, as with Determined's
    ``--include``: ``scripts/train.py`` with ``--include ../scripts`` is there."""
    path = write_experiment(tmp_path / "m", config={"entrypoint": "python3 scripts/train.py"})
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    with pytest.raises(DsatError):
        check_entrypoint_script(load_experiment(path, path.parent))
    (scripts / "train.py").write_text("print('training')\n")
    check_entrypoint_script(load_experiment(path, path.parent, includes=[scripts]))


def test_entrypoint_naming_the_same_file_differently_is_accepted(tmp_path: Path) -> None:
    path = write_experiment(
        tmp_path / "m", config={"entrypoint": "python3 train.py --deepspeed ./ds_config.json"}
    )
    assert load_experiment(path, path.parent).ds_config_path == path.parent / "ds_config.json"


def test_load_experiment_reads_everything(tmp_path: Path) -> None:
    path = write_experiment(tmp_path / "m", config={"resources": {"slots_per_trial": 2}})
    experiment = load_experiment(path, path.parent)
    assert experiment.name == "tiny"
    assert experiment.slots_per_trial == 2
    assert experiment.ds_config == {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 1},
    }
    assert experiment.hparams["deepspeed_config"] == "ds_config.json"


def test_determined_constants_are_their_values_as_a_cluster_gives_them(tmp_path: Path) -> None:
    hparams = {
        "deepspeed_config": {"type": "const", "val": "ds_config.json"},
        "model": {"width": {"type": "const", "val": 256}, "depth": 4},
        "optimizer": {"type": "adamw", "lr": 1e-4},  # the user's own mapping, not a definition
    }
    path = write_experiment(tmp_path / "m", config={"hyperparameters": hparams})
    assert load_experiment(path, path.parent).hparams == {
        "deepspeed_config": "ds_config.json",
        "model": {"width": 256, "depth": 4},
        "optimizer": {"type": "adamw", "lr": 1e-4},
    }


def test_a_determined_range_is_one_line_naming_the_hyperparameter(tmp_path: Path) -> None:
    hparams = {
        "deepspeed_config": "ds_config.json",
        "model": {"lr": {"type": "log", "minval": -5, "maxval": -3, "base": 10}},
    }
    path = write_experiment(tmp_path / "m", config={"hyperparameters": hparams})
    with pytest.raises(DsatError, match=r"hyperparameters\.model\.lr is a range \(type: log\)"):
        load_experiment(path, path.parent)


def test_a_determined_constant_without_its_value_is_one_line(tmp_path: Path) -> None:
    """The trial got ``{"type": "const"}`` as the value, and failed in its first line."""
    hparams = {"deepspeed_config": "ds_config.json", "model": {"width": {"type": "const"}}}
    path = write_experiment(tmp_path / "m", config={"hyperparameters": hparams})
    with pytest.raises(DsatError) as raised:
        load_experiment(path, path.parent)
    assert str(raised.value).endswith(
        "hyperparameters.model.width is type: const without its val; add val: ..."
    )


def test_overrides_that_make_the_batch_sizes_wrong_are_one_line(tmp_path: Path) -> None:
    """The search's trials set their own micro-batch over them, so the search ran and only the
    summary said "your config: not run (its batch sizes do not add up...)"."""
    overrides = {"train_micro_batch_size_per_gpu": "x"}
    hparams = {"deepspeed_config": "ds_config.json", "overwrite_deepspeed_args": overrides}
    path = write_experiment(tmp_path / "m", config={"hyperparameters": hparams})
    with pytest.raises(DsatError) as raised:
        load_experiment(path, path.parent)
    assert str(raised.value) == (
        f"{path}: your JSON with hyperparameters.overwrite_deepspeed_args: "
        "train_micro_batch_size_per_gpu must be a positive integer or \"auto\", got 'x'"
    )
    hparams["overwrite_deepspeed_args"] = {"train_micro_batch_size_per_gpu": 4}
    path = write_experiment(tmp_path / "m", config={"hyperparameters": hparams})
    assert load_experiment(path, path.parent).hparams["overwrite_deepspeed_args"] == {
        "train_micro_batch_size_per_gpu": 4
    }


def test_a_yaml_key_given_twice_is_one_line(tmp_path: Path) -> None:
    """As Determined's reader refuses it; PyYAML kept the second silently."""
    path = write_experiment(tmp_path / "m")
    path.write_text(path.read_text() + "name: again\n")
    with pytest.raises(DsatError) as raised:
        load_experiment(path, path.parent)
    assert str(raised.value).startswith(
        f"{path}: not valid YAML (key 'name' given twice in one mapping at line "
    )
    # Anchors and merges, which repeat keys on purpose, still load.
    path.write_text(
        "base: &base {slots_per_trial: 1}\nresources:\n  <<: *base\n  slots_per_trial: 2\n"
        "entrypoint: python3 train.py\nhyperparameters: {deepspeed_config: ds_config.json}\n"
    )
    assert load_experiment(path, path.parent).slots_per_trial == 2


def test_zero_optimization_true_is_zero_1_as_deepspeed_runs_it(tmp_path: Path) -> None:
    """DeepSpeed's old form ``"zero_optimization": true`` runs as ZeRO-1; dsat called the user's
    config ZeRO-0 in trials.jsonl and the summary."""
    for old, stage in ((True, 1), (False, 0)):
        path = write_experiment(tmp_path / str(old), ds_config={"zero_optimization": old})
        zero = load_experiment(path, path.parent).ds_config["zero_optimization"]
        assert zero == {"stage": stage}


def test_name_defaults_to_the_config_file_stem(tmp_path: Path) -> None:
    path = write_experiment(tmp_path / "m", config={"name": ""})
    assert load_experiment(path, path.parent).name == "deepspeed"


def test_ds_config_found_through_an_included_file(tmp_path: Path) -> None:
    path = write_experiment(
        tmp_path / "m", config={"hyperparameters": {"deepspeed_config": "shared.json"}}
    )
    shared = tmp_path / "elsewhere" / "shared.json"
    shared.parent.mkdir()
    shared.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4}))
    with pytest.raises(DsatError, match="shared.json"):
        load_experiment(path, path.parent)
    experiment = load_experiment(path, path.parent, [shared])
    assert (
        experiment.ds_config_path == shared
        and experiment.ds_config["train_micro_batch_size_per_gpu"] == 4
    )


def test_ds_config_found_through_an_included_folder(tmp_path: Path) -> None:
    path = write_experiment(
        tmp_path / "m", config={"hyperparameters": {"deepspeed_config": "configs/ds.json"}}
    )
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "ds.json").write_text("{}")
    assert load_experiment(path, path.parent, [tmp_path / "configs"]).ds_config == {}


def test_an_include_that_would_replace_a_model_dir_file_is_one_line(tmp_path: Path) -> None:
    """MODEL_DIR's ds_config.json was the one dsat checked and planned with, while every trial's
    copy held the include's (copied over it): an SGD config DeepSpeed refused mid-search, or
    one configuration measured and another handed over. Two includes of one name alike."""
    path = write_experiment(tmp_path / "m")
    other = tmp_path / "ds_config.json"
    other.write_text("{}")
    with pytest.raises(DsatError) as info:
        load_experiment(path, path.parent, [other])
    assert str(info.value) == (
        f"--include {other}: its ds_config.json would replace MODEL_DIR's "
        f"{path.parent / 'ds_config.json'} in each trial's copy, while dsat checks and plans with "
        "MODEL_DIR's; rename one of them"
    )
    # A folder that merges with MODEL_DIR's: a file of both is refused, new files are not.
    (path.parent / "conf").mkdir()
    (path.parent / "conf" / "a.yaml").write_text("a: 1\n")
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "b.yaml").write_text("b: 1\n")
    load_experiment(path, path.parent, [tmp_path / "conf"])
    (tmp_path / "conf" / "a.yaml").write_text("a: 2\n")
    with pytest.raises(DsatError, match="its a.yaml would replace MODEL_DIR's"):
        load_experiment(path, path.parent, [tmp_path / "conf"])
    (tmp_path / "x" / "shared.py").parent.mkdir()
    for shared in (tmp_path / "x" / "shared.py", tmp_path / "shared.py"):
        shared.write_text("")
    with pytest.raises(DsatError, match="both land in each trial's copy as shared.py"):
        load_experiment(path, path.parent, [tmp_path / "x" / "shared.py", tmp_path / "shared.py"])


@pytest.mark.parametrize("slots", [0, -1, "two", True])
def test_bad_slots_per_trial(tmp_path: Path, slots: Any) -> None:
    path = write_experiment(tmp_path / "m", config={"resources": {"slots_per_trial": slots}})
    with pytest.raises(DsatError, match="resources.slots_per_trial"):
        load_experiment(path, path.parent)


def test_top_level_yaml_must_be_a_mapping(tmp_path: Path) -> None:
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(DsatError, match="mapping"):
        load_experiment(path, tmp_path)


def test_trial_ready_config_drops_autotuning_and_fixes_batch() -> None:
    config = trial_ready_config(
        {
            "train_micro_batch_size_per_gpu": 3,
            "gradient_accumulation_steps": 2,
            "autotuning": {"enabled": True},
        },
        slots=4,
        source="x",
    )
    assert "autotuning" not in config
    assert config["train_batch_size"] == 24


def test_validate_with_deepspeed_accepts_a_good_config() -> None:
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": 3},
        "bf16": {"enabled": True},
    }
    assert validate_with_deepspeed(config, slots=4, source="ds.json") is True


# The shape of HF's documented ZeRO-3 config: "auto" wherever its Trainer fills a value in.
HF_ZERO3 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16, "hysteresis": 2},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
    },
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "steps_per_print": 2000,
}


def test_validate_with_deepspeed_checks_around_hf_auto_values() -> None:
    """With "auto" anywhere DeepSpeed's check was skipped: a mistake beside HF's values ran every
    trial into DeepSpeed's refusal. The "auto" values are left to DeepSpeed's defaults."""
    assert validate_with_deepspeed(HF_ZERO3, slots=2, source="ds.json") is True
    mistakes = [
        ({"zero_optimization": {"overlap_comm": "sure"}}, "overlap_comm"),
        ({"optimizer": {"type": "AdamWW"}}, "AdamWW"),
        ({"scheduler": {"type": "WarmupCosine"}}, "WarmupCosine"),
        ({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}}, "nvme_path"),
    ]
    for mistake, named in mistakes:
        with pytest.raises(DsatError) as caught:
            validate_with_deepspeed(deep_merge(HF_ZERO3, mistake), slots=2, source="ds.json")
        line = str(caught.value)
        assert line.startswith('ds.json: DeepSpeed rejects this config (its "auto" values')
        assert named in line and "\n" not in line


def test_an_auto_inside_a_list_leaves_the_config_unchecked() -> None:
    config = {"optimizer": {"type": "Adam", "params": {"betas": ["auto", "auto"]}}}
    assert validate_with_deepspeed(config, slots=1, source="ds.json") is False


def test_validate_with_deepspeed_reports_deepspeeds_reason() -> None:
    with pytest.raises(DsatError, match=r"ds.json: DeepSpeed rejects this config: .*stage"):
        validate_with_deepspeed({"zero_optimization": {"stage": 9}}, slots=1, source="ds.json")


@pytest.mark.parametrize("stage", ["auto", "two", 7, True])
def test_a_zero_stage_that_is_none_is_one_line_beside_hf_auto_values(stage: Any) -> None:
    """With "auto" anywhere DeepSpeed's own check is skipped (HF fills those values in at run
    time), and a stage of "auto" ended the search in a ValueError's traceback."""
    config = {
        "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
        "zero_optimization": {"stage": stage},
    }
    with pytest.raises(DsatError, match=r"ds.json: zero_optimization.stage is .*0, 1, 2 or 3"):
        validate_with_deepspeed(config, slots=1, source="ds.json")
    config["zero_optimization"]["stage"] = 2
    assert validate_with_deepspeed(config, slots=1, source="ds.json") is True


def test_overrides_that_are_not_a_mapping_are_one_line(tmp_path: Path) -> None:
    hparams = {"deepspeed_config": "ds_config.json", "overwrite_deepspeed_args": ["stage", 2]}
    path = write_experiment(tmp_path / "m", config={"hyperparameters": hparams})
    with pytest.raises(DsatError, match="overwrite_deepspeed_args must be a mapping"):
        load_experiment(path, path.parent)


HF_ENTRYPOINT = (
    "python3 train.py --deepspeed ds_config.json --per_device_train_batch_size 4 "
    "--gradient_accumulation_steps 2"
)
HF_AUTO = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}


@pytest.mark.parametrize(
    ("entrypoint", "ds_config", "kept"),
    [
        (HF_ENTRYPOINT, HF_AUTO, 2),  # HF fills the "auto" from its flag: that is the user's
        (HF_ENTRYPOINT, {"train_micro_batch_size_per_gpu": "auto"}, 2),
        (HF_ENTRYPOINT, {**HF_AUTO, "gradient_accumulation_steps": 3}, 3),  # the JSON's number
        (HF_ENTRYPOINT, {**HF_AUTO, "train_batch_size": 8}, "auto"),  # fixed: dsat makes it up
        # DeepSpeed's own launcher arguments: a bare --deepspeed switch, no HF Trainer.
        (
            "python3 train.py --deepspeed --deepspeed_config ds_config.json "
            "--gradient_accumulation_steps 2",
            {"train_micro_batch_size_per_gpu": 4},
            None,
        ),
    ],
)
def test_with_a_free_batch_the_hf_scripts_accumulation_is_the_users(
    tmp_path: Path, entrypoint: str, ds_config: dict[str, Any], kept: object
) -> None:
    """The baseline ran at the script's --gradient_accumulation_steps 2, every search trial at
    1, and the hand-over changed the user's accumulation without a word."""
    path = write_experiment(tmp_path / "m", config={"entrypoint": entrypoint}, ds_config=ds_config)
    experiment = load_experiment(path, path.parent)
    assert experiment.ds_config.get("gradient_accumulation_steps") == kept
    if kept != 2:
        return
    from dsat.search import MethodSettings, make_search_method
    from dsat.search.trial_builder import SearchSpec
    from dsat.trial import TrialOutcome, TrialStatus

    spec = SearchSpec(experiment.hparams, experiment.ds_config, 1, entrypoint)
    method = make_search_method(MethodSettings(method="binary", zero_stages=(1,)), spec)
    profile = method.suggest()
    assert profile is not None
    profiled = {
        "num_params": 10**6,
        "trainable_num_params": 10**6,
        "activation_mem_per_gpu": 10**6,
        "gpu_mem": 16 * 2**30,
    }
    method.observe(TrialOutcome(profile.request_id, TrialStatus.COMPLETED, profiled, None, 0, 1))
    trials = [method.suggest() for _ in range(3)]
    assert all(t is not None and t.gas == 2 for t in trials)


@pytest.mark.parametrize(
    ("config", "said"),
    [
        # Each was there, of the wrong kind: "no hyperparameters section; add one" and "must be a
        # positive integer, got None" pointed elsewhere.
        ({"hyperparameters": ["deepspeed_config"]}, "hyperparameters is list ["),
        ({"hyperparameters": "ds_config.json"}, "hyperparameters is str 'ds_config.json', not a"),
        ({"resources": [{"slots_per_trial": 2}]}, "resources is list [{'slots_per_trial': 2}]"),
        ({"hyperparameters": {"deepspeed_config": "."}}, "names ., a folder; name your"),
    ],
)
def test_a_section_of_the_wrong_kind_is_named_as_such(
    tmp_path: Path, config: dict[str, Any], said: str
) -> None:
    path = write_experiment(tmp_path / "m", config=config)
    with pytest.raises(DsatError) as raised:
        load_experiment(path, path.parent)
    assert said in str(raised.value) and "\n" not in str(raised.value)


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("", "the file is empty; a DeepSpeed config is a JSON object {...}"),
        ("  \n", "the file is empty"),
        # Python's own words end "starting at": dsat's read "starting at at line 1".
        ('{"a": "cut', "not valid JSON (Unterminated string starting at: line 1, column 7)"),
    ],
)
def test_an_empty_or_cut_deepspeed_config_is_one_line(tmp_path: Path, text: str, said: str) -> None:
    """An empty file was read as {} (hjson) and searched as the user's config."""
    path = write_experiment(tmp_path / "m")
    (path.parent / "ds_config.json").write_text(text)
    with pytest.raises(DsatError) as raised:
        load_experiment(path, path.parent)
    assert said in str(raised.value), raised.value


def test_a_global_batch_the_overrides_contradict_is_refused(tmp_path: Path) -> None:
    """The hyperparameters' train_batch_size won in every trial and the hand-over, and
    --global-batch was dropped without a word."""
    overrides = {"deepspeed_config": "ds_config.json", OVERWRITE_KEY: {"train_batch_size": 256}}
    path = write_experiment(tmp_path / "m", config={"hyperparameters": overrides})
    with pytest.raises(DsatError, match="--global-batch 64 and hyperparameters.overwrite_deepsp"):
        load_experiment(path, path.parent, global_batch=64)
    assert load_experiment(path, path.parent, global_batch=256).ds_config["train_batch_size"] == 256


@pytest.mark.parametrize("block", [True, [1], "on"])
def test_an_autotuning_value_deepspeed_cannot_read_is_refused(block: object) -> None:
    """DeepSpeed's parser fails on it (an AttributeError); it was searched and handed back."""
    config = {"train_micro_batch_size_per_gpu": 2, "autotuning": block}
    with pytest.raises(DsatError, match="ds.json: autotuning is .*, not a section DeepSpeed reads"):
        trial_ready_config(config, 1, "ds.json")


def test_a_users_enabled_autotuning_block_is_said_to_stop_training() -> None:
    """Handed back as written, it ended the user's training at its profile steps, unsaid."""
    said = autotuning_enabled_note({"autotuning": {"enabled": True}}, "ds.json")
    assert said is not None and "DeepSpeed stops training at its profile steps" in said
    assert autotuning_enabled_note({"autotuning": {"enabled": False}}, "ds.json") is None
    assert autotuning_enabled_note({}, "ds.json") is None


def test_a_sequence_parallel_config_is_refused_in_one_line(tmp_path: Path) -> None:
    """DeepSpeed divides the ranks by it: every trial's batch and the hand-over were ones it
    rejected ("112 != 14 * 1 * 4"), and a right batch was refused as inconsistent."""
    ds = {"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 2}
    path = write_experiment(tmp_path / "m", ds_config=ds)
    with pytest.raises(DsatError, match="sequence_parallel_size 2: dsat counts every slot"):
        load_experiment(path, path.parent)


@pytest.mark.parametrize("old", ["cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory"])
def test_deepspeeds_old_offload_names_are_one_line_with_the_new_one(
    tmp_path: Path, old: str
) -> None:
    """DeepSpeed refuses an old name beside the new one (every offload trial failed), and a
    key of the user's JSON cannot be taken out by a trial's overrides."""
    zero = {"stage": 2, old: False}
    path = write_experiment(tmp_path / "m", ds_config={"zero_optimization": zero})
    with pytest.raises(DsatError) as caught:
        load_experiment(path, path.parent)
    line = str(caught.value)
    assert line.startswith(f"{path.parent / 'ds_config.json'}: zero_optimization.{old} is")
    assert OLD_OFFLOAD_NAMES[old] in line
    zero_optimization = {"zero_optimization": {old: True}}
    hparams = {"deepspeed_config": "ds_config.json", OVERWRITE_KEY: zero_optimization}
    path = write_experiment(tmp_path / "n", config={"hyperparameters": hparams})
    with pytest.raises(DsatError, match=f"overwrite_deepspeed_args.zero_optimization.{old} is"):
        load_experiment(path, path.parent)
    new_key = OLD_OFFLOAD_NAMES[old].split('"')[1]
    if new_key.startswith("offload_"):  # what a trial sets beside it, with the user's False
        beside = {"zero_optimization": {old: False, new_key: {"device": "none"}}}
        assert "together" in str(deepspeed_config_error(beside, 1))


def test_a_global_batch_replacing_the_batch_an_hf_entrypoint_passes_says_so(
    tmp_path: Path,
) -> None:
    """With "auto" in the JSON the batch is the entrypoint's flags': --global-batch replaced it
    with no launch line."""
    auto = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}
    entrypoint = (
        "python3 train.py --deepspeed ds_config.json --per_device_train_batch_size 4 "
        "--gradient_accumulation_steps 2"
    )
    path = write_experiment(tmp_path / "m", config={"entrypoint": entrypoint}, ds_config=auto)
    experiment = load_experiment(path, path.parent, global_batch=64)
    assert experiment.replaced_batch == (
        "micro-batch 4 x accumulation 2 x 1 slot(s) = 8, as your entrypoint's flags set it"
    )
    assert load_experiment(path, path.parent, global_batch=8).replaced_batch is None
    mine = {**auto, "train_micro_batch_size_per_gpu": 16}  # the JSON's number is what trains
    path = write_experiment(tmp_path / "n", config={"entrypoint": entrypoint}, ds_config=mine)
    assert load_experiment(path, path.parent, global_batch=64).replaced_batch == (
        "micro-batch 16 x accumulation 2 x 1 slot(s) = 32, as ds_config.json and your "
        "entrypoint's flags set it"
    )


@pytest.mark.parametrize(
    ("searcher", "extra", "batches"),
    [
        ({"max_length": 20}, {}, 20),
        ({"max_length": {"batches": 20}}, {}, 20),
        ({"max_length": {"records": 1000}}, {}, 16),  # ceil(1000 / 64)
        ({"max_length": {"epochs": 2}}, {"records_per_epoch": 640}, 20),
        ({"max_length": {"epochs": 2}}, {}, None),  # no records_per_epoch: not countable
        ({"max_length": {"records": 0}}, {}, None),
        ({"max_length": True}, {}, None),
        (None, {}, None),
    ],
)
def test_the_searchers_length_in_batches_of_the_full_runs_global_batch(
    searcher: dict[str, Any] | None, extra: dict[str, Any], batches: int | None
) -> None:
    config = {**({"searcher": searcher} if searcher else {}), **extra}
    assert searcher_length(config, 64) == batches
    # At launch, a length no batch makes countable is said: the full run would train one step.
    note = full_run_length_note(config, "deepspeed.yaml")
    assert (note is None) is (searcher_length(config, 1) is not None)
    assert (note is None) is (batches is not None)  # in records too: countable by any batch
    if note is not None:
        assert note.startswith("dsat: note: deepspeed.yaml gives no searcher.max_length")
