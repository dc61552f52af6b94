"""Loading and checking what the user submits: the experiment YAML and its DeepSpeed JSON.

Everything here turns a user mistake into a one-line ``DsatError`` naming the file and key, so a
search never starts on a config that every trial would reject.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from dsat.constants import (
    AUTO,
    AUTOTUNING_KEY,
    DS_CONFIG_KEY,
    GRAD_ACCUM_STEPS,
    MICRO_BATCH_SIZE,
    OVERWRITE_KEY,
    TRAIN_BATCH_SIZE,
)
from dsat.errors import DsatError
from dsat.experiment.batch_size import (
    GLOBAL_BATCH_FLAG,
    batch_value,
    consistent_batch_sizes,
    replaced_batch,
    with_global_batch,
)
from dsat.experiment.config_keys import refuse_misspelt_keys

# Entrypoint flags that name a DeepSpeed config: HF's `--deepspeed PATH` and DeepSpeed's own
# `--deepspeed_config PATH` (DeepSpeed's bare `--deepspeed` is a switch with no value).
ENTRYPOINT_DS_FLAGS = ("--deepspeed", "--deepspeed_config", "--deepspeed-config")


@dataclasses.dataclass(frozen=True)
class Experiment:
    """A loaded, checked experiment: the user's YAML plus the DeepSpeed JSON it points to."""

    config_path: Path
    model_dir: Path
    config: dict[str, Any]
    ds_config_path: Path
    ds_config: dict[str, Any]
    includes: tuple[Path, ...] = ()
    replaced_batch: str | None = None  # the file's batch, where --global-batch changed it

    @property
    def name(self) -> str:
        name = self.config.get("name")
        return name if isinstance(name, str) and name.strip() else self.config_path.stem

    @property
    def hparams(self) -> dict[str, Any]:
        hparams: dict[str, Any] = self.config["hyperparameters"]
        return hparams

    @property
    def slots_per_trial(self) -> int:
        return slots_per_trial(self.config, str(self.config_path))


