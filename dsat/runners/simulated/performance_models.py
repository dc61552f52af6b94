"""The built-in performance functions for the simulated runner (dsat.runners.simulated.performance_model).

Three are shaped on DeepSpeed's published results; the stress surfaces (`STRESS_MODELS`) are each
built to break one assumption a search might make; the hardware-like surfaces (`HARDWARE_MODELS`)
add what real GPUs do besides: run-to-run noise, out-of-memory near the limit that comes and goes,
aligned micro-batches that compute faster, and knob effects of either sign. docs/search.md says
what each is for.
"""

from __future__ import annotations

from dsat.memory import Precision
from dsat.runners.simulated.performance_model import (
    DEFAULT_BUCKET,
    GB,
    PerformanceModel,
    configurations,
    is_model_profile,
    optimum,
)

__all__ = [
    "BUILTIN_MODELS",
    "DEFAULT_BUCKET",
    "GB",
    "HARDWARE_MODELS",
    "OFFLOAD_MODELS",
    "STRESS_MODELS",
    "ZERO3_KNOB_MODELS",
    "PerformanceModel",
    "configurations",
    "is_model_profile",
    "optimum",
]

# GPT2-large (774M parameters, fp16, sequence 1024) on 16 V100-32GB, as in DeepSpeed's tutorial:
# ZeRO-1 at micro-batch 3 is best; ZeRO-0 runs out of memory above 2.
gpt2_large_16xv100 = PerformanceModel(
    name="gpt2-large-16xV100",
    num_params=774_000_000,
    precision=Precision.FP16,
    gpu_mem=32 * 2**30,
    activation_per_sample=int(7.2 * GB),
    activation_reported_fraction=0.85,
    flops_per_sample=6 * 774e6 * 1024,
    peak_flops=125e12,
    max_efficiency=0.30,
    half_efficiency_mbs=1.0,
    bandwidth=60e9,
    call_latency=60e-6,
    stage_overhead=(0.0, 0.01, 0.08, 0.30),
)

# BERT-base (110M parameters, fp32, sequence 128) on 16 V100-32GB, as in DeepSpeed's results:
# ZeRO-0/1 near micro-batch 235 are best, ZeRO-2 about 6% and ZeRO-3 about 15% slower.
bert_base_16xv100 = PerformanceModel(
    name="bert-base-16xV100",
    num_params=110_000_000,
    precision=Precision.FP32,
    gpu_mem=32 * 2**30,
    activation_per_sample=int(0.128 * GB),
    activation_reported_fraction=0.9,
    flops_per_sample=6 * 110e6 * 128,
    peak_flops=30e12,
    max_efficiency=0.55,
    half_efficiency_mbs=8.0,
    bandwidth=60e9,
    call_latency=60e-6,
    stage_overhead=(0.0, 0.0, 0.06, 0.15),
)

# A 7B-parameter decoder (bf16, sequence 2048, activation checkpointing) on 8 A100-80GB: ZeRO-0
# does not fit at all and ZeRO-1 barely; ZeRO-2 gives the best balance of memory and traffic.
llama_7b_8xa100 = PerformanceModel(
    name="7b-8xA100",
    num_params=6_740_000_000,
    precision=Precision.BF16,
    gpu_mem=80 * 2**30,
    activation_per_sample=int(2.6 * GB),
    activation_reported_fraction=0.8,
    flops_per_sample=8 * 6.74e9 * 2048,  # 6 N T, plus recomputation of the forward pass
    peak_flops=312e12,
    max_efficiency=0.55,
    half_efficiency_mbs=1.5,
    bandwidth=150e9,
    call_latency=40e-6,
    stage_overhead=(0.0, 0.0, 0.03, 0.12),
    startup_seconds=240.0,
    gpus=8,
)

# ---------------------------------------------------------------- stress surfaces
# Each breaks one assumption; none is calibrated on the memory model's own accounting alone.

# A third of the activations never show up in the profile (a fused kernel's workspace, say): the
# memory model's ceiling is about 1.5x the real one.
gpt_1b_underreported_4xa10 = PerformanceModel(
    name="1.3b-underreported-4xA10",
    num_params=1_300_000_000,
    precision=Precision.FP16,
    gpu_mem=24 * 2**30,
    activation_per_sample=int(0.9 * GB),
    activation_reported_fraction=0.67,
    flops_per_sample=6 * 1.3e9 * 1024,
    peak_flops=125e12,
    max_efficiency=0.40,
    half_efficiency_mbs=2.0,
    bandwidth=20e9,
    call_latency=80e-6,
    stage_overhead=(0.0, 0.01, 0.05, 0.20),
    noise_seed=11,
    gpus=4,
)

