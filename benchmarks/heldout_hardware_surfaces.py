"""Held-out hardware-like surfaces: written apart from the guided search's development (issue 31).

The hardware-like surfaces in dsat.runners.simulated.performance_models (``HARDWARE_MODELS``)
add what real GPUs do besides the memory cliff: run-to-run noise, out-of-memory near the limit
that comes and goes, aligned micro-batches that compute faster, and knob effects of either sign.
The search is tuned on those. These four use the same quirks on other model sizes, GPU counts,
GPU memories and precisions, were written by someone who did not see the search's tuning, and
are scored once, at the end, to check that what the search learned there carries over:

    python3 benchmarks/search_efficiency.py --surfaces heldout-hardware

Do not tune the search on them; a surface tuned on is no longer held out.
"""

from __future__ import annotations

from dsat.memory import Precision
from dsat.runners.simulated.performance_models import GB, PerformanceModel

# A 1.1B model in bf16 on 12 A10G-24GB (three cloud nodes over Ethernet): noisy shared-tenancy
# runs, overlap that helps despite contention, and a U-shaped reduce bucket (latency vs last bucket).
llama_1b_noisy_buckets_12xa10g = PerformanceModel(
    name="1.1b-noisy-buckets-12xA10G",
    num_params=1_100_000_000,
    precision=Precision.BF16,
    gpu_mem=24 * 2**30,
    activation_per_sample=int(1.4 * GB),
    activation_reported_fraction=0.82,
    flops_per_sample=6 * 1.1e9 * 2048,
    peak_flops=70e12,
    max_efficiency=0.45,
    half_efficiency_mbs=2.0,
    bandwidth=4e9,
    call_latency=600e-6,
    stage_overhead=(0.0, 0.01, 0.05, 0.18),
    overlap_contention=0.3,
    bucket_pipelining=True,
    noise=0.008,
    run_noise=0.035,
    startup_seconds=120.0,
    noise_seed=61,
    gpus=12,
)

# A 34B model (sequence 4096, checkpointing) on 16 H200: allocator fragmentation makes OOMs near
# the limit come and go, and efficiency keeps growing, so the best lies close to that limit.
codellama_34b_flaky_oom_16xh200 = PerformanceModel(
    name="34b-flaky-oom-16xH200",
    num_params=34_000_000_000,
    precision=Precision.BF16,
    gpu_mem=140 * 2**30,
    activation_per_sample=int(5.5 * GB),
    activation_reported_fraction=0.85,
    flops_per_sample=8 * 34e9 * 4096,
    peak_flops=989e12,
    max_efficiency=0.5,
    half_efficiency_mbs=4.0,
    bandwidth=250e9,
    call_latency=30e-6,
    stage_overhead=(0.0, 0.0, 0.02, 0.06),
    usable_memory_fraction=0.92,
    flaky_oom_band=0.05,
    noise=0.005,
    run_noise=0.015,
    startup_seconds=420.0,
    noise_seed=62,
    gpus=16,
)

# A 410M model in fp16 (sequence 2048) on 4 RTX A6000-48GB over PCIe: micro-batches divisible by
# 16 and 32 hit faster GEMM tiles, and steps slow down as memory fills.
pythia_410m_aligned_4xa6000 = PerformanceModel(
    name="410m-aligned-pressure-4xA6000",
    num_params=405_000_000,
    precision=Precision.FP16,
    gpu_mem=48 * 2**30,
    activation_per_sample=int(0.9 * GB),
    activation_reported_fraction=0.85,
    flops_per_sample=6 * 405e6 * 2048,
    peak_flops=150e12,
    max_efficiency=0.45,
    half_efficiency_mbs=5.0,
    bandwidth=10e9,
    call_latency=80e-6,
    stage_overhead=(0.0, 0.01, 0.05, 0.16),
    pressure_threshold=0.75,
    pressure_slowdown=0.12,
    aligned_speedups=((16, 0.035), (32, 0.05)),
    noise=0.005,
    run_noise=0.02,
    noise_seed=63,
    gpus=4,
)

# A 6.7B model in fp16 on 16 PCIe V100-32GB over RoCE: overlapped traffic contends with compute
# for PCIe and costs more than it hides, OOMs near the limit come and go, multiples of 8 are faster.
opt_6b_pcie_flaky_16xv100 = PerformanceModel(
    name="6.7b-pcie-contention-flaky-16xV100-32GB",
    num_params=6_700_000_000,
    precision=Precision.FP16,
    gpu_mem=32 * 2**30,
    activation_per_sample=int(1.1 * GB),
    activation_reported_fraction=0.8,
    flops_per_sample=8 * 6.7e9 * 2048,
    peak_flops=125e12,
    max_efficiency=0.4,
    half_efficiency_mbs=2.0,
    bandwidth=5e9,
    call_latency=100e-6,
    stage_overhead=(0.0, 0.01, 0.04, 0.13),
    usable_memory_fraction=0.94,
    flaky_oom_band=0.03,
    aligned_speedups=((8, 0.03),),
    overlap_contention=1.3,
    noise=0.006,
    run_noise=0.025,
    startup_seconds=200.0,
    noise_seed=64,
    gpus=16,
)

HELDOUT_HARDWARE_MODELS: dict[str, PerformanceModel] = {
    "llama_1b_noisy_buckets_12xa10g": llama_1b_noisy_buckets_12xa10g,
    "codellama_34b_flaky_oom_16xh200": codellama_34b_flaky_oom_16xh200,
    "pythia_410m_aligned_4xa6000": pythia_410m_aligned_4xa6000,
    "opt_6b_pcie_flaky_16xv100": opt_6b_pcie_flaky_16xv100,
}