def deep_merge(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """A new dict: mappings merge key by key, recursively; any other override value replaces."""
    merged = copy.deepcopy(dict(base))
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


class UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping, as Determined's own
    reader does (PyYAML keeps the last silently: a second ``hyperparameters`` hid the first)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` repeats keys on purpose
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} given twice in one mapping", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_yaml_mapping(path: Path, named_by: str = "") -> dict[str, Any]:
    """A YAML file's top-level mapping; ``named_by``: the flag that named the file, for the
    message (none: CONFIG_PATH, the experiment's YAML)."""
    if not path.is_file():
        what = "a directory, not a file" if path.is_dir() else "config file not found"
        fix = f"fix {named_by}" if named_by else "pass the path of your experiment YAML"
        raise DsatError(f"{path}: {what}; {fix}")
    try:
        data = yaml.load(path.read_text(), Loader=UniqueKeyLoader)  # a SafeLoader
    except OSError as err:
        raise DsatError(f"{path}: cannot read it ({err.strerror or err}); {READ_FIX}") from None
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise DsatError(f"{path}: not valid YAML ({err.problem}{where}); fix the syntax") from None
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise DsatError(f"{path}: not valid YAML ({err}); fix the syntax") from None
    if not isinstance(data, dict):
        raise DsatError(f"{path}: expected a YAML mapping of experiment settings at the top level")
    return data


def load_ds_json(path: Path, source: str) -> dict[str, Any]:
    """Read a DeepSpeed JSON config; ``source`` says who named it, for the error message."""
    if not path.is_file():
        raise DsatError(f"{path}: DeepSpeed config not found (named by {source}); fix the path")
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise DsatError(f"{path}: not valid JSON (not UTF-8 text)") from None
    except OSError as err:
        raise DsatError(f"{path}: cannot read it ({err.strerror or err}); {READ_FIX}") from None
    if not text.strip():  # read as {} (hjson), which DeepSpeed refuses: no batch size
        raise DsatError(f"{path}: the file is empty; a DeepSpeed config is a JSON object {{...}}")
    try:
        try:
            data = json.loads(text, object_pairs_hook=_refuse_repeated_keys)
        except json.JSONDecodeError as err:
            data = _relaxed_json(text)  # comments, trailing commas: DeepSpeed reads them (hjson)
            if data is None:
                raise DsatError(
                    f"{path}: not valid JSON ({err.msg}: line {err.lineno}, column "
                    f"{err.colno}); fix the syntax"
                ) from None
    except RepeatedKey as err:
        raise DsatError(
            f"{path}: key {err.key!r} given twice in one object (DeepSpeed refuses such a "
            "config); keep one"
        ) from None
    if not isinstance(data, dict):
        raise DsatError(
            f"{path}: a DeepSpeed config must be a JSON object, got {type(data).__name__}"
        )
    return data


class RepeatedKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _refuse_repeated_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """One JSON object, refusing a key given twice, as DeepSpeed's own reader does (json keeps
    the last silently: ``"zero_optimization"`` twice searched the second)."""
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise RepeatedKey(key)
        found[key] = value
    return found


def _relaxed_json(text: str) -> dict[str, Any] | None:
    """``text`` as DeepSpeed reads a config file (hjson: comments, trailing commas), where that
    gives an object; None otherwise, or where hjson is not installed (a Determined search
    runner's image)."""
    try:
        import hjson
    except ImportError:
        return None
    try:
        data = hjson.loads(text, object_pairs_hook=_refuse_repeated_keys)
    except hjson.HjsonDecodeError:
        return None
    return data if isinstance(data, dict) else None


READ_FIX = "make it readable by the user running dsat"


def slots_per_trial(config: Mapping[str, Any], source: str) -> int:
    resources = config.get("resources") or {}
    if not isinstance(resources, Mapping):
        raise DsatError(
            f"{source}: resources is {type(resources).__name__} {resources!r}, not a mapping; "
            "write it as 'resources:' with 'slots_per_trial: N' indented below"
        )
    slots = resources.get("slots_per_trial", 1)
    if isinstance(slots, bool) or not isinstance(slots, int) or slots <= 0:
        raise DsatError(
            f"{source}: resources.slots_per_trial must be a positive integer, got {slots!r}"
        )
    return slots


def refuse_include_clashes(model_dir: Path, includes: Sequence[Path]) -> None:
    """One line where an include would replace a file of MODEL_DIR's (or of another include's)
    in the trial's copy, where each lands under its own name: dsat checked and planned with
    MODEL_DIR's ``ds_config.json`` while every trial trained with the include's."""
    taken: dict[str, Path] = {}
    for inc in includes:
        earlier = taken.setdefault(inc.name, inc)
        if earlier is not inc:
            raise DsatError(
                f"--include {inc} and --include {earlier} both land in each trial's copy as "
                f"{inc.name}; include one of them, or their parent folders"
            )
        there = model_dir / inc.name
        files = (
            [Path(folder, name) for folder, _, names in os.walk(inc) for name in names]
            if inc.is_dir()
            else [inc]
        )
        for path in files:
            mine = there / path.relative_to(inc) if inc.is_dir() else there
            if "__pycache__" not in path.parts and (mine.is_file() or mine.is_symlink()):
                raise DsatError(
                    f"--include {inc}: its {path.name} would replace MODEL_DIR's {mine} in "
                    "each trial's copy, while dsat checks and plans with MODEL_DIR's; rename "
                    "one of them"
                )
        if inc.is_dir() and there.exists() and not there.is_dir():
            raise DsatError(
                f"--include {inc}: a folder, where MODEL_DIR has the file {there}; rename one"
            )


def resolve_context_path(relative: str, model_dir: Path, includes: Sequence[Path]) -> Path | None:
    """Where a path relative to a trial's directory (``hyperparameters.deepspeed_config``, the
    entrypoint's script) points here: MODEL_DIR first, then the includes.

    An included path lands at the root of the trial's context under its own name (as with
    Determined's ``--include``), so ``configs/ds.json`` matches ``--include ../configs``.
    """
    candidates = [model_dir / relative]
    first_part = Path(relative).parts[0] if Path(relative).parts else ""
    candidates += [inc.parent / relative for inc in includes if inc.name == first_part]
    return next((c for c in candidates if c.is_file() and not escapes(relative)), None)


def escapes(relative: str) -> bool:
    """Whether a relative path climbs out of the directory it is relative to (``../x``): a
    trial's copy holds MODEL_DIR and the includes only, so it would not find it there."""
    path = Path(relative)
    return not path.is_absolute() and ".." in Path(os.path.normpath(path)).parts


def entrypoint_ds_config(entrypoint: str | Sequence[str] | None) -> str | None:
    """The config path an entrypoint passes with ``--deepspeed``/``--deepspeed_config``, if any."""
    return entrypoint_flag(entrypoint, ENTRYPOINT_DS_FLAGS)


def entrypoint_script(entrypoint: str | Sequence[str] | None) -> str | None:
    """The Python script an entrypoint command runs (its first ``.py`` argument that is not a
    flag's value), if it names one: ``python3 train.py``, ``deepspeed train.py ...``,
    ``python3 -m determined.launch.deepspeed python3 train.py``. None for a module
    (``-m pkg``, ``model_def:Trial``), a path the shell expands (``$HOME/...``), or an absolute
    one (on a cluster it may be in the container's image, not here)."""
    tokens = entrypoint_words(entrypoint)
    for i, token in enumerate(tokens):
        if (
            not token.endswith(".py")
            or token.startswith(("-", "/", "~"))
            or "$" in token
            or "=" in token
        ):
            continue
        before = tokens[i - 1] if i > 0 else ""
        if before.startswith("-") and "=" not in before and before not in ("-u", "-O", "-B"):
            continue  # a flag's value (--config x.py), not what runs
        return token
    return None


def entrypoint_words(entrypoint: str | Sequence[str] | None) -> list[str]:
    """An entrypoint's arguments, as the shell would split a string one (none if it cannot)."""
    if entrypoint is None:
        return []
    if isinstance(entrypoint, str):
        try:
            return shlex.split(entrypoint)
        except ValueError:
            return []
    return [str(t) for t in entrypoint]


def entrypoint_flag(entrypoint: str | Sequence[str] | None, flags: Sequence[str]) -> str | None:
    """The value an entrypoint passes with one of ``flags`` (``--flag value`` or
    ``--flag=value``), if any: the last given, which argparse keeps."""
    tokens = entrypoint_words(entrypoint)
    for i in reversed(range(len(tokens))):
        flag, eq, value = tokens[i].partition("=")
        if flag not in flags:
            continue
        if eq:
            return value
        if i + 1 < len(tokens) and not tokens[i + 1].startswith("-"):
            return tokens[i + 1]
    return None


# HF's TrainingArguments batch flags (underscore spelling; HfArgumentParser also accepts dashes)
# -> the DeepSpeed key each fills in where the config leaves it "auto".
HF_BATCH_FLAGS = {
    "--per_device_train_batch_size": MICRO_BATCH_SIZE,
    "--gradient_accumulation_steps": GRAD_ACCUM_STEPS,
}


def entrypoint_batch_flags(entrypoint: str | Sequence[str] | None) -> dict[str, int]:
    """The numbers an entrypoint passes an HF script with ``HF_BATCH_FLAGS`` (either
    spelling), by DeepSpeed key; a flag given no number is left out."""
    found = {}
    for flag, key in HF_BATCH_FLAGS.items():
        value = entrypoint_flag(entrypoint, (flag, flag.replace("_", "-")))
        if value is not None and value.isdigit():
            found[key] = int(value)
    return found


def script_batch(
    ds_config: Mapping[str, Any], entrypoint: str | Sequence[str] | None, source: str
) -> dict[str, int]:
    """The batch an HF Trainer entrypoint passes (``--deepspeed FILE ...
    --per_device_train_batch_size N``) where ``ds_config`` leaves it to HF (``"auto"`` or
    absent): the batch the user trains with."""
    if entrypoint_flag(entrypoint, ("--deepspeed",)) is None:
        return {}
    return {
        key: value
        for key, value in entrypoint_batch_flags(entrypoint).items()
        if batch_value(ds_config, key, source) is None
    }


def with_script_accumulation(
    ds_config: dict[str, Any], entrypoint: str | Sequence[str] | None, hparams: Mapping[str, Any]
) -> dict[str, Any]:
    """``ds_config`` with the accumulation an HF Trainer entrypoint passes (``--deepspeed
    FILE ... --gradient_accumulation_steps N``), where the batch is free and the config leaves
    the accumulation to HF (``"auto"`` or absent): that is the user's accumulation, which every
    trial keeps, as it keeps a number in the JSON. Read only for the baseline, it ran there at N
    and every search trial at 1."""
    merged = deep_merge(ds_config, hparams.get(OVERWRITE_KEY) or {})
    if entrypoint_flag(entrypoint, ("--deepspeed",)) is None:
        return ds_config
    for key in (TRAIN_BATCH_SIZE, GRAD_ACCUM_STEPS):
        value = merged.get(key)
        if value is not None and not (isinstance(value, str) and value.strip() == AUTO):
            return ds_config
    given = entrypoint_batch_flags(entrypoint).get(GRAD_ACCUM_STEPS)
    if given is None or given < 1:
        return ds_config
    return {**ds_config, GRAD_ACCUM_STEPS: given}


def searcher_length(config: Mapping[str, Any], global_batch: int | None = None) -> int | None:
    """The length of the experiment's own searcher operation in batches, which the full run's
    ``op.length`` is off a cluster: ``searcher.max_length: 20`` or ``{batches: 20}``; in records
    (or in epochs, with ``records_per_epoch``), batches of ``global_batch``, as Determined's
    master counts them. None where it gives none, or none dsat can count."""
    searcher = config.get("searcher")
    length = searcher.get("max_length") if isinstance(searcher, Mapping) else None
    if isinstance(length, Mapping) and len(length) == 1:
        ((unit, value),) = length.items()
        if not _positive_int(value):
            return None
        if unit == "batches":
            return int(value)
        per_epoch = config.get("records_per_epoch")
        records = (
            value
            if unit == "records"
            else value * per_epoch
            if unit == "epochs" and _positive_int(per_epoch)
            else None
        )
        if records is None or global_batch is None or global_batch < 1:
            return None
        return max(1, math.ceil(int(records) / global_batch))
    return int(length) if isinstance(length, int) and _positive_int(length) else None


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def full_run_length_note(config: Mapping[str, Any], source: str) -> str | None:
    """Said at launch with --run-full-experiment where the full run's ``op.length`` would be 1
    off a cluster (no searcher length dsat can count in batches): a loop over it trained one
    step, and the full run said it had finished."""
    if searcher_length(config, 1) is not None:
        return None
    return (
        f"dsat: note: {source} gives no searcher.max_length dsat can count in batches (batches, "
        "records, or epochs with records_per_epoch): off a cluster the full run's op.length is "
        "then 1, and a training loop over op.length trains one step; give searcher.max_length: "
        "{batches: N} where your script loops over it"
    )


def same_relative_file(a: str, b: str) -> bool:
    return os.path.normpath(a) == os.path.normpath(b)


# Determined's hyperparameter definitions (its experiment config's `hyperparameters`): a
# constant, or a range its own searchers sample from.
RANGE_KEYS = {
    "int": {"minval", "maxval", "count"},
    "double": {"minval", "maxval", "count"},
    "log": {"minval", "maxval", "base", "count"},
    "categorical": {"vals"},
}


def hyperparameter_values(hparams: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The values a trial gets from a Determined-style `hyperparameters` section: a
    ``{type: const, val: X}`` is X, as a cluster hands it to a trial, nested ones too. A range
    is refused in one line: a search of the DeepSpeed config runs your model as it is. Any other
    mapping (``optimizer: {type: adamw, lr: ...}``) is the user's own and stays as it is."""
    values: dict[str, Any] = {}
    for name, value in hparams.items():
        if not isinstance(value, Mapping):
            values[name] = value
            continue
        kind, keys = value.get("type"), set(value) - {"type"}
        if kind == "const" and keys == {"val"}:
            values[name] = value["val"]
        elif kind == "const" and not keys:  # the trial got {"type": "const"} as the value
            raise DsatError(f"{where}.{name} is type: const without its val; add val: ...")
        elif kind in RANGE_KEYS and keys <= RANGE_KEYS[kind]:
            raise DsatError(
                f"{where}.{name} is a range (type: {kind}); dsat tunes the DeepSpeed config of "
                "your model as it is: give it one value (type: const, val: ...)"
            )
        else:
            values[name] = hyperparameter_values(value, f"{where}.{name}")
    return values


def load_experiment(
    config_path: str | Path,
    model_dir: str | Path,
    includes: Sequence[str | Path] = (),
    global_batch: int | None = None,
) -> Experiment:
    """Load and check an experiment; raises ``DsatError`` on the first user mistake.
    ``global_batch`` (``--global-batch``) fixes the DeepSpeed config's ``train_batch_size``."""
    config_path, model_dir = Path(config_path), Path(model_dir)
    include_paths = tuple(Path(p) for p in includes)
    config = load_yaml_mapping(config_path)
    refuse_misspelt_keys(config, str(config_path))
    if not model_dir.is_dir():
        what = "a file, not a directory" if model_dir.exists() else "model directory not found"
        raise DsatError(f"{model_dir}: {what}; pass the folder with your code as MODEL_DIR")
    if not os.access(model_dir, os.R_OK | os.X_OK):
        raise DsatError(
            f"{model_dir}: MODEL_DIR cannot be read; every trial runs in a copy of it: make it "
            "readable by the user running dsat"
        )
    for inc in include_paths:
        if not inc.exists():
            raise DsatError(f"--include {inc}: path not found")
    refuse_include_clashes(model_dir, include_paths)
    entrypoint = config.get("entrypoint")
    if entrypoint is not None and not isinstance(entrypoint, (str, list)):
        raise DsatError(
            f"{config_path}: entrypoint is {entrypoint!r}, not a command; give the command that "
            "trains as a string (python3 train.py) or a list of its words"
        )
    hparams = config.get("hyperparameters")
    if hparams is None:
        raise DsatError(
            f"{config_path}: no hyperparameters section; add one with "
            f"'{DS_CONFIG_KEY}: <your DeepSpeed JSON>'"
        )
    if not isinstance(hparams, dict):
        raise DsatError(
            f"{config_path}: hyperparameters is {type(hparams).__name__} {hparams!r}, not a "
            f"mapping; write it as 'hyperparameters:' with '{DS_CONFIG_KEY}: <your DeepSpeed "
            "JSON>' indented below"
        )
    hparams = hyperparameter_values(hparams, f"{config_path}: hyperparameters")
    config = {**config, "hyperparameters": hparams}
    if not isinstance(hparams.get(OVERWRITE_KEY) or {}, Mapping):
        raise DsatError(
            f"{config_path}: hyperparameters.{OVERWRITE_KEY} must be a mapping of DeepSpeed keys "
            "to values (the reference's overrides of your JSON); fix or remove it"
        )
    relative = hparams.get(DS_CONFIG_KEY)
    if relative is not None and not isinstance(relative, str):
        raise DsatError(
            f"{config_path}: hyperparameters.{DS_CONFIG_KEY} is {relative!r}, not a path; set it "
            "to the path of your DeepSpeed JSON, relative to MODEL_DIR"
        )
    if not isinstance(relative, str) or not relative.strip():
        raise DsatError(
            f"{config_path}: hyperparameters.{DS_CONFIG_KEY} is missing; set it to the path of "
            "your DeepSpeed JSON, relative to MODEL_DIR"
        )
    ds_path = resolve_context_path(relative, model_dir, include_paths)
    if ds_path is None and escapes(relative):
        raise DsatError(
            f"{config_path}: hyperparameters.{DS_CONFIG_KEY} names {relative}, outside MODEL_DIR; "
            "each trial runs in a copy of MODEL_DIR (and --include), where it is not: move it "
            "into MODEL_DIR, or --include its folder and name it <folder>/<file>"
        )
    if ds_path is None and (model_dir / relative).is_dir():
        raise DsatError(
            f"{config_path}: hyperparameters.{DS_CONFIG_KEY} names {relative}, a folder; name "
            "your DeepSpeed JSON file (relative to MODEL_DIR)"
        )
    if ds_path is None:
        raise DsatError(
            f"{config_path}: hyperparameters.{DS_CONFIG_KEY} names {relative}, which is not in "
            f"MODEL_DIR {model_dir} nor any --include; fix the path (it is relative to MODEL_DIR)"
        )
    named = entrypoint_ds_config(config.get("entrypoint"))
    if named is not None and named.lstrip().startswith("{"):
        raise DsatError(
            f"{config_path}: the entrypoint passes its DeepSpeed config as JSON text; each trial "
            f"writes its own config to a file, so pass the file instead: --deepspeed {relative} "
            f"(hyperparameters.{DS_CONFIG_KEY})"
        )
    if named is not None and not same_relative_file(named, relative):
        raise DsatError(
            f"{config_path}: the entrypoint passes DeepSpeed config {named} but "
            f"hyperparameters.{DS_CONFIG_KEY} is {relative}; make them name the same file"
        )
    ds_config = load_ds_json(ds_path, f"hyperparameters.{DS_CONFIG_KEY} in {config_path}")
    parallel = ds_config.get("sequence_parallel_size")
    if isinstance(parallel, int) and not isinstance(parallel, bool) and parallel > 1:
        # DeepSpeed's data-parallel ranks are the slots over it: every batch dsat worked out
        # for the slots was one DeepSpeed refused (and a right one was refused here).
        raise DsatError(
            f"{ds_path}: sequence_parallel_size {parallel}: dsat counts every slot as a "
            "data-parallel rank and does not tune sequence-parallel training; drop the key to "
            "tune the data-parallel run, or tune this one by hand"
        )
    check_old_offload_names(ds_config.get("zero_optimization"), f"{ds_path}: zero_optimization")
    overrides = hparams.get(OVERWRITE_KEY)
    if isinstance(overrides, Mapping):
        where = f"{config_path}: hyperparameters.{OVERWRITE_KEY}.zero_optimization"
        check_old_offload_names(overrides.get("zero_optimization"), where)
    zero = ds_config.get("zero_optimization")
    if isinstance(zero, bool):  # DeepSpeed's old form, which it runs as ZeRO-1 (true) or 0
        ds_config = {**ds_config, "zero_optimization": {"stage": int(zero)}}
    replaced = None
    if global_batch is not None:
        theirs = overrides.get(TRAIN_BATCH_SIZE) if isinstance(overrides, dict) else None
        if theirs is not None and theirs != global_batch:  # it won in every trial, unsaid
            raise DsatError(
                f"{GLOBAL_BATCH_FLAG} {global_batch} and hyperparameters.{OVERWRITE_KEY}."
                f"{TRAIN_BATCH_SIZE} {theirs} in {config_path} disagree; drop one"
            )
        slots = slots_per_trial(config, str(config_path))
        flags = script_batch(ds_config, config.get("entrypoint"), str(ds_path))
        replaced = replaced_batch(deep_merge(ds_config, flags), global_batch, slots, str(ds_path))
        if replaced is not None:
            own = any(
                batch_value(ds_config, key, str(ds_path)) is not None
                for key in (TRAIN_BATCH_SIZE, MICRO_BATCH_SIZE, GRAD_ACCUM_STEPS)
            )
            by = [relative] if own or not flags else []
            by += ["your entrypoint's flags"] if flags else []
            replaced = f"{replaced}, as {' and '.join(by)} set{'' if flags else 's'} it"
        ds_config = with_global_batch(ds_config, global_batch, slots, GLOBAL_BATCH_FLAG)
    else:
        ds_config = with_script_accumulation(ds_config, config.get("entrypoint"), hparams)
    experiment = Experiment(
        config_path, model_dir, config, ds_path, ds_config, include_paths, replaced
    )
    # Fail now, not in every trial, if the batch sizes cannot be made consistent.
    consistent_batch_sizes(ds_config, experiment.slots_per_trial, source=str(ds_path))
    overwrites = hparams.get(OVERWRITE_KEY)
    if overwrites and global_batch is None:  # as the user's own config runs (the baseline)
        consistent_batch_sizes(
            deep_merge(ds_config, overwrites),
            experiment.slots_per_trial,
            source=f"{config_path}: your JSON with hyperparameters.{OVERWRITE_KEY}",
        )
    return experiment


# DeepSpeed's old names for its offloads, and what replaced them.
OLD_OFFLOAD_NAMES = {
    "cpu_offload": '"offload_optimizer": {"device": "cpu"}',
    "cpu_offload_param": '"offload_param": {"device": "cpu"}',
    "cpu_offload_use_pin_memory": '"pin_memory": true inside those',
}


def check_old_offload_names(section: Any, where: str) -> None:
    """Refuse DeepSpeed's old offload names: DeepSpeed refuses one beside its new name, which
    trials set to offload or to turn an offload off, and a key of the user's JSON cannot be
    removed by a trial's overrides (they merge in); every offload trial failed."""
    if not isinstance(section, Mapping):
        return
    for old, new in OLD_OFFLOAD_NAMES.items():
        if old in section:
            raise DsatError(
                f"{where}.{old} is DeepSpeed's old name, which it refuses beside the new one that "
                f"dsat's trials set: write {new} instead (or drop it where it is false)"
            )


def check_entrypoint_script(experiment: Experiment) -> None:
    """Raise ``DsatError`` when the script the entrypoint runs is not in the trial's files: a
    typo in its name used to run the model-profile trial, fail it with Python's "can't open
    file", and end the search with exit 1. For runners that run the script (the simulator
    does not)."""
    script = entrypoint_script(experiment.config.get("entrypoint"))
    model_dir = experiment.model_dir
    if script is None or resolve_context_path(script, model_dir, experiment.includes):
        return
    raise DsatError(
        f"{experiment.config_path}: the entrypoint runs {script}, which is not in MODEL_DIR "
        f"{model_dir} nor any --include; fix the script's path in the entrypoint (it is "
        "relative to MODEL_DIR)"
    )


# Launchers that start the training processes themselves: a trial's processes are dsat's to
# start (one per slot, on a free port), as Determined's launch layers, which are dropped, are.
OUTSIDE_LAUNCHERS = ("torchrun", "deepspeed", "accelerate")
OUTSIDE_LAUNCHER_MODULES = (
    "torch.distributed.run",
    "torch.distributed.launch",
    "deepspeed.launcher.runner",
    "accelerate.commands.launch",
)


def outside_launcher(tokens: Sequence[str]) -> str | None:
    """The launcher ``tokens`` (the command, Determined's launch layer dropped) start with."""
    if tokens and Path(tokens[0]).name in OUTSIDE_LAUNCHERS:
        return Path(tokens[0]).name
    if len(tokens) >= 3 and tokens[1] == "-m" and tokens[2] in OUTSIDE_LAUNCHER_MODULES:
        return f"{tokens[0]} -m {tokens[2]}"
    return None


def check_entrypoint_launcher(experiment: Experiment, command: Sequence[str]) -> None:
    """Raise ``DsatError`` for an entrypoint that starts its own launcher: its processes
    (``--nproc_per_node 2`` at one slot) did not match the trial's, which DeepSpeed refused as a
    config's fault, and its fixed port (29500) made two trials at once fail each other."""
    launcher = outside_launcher(command)
    if launcher is None:
        return
    script = entrypoint_script(list(command)) or "train.py"
    raise DsatError(
        f"{experiment.config_path}: the entrypoint starts {launcher}, which starts the training "
        "processes itself; dsat starts a trial's processes (one per slot, "
        f"resources.slots_per_trial: {experiment.slots_per_trial}) on a free port: run the script "
        f"directly, `python3 {script} ...`"
    )


def check_hf_args_file(experiment: Experiment, command: Sequence[str]) -> None:
    """Raise ``DsatError`` where the script takes its HF arguments from one JSON or YAML file
    (HF's ``python3 run_clm.py args.json``): dsat sets a trial's on the command line, found no
    ``--deepspeed`` there, and every trial failed after the launch had passed."""
    script = entrypoint_script(list(command))
    rest = list(command[command.index(script) + 1 :]) if script in command else []
    if len(rest) != 1 or not rest[0].endswith((".json", ".yaml", ".yml")):
        return
    path = resolve_context_path(rest[0], experiment.model_dir, experiment.includes)
    try:
        held = yaml.safe_load(path.read_text()) if path is not None else None
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return
    if isinstance(held, dict) and "deepspeed" in held:
        raise DsatError(
            f"{experiment.config_path}: the entrypoint passes its HF arguments in {rest[0]}; dsat "
            "sets each trial's on the command line, so pass them as flags instead: "
            f"`python3 {script} --deepspeed {held['deepspeed']} "
            "--per_device_train_batch_size N ...`"
        )


