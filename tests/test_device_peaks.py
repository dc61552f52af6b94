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
        ("NVIDIA H800 PCIe", Precision.BF16, 756),
        ("NVIDIA H800", Precision.BF16, 989),
        ("NVIDIA GH200 480GB", Precision.BF16, 989),  # not an H200
        ("NVIDIA A800-SXM4-80GB", Precision.BF16, 312),
        ("AMD Instinct MI300X", Precision.BF16, 1307.4),
        ("NVIDIA L40", Precision.FP32, 90.5),  # not the L40S
        ("NVIDIA RTX A6000", Precision.BF16, 154.8),
        ("NVIDIA GeForce RTX 4090", Precision.BF16, 165.2),
        ("Tesla T4", Precision.FP16, 65),
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
        ("Tesla T4", Precision.BF16),  # nor on a T4
        ("cpu", Precision.FP32),
    ],
)
def test_a_device_not_in_the_table_gets_no_peak(name: str, precision: Precision) -> None:
    assert peak_flops(name, precision) is None
