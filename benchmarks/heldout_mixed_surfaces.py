"""Held-out surfaces that mix the hardware quirks the others model one or two at a time, written
after every rule of guided they check (2026-11-26) and scored once.

The other held-out sets have been looked into since they were scored (benchmarks/README.md says
which), so they no longer say how guided does on a surface it was not built on. These four put
several quirks on one surface each: run-to-run noise with flaky OOMs and aligned micro-batches on
slow PCIe cards; ZeRO-3's own knobs where memory is tight; offload with a noisy host link; and
a network slow enough that bucket sizes have a best in the middle:

    python3 benchmarks/search_efficiency.py --surfaces heldout-mixed

Do not tune the search on them; a surface tuned on is no longer held out.
"""

from __future__ import annotations

from dsat.memory import Precision
from dsat.runners.simulated.performance_models import GB, PerformanceModel

# A 1.3B model in fp16 (sequence 2048) on 8 T4-16GB over PCIe: overlapped traffic contends with
# compute, OOMs near the limit come and go, multiples of 8 are faster, runs differ by 2%.
neox_1b_t4_pcie_8x = PerformanceModel(
    name="1.3b-t4-pcie-flaky-8xT4-16GB",
    num_params=1_300_000_000,
    precision=Precision.FP16,
    gpu_mem=16 * 2**30,
    activation_per_sample=int(1.2 * GB),
    activation_reported_fraction=0.8,
    flops_per_sample=8 * 1.3e9 * 2048,
    peak_flops=65e12,
    max_efficiency=0.35,
    half_efficiency_mbs=2.0,
    bandwidth=4e9,
    call_latency=120e-6,
    stage_overhead=(0.0, 0.01, 0.04, 0.14),
    usable_memory_fraction=0.93,
    flaky_oom_band=0.03,
    aligned_speedups=((8, 0.02),),
    overlap_contention=0.8,
    noise=0.006,
    run_noise=0.02,
    startup_seconds=150.0,
    noise_seed=81,
    gpus=8,
)

# A 7B model in bf16 (hidden 4096, sequence 4096, checkpointing) on 8 A100-40GB: ZeRO-3's
# prefetch bucket and persistence threshold matter, memory is tight enough that what they keep
# costs micro-batches, and steps slow down as memory fills; 1.2% run-to-run noise.
mistral_7b_zero3_tight_8xa100 = PerformanceModel(
    name="7b-zero3-tight-8xA100-40GB",
    num_params=7_200_000_000,
    precision=Precision.BF16,
    gpu_mem=40 * 2**30,
    activation_per_sample=int(2.2 * GB),
    activation_reported_fraction=0.85,
    flops_per_sample=8 * 7.2e9 * 4096,
    peak_flops=312e12,
    max_efficiency=0.5,
    half_efficiency_mbs=2.5,
    bandwidth=60e9,
    call_latency=300e-6,
    stage_overhead=(0.0, 0.0, 0.03, 0.1),
    usable_memory_fraction=0.94,
    pressure_threshold=0.85,
    pressure_slowdown=0.05,
    aligned_speedups=((8, 0.015),),
    hidden=4096,
    prefetch_knee=5e7,
    noise=0.005,
    run_noise=0.012,
    startup_seconds=240.0,
    noise_seed=82,
    gpus=8,
)

# A 13B model in bf16 (sequence 2048) on 4 L40S-48GB: it does not fit without offload; the host
# link is shared and noisy (2.5% run-to-run), multiples of 16 are faster, OOMs near the limit
# come and go.
llama_13b_offload_noisy_4xl40s = PerformanceModel(
    name="13b-offload-noisy-link-4xL40S-48GB",
    num_params=13_000_000_000,
    precision=Precision.BF16,
    gpu_mem=48 * 2**30,
    activation_per_sample=int(1.4 * GB),
    activation_reported_fraction=0.85,
    flops_per_sample=8 * 13e9 * 2048,
    peak_flops=362e12,
    max_efficiency=0.45,
    half_efficiency_mbs=3.0,
    bandwidth=15e9,
    call_latency=90e-6,
    stage_overhead=(0.0, 0.0, 0.02, 0.08),
    usable_memory_fraction=0.93,
    flaky_oom_band=0.02,
    aligned_speedups=((16, 0.025),),
    pcie_bandwidth=22e9,
    cpu_optimizer_bandwidth=30e9,
    noise=0.006,
    run_noise=0.025,
    profile_can_oom=True,
    startup_seconds=240.0,
    noise_seed=83,
    gpus=4,
)

# A 340M model in fp16 (sequence 512) on 32 V100-32GB over 10 Gb Ethernet: collectives are slow
# and costly per call, so small buckets are latency-bound and large ones overlap nothing (the
# last bucket's traffic is exposed); overlap helps; 3% run-to-run noise on a shared network.
bert_large_ethernet_32xv100 = PerformanceModel(
    name="340m-ethernet-buckets-32xV100-32GB",
    num_params=340_000_000,
    precision=Precision.FP16,
    gpu_mem=32 * 2**30,
    activation_per_sample=int(0.25 * GB),
    activation_reported_fraction=0.85,
    flops_per_sample=6 * 340e6 * 512,
    peak_flops=125e12,
    max_efficiency=0.45,
    half_efficiency_mbs=8.0,
    bandwidth=1.2e9,
    call_latency=1.5e-3,
    stage_overhead=(0.0, 0.01, 0.04, 0.15),
    bucket_pipelining=True,
    noise=0.006,
    run_noise=0.03,
    startup_seconds=120.0,
    noise_seed=84,
    gpus=32,
)

HELDOUT_MIXED_MODELS: dict[str, PerformanceModel] = {
    "neox_1b_t4_pcie_8x": neox_1b_t4_pcie_8x,
    "mistral_7b_zero3_tight_8xa100": mistral_7b_zero3_tight_8xa100,
    "llama_13b_offload_noisy_4xl40s": llama_13b_offload_noisy_4xl40s,
    "bert_large_ethernet_32xv100": bert_large_ethernet_32xv100,
}
