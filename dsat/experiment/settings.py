"""The validated settings of one search: what the CLI parsed, as a JSON-friendly record.

The same record drives every runner and travels to a Determined search runner as JSON (never
pickle), so all cross-flag checks live here, where loading from JSON repeats them.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any

from dsat.errors import DsatError
from dsat.experiment.function_path import with_absolute_file
from dsat.experiment.metric import Metric
from dsat.paths import absolute

SEARCH_METHODS = ("guided", "asha", "binary", "random")
ALL_ZERO_STAGES = (0, 1, 2, 3)

# The reference's defaults (determined.pytorch.dsat), so its users see no surprises.
DEFAULT_MAX_TRIALS = 64
DEFAULT_MAX_CONCURRENT_TRIALS = 16
DEFAULT_METRIC = Metric.FLOPS_PER_GPU
DEFAULT_ZERO_STAGES = (1, 2, 3)
DEFAULT_START_PROFILE_STEP = 3
DEFAULT_END_PROFILE_STEP = 5
DEFAULT_RANDOM_SEED = 42
DEFAULT_MAX_SEARCH_RUNNER_RESTARTS = 5
DEFAULT_TRIALS_PER_RANDOM_CONFIG = 5
DEFAULT_SEARCH_RANGE_FACTOR = 1.0
DEFAULT_MAX_RUNGS = 5
DEFAULT_MIN_BINARY_SEARCH_TRIALS = 3
DEFAULT_ASHA_EARLY_STOPPING = 0
DEFAULT_DIVISOR = 2
# dsat's own: the confirmation round and the memory a handed-over configuration must leave free.
DEFAULT_CONFIRM_TOP = 3
DEFAULT_MEMORY_MARGIN = 0.05


@dataclasses.dataclass(frozen=True)
class SearchSettings:
    """Everything a search needs to know from the command line."""

    method: str
    config_path: str
    model_dir: str
    include: tuple[str, ...] = ()
    max_trials: int = DEFAULT_MAX_TRIALS
    max_slots: int | None = None
    max_concurrent_trials: int = DEFAULT_MAX_CONCURRENT_TRIALS
    metric: Metric = DEFAULT_METRIC
    run_full_experiment: bool = False
    zero_stages: tuple[int, ...] = DEFAULT_ZERO_STAGES
    start_profile_step: int = DEFAULT_START_PROFILE_STEP
    end_profile_step: int = DEFAULT_END_PROFILE_STEP
    random_seed: int = DEFAULT_RANDOM_SEED
    search_runner_config: str | None = None
    # None where not given: a --search-runner-config file's max_restarts then stands, and a
    # value given for a runner without a search runner is refused, not dropped unsaid.
    max_search_runner_restarts: int | None = None
    # random
    trials_per_random_config: int = DEFAULT_TRIALS_PER_RANDOM_CONFIG
    early_stopping: int | None = None
    # binary and asha
    search_range_factor: float = DEFAULT_SEARCH_RANGE_FACTOR
    # asha
    max_rungs: int = DEFAULT_MAX_RUNGS
    min_binary_search_trials: int = DEFAULT_MIN_BINARY_SEARCH_TRIALS
    asha_early_stopping: int = DEFAULT_ASHA_EARLY_STOPPING
    divisor: int = DEFAULT_DIVISOR
    # dsat's own
    confirm_top: int = DEFAULT_CONFIRM_TOP
    memory_margin: float = DEFAULT_MEMORY_MARGIN
    global_batch: int | None = None  # None: the config's numeric train_batch_size, if any
    baseline: bool = True  # run the user's own configuration once, to compare (--no-baseline)
    offload: bool = False  # offload configurations in the space even when the model fits
    offload_nvme: str | None = None  # a path for NVMe offload, the ladder's last rung
    seq_len: int | None = None  # tokens per sample, for tokens/s (else a hyperparameter's)
    peak_tflops: float | None = None  # the GPU's peak, for MFU (else the trial's GPU's)
    runner: str = "auto"
    results_dir: str | None = None
    resume: str | None = None
    trial_timeout: float | None = None  # None: derived from the model-profile trial
    fresh_processes: bool = False  # local runner: no warm workers
    # local runner: one-slot trials in a host per slot (None: the default, on)
    trial_host: bool | None = None
    simulator: str | None = None
    ray_address: str | None = None  # ray runner: the cluster (else RAY_ADDRESS)

    @property
    def search_runner_restarts(self) -> int:
        """How often Determined restarts a crashed search runner: as given, else the default."""
        if self.max_search_runner_restarts is None:
            return DEFAULT_MAX_SEARCH_RUNNER_RESTARTS
        return self.max_search_runner_restarts

    def __post_init__(self) -> None:
        if self.method not in SEARCH_METHODS:
            raise DsatError(
                f"unknown search method {self.method!r}; use one of {', '.join(SEARCH_METHODS)}"
            )
        if not isinstance(self.metric, Metric):
            object.__setattr__(self, "metric", parse_metric(str(self.metric)))
        object.__setattr__(self, "zero_stages", tuple(sorted(set(self.zero_stages))))
        object.__setattr__(self, "include", tuple(self.include))
        self._check()

    def _check(self) -> None:
        if self.max_trials <= 1:
            raise DsatError(
                f"--max-trials must be at least 2 (it counts the model-profile trial), got {self.max_trials}"
            )
        if not self.zero_stages or any(s not in ALL_ZERO_STAGES for s in self.zero_stages):
            raise DsatError(
                f"--zero-stages must be a subset of 0 1 2 3, got {list(self.zero_stages)}"
            )
        if self.offload and self.zero_stages == (0,):
            raise DsatError(  # the search found nothing to offload, and said only "out of memory"
                "--offload needs a ZeRO stage of 1 or more in --zero-stages (DeepSpeed offloads "
                "nothing at ZeRO-0); add one, or drop --offload"
            )
        if self.offload_nvme is not None and 3 not in self.zero_stages:
            raise DsatError(  # the ladder's NVMe rung is ZeRO-3's: the path went unused, unsaid
                "--offload-nvme needs ZeRO-3 in --zero-stages (DeepSpeed offloads to NVMe at "
                "ZeRO-3 only); add 3, or drop --offload-nvme"
            )
        if self.end_profile_step <= self.start_profile_step:
            raise DsatError(
                f"--end-profile-step ({self.end_profile_step}) must be greater than "
                f"--start-profile-step ({self.start_profile_step})"
            )
        if self.start_profile_step < 0:
            raise DsatError(
                f"--start-profile-step must be 0 or more, got {self.start_profile_step}"
            )
        positive = {
            "--max-concurrent-trials": self.max_concurrent_trials,
            "--trials-per-random-config": self.trials_per_random_config,
            "--max-rungs": self.max_rungs,
            "--min-binary-search-trials": self.min_binary_search_trials,
            "--search-range-factor": self.search_range_factor,
        }
        if self.max_slots is not None:
            positive["--max-slots"] = self.max_slots
        if self.global_batch is not None:
            positive["--global-batch"] = self.global_batch
        if self.seq_len is not None:
            positive["--seq-len"] = self.seq_len
        if self.peak_tflops is not None:
            positive["--peak-tflops"] = self.peak_tflops
        if self.early_stopping is not None:
            positive["--early-stopping"] = self.early_stopping
        if self.trial_timeout is not None:
            positive["--trial-timeout"] = self.trial_timeout
        for flag, value in positive.items():
            if value <= 0:
                raise DsatError(f"{flag} must be positive, got {value}")
        for flag, value in {
            "--asha-early-stopping": self.asha_early_stopping,
            "--max-search-runner-restarts": self.search_runner_restarts,
        }.items():
            if value < 0:
                raise DsatError(f"{flag} must be 0 or more, got {value}")
        if self.confirm_top < 0:
            raise DsatError(f"--confirm-top must be 0 or more, got {self.confirm_top}")
        if not 0.0 <= self.memory_margin < 1.0:
            raise DsatError(
                f"--memory-margin is a fraction of the device's memory, from 0 to below 1; got "
                f"{self.memory_margin}"
            )
        if self.divisor < 2:
            raise DsatError(
                f"--divisor must be at least 2 (ASHA keeps 1/divisor per rung), got {self.divisor}"
            )
        if self.ray_address is not None and not self.ray_address.strip():
            # "--ray-address $HEAD" with HEAD unset: one check took it as given, another as not.
            raise DsatError(
                "--ray-address is empty (an unset shell variable?): give the head node's address, "
                "HOST:6379, or leave the flag out"
            )
        if self.resume and self.results_dir and self.resume != self.results_dir:
            raise DsatError("--resume DIR already names the results directory; drop --results-dir")

    @property
    def smaller_is_better(self) -> bool:
        return self.metric.smaller_is_better

    def with_absolute_paths(self) -> SearchSettings:
        """These settings with every path made absolute against the current directory, once, so
        trials, child processes and a resumed search find the same files wherever they run."""

        def optional(path: str | None) -> str | None:
            return None if path is None else absolute(path)

        return dataclasses.replace(
            self,
            config_path=absolute(self.config_path),
            model_dir=absolute(self.model_dir),
            include=tuple(absolute(p) for p in self.include),
            search_runner_config=optional(self.search_runner_config),
            results_dir=optional(self.results_dir),
            resume=optional(self.resume),
            simulator=None if self.simulator is None else with_absolute_file(self.simulator),
        )

    def on_cluster(self) -> SearchSettings:
        """These settings as a search runner sees them: the config, MODEL_DIR and includes are
        uploaded by their base names to the top of the task's working directory."""
        return dataclasses.replace(
            self,
            config_path=Path(self.config_path).name,
            model_dir=Path(self.model_dir).resolve().name,
            include=tuple(Path(p).resolve().name for p in self.include),
            runner="determined",
            results_dir=None,
            resume=None,
        )

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["metric"] = self.metric.value
        return json.dumps(data, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> SearchSettings:
        data: dict[str, Any] = json.loads(text)
        if not isinstance(data, dict):
            raise DsatError(f"search settings are a JSON {type(data).__name__}, not an object")
        if "backend" in data and "runner" not in data:  # saved before --backend became --runner
            data["runner"] = data.pop("backend")
        if data.get("max_search_runner_restarts") == DEFAULT_MAX_SEARCH_RUNNER_RESTARTS:
            # Saved as the default by a dsat that did not tell it from given: read as not
            # given, which the local and Ray runners refuse to resume with.
            data["max_search_runner_restarts"] = None
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise DsatError(f"search settings: unknown keys {unknown}")
        kinds = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            if field.name not in data:
                if field.default is dataclasses.MISSING:
                    raise DsatError(f"'{field.name}' is missing")
            elif not _fits(data[field.name], kinds[field.name]):
                # Python's own words ("'<=' not supported between 'str' and 'int'") name no key
                raise DsatError(
                    f"'{field.name}' is {json.dumps(data[field.name])}, not "
                    f"{_described(kinds[field.name])}"
                )
        for key in ("include", "zero_stages"):
            if key in data:
                data[key] = tuple(data[key])
        return cls(**data)


def _fits(value: Any, kind: Any) -> bool:
    """Whether a JSON value is one a field of type ``kind`` takes (a JSON list for a tuple)."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return any(_fits(value, option) for option in typing.get_args(kind))
    if kind is type(None):
        return value is None
    if typing.get_origin(kind) is tuple:
        item = typing.get_args(kind)[0]
        return isinstance(value, list) and all(_fits(v, item) for v in value)
    if isinstance(value, bool):
        return kind is bool
    if kind is float:
        return isinstance(value, (int, float))
    return isinstance(value, str if kind is Metric else kind)


def _described(kind: Any) -> str:
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return " or ".join(_described(option) for option in typing.get_args(kind))
    if typing.get_origin(kind) is tuple:
        return f"a list of {_described(typing.get_args(kind)[0]).split(' ', 1)[1]}s"
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    return "null" if kind is type(None) else names.get(kind, "a metric's name")


def parse_metric(name: str) -> Metric:
    try:
        return Metric(name)
    except ValueError:
        raise DsatError(
            f"--metric {name!r} is not a metric; use one of {', '.join(Metric.names())}"
        ) from None
