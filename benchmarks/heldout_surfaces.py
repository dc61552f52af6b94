"""Held-out surfaces: simulated hardware the guided search was never tuned on.

The built-in surfaces (dsat.runners.simulated.performance_models) are what dsat's search was developed
against; a search tuned to them can look better than it is. These are built the same way but with
other model sizes, GPU counts, networks, memory pressure and measurement noise, and are used only
to check that a change to the search helps beyond the surfaces it was developed on:

    python3 benchmarks/search_efficiency.py --surfaces heldout
"""

from __future__ import annotations

from dsat.memory import Precision
from dsat.runners.simulated.performance_models import GB, PerformanceModel

# A 3B model on 4 A100-80GB over PCIe with noisier measurements (2.5%) and mild memory pressure:
# throughput flattens, then dips a little, before the memory cliff.
gpt_3b_noisy_pcie_4xa100 = PerformanceModel(
    name="3b-noisy-pcie-4xA100-80GB",
    num_params=3_000_000_000,
    precision=Precision.FP16,
    gpu_mem=80 * 2**30,
    activation_per_sample=int(2.2 * GB),
    activation_reported_fraction=0.82,
    flops_per_sample=6 * 3e9 * 2048,
    peak_flops=312e12,
    max_efficiency=0.5,
    half_efficiency_mbs=2.5,
    bandwidth=16e9,
    call_latency=120e-6,
    stage_overhead=(0.0, 0.01, 0.05, 0.16),
    noise=0.025,
    noise_seed=31,
    gpus=4,
    pressure_threshold=0.8,
    pressure_slowdown=0.12,
)

# A 13B model on 32 H100-80GB with a fast fabric: every stage above 0 fits, and ZeRO-2 and 3 are
# close; efficiency keeps growing up to large micro-batches.
llama_13b_32xh100 = PerformanceModel(
    name="13b-32xH100",
    num_params=13_000_000_000,
    precision=Precision.BF16,
    gpu_mem=80 * 2**30,
    activation_per_sample=int(1.4 * GB),
    activation_reported_fraction=0.88,
    flops_per_sample=8 * 13e9 * 4096,
    peak_flops=900e12,
    max_efficiency=0.5,
    half_efficiency_mbs=4.0,
    bandwidth=300e9,
    call_latency=25e-6,
    stage_overhead=(0.0, 0.0, 0.03, 0.07),
    startup_seconds=260.0,
    noise_seed=32,
    gpus=32,
)

# A 700M model in fp16 on 8 consumer 24GB GPUs over a slow network, with quieter measurements
# (1%): bucket sizes and overlap matter, and the profile under-reports activations by a quarter.
gpt_700m_slow_network_8x24gb = PerformanceModel(
    name="700m-slow-network-8x24GB",
    num_params=700_000_000,
    precision=Precision.FP16,
    gpu_mem=24 * 2**30,
    activation_per_sample=int(0.55 * GB),
    activation_reported_fraction=0.75,
    flops_per_sample=6 * 700e6 * 1024,
    peak_flops=160e12,
    max_efficiency=0.42,
    half_efficiency_mbs=3.0,
    bandwidth=6e9,
    call_latency=250e-6,
    stage_overhead=(0.0, 0.01, 0.04, 0.14),
    noise=0.01,
    noise_seed=33,
    gpus=8,
)

HELDOUT_MODELS: dict[str, PerformanceModel] = {
    "gpt_3b_noisy_pcie_4xa100": gpt_3b_noisy_pcie_4xa100,
    "llama_13b_32xh100": llama_13b_32xh100,
    "gpt_700m_slow_network_8x24gb": gpt_700m_slow_network_8x24gb,
}
