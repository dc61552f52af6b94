"""What a search method reads of a search's settings: its budget, limits, metric and own flags.

A method needs no paths and no runner, so a test of a pure search builds this alone; the CLI's
`SearchSettings` (validated, saved for a resume) turns into one with `from_settings`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from dsat.experiment.metric import Metric
from dsat.experiment.settings import (
    DEFAULT_ASHA_EARLY_STOPPING,
    DEFAULT_CONFIRM_TOP,
    DEFAULT_DIVISOR,
    DEFAULT_END_PROFILE_STEP,
    DEFAULT_MAX_CONCURRENT_TRIALS,
    DEFAULT_MAX_RUNGS,
    DEFAULT_MAX_TRIALS,
    DEFAULT_MEMORY_MARGIN,
    DEFAULT_METRIC,
    DEFAULT_MIN_BINARY_SEARCH_TRIALS,
    DEFAULT_RANDOM_SEED,
    DEFAULT_SEARCH_RANGE_FACTOR,
    DEFAULT_START_PROFILE_STEP,
    DEFAULT_TRIALS_PER_RANDOM_CONFIG,
    DEFAULT_ZERO_STAGES,
    parse_metric,
)

if TYPE_CHECKING:
    from dsat.experiment.settings import SearchSettings


@dataclasses.dataclass(frozen=True)
class MethodSettings:
    method: str
    max_trials: int = DEFAULT_MAX_TRIALS
    max_slots: int | None = None  # slots all running trials may use together
    max_concurrent_trials: int = DEFAULT_MAX_CONCURRENT_TRIALS
    metric: Metric = DEFAULT_METRIC
    zero_stages: tuple[int, ...] = DEFAULT_ZERO_STAGES
    start_profile_step: int = DEFAULT_START_PROFILE_STEP
    end_profile_step: int = DEFAULT_END_PROFILE_STEP
    random_seed: int = DEFAULT_RANDOM_SEED
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
    # the confirmation round
    confirm_top: int = DEFAULT_CONFIRM_TOP
    memory_margin: float = DEFAULT_MEMORY_MARGIN
    # The user's own configuration run once, to compare (the CLI's default; off for a bare
    # method, as tests and benchmarks of the search build one).
    baseline: bool = False
    # Models that do not fit (fit_ladder.py): offload in the space even when the model fits
    # (--offload), and where NVMe offload may put its files (--offload-nvme PATH).
    offload: bool = False
    offload_nvme: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.metric, Metric):
            object.__setattr__(self, "metric", parse_metric(str(self.metric)))
        object.__setattr__(self, "zero_stages", tuple(sorted(set(self.zero_stages))))

    @classmethod
    def from_settings(
        cls, settings: SearchSettings, machine_slots: int | None = None
    ) -> MethodSettings:
        """The method's part of ``settings``. ``machine_slots`` (the local runner's slot pool)
        caps ``--max-slots`` for this run only: the settings saved for a resume keep the user's."""
        max_slots = settings.max_slots
        if machine_slots is not None:
            max_slots = machine_slots if max_slots is None else min(max_slots, machine_slots)
        fields = {f.name for f in dataclasses.fields(cls)} - {"max_slots"}
        return cls(max_slots=max_slots, **{name: getattr(settings, name) for name in fields})
