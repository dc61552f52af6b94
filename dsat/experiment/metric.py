"""The metrics a search can optimise, and which way is better for each."""

from __future__ import annotations

import enum
import math
from typing import Any


def finite_number(value: Any) -> float | None:
    """A reported value as a float, where it is a finite number (not a bool): a NaN (JSON
    allows one) makes every comparison false, and an infinity wins every one."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def positive_number(value: Any) -> float | None:
    """``value`` as a float where it is a finite positive number; else None."""
    number = finite_number(value)
    return number if number is not None and number > 0 else None


class Metric(str, enum.Enum):
    """A metric that DeepSpeed's autotuning hooks report for a profiling trial."""

    FLOPS_PER_GPU = "FLOPS_per_gpu"
    THROUGHPUT = "throughput"
    FORWARD = "forward"
    BACKWARD = "backward"
    LATENCY = "latency"

    @property
    def smaller_is_better(self) -> bool:
        # Forward/backward/latency are times; the other two are rates.
        return self in (Metric.FORWARD, Metric.BACKWARD, Metric.LATENCY)

    @property
    def file_key(self) -> str:
        """The key under which DeepSpeed's metric file stores this metric (it abbreviates two)."""
        return {Metric.FORWARD: "fwd", Metric.BACKWARD: "bwd"}.get(self, self.value)

    @property
    def unit(self) -> str:
        """Its unit: dsat measures latency in ms; forward and backward are DeepSpeed's timers,
        in microseconds (its get_mean scales their ms by 1000)."""
        return {
            Metric.FLOPS_PER_GPU: "FLOP/s per GPU",
            Metric.THROUGHPUT: "samples/s",
            Metric.LATENCY: "ms a step",
        }.get(self, "µs a pass")

    def describe(self, value: float) -> str:
        """``value`` with its unit, as the progress lines show it (61.1 GFLOP/s per GPU)."""
        if self is Metric.FLOPS_PER_GPU:
            for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M")):
                if abs(value) >= scale:
                    return f"{value / scale:.3g} {prefix}{self.unit}"
            return f"{value:.3g} {self.unit}"
        return f"{value:.4g} {self.unit}"

    def is_better(self, candidate: float, incumbent: float) -> bool:
        return candidate < incumbent if self.smaller_is_better else candidate > incumbent

    @classmethod
    def names(cls) -> list[str]:
        return [m.value for m in cls]