# Bucket buffers worth several samples of activations: a bucket size moves the memory cliff, and
# the fastest buckets do not leave room for the largest micro-batch.
gpt_2b_bucket_memory_8xa100 = PerformanceModel(
    name="2.7b-bucket-memory-8xA100-40GB",
    num_params=2_700_000_000,
    precision=Precision.BF16,
    gpu_mem=40 * 2**30,
    activation_per_sample=int(1.1 * GB),
    activation_reported_fraction=0.85,
    flops_per_sample=6 * 2.7e9 * 2048,
    peak_flops=312e12,
    max_efficiency=0.50,
    half_efficiency_mbs=1.5,
    bandwidth=80e9,
    call_latency=150e-6,
    stage_overhead=(0.0, 0.01, 0.04, 0.15),
    noise_seed=12,
    gpus=8,
)

# Steps slow down as memory fills: throughput peaks well below the largest micro-batch that fits.
gpt_350m_pressure_2x4090 = PerformanceModel(
    name="350m-memory-pressure-2xRTX4090",
    num_params=355_000_000,
    precision=Precision.BF16,
    gpu_mem=24 * 2**30,
    activation_per_sample=int(0.75 * GB),
    activation_reported_fraction=0.8,
    flops_per_sample=6 * 355e6 * 1024,
    peak_flops=165e12,
    max_efficiency=0.45,
    half_efficiency_mbs=2.0,
    bandwidth=12e9,
    call_latency=50e-6,
    stage_overhead=(0.0, 0.01, 0.04, 0.18),
    pressure_threshold=0.6,
    pressure_slowdown=0.35,
    noise_seed=13,
    gpus=2,
)

# A slow network (16 GPUs over Ethernet): bucket sizes and overlap are worth 5-15%.
gpt_1b_knobs_16xethernet = PerformanceModel(
    name="1.5b-knob-sensitive-16xA100-ethernet",
    num_params=1_500_000_000,
    precision=Precision.FP16,
    gpu_mem=40 * 2**30,
    activation_per_sample=int(1.6 * GB),
    activation_reported_fraction=0.8,
    flops_per_sample=6 * 1.5e9 * 1024,
    peak_flops=312e12,
    max_efficiency=0.45,
    half_efficiency_mbs=1.0,
    bandwidth=25e9,
    call_latency=1.5e-3,
    stage_overhead=(0.0, 0.01, 0.03, 0.10),
    noise_seed=14,
    gpus=16,
)

# A 14B model on 8 A100-80GB: stages 0 and 1 do not fit at any micro-batch.
llama_14b_no_low_stages_8xa100 = PerformanceModel(
    name="14b-stages-0-1-cannot-fit-8xA100",
    num_params=14_000_000_000,
    precision=Precision.BF16,
    gpu_mem=80 * 2**30,
    activation_per_sample=int(3.2 * GB),
    activation_reported_fraction=0.75,
    flops_per_sample=8 * 14e9 * 2048,
    peak_flops=312e12,
    max_efficiency=0.55,
    half_efficiency_mbs=1.0,
    bandwidth=150e9,
    call_latency=40e-6,
    stage_overhead=(0.0, 0.0, 0.03, 0.10),
    startup_seconds=300.0,
    noise_seed=15,
    gpus=8,
)

# BERT-large in fp32 on 2 GPUs: 16 bytes a parameter, little to gain from partitioning.
bert_large_fp32_2xv100 = PerformanceModel(
    name="bert-large-fp32-2xV100",
    num_params=340_000_000,
    precision=Precision.FP32,
    gpu_mem=16 * 2**30,
    activation_per_sample=int(0.3 * GB),
    activation_reported_fraction=0.7,
    flops_per_sample=6 * 340e6 * 512,
    peak_flops=15e12,
    max_efficiency=0.6,
    half_efficiency_mbs=3.0,
    bandwidth=10e9,
    call_latency=100e-6,
    stage_overhead=(0.0, 0.02, 0.07, 0.2),
    noise_seed=16,
    gpus=2,
)

# A 6B model on 16 A100-40GB with a fast fabric, whose efficiency keeps growing with the
# micro-batch: ZeRO-3's room for larger micro-batches beats its extra traffic.
gpt_6b_zero3_wins_16xa100 = PerformanceModel(
    name="6b-zero3-wins-16xA100-40GB",
    num_params=6_000_000_000,
    precision=Precision.BF16,
    gpu_mem=40 * 2**30,
    activation_per_sample=int(1.9 * GB),
    activation_reported_fraction=0.9,
    flops_per_sample=6 * 6e9 * 2048,
    peak_flops=312e12,
    max_efficiency=0.6,
    half_efficiency_mbs=6.0,
    bandwidth=200e9,
    call_latency=30e-6,
    stage_overhead=(0.0, 0.0, 0.02, 0.05),
    startup_seconds=200.0,
    noise_seed=17,
    gpus=16,
)

