"""Peak dense throughput of common GPUs, for MFU (model FLOPS utilisation).

MFU is the FLOPS a trial achieved over what its device could do at the trial's precision, so it
needs the device's peak: from the vendors' datasheets, dense (no structured sparsity), tensor
cores for fp16 and bf16, plain fp32 for fp32 (PyTorch does not use TF32 for matmuls by default).
A GPU not listed gets no MFU unless ``--peak-tflops`` says its peak.
"""

from __future__ import annotations

import re

from dsat.memory import Precision

# (name tokens that must all appear, tokens that must not, {precision: TFLOPS}); first match wins.
_TABLE: tuple[tuple[frozenset[str], frozenset[str], dict[Precision, float]], ...] = (
    (
        frozenset({"H200"}),
        frozenset(),
        {Precision.BF16: 989, Precision.FP16: 989, Precision.FP32: 67},
    ),
    (
        frozenset({"H100", "PCIE"}),
        frozenset(),
        {Precision.BF16: 756, Precision.FP16: 756, Precision.FP32: 51},
    ),
    (
        frozenset({"H100"}),
        frozenset({"NVL"}),
        {Precision.BF16: 989, Precision.FP16: 989, Precision.FP32: 67},
    ),
    (
        frozenset({"H800", "PCIE"}),  # an H100 with less NVLink: the same compute
        frozenset(),
        {Precision.BF16: 756, Precision.FP16: 756, Precision.FP32: 51},
    ),
    (
        frozenset({"H800"}),
        frozenset(),
        {Precision.BF16: 989, Precision.FP16: 989, Precision.FP32: 67},
    ),
    (
        frozenset({"GH200"}),  # its GPU is an H100's
        frozenset(),
        {Precision.BF16: 989, Precision.FP16: 989, Precision.FP32: 67},
    ),
    (
        frozenset({"A100"}),
        frozenset(),
        {Precision.BF16: 312, Precision.FP16: 312, Precision.FP32: 19.5},
    ),
    (
        frozenset({"A800"}),  # an A100 with less NVLink
        frozenset(),
        {Precision.BF16: 312, Precision.FP16: 312, Precision.FP32: 19.5},
    ),
    (
        frozenset({"MI300X"}),
        frozenset(),
        {Precision.BF16: 1307.4, Precision.FP16: 1307.4, Precision.FP32: 163.4},
    ),
    (frozenset({"V100"}), frozenset(), {Precision.FP16: 125, Precision.FP32: 15.7}),
    (
        frozenset({"L40S"}),
        frozenset(),
        {Precision.BF16: 362, Precision.FP16: 362, Precision.FP32: 91.6},
    ),
    (
        frozenset({"L40"}),
        frozenset(),
        {Precision.BF16: 181, Precision.FP16: 181, Precision.FP32: 90.5},
    ),
    (
        frozenset({"A6000"}),  # RTX A6000
        frozenset(),
        {Precision.BF16: 154.8, Precision.FP16: 154.8, Precision.FP32: 38.7},
    ),
    (
        frozenset({"4090"}),  # GeForce: tensor cores at half rate with fp32 accumulation
        frozenset(),
        {Precision.BF16: 165.2, Precision.FP16: 165.2, Precision.FP32: 82.6},
    ),
    (frozenset({"T4"}), frozenset(), {Precision.FP16: 65, Precision.FP32: 8.1}),
    (
        frozenset({"L4"}),
        frozenset(),
        {Precision.BF16: 121, Precision.FP16: 121, Precision.FP32: 30.3},
    ),
    (
        frozenset({"A10"}),
        frozenset(),
        {Precision.BF16: 125, Precision.FP16: 125, Precision.FP32: 31.2},
    ),
)


def _tokens(device_name: str) -> set[str]:
    """'NVIDIA A100-SXM4-80GB' -> {'NVIDIA', 'A100', 'SXM4', '80GB'}."""
    return {t for t in re.split(r"[\s\-_/]+", device_name.upper()) if t}


def peak_flops(device_name: str, precision: Precision) -> float | None:
    """The device's peak FLOPS per second at ``precision``; None when it is not in the table."""
    tokens = _tokens(device_name)
    for needed, excluded, peaks in _TABLE:
        if needed <= tokens and not excluded & tokens:
            tflops = peaks.get(precision)
            return None if tflops is None else tflops * 1e12
    return None
