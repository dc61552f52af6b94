"""The GPU peak table MFU is worked out against: names as torch reports them, by precision."""

from __future__ import annotations

import pytest

from dsat.device_peaks import peak_flops
from dsat.memory import Precision


@pytest.mark.parametrize(
    ("name", "precision", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", Precision.BF16, 989),
        ("NVIDIA H100 PCIe", Precision.BF16, 756),
        ("NVIDIA H200", Precision.FP16, 989),
        ("NVIDIA A100-SXM4-80GB", Precision.BF16, 312),
        ("NVIDIA A100 80GB PCIe", Precision.FP32, 19.5),
        ("Tesla V100-SXM2-32GB", Precision.FP16, 125),
        ("NVIDIA L40S", Precision.BF16, 362),
        ("NVIDIA L4", Precision.BF16, 121),
        ("NVIDIA A10", Precision.FP16, 125),
    ],
)
def test_common_gpus_have_their_datasheet_peak(
    name: str, precision: Precision, tflops: float
) -> None:
    assert peak_flops(name, precision) == pytest.approx(tflops * 1e12)


@pytest.mark.parametrize(
    ("name", "precision"),
    [
        ("NVIDIA A10G", Precision.BF16),  # not the A10, nor the A100
        ("NVIDIA H100 NVL", Precision.BF16),  # another H100, another peak: not guessed
        ("Tesla V100-SXM2-32GB", Precision.BF16),  # no bf16 on a V100
        ("cpu", Precision.FP32),
    ],
)
def test_a_device_not_in_the_table_gets_no_peak(name: str, precision: Precision) -> None:
    assert peak_flops(name, precision) is None