def contains_auto(value: Any) -> bool:
    if isinstance(value, Mapping):
        return any(contains_auto(v) for v in value.values())
    if isinstance(value, list):
        return any(contains_auto(v) for v in value)
    return isinstance(value, str) and value.strip() == AUTO


def trial_ready_config(ds_config: Mapping[str, Any], slots: int, source: str) -> dict[str, Any]:
    """``ds_config`` with a consistent batch triple and no autotuning block, as a trial runs it.
    The user's own block, handed back with the rest, must be one DeepSpeed can read."""
    block = ds_config.get(AUTOTUNING_KEY)
    if block is not None and not isinstance(block, Mapping):
        raise DsatError(  # DeepSpeed's parser fails on it with an AttributeError
            f"{source}: {AUTOTUNING_KEY} is {json.dumps(block)}, not a section DeepSpeed reads "
            f'({{"enabled": false, ...}}); drop it (dsat sets its own in every trial)'
        )
    config = deep_merge(ds_config, consistent_batch_sizes(ds_config, slots, source=source))
    config.pop(AUTOTUNING_KEY, None)
    return config


def autotuning_enabled_note(ds_config: Mapping[str, Any], source: str) -> str | None:
    """What to say where the user's own autotuning block is enabled: best_ds_config.json keeps
    it as they wrote it, and DeepSpeed then ends training at its profile steps, without a
    word (a block copied from DeepSpeed's autotuning tutorial)."""
    block = ds_config.get(AUTOTUNING_KEY)
    if not isinstance(block, Mapping) or block.get("enabled") is not True:
        return None
    return (
        f"{source} has {AUTOTUNING_KEY}.enabled true, which best_ds_config.json keeps as you "
        "wrote it: DeepSpeed stops training at its profile steps with it; set it false to "
        "train with the hand-over"
    )


