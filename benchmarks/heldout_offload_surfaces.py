"""Held-out surfaces of models that do not fit without offload (issue 32), written after the search
they check and scored once.

The three built-in surfaces of models that do not fit (``OFFLOAD_MODELS``) are what the fit ladder
and guided's offload rules were developed on. These three use the same mechanics with other
hardware quirks: run-to-run noise, out-of-memory near the limit that comes and goes, aligned
micro-batches, a slow shared PCIe link and steps that slow down as memory fills, so that the best
is not always at the top of what fits:

    python3 benchmarks/search_efficiency.py --surfaces heldout-offload

Do not tune the search on them; a surface tuned on is no longer held out.
"""

from __future__ import annotations

from dsat.memory import Precision
from dsat.runners.simulated.performance_models import GB, PerformanceModel

# A 30B model in bf16 (sequence 2048, checkpointing) on 4 A100-40GB: ZeRO-3 alone runs out of
# memory; with the optimizer on the CPU it fits to a micro-batch of about ten, with the
# parameters too to nearly twice that. OOMs near the limit come and go; multiples of 8 are faster.
llama_30b_offload_flaky_4xa100 = PerformanceModel(
    name="30b-offload-flaky-4xA100-40GB",
    num_params=30_000_000_000,
    precision=Precision.BF16,
    gpu_mem=40 * 2**30,
    activation_per_sample=int(1.6 * GB),
    activation_reported_fraction=0.85,
    flops_per_sample=8 * 30e9 * 2048,
    peak_flops=312e12,
    max_efficiency=0.5,
    half_efficiency_mbs=1.5,
    bandwidth=150e9,
    call_latency=40e-6,
    stage_overhead=(0.0, 0.0, 0.03, 0.1),
    usable_memory_fraction=0.93,
    flaky_oom_band=0.03,
    aligned_speedups=((8, 0.02),),
    pcie_bandwidth=20e9,
    cpu_optimizer_bandwidth=20e9,
    noise=0.005,
    run_noise=0.02,
    profile_can_oom=True,
    startup_seconds=480.0,
    noise_seed=71,
    gpus=4,
)

# A 46B model in bf16 on 8 A100-80GB whose PCIe link the node's eight GPUs share (6 GB/s each):
# offloading the parameters too crosses it in every pass and loses to the optimizer alone, though
# it reaches larger micro-batches. A noisy machine.
moe_46b_slow_pcie_8xa100 = PerformanceModel(
    name="46b-slow-pcie-offload-8xA100-80GB",
    num_params=46_000_000_000,
    precision=Precision.BF16,
    gpu_mem=80 * 2**30,
    activation_per_sample=int(2.4 * GB),
    activation_reported_fraction=0.85,
    flops_per_sample=8 * 13e9 * 4096,
    peak_flops=312e12,
    max_efficiency=0.45,
    half_efficiency_mbs=2.0,
    bandwidth=100e9,
    call_latency=50e-6,
    stage_overhead=(0.0, 0.0, 0.03, 0.12),
    usable_memory_fraction=0.95,
    pcie_bandwidth=6e9,
    cpu_optimizer_bandwidth=15e9,
    noise=0.006,
    run_noise=0.025,
    profile_can_oom=True,
    startup_seconds=540.0,
    noise_seed=72,
    gpus=8,
)

# A 20B model in bf16 on 2 RTX 4090-24GB (consumer cards over PCIe, no NVLink): only parameter
# offload fits; steps slow down as memory fills, so the best sits below the top of what fits, and
# multiples of 16 are faster. Very noisy runs (a desktop).
neox_20b_param_offload_2x4090 = PerformanceModel(
    name="20b-param-offload-pressure-2x4090",
    num_params=20_000_000_000,
    precision=Precision.BF16,
    gpu_mem=24 * 2**30,
    activation_per_sample=int(0.6 * GB),
    activation_reported_fraction=0.85,
    flops_per_sample=8 * 20e9 * 1024,
    peak_flops=165e12,
    max_efficiency=0.45,
    half_efficiency_mbs=3.0,
    bandwidth=12e9,
    call_latency=80e-6,
    stage_overhead=(0.0, 0.0, 0.02, 0.06),
    usable_memory_fraction=0.92,
    pressure_threshold=0.7,
    pressure_slowdown=0.1,
    aligned_speedups=((16, 0.03),),
    pcie_bandwidth=16e9,
    cpu_optimizer_bandwidth=20e9,
    noise=0.008,
    run_noise=0.03,
    profile_can_oom=True,
    startup_seconds=300.0,
    noise_seed=73,
    gpus=2,
)

HELDOUT_OFFLOAD_MODELS: dict[str, PerformanceModel] = {
    "llama_30b_offload_flaky_4xa100": llama_30b_offload_flaky_4xa100,
    "moe_46b_slow_pcie_8xa100": moe_46b_slow_pcie_8xa100,
    "neox_20b_param_offload_2x4090": neox_20b_param_offload_2x4090,
}
