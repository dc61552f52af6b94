"""Built-in performance functions for the simulated runner, shaped like real DeepSpeed training.

Each is called as ``model(ds_config, slots)``. A model-profile trial gets model info back; any other
trial gets DeepSpeed-style metrics (times in ms, throughput in samples/s) and its peak memory, as
a real trial reports them, or ``MemoryError`` when its memory exceeds the GPU's. What shapes them:

- a memory cliff per stage: ZeRO model states (see dsat.memory) plus activations that grow with
  the micro-batch, plus bucket buffers; the profile under-reports activations a little, as real
  profiles do, so the memory model's ceiling is an over-estimate the search has to correct;
- compute efficiency that saturates with the micro-batch;
- communication: gradient reduction and parameter all-gathers, per-call latency that makes small
  buckets expensive, overlap that hides part of it, and ZeRO-3's extra parameter traffic;
- optionally, memory pressure: steps slow down as memory fills (allocator retries, cache
  flushes), so throughput can peak below the largest micro-batch that fits;
- a few percent of measurement noise, a deterministic function of the configuration and a seed.

The first three are calibrated loosely against DeepSpeed's published autotuning tables
(GPT2-large and BERT-base on 16 V100s, see shared/reference) and a 7B model on 8 A100s. The
others (`STRESS_MODELS`) are each built to break one assumption a search might make; see
docs/search.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Mapping
from typing import Any

from dsat.memory import ModelProfile, Precision, bucket_buffer_bytes, memory_per_gpu_per_stage

GB = 10**9
DEFAULT_BUCKET = 500_000_000  # DeepSpeed's default reduce/allgather bucket size (elements)


def _zero(ds_config: Mapping[str, Any]) -> dict[str, Any]:
    section = ds_config.get("zero_optimization")
    return dict(section) if isinstance(section, Mapping) else {}


def is_model_profile(ds_config: Mapping[str, Any]) -> bool:
    autotuning = ds_config.get("autotuning")
    if not isinstance(autotuning, Mapping):
        return False
    info = autotuning.get("model_info")
    return isinstance(info, Mapping) and info.get("profile") is True


@dataclasses.dataclass(frozen=True)
class PerformanceModel:
    name: str
    num_params: int
    precision: Precision
    gpu_mem: int  # bytes
    activation_per_sample: int  # bytes, true
    activation_reported_fraction: float  # what the model-profile trial sees, as a fraction
    flops_per_sample: float
    peak_flops: float  # per GPU
    max_efficiency: float
    half_efficiency_mbs: float  # micro-batch at which efficiency reaches half its maximum
    bandwidth: float  # effective collective bandwidth per GPU, bytes/s
    call_latency: float  # seconds per collective call
    stage_overhead: tuple[float, float, float, float]  # extra compute fraction per ZeRO stage
    optimizer_bandwidth: float = 1.0e12  # bytes/s of memory traffic in the optimizer step
    usable_memory_fraction: float = 0.97
    noise: float = 0.015  # relative standard deviation of measured latency
    noise_seed: int = 0
    startup_seconds: float = 90.0
    profiled_steps: int = 6
    gpus: int = 16  # the trial's slots this surface is built for
    # Above this fraction of usable memory, compute slows down, by `pressure_slowdown` when full.
    pressure_threshold: float = 1.0
    pressure_slowdown: float = 0.0

    # ---------------------------------------------------------------- memory

    def profile(self) -> ModelProfile:
        return ModelProfile(
            num_params=self.num_params,
            trainable_num_params=self.num_params,
            activation_mem_per_gpu=int(
                self.activation_per_sample * self.activation_reported_fraction
            ),
            gpu_mem=self.gpu_mem,
        )

    def memory_bytes(self, ds_config: Mapping[str, Any], slots: int) -> int:
        zero = _zero(ds_config)
        stage = int(zero.get("stage", 0))
        mbs = int(ds_config["train_micro_batch_size_per_gpu"])
        true_profile = dataclasses.replace(
            self.profile(), activation_mem_per_gpu=self.activation_per_sample
        )
        states = memory_per_gpu_per_stage(true_profile, self.precision, slots)[stage]
        _, grad_bytes, _ = self.precision.bytes_per_param
        buffers = 0
        if stage >= 1:
            buffers = bucket_buffer_bytes(
                int(zero.get("reduce_bucket_size", DEFAULT_BUCKET)),
                int(zero.get("allgather_bucket_size", DEFAULT_BUCKET)),
                bool(zero.get("overlap_comm", stage == 3)),
                self.precision,
                self.num_params,
            )
        if stage >= 2 and zero.get("contiguous_gradients", True) is False:
            buffers += self.num_params * grad_bytes // (4 * slots)  # fragmentation
        return states + (mbs - 1) * self.activation_per_sample + buffers

    def max_micro_batch(
        self, ds_config: Mapping[str, Any], slots: int, memory_margin: float = 0.0
    ) -> int:
        """The largest micro-batch that fits with this config's ZeRO settings (0 if none), and
        leaves ``memory_margin`` of the device free."""
        at_one = self.memory_bytes({**ds_config, "train_micro_batch_size_per_gpu": 1}, slots)
        usable = min(self.usable_memory_fraction, 1.0 - memory_margin)
        spare = usable * self.gpu_mem - at_one
        return 0 if spare < 0 else 1 + int(spare // self.activation_per_sample)

    # ---------------------------------------------------------------- time

    def step_times(self, ds_config: Mapping[str, Any], slots: int) -> tuple[float, float, float]:
        """Noise-free (forward, backward, optimizer step) seconds of one micro-step."""
        zero = _zero(ds_config)
        stage = int(zero.get("stage", 0))
        mbs = int(ds_config["train_micro_batch_size_per_gpu"])
        efficiency = self.max_efficiency * mbs / (mbs + self.half_efficiency_mbs)
        compute = mbs * self.flops_per_sample / (self.peak_flops * efficiency)
        compute *= 1.0 + self.stage_overhead[stage]
        if stage >= 2 and zero.get("contiguous_gradients", True) is False:
            compute *= 1.01
        compute *= self._pressure(ds_config, slots)
        forward, backward = compute / 3, 2 * compute / 3

        param_bytes, grad_bytes, _ = self.precision.bytes_per_param
        share = (slots - 1) / slots if slots > 1 else 0.0
        grads = self.num_params * grad_bytes
        params = self.num_params * param_bytes
        reduce_bucket = int(zero.get("reduce_bucket_size", DEFAULT_BUCKET))
        gather_bucket = int(zero.get("allgather_bucket_size", DEFAULT_BUCKET))
        reduce_calls = math.ceil(self.num_params / reduce_bucket)
        scatter = stage >= 2 and zero.get("reduce_scatter", True)
        comm = (
            1 if scatter else 2
        ) * share * grads / self.bandwidth + reduce_calls * self.call_latency
        if stage in (1, 2):
            comm += share * params / self.bandwidth
            comm += math.ceil(self.num_params / gather_bucket) * self.call_latency
        if stage == 3:
            gathers = 2 * share * params / self.bandwidth
            comm += gathers * (1.0 if zero.get("allgather_partitions", True) else 1.15)
        overlap = zero.get("overlap_comm", stage == 3) and reduce_calls > 1
        exposed = comm * (0.25 if overlap else 1.0)
        if overlap:
            exposed = max(exposed, comm - backward)
        backward += exposed

        optimizer_bytes = self.num_params * sum(self.precision.bytes_per_param)
        step = optimizer_bytes / (slots if stage >= 1 else 1) / self.optimizer_bandwidth
        return forward, backward, step

    def _pressure(self, ds_config: Mapping[str, Any], slots: int) -> float:
        if self.pressure_slowdown == 0.0:
            return 1.0
        used = self.memory_bytes(ds_config, slots) / (self.usable_memory_fraction * self.gpu_mem)
        excess = max(0.0, used - self.pressure_threshold) / (1.0 - self.pressure_threshold)
        return 1.0 + self.pressure_slowdown * min(excess, 1.0) ** 2

    @property
    def base_ds_config(self) -> dict[str, Any]:
        """The precision section a user's config has for this surface."""
        if self.precision is Precision.FP32:
            return {}
        return {self.precision.value: {"enabled": True}}

    def _noise_factor(self, ds_config: Mapping[str, Any], slots: int) -> float:
        key = json.dumps(
            [
                self.noise_seed,
                slots,
                ds_config.get("train_micro_batch_size_per_gpu"),
                _zero(ds_config),
            ],
            sort_keys=True,
        )
        digest = hashlib.sha256(key.encode()).digest()
        # Two uniforms -> one standard normal (Box-Muller), clipped to +-2.5 sigma.
        u1 = (int.from_bytes(digest[:8], "big") + 1) / 2**64
        u2 = int.from_bytes(digest[8:16], "big") / 2**64
        normal = math.sqrt(-2 * math.log(u1)) * math.cos(2 * math.pi * u2)
        return 1.0 + self.noise * max(-2.5, min(2.5, normal))

    def metrics(
        self, ds_config: Mapping[str, Any], slots: int, noisy: bool = True
    ) -> dict[str, float]:
        forward, backward, step = self.step_times(ds_config, slots)
        gas = int(ds_config.get("gradient_accumulation_steps", 1))
        mbs = int(ds_config["train_micro_batch_size_per_gpu"])
        factor = self._noise_factor(ds_config, slots) if noisy else 1.0
        forward, backward, step = forward * factor, backward * factor, step * factor
        latency = (forward + backward + step) * gas
        return {
            "fwd": forward * 1000,
            "bwd": backward * 1000,
            "step": step * 1000,
            "latency": latency * 1000,
            "throughput": mbs * gas * slots / latency,
            "FLOPS_per_gpu": self.flops_per_sample * mbs * gas / latency,
        }

    # ---------------------------------------------------------------- the performance function

    def __call__(self, ds_config: Mapping[str, Any], slots: int) -> dict[str, Any]:
        if is_model_profile(ds_config):
            profile = self.profile()
            return {**dataclasses.asdict(profile), "seconds": self.startup_seconds}
        peak = self.memory_bytes(ds_config, slots)
        if peak > self.usable_memory_fraction * self.gpu_mem:
            raise MemoryError(f"{self.name}: out of memory")
        result: dict[str, Any] = self.metrics(ds_config, slots)
        # A real trial reports its peak and its device's memory (dsat.training.step_clock); the
        # hand-over reads them (--memory-margin, the confirmation round's headroom preference).
        result["memory_peak_bytes"] = peak
        result["memory_total_bytes"] = self.gpu_mem
        result["seconds"] = self.startup_seconds + self.profiled_steps * result["latency"] / 1000
        return result


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