STRESS_MODELS: dict[str, PerformanceModel] = {
    "gpt_1b_underreported_4xa10": gpt_1b_underreported_4xa10,
    "gpt_2b_bucket_memory_8xa100": gpt_2b_bucket_memory_8xa100,
    "gpt_350m_pressure_2x4090": gpt_350m_pressure_2x4090,
    "gpt_1b_knobs_16xethernet": gpt_1b_knobs_16xethernet,
    "llama_14b_no_low_stages_8xa100": llama_14b_no_low_stages_8xa100,
    "bert_large_fp32_2xv100": bert_large_fp32_2xv100,
    "gpt_6b_zero3_wins_16xa100": gpt_6b_zero3_wins_16xa100,
}

# ---------------------------------------------------------------- hardware-like surfaces
# What real GPUs do that the surfaces above do not: each run measures anew, OOMs near the limit
# come and go, aligned micro-batches are faster, and knobs can cost as well as help.

# Run-to-run noise of 3% a run (the H100 check's plain loop varied 1-3% between runs) over a flat
# top: many configurations within the noise of each other.
gpt_1b_run_noise_8xa100 = PerformanceModel(
    name="1.3b-run-noise-8xA100-80GB",
    num_params=1_300_000_000,
    precision=Precision.BF16,
    gpu_mem=80 * 2**30,
    activation_per_sample=int(0.6 * GB),
    activation_reported_fraction=0.85,
    flops_per_sample=6 * 1.3e9 * 2048,
    peak_flops=312e12,
    max_efficiency=0.5,
    half_efficiency_mbs=4.0,
    bandwidth=150e9,
    call_latency=40e-6,
    stage_overhead=(0.0, 0.01, 0.03, 0.12),
    noise=0.005,
    run_noise=0.03,
    noise_seed=41,
    gpus=8,
)

# Fragmentation: an 8B model on 8 H100-80GB whose runs fail by chance in the top 4% of the
# usable memory, itself 93% of the device; efficiency keeps growing, so the best lies at the limit.
llama_8b_flaky_oom_8xh100 = PerformanceModel(
    name="8b-flaky-oom-8xH100",
    num_params=8_000_000_000,
    precision=Precision.BF16,
    gpu_mem=80 * 2**30,
    activation_per_sample=int(2.2 * GB),
    activation_reported_fraction=0.85,
    flops_per_sample=8 * 8e9 * 2048,
    peak_flops=900e12,
    max_efficiency=0.5,
    half_efficiency_mbs=6.0,
    bandwidth=200e9,
    call_latency=30e-6,
    stage_overhead=(0.0, 0.0, 0.03, 0.1),
    usable_memory_fraction=0.93,
    flaky_oom_band=0.04,
    noise=0.005,
    run_noise=0.015,
    startup_seconds=240.0,
    noise_seed=42,
    gpus=8,
)

# Tensor-core tiles: micro-batches divisible by 8, 16 and 64 compute 4%, 5% and 6% faster, and
# throughput falls as memory fills, so neither concavity nor "largest is best" holds.
gpt_760m_aligned_8xa100 = PerformanceModel(
    name="760m-aligned-8xA100-40GB",
    num_params=760_000_000,
    precision=Precision.FP16,
    gpu_mem=40 * 2**30,
    activation_per_sample=int(0.22 * GB),
    activation_reported_fraction=0.85,
    flops_per_sample=6 * 760e6 * 1024,
    peak_flops=312e12,
    max_efficiency=0.5,
    half_efficiency_mbs=6.0,
    bandwidth=100e9,
    call_latency=50e-6,
    stage_overhead=(0.0, 0.01, 0.04, 0.14),
    pressure_threshold=0.8,
    pressure_slowdown=0.08,
    aligned_speedups=((8, 0.04), (16, 0.05), (64, 0.06)),
    noise=0.005,
    run_noise=0.015,
    noise_seed=43,
    gpus=8,
)

