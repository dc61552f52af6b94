"""Metric directions and the keys DeepSpeed writes them under."""

from __future__ import annotations

import pytest

from dsat.experiment.metric import Metric, finite_number, positive_number


@pytest.mark.parametrize(
    ("metric", "smaller"),
    [
        (Metric.FLOPS_PER_GPU, False),
        (Metric.THROUGHPUT, False),
        (Metric.FORWARD, True),
        (Metric.BACKWARD, True),
        (Metric.LATENCY, True),
    ],
)
def test_direction(metric: Metric, smaller: bool) -> None:
    assert metric.smaller_is_better is smaller
    assert metric.is_better(1.0, 2.0) is smaller
    assert metric.is_better(2.0, 1.0) is not smaller


def test_file_keys_match_deepspeeds_metric_file() -> None:
    from deepspeed.utils.timer import BACKWARD_GLOBAL_TIMER, FORWARD_GLOBAL_TIMER

    assert Metric.FORWARD.file_key == FORWARD_GLOBAL_TIMER
    assert Metric.BACKWARD.file_key == BACKWARD_GLOBAL_TIMER
    assert Metric.LATENCY.file_key == "latency" and Metric.FLOPS_PER_GPU.file_key == "FLOPS_per_gpu"


def test_values_read_with_their_units() -> None:
    """dsat's latency is ms an iteration; forward and backward are DeepSpeed's timers, which
    its get_mean reports in microseconds (its throughput is batch x 1e6 / latency)."""
    assert Metric.FLOPS_PER_GPU.describe(6.113e10) == "61.1 GFLOP/s per GPU"
    assert Metric.FLOPS_PER_GPU.describe(512.0) == "512 FLOP/s per GPU"
    assert Metric.THROUGHPUT.describe(30.0) == "30 samples/s"
    assert Metric.LATENCY.describe(5.7) == "5.7 ms a step"
    assert Metric.FORWARD.describe(510.9) == "510.9 µs a pass"


@pytest.mark.parametrize(
    ("value", "finite", "positive"),
    [
        (3, 3.0, 3.0),
        (-2.5, -2.5, None),
        (0, 0.0, None),
        (True, None, None),  # a flag, not a measurement
        ("3", None, None),
        (float("nan"), None, None),
        (float("inf"), None, None),
        (None, None, None),
    ],
)
def test_only_finite_numbers_are_reported_values(
    value: object, finite: float | None, positive: float | None
) -> None:
    assert finite_number(value) == finite and positive_number(value) == positive