def validate_with_deepspeed(ds_config: Mapping[str, Any], slots: int, source: str) -> bool:
    """Check a config with DeepSpeed's own parser for ``slots`` data-parallel ranks.

    Values HF's Trainer or Accelerate fill in at run time (``"auto"``) are left to DeepSpeed's
    defaults for the check, so a mistake beside them is still caught before any trial (the check
    was skipped wherever one "auto" stood). Returns False when the check cannot be made (an
    "auto" inside a list); raises ``DsatError`` with DeepSpeed's reason when it rejects the config.
    """
    from dsat.experiment.ds_config_check import deepspeed_config_error, load_deepspeed

    config = trial_ready_config(ds_config, slots, source)
    with_auto = contains_auto(config)
    if with_auto:
        zero = config.get("zero_optimization")
        stage = zero.get("stage") if isinstance(zero, Mapping) else None
        if stage is not None and (isinstance(stage, bool) or stage not in (0, 1, 2, 3)):
            raise DsatError(  # DeepSpeed would take an "auto" stage, left out, as 0
                f"{source}: zero_optimization.stage is {stage!r}; give it 0, 1, 2 or 3 (HF fills "
                'in "auto" batch and optimizer values, not the stage)'
            )
        config = without_auto(config)
        if contains_auto(config):
            load_deepspeed()  # not checked here, but every trial needs it (the check imports it)
            return False

    reason = deepspeed_config_error(config, world_size=slots)
    if reason is not None:
        auto = ' (its "auto" values, which HF fills in, left to DeepSpeed\'s defaults)'
        raise DsatError(
            f"{source}: DeepSpeed rejects this config{auto if with_auto else ''}: {reason}"
        )
    return True


def without_auto(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` without its ``"auto"`` keys, at any depth (lists kept as they are)."""
    return {
        key: without_auto(value) if isinstance(value, Mapping) else value
        for key, value in config.items()
        if not (isinstance(value, str) and value.strip() == AUTO)
    }