# PCIe: overlapping communication slows compute more than it hides (copy contention), so
# DeepSpeed's default at stage 3 (overlap on) and the usual advice both cost; small buckets pay
# latency.
gpt_2b_pcie_knobs_8xl40 = PerformanceModel(
    name="2b-pcie-knobs-8xL40",
    num_params=2_000_000_000,
    precision=Precision.FP16,
    gpu_mem=48 * 2**30,
    activation_per_sample=int(1.0 * GB),
    activation_reported_fraction=0.8,
    flops_per_sample=6 * 2e9 * 1024,
    peak_flops=180e12,
    max_efficiency=0.45,
    half_efficiency_mbs=2.0,
    bandwidth=8e9,
    call_latency=400e-6,
    stage_overhead=(0.0, 0.01, 0.04, 0.15),
    overlap_contention=1.25,
    bucket_pipelining=True,
    noise=0.005,
    run_noise=0.02,
    noise_seed=44,
    gpus=8,
)

# All four at once, on 4 A100-80GB: 2.5% run noise, flaky OOMs in the top 3%, aligned
# micro-batches, overlap that helps only with mid-sized buckets, and mild memory pressure.
gpt_3b_hardware_4xa100 = PerformanceModel(
    name="3b-hardware-4xA100-80GB",
    num_params=3_000_000_000,
    precision=Precision.BF16,
    gpu_mem=80 * 2**30,
    activation_per_sample=int(1.6 * GB),
    activation_reported_fraction=0.8,
    flops_per_sample=6 * 3e9 * 2048,
    peak_flops=312e12,
    max_efficiency=0.5,
    half_efficiency_mbs=3.0,
    bandwidth=40e9,
    call_latency=150e-6,
    stage_overhead=(0.0, 0.01, 0.04, 0.15),
    usable_memory_fraction=0.95,
    flaky_oom_band=0.03,
    pressure_threshold=0.85,
    pressure_slowdown=0.06,
    aligned_speedups=((8, 0.03), (64, 0.05)),
    overlap_contention=0.5,
    bucket_pipelining=True,
    noise=0.005,
    run_noise=0.025,
    startup_seconds=150.0,
    noise_seed=45,
    gpus=4,
)

HARDWARE_MODELS: dict[str, PerformanceModel] = {
    "gpt_1b_run_noise_8xa100": gpt_1b_run_noise_8xa100,
    "llama_8b_flaky_oom_8xh100": llama_8b_flaky_oom_8xh100,
    "gpt_760m_aligned_8xa100": gpt_760m_aligned_8xa100,
    "gpt_2b_pcie_knobs_8xl40": gpt_2b_pcie_knobs_8xl40,
    "gpt_3b_hardware_4xa100": gpt_3b_hardware_4xa100,
}

# ---------------------------------------------------------------- models that do not fit
# Each runs out of memory in the model profile as submitted (ZeRO-0, micro-batch 1), so the
# search must climb dsat's fit ladder (dsat.search.fit_ladder) to run at all.

# A 13B model (bf16, sequence 2048) on 8 A100-80GB: ZeRO-0 and -1 do not fit, ZeRO-2 does after
# the ZeRO-3 rung's profile shows the model; ZeRO-2's lighter traffic makes it the best.
gpt_13b_no_zero0_8xa100 = PerformanceModel(
    name="13b-no-zero0-8xA100",
    num_params=13_000_000_000,
    precision=Precision.BF16,
    gpu_mem=80 * 2**30,
    activation_per_sample=int(2.2 * GB),
    activation_reported_fraction=0.85,
    flops_per_sample=8 * 13e9 * 2048,
    peak_flops=312e12,
    max_efficiency=0.55,
    half_efficiency_mbs=1.5,
    bandwidth=150e9,
    call_latency=40e-6,
    stage_overhead=(0.0, 0.0, 0.03, 0.12),
    profile_can_oom=True,
    startup_seconds=300.0,
    noise_seed=61,
    gpus=8,
)

# A 70B model (bf16, sequence 4096) on 8 H100-80GB: even ZeRO-3 holds 175 GB of states per GPU,
# so the optimizer's states go to the CPU, where the step takes seconds; a larger micro-batch
# amortises it until memory runs out. 2% run-to-run noise.
llama_70b_offload_8xh100 = PerformanceModel(
    name="70b-offload-8xH100",
    num_params=70_000_000_000,
    precision=Precision.BF16,
    gpu_mem=80 * 2**30,
    activation_per_sample=int(3.5 * GB),
    activation_reported_fraction=0.85,
    flops_per_sample=8 * 70e9 * 4096,
    peak_flops=989e12,
    max_efficiency=0.5,
    half_efficiency_mbs=1.0,
    bandwidth=200e9,
    call_latency=40e-6,
    stage_overhead=(0.0, 0.0, 0.03, 0.12),
    usable_memory_fraction=0.95,
    run_noise=0.02,
    profile_can_oom=True,
    startup_seconds=600.0,
    noise_seed=62,
    gpus=8,
)