BUILTIN_MODELS: dict[str, PerformanceModel] = {
    "gpt2_large_16xv100": gpt2_large_16xv100,
    "bert_base_16xv100": bert_base_16xv100,
    "llama_7b_8xa100": llama_7b_8xa100,
    **STRESS_MODELS,
}


def configurations(stages: tuple[int, ...]) -> list[dict[str, Any]]:
    """Every ``zero_optimization`` section the search space holds for ``stages``."""
    import itertools

    from dsat.zero_space import zero_knobs

    sections: list[dict[str, Any]] = []
    for stage in stages:
        knobs = zero_knobs(stage)
        for values in itertools.product(*knobs.values()):
            sections.append({"stage": stage, **dict(zip(knobs, values, strict=True))})
    return sections


def optimum(
    model: PerformanceModel,
    slots: int,
    metric_key: str,
    smaller_is_better: bool,
    stages: tuple[int, ...] = (0, 1, 2, 3),
    base: Mapping[str, Any] | None = None,
    memory_margin: float = 0.0,
) -> tuple[float, dict[str, Any]]:
    """The best noise-free metric over the whole search space, and the config that reaches it.

    Without memory pressure, throughput and FLOPS only grow with the micro-batch in these models
    and times only shrink as it falls, so each ZeRO configuration is evaluated at its largest
    fitting micro-batch and at 1 (tests check that property on sampled configurations); with
    pressure, at every micro-batch that fits. With ``memory_margin``, only configurations that
    leave that fraction of the device free count: the best a search could hand over.
    """
    best_value: float | None = None
    best_config: dict[str, Any] = {}
    for section in configurations(stages):
        config = {**(base or {}), "zero_optimization": section, "train_micro_batch_size_per_gpu": 1}
        largest = model.max_micro_batch(config, slots, memory_margin)
        if largest == 0:
            continue
        sizes = range(1, largest + 1) if model.pressure_slowdown else (1, largest)
        for mbs in sizes:
            candidate = {**config, "train_micro_batch_size_per_gpu": mbs}
            value = model.metrics(candidate, slots, noisy=False)[metric_key]
            better = best_value is None or (
                value < best_value if smaller_is_better else value > best_value
            )
            if better:
                best_value, best_config = value, candidate
    if best_value is None:
        raise ValueError(f"{model.name}: no configuration fits on {slots} slots")
    return best_value, best_config
