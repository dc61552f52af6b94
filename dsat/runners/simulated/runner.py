"""The simulated runner: a performance function instead of training, in virtual time.

``FUNCTION(ds_config, slots)`` is called once per trial when it starts; a function that also takes
``run_id`` gets the trial's id, from which it can draw what differs from one run of a
configuration to the next (noise, an OOM near the limit) reproducibly. Trials overlap up to the
search's limits and each lasts the ``seconds`` its function reports, on a virtual clock, so a
64-trial search takes well under a second. ``MemoryError`` means OOM, ``ConnectionError`` a fault of
the machine (run again, as a taken port would be); any other exception (``SystemExit`` too), or a
value that is not finite, a failed trial.
"""

from __future__ import annotations

import copy
import heapq
import inspect
import itertools
import math
from collections.abc import Callable
from typing import Any

from dsat.errors import DsatError
from dsat.runners.trial_runner import StoppedRun
from dsat.trial import TrialOutcome, TrialStatus
from dsat.trial_failure import FailureCause

PerformanceFunction = Callable[[dict[str, Any], int], dict[str, Any]]
# How long a trial lasts when its function does not say: start-up plus a few steps.
DEFAULT_TRIAL_SECONDS = 120.0
FAILED_TRIAL_SECONDS = 60.0
NO_FULL_RUN = (
    "--run-full-experiment needs a runner that trains for real; drop it with --runner simulated"
)


# What a performance function raises to play a failed trial: MemoryError an OOM, ConnectionError
# a fault of the machine (a taken port, a lost node), which the search runs again.
SIMULATED_FAILURES: dict[type[BaseException], tuple[TrialStatus, FailureCause]] = {
    MemoryError: (TrialStatus.OOM, FailureCause.CONFIG),
    ConnectionError: (TrialStatus.ERROR, FailureCause.MACHINE),
}


class SimulatedRunner:
    """Trials as calls to a performance function, on a virtual clock (see the module's docstring)."""

    slot_limit = None  # only the method's limits: the simulated cluster has the slots it needs
    takes_real_time = False
    slot_kind = "GPU"  # the surfaces model GPUs

    def __init__(
        self,
        function: PerformanceFunction,
        slots_per_trial: int,
        default_seconds: float = DEFAULT_TRIAL_SECONDS,
        failed_seconds: float = FAILED_TRIAL_SECONDS,
    ) -> None:
        self.function = function
        self.takes_run_id = _takes_run_id(function)
        self.slots = slots_per_trial
        self.default_seconds = default_seconds
        self.failed_seconds = failed_seconds
        self.now = 0.0
        self._events: list[tuple[float, int, TrialOutcome]] = []
        self._order = itertools.count()

    def start(
        self, request_id: str, hparams: dict[str, Any], ds_config: dict[str, Any], length: int
    ) -> None:
        status, metrics, error, cause = TrialStatus.COMPLETED, {}, None, None
        seconds = self.default_seconds
        try:
            config = copy.deepcopy(ds_config)
            if self.takes_run_id:
                metrics = dict(self.function(config, self.slots, run_id=request_id))  # type: ignore[call-arg]
            else:
                metrics = dict(self.function(config, self.slots))
            seconds = float(metrics.pop("seconds", self.default_seconds))
            unusable = [
                k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)
            ]
            if unusable:  # searched as a value, a NaN compared as neither better nor worse
                raise ValueError(f"the function returned {unusable[0]}={metrics[unusable[0]]}")
        # The user's function failing is a failed trial, not a crash: sys.exit() in it included.
        except (Exception, SystemExit) as err:
            status, cause = next(
                (found for kind, found in SIMULATED_FAILURES.items() if isinstance(err, kind)),
                (TrialStatus.ERROR, FailureCause.UNKNOWN),
            )
            metrics, error = {}, f"{type(err).__name__}: {err}"
            seconds = self.failed_seconds
        outcome = TrialOutcome(
            request_id, status, metrics, error, self.now, self.now + seconds, cause
        )
        heapq.heappush(self._events, (outcome.end, next(self._order), outcome))

    def wait(self) -> TrialOutcome:
        end, _, outcome = heapq.heappop(self._events)
        self.now = end
        return outcome

    def running_count(self) -> int:
        return len(self._events)

    def stop_all(self) -> list[StoppedRun]:
        stopped = [
            StoppedRun(outcome.request_id, outcome.start, self.now)
            for _, _, outcome in self._events
        ]
        self._events.clear()
        return stopped

    def close(self) -> None:
        """Nothing is held between trials."""

    def run_full_experiment(self, hparams: dict[str, Any], length: int | None = None) -> None:
        raise DsatError(NO_FULL_RUN)


def _takes_run_id(function: PerformanceFunction) -> bool:
    try:
        return "run_id" in inspect.signature(function).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin): the two-argument form
        return False