# A 13B model on one L4-24GB: only the last CPU rung fits (optimizer states and parameters on the
# CPU), where every pass fetches the parameters over PCIe.
gpt_13b_param_offload_1xl4 = PerformanceModel(
    name="13b-param-offload-1xL4",
    num_params=13_000_000_000,
    precision=Precision.BF16,
    gpu_mem=24 * 2**30,
    activation_per_sample=int(1.1 * GB),
    activation_reported_fraction=0.85,
    flops_per_sample=8 * 13e9 * 1024,
    peak_flops=121e12,
    max_efficiency=0.5,
    half_efficiency_mbs=2.0,
    bandwidth=20e9,
    call_latency=40e-6,
    stage_overhead=(0.0, 0.0, 0.0, 0.05),
    pcie_bandwidth=12e9,
    profile_can_oom=True,
    startup_seconds=300.0,
    noise_seed=63,
    gpus=1,
)

# ---------------------------------------------------------------- ZeRO-3's own knobs
# Models that only ZeRO-3 fits, where its prefetch bucket and persistence threshold matter: a
# call per unpersisted tensor, prefetching too little or too much, and persistent parameters
# that cost memory.

# A 20B model (bf16, hidden 6144) on 32 A100-40GB over a slow inter-node network: the prefetch
# bucket that keeps the fetches ahead is several times DeepSpeed's default (and its hidden-size
# rule), and persisting more than the small tensors costs micro-batches it cannot spare.
gpt_20b_zero3_knobs_32xa100 = PerformanceModel(
    name="20b-zero3-knobs-32xA100-40GB",
    num_params=20_000_000_000,
    precision=Precision.BF16,
    gpu_mem=40 * 2**30,
    activation_per_sample=int(3 * GB),
    activation_reported_fraction=0.85,
    flops_per_sample=8 * 20e9 * 2048,
    peak_flops=312e12,
    max_efficiency=0.5,
    half_efficiency_mbs=2.0,
    bandwidth=12.5e9,
    call_latency=2e-3,
    stage_overhead=(0.0, 0.0, 0.03, 0.12),
    hidden=6144,
    prefetch_knee=1.5e8,
    startup_seconds=300.0,
    noise_seed=71,
    gpus=32,
)

# A 4.5B model (fp16, hidden 3072, long sequences) on 64 V100-16GB over a slow network: ZeRO-3
# fits two samples a GPU where ZeRO-2 fits one, and at two samples every fetch counts: persisting
# the attention matrices (3 GB a GPU) saves 40% of the calls and a third of the traffic and still
# fits two samples; persisting every matrix costs one. 1.5% run-to-run noise.
gpt_4b_zero3_persistence_64xv100 = PerformanceModel(
    name="4.5b-zero3-persistence-64xV100-16GB",
    num_params=4_500_000_000,
    precision=Precision.FP16,
    gpu_mem=16 * 2**30,
    activation_per_sample=int(5.0 * GB),
    activation_reported_fraction=0.85,
    flops_per_sample=6 * 4.5e9 * 8192,
    peak_flops=125e12,
    max_efficiency=0.45,
    half_efficiency_mbs=0.5,
    bandwidth=12.5e9,
    call_latency=2e-3,
    stage_overhead=(0.0, 0.0, 0.03, 0.12),
    hidden=3072,
    prefetch_knee=3e7,
    run_noise=0.015,
    startup_seconds=240.0,
    noise_seed=72,
    gpus=64,
)

ZERO3_KNOB_MODELS: dict[str, PerformanceModel] = {
    "gpt_20b_zero3_knobs_32xa100": gpt_20b_zero3_knobs_32xa100,
    "gpt_4b_zero3_persistence_64xv100": gpt_4b_zero3_persistence_64xv100,
}

OFFLOAD_MODELS: dict[str, PerformanceModel] = {
    "gpt_13b_no_zero0_8xa100": gpt_13b_no_zero0_8xa100,
    "llama_70b_offload_8xh100": llama_70b_offload_8xh100,
    "gpt_13b_param_offload_1xl4": gpt_13b_param_offload_1xl4,
}

BUILTIN_MODELS: dict[str, PerformanceModel] = {
    "gpt2_large_16xv100": gpt2_large_16xv100,
    "bert_base_16xv100": bert_base_16xv100,
    "llama_7b_8xa100": llama_7b_8xa100,
    **STRESS_MODELS,
    **HARDWARE_MODELS,
}
