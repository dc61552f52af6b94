"""A performance function for the simulated runner, shaped like real DeepSpeed training.

Called as ``model(ds_config, slots, run_id)``. A model-profile trial gets model info back; any
other trial gets DeepSpeed-style metrics (times in ms, throughput in samples/s) and its peak
memory, as a real trial reports them, or ``MemoryError`` when it runs out of memory. What shapes
them:

- a memory cliff per stage: ZeRO model states (see dsat.memory) plus activations that grow with
  the micro-batch, plus bucket buffers; the profile under-reports activations a little, as real
  profiles do, so the memory model's ceiling is an over-estimate the search has to correct;
- compute efficiency that saturates with the micro-batch;
- communication: gradient reduction and parameter all-gathers, per-call latency that makes small
  buckets expensive, overlap that hides part of it, and ZeRO-3's extra parameter traffic;
- optionally, memory pressure: steps slow down as memory fills (allocator retries, cache
  flushes), so throughput can peak below the largest micro-batch that fits;
- a few percent of measurement noise, a deterministic function of the configuration and a seed;
- gradient accumulation: an optimizer step computes every micro-step; ZeRO-0 and -1 reduce the
  gradients once per optimizer step, ZeRO-2 and -3 at every micro-step (memory does not grow).

And, each off unless a surface sets it, what real hardware does besides (docs/search.md,
"Hardware-like surfaces"):

- run-to-run noise: a run's step time drawn anew for every run (``run_id``), reproducibly;
- out-of-memory near the limit that comes and goes (allocator fragmentation): above
  ``1 - flaky_oom_band`` of the usable memory a run fails with a probability that rises to 1 at
  the limit, so a configuration that completed once may fail the next time;
- aligned micro-batches (tensor-core tiles, kernel choice): multiples of 8, 16 or 64 compute
  faster than their neighbours, so throughput is not concave in the micro-batch;
- knob effects of either sign: overlap that slows compute (copy contention on PCIe), and a
  reduce bucket whose best size lies inside the ladder (small: latency; large: the last bucket's
  reduction cannot overlap);
- a model profile that runs out of memory, as a real one does when the model does not fit at
  micro-batch 1 as submitted (``profile_can_oom``; the older surfaces' users submit ZeRO-0, which
  those surfaces let profile anyway).

Offload is always modelled: offloaded state takes no GPU memory (dsat.memory), the optimizer
step of offloaded states runs on the CPU after the gradients cross PCIe and before the
parameters cross back, and offloaded parameters cross PCIe in every forward and backward pass.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
from collections.abc import Mapping
from typing import Any

from dsat.experiment.batch_size import micro_batches_for
from dsat.memory import (
    ModelProfile,
    Offload,
    Precision,
    bucket_buffer_bytes,
    memory_per_gpu_per_stage,
)
from dsat.search.fit_ladder import offload_choices
from dsat.zero_space import DEEPSPEED_DEFAULTS, stage3_ladders, zero_knobs

GB = 10**9
DEFAULT_BUCKET = 500_000_000  # DeepSpeed's default reduce/allgather bucket size (elements)
# Run-to-run noise is clipped at this many standard deviations (a normal draw, not a heavy tail).
RUN_NOISE_CLIP = 3.0


def _share(slots: int) -> float:
    """The share of a collective's data a rank sends or receives over the network."""
    return (slots - 1) / slots if slots > 1 else 0.0


def _zero(ds_config: Mapping[str, Any]) -> dict[str, Any]:
    section = ds_config.get("zero_optimization")
    return dict(section) if isinstance(section, Mapping) else {}


def is_model_profile(ds_config: Mapping[str, Any]) -> bool:
    autotuning = ds_config.get("autotuning")
    if not isinstance(autotuning, Mapping):
        return False
    info = autotuning.get("model_info")
    return isinstance(info, Mapping) and info.get("profile") is True


def _uniforms(*key: Any) -> tuple[float, float]:
    """Two uniforms, in (0, 1] and [0, 1), a deterministic function of ``key``."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).digest()
    return (
        (int.from_bytes(digest[:8], "big") + 1) / 2**64,
        int.from_bytes(digest[8:16], "big") / 2**64,
    )


def _normal(*key: Any) -> float:
    """A standard normal draw (Box-Muller), a deterministic function of ``key``."""
    u1, u2 = _uniforms(*key)
    return math.sqrt(-2 * math.log(u1)) * math.cos(2 * math.pi * u2)


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
    noise: float = 0.015  # relative sd of a configuration's measured latency, the same every run
    noise_seed: int = 0
    startup_seconds: float = 90.0
    profiled_steps: int = 6
    gpus: int = 16  # the trial's slots this surface is built for
    # Above this fraction of usable memory, compute slows down, by `pressure_slowdown` when full.
    pressure_threshold: float = 1.0
    pressure_slowdown: float = 0.0
    # ---- hardware quirks (see the module's docstring); off by default
    run_noise: float = 0.0  # relative sd of one run's step time, drawn anew for every run
    flaky_oom_band: float = 0.0  # share of the usable memory, below it, where OOMs come and go
    # (multiple, compute speed-up) pairs: a micro-batch divisible by the multiple computes this
    # much faster (the largest that applies counts).
    aligned_speedups: tuple[tuple[int, float], ...] = ()
    overlap_contention: float = 0.0  # compute slowed by this share of the overlapped traffic
    bucket_pipelining: bool = False  # with overlap, the last reduce bucket's traffic is exposed
    # The model profile runs out of memory where the model does not fit.
    profile_can_oom: bool = False
    # ---- offload
    pcie_bandwidth: float = 20e9  # bytes/s between one GPU and the CPU
    cpu_optimizer_bandwidth: float = 25e9  # bytes/s of optimizer state one GPU's CPU share steps
    # ---- ZeRO-3's own knobs (stage3_prefetch_bucket_size, stage3_param_persistence_threshold)
    # have effects only where a surface gives the model's hidden size; at DeepSpeed's defaults
    # every figure is what it is without them.
    hidden: int = 0
    prefetch_knee: float = 0.0  # prefetch elements below which fetching cannot keep ahead

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
        offload = Offload.of(zero)
        states = memory_per_gpu_per_stage(true_profile, self.precision, slots, offload)[stage]
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
        if stage == 3 and self.hidden:
            buffers += int(self._stage3_memory(zero, slots) - self._stage3_memory({}, slots))
        return states + (mbs - 1) * self.activation_per_sample + buffers

    # ---------------------------------------------------------------- ZeRO-3's knobs

    def _stage3_knobs(self, zero: Mapping[str, Any]) -> tuple[float, float]:
        prefetch, persistence = "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"
        return (
            float(zero.get(prefetch, DEEPSPEED_DEFAULTS[prefetch])),
            float(zero.get(persistence, DEEPSPEED_DEFAULTS[persistence])),
        )

    def _layers(self) -> float:
        return self.num_params / (12 * self.hidden**2)

    def _persisted(self, threshold: float) -> tuple[float, float]:
        """(elements, tensors) a persistence threshold keeps whole on every GPU, for a decoder
        with per layer 4 vectors of h, 4 matrices of h^2 and 2 of 4 h^2."""
        layers, h = self._layers(), self.hidden
        elements = tensors = 0.0
        for count, size in ((4, h), (4, h * h), (2, 4 * h * h)):
            if size <= threshold:
                elements += layers * count * size
                tensors += layers * count
        return elements, tensors

    def _stage3_memory(self, zero: Mapping[str, Any], slots: int) -> float:
        """What the prefetched and the persistent parameters take."""
        prefetch, threshold = self._stage3_knobs(zero)
        param_bytes = self.precision.bytes_per_param[0]
        persisted, _ = self._persisted(threshold)
        share = _share(slots)
        return min(prefetch, self.num_params) * param_bytes + persisted * param_bytes * share

    def _stage3_seconds(self, zero: Mapping[str, Any], slots: int) -> float:
        """The parameter fetches a micro-step cannot hide: a call per tensor that is not
        persistent in each pass, and the gathered traffic, more of it exposed with a prefetch
        bucket too small to keep ahead or so large that the first fetch waits for it."""
        prefetch, threshold = self._stage3_knobs(zero)
        persisted, kept_tensors = self._persisted(threshold)
        tensors = self._layers() * 10 - kept_tensors
        share = _share(slots)
        traffic = 2 * share * (self.num_params - persisted) * self.precision.bytes_per_param[0]
        exposure = 0.1 + self.prefetch_knee / (self.prefetch_knee + prefetch)
        exposure += 8 * min(1.0, prefetch / self.num_params)
        return 2 * tensors * self.call_latency + exposure * traffic / self.bandwidth

    @property
    def oom_bytes(self) -> float:
        """Above this a run always runs out of memory."""
        return self.usable_memory_fraction * self.gpu_mem

    @property
    def never_oom_bytes(self) -> float:
        """Up to this a run never runs out of memory; between it and ``oom_bytes``, sometimes."""
        return self.oom_bytes * (1.0 - self.flaky_oom_band)

    def safe_bytes(self, memory_margin: float = 0.0) -> float:
        """The most a configuration may use and be safe to hand over: it never runs out of
        memory, and leaves ``memory_margin`` of the usable memory free (of what a run can use,
        not of the device's nominal total: a real training run goes higher than a short trial,
        and what runs out of memory is the usable memory)."""
        return min(self.never_oom_bytes, (1.0 - memory_margin) * self.oom_bytes)

    def is_safe(self, ds_config: Mapping[str, Any], slots: int, memory_margin: float) -> bool:
        return self.memory_bytes(ds_config, slots) <= self.safe_bytes(memory_margin)

    def max_micro_batch(
        self, ds_config: Mapping[str, Any], slots: int, memory_margin: float = 0.0
    ) -> int:
        """The largest micro-batch that never runs out of memory with this config's ZeRO
        settings (0 if none), and leaves ``memory_margin`` of the device free."""
        at_one = self.memory_bytes({**ds_config, "train_micro_batch_size_per_gpu": 1}, slots)
        spare = self.safe_bytes(memory_margin) - at_one
        return 0 if spare < 0 else 1 + int(spare // self.activation_per_sample)

    # ---------------------------------------------------------------- time

    def step_times(
        self, ds_config: Mapping[str, Any], slots: int
    ) -> tuple[float, float, float, float]:
        """Noise-free seconds of (forward, backward, the communication the backward pass does not
        hide, the optimizer step) of one micro-step."""
        zero = _zero(ds_config)
        stage = int(zero.get("stage", 0))
        mbs = int(ds_config["train_micro_batch_size_per_gpu"])
        efficiency = self.max_efficiency * mbs / (mbs + self.half_efficiency_mbs)
        efficiency *= 1.0 + max(
            (speedup for multiple, speedup in self.aligned_speedups if mbs % multiple == 0),
            default=0.0,
        )
        compute = mbs * self.flops_per_sample / (self.peak_flops * efficiency)
        compute *= 1.0 + self.stage_overhead[stage]
        if stage >= 2 and zero.get("contiguous_gradients", True) is False:
            compute *= 1.01
        compute *= self._pressure(ds_config, slots)
        forward, backward = compute / 3, 2 * compute / 3

        param_bytes, grad_bytes, _ = self.precision.bytes_per_param
        share = _share(slots)
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
            if self.bucket_pipelining:  # the last bucket reduces after the backward pass
                exposed = max(exposed, comm * min(1.0, reduce_bucket / self.num_params))
            exposed += self.overlap_contention * (comm - exposed)

        optimizer_bytes = self.num_params * sum(self.precision.bytes_per_param)
        partition = slots if stage >= 1 else 1
        offload = Offload.of(zero)
        if offload.optimizer:  # gradients to the CPU, the step there, parameters back
            step = (grads + params) / partition / self.pcie_bandwidth
            step += optimizer_bytes / partition / self.cpu_optimizer_bandwidth
        else:
            step = optimizer_bytes / partition / self.optimizer_bandwidth
        if offload.params and stage == 3:  # each pass fetches this rank's partition
            exposed += 2 * params / slots / self.pcie_bandwidth
        if stage == 3 and self.hidden:
            knobs = self._stage3_seconds(zero, slots) - self._stage3_seconds({}, slots)
            exposed = max(0.0, exposed + knobs)
        return forward, backward, exposed, step

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

    def _key(self, ds_config: Mapping[str, Any], slots: int) -> list[Any]:
        """What a configuration's noise is drawn from: the knobs that act on this surface (a
        knob without effect here, ZeRO-3's own where no hidden size is given, leaves the
        configuration the one it was)."""
        zero = _zero(ds_config)
        if not self.hidden:
            zero = {k: v for k, v in zero.items() if not str(k).startswith("stage3_")}
        return [self.noise_seed, slots, ds_config.get("train_micro_batch_size_per_gpu"), zero]

    def _noise_factor(
        self, ds_config: Mapping[str, Any], slots: int, run_id: str | None = None
    ) -> float:
        """The configuration's own deviation (the same every run, clipped to +-2.5 sigma) and,
        given a ``run_id``, this run's."""
        key = self._key(ds_config, slots)
        factor = 1.0 + self.noise * max(-2.5, min(2.5, _normal(*key)))
        if run_id is not None and self.run_noise:
            draw = _normal(*key, "run", run_id)
            factor *= 1.0 + self.run_noise * max(-RUN_NOISE_CLIP, min(RUN_NOISE_CLIP, draw))
        return factor

    def own_deviation(self, ds_config: Mapping[str, Any], slots: int) -> float:
        """How much higher (relative; negative: lower) every run of the configuration measures
        its throughput than its noise-free value: its own deviation, which no number of runs
        averages away. Benchmarks use it to tell a hand-over picked for its own deviation from
        one picked for a run's luck."""
        return 1.0 / self._noise_factor(ds_config, slots) - 1.0

    def metrics(
        self,
        ds_config: Mapping[str, Any],
        slots: int,
        noisy: bool = True,
        run_id: str | None = None,
    ) -> dict[str, float]:
        forward, backward, exposed, step = self.step_times(ds_config, slots)
        gas = int(ds_config.get("gradient_accumulation_steps", 1))
        mbs = int(ds_config["train_micro_batch_size_per_gpu"])
        factor = self._noise_factor(ds_config, slots, run_id) if noisy else 1.0
        # With accumulation, every micro-step computes; ZeRO-0 and -1 reduce the gradients once,
        # at the optimizer step, while ZeRO-2 reduces (and ZeRO-3 also gathers) at every one. A
        # micro-step's backward carries its share of that communication.
        communications = gas if int(_zero(ds_config).get("stage", 0)) >= 2 else 1
        forward *= factor
        backward = (backward + exposed * (communications / gas)) * factor
        step *= factor
        latency = (forward + backward) * gas + step
        return {
            "fwd": forward * 1e6,  # µs, as DeepSpeed reports a pass; the latency in ms
            "bwd": backward * 1e6,
            "step": step * 1000,
            "latency": latency * 1000,
            "throughput": mbs * gas * slots / latency,
            "FLOPS_per_gpu": self.flops_per_sample * mbs * gas / latency,
        }

    def runs_out_of_memory(self, peak: float, key: list[Any], run_id: str | None) -> bool:
        """Whether a run that needs ``peak`` bytes fails: always above the usable memory, by
        chance in the band below it (a run without an id draws the same every time)."""
        if peak > self.oom_bytes:
            return True
        if peak <= self.never_oom_bytes:
            return False
        chance = (peak - self.never_oom_bytes) / (self.oom_bytes - self.never_oom_bytes)
        draw, _ = _uniforms(*key, "oom", run_id)
        return draw <= chance

    # ---------------------------------------------------------------- the performance function

    def __call__(
        self, ds_config: Mapping[str, Any], slots: int, run_id: str | None = None
    ) -> dict[str, Any]:
        if is_model_profile(ds_config):
            at_one = {**ds_config, "train_micro_batch_size_per_gpu": 1}
            if self.profile_can_oom and self.memory_bytes(at_one, slots) > self.oom_bytes:
                raise MemoryError(f"{self.name}: out of memory in the model profile")
            profile = self.profile()
            return {**dataclasses.asdict(profile), "seconds": self.startup_seconds}
        peak = self.memory_bytes(ds_config, slots)
        if self.runs_out_of_memory(peak, self._key(ds_config, slots), run_id):
            raise MemoryError(f"{self.name}: out of memory")
        result: dict[str, Any] = self.metrics(ds_config, slots, run_id=run_id)
        # A real trial reports its peak and its device's memory (dsat.training.step_clock); the
        # hand-over reads them (--memory-margin, the confirmation round's headroom preference).
        result["memory_peak_bytes"] = peak
        result["memory_total_bytes"] = self.gpu_mem
        result["device_peak_flops"] = self.peak_flops  # as a trial on a known GPU reports it
        result["seconds"] = self.startup_seconds + self.profiled_steps * result["latency"] / 1000
        return result


def configurations(
    stages: tuple[int, ...], offload: bool = False, hidden: int = 0
) -> list[dict[str, Any]]:
    """Every ``zero_optimization`` section the search space holds for ``stages`` (with
    ``offload``, each with every offload it may take; given the model's ``hidden`` size,
    ZeRO-3's own knobs on their ladders, which guided steps)."""
    sections: list[dict[str, Any]] = []
    for stage in stages:
        knobs = zero_knobs(stage)
        if stage == 3 and hidden:
            knobs.update(stage3_ladders(hidden))
        for values in itertools.product(*knobs.values()):
            section = {"stage": stage, **dict(zip(knobs, values, strict=True))}
            for variant in offload_choices(stage, 0) if offload else [{}]:
                sections.append({**section, **variant})
    return sections


def optimum(
    model: PerformanceModel,
    slots: int,
    metric_key: str,
    smaller_is_better: bool,
    stages: tuple[int, ...] = (0, 1, 2, 3),
    base: Mapping[str, Any] | None = None,
    memory_margin: float = 0.0,
    global_batch: int | None = None,
    offload: bool = False,
) -> tuple[float, dict[str, Any]]:
    """The best noise-free metric over the whole search space among configurations that never
    run out of memory, and the config that reaches it.

    Without memory pressure or aligned micro-batches, throughput and FLOPS only grow with the
    micro-batch in these models and times only shrink as it falls, so each ZeRO configuration is
    evaluated at its largest safe micro-batch and at 1 (tests check that property on sampled
    configurations); otherwise at every micro-batch that fits. With ``memory_margin``, only
    configurations that also leave that fraction of the device free count: the best a search
    could safely hand over. With ``global_batch``, only the micro-batches that keep it, each
    with the accumulation that makes it up (all of them are evaluated). With ``offload``, also
    every configuration with the optimizer's states, or the parameters too, on the CPU.
    """
    best_value: float | None = None
    best_config: dict[str, Any] = {}
    every = bool(model.pressure_slowdown or model.aligned_speedups)
    for section in configurations(stages, offload, model.hidden):
        config = {**(base or {}), "zero_optimization": section, "train_micro_batch_size_per_gpu": 1}
        largest = model.max_micro_batch(config, slots, memory_margin)
        if largest == 0:
            continue
        sizes: list[int] = list(range(1, largest + 1)) if every else sorted({1, largest})
        if global_batch is not None:
            sizes = [m for m in micro_batches_for(global_batch, slots) if m <= largest]
        for mbs in sizes:
            candidate = {**config, "train_micro_batch_size_per_gpu": mbs}
            if global_batch is not None:
                candidate["train_batch_size"] = global_batch
                candidate["gradient_accumulation_steps"] = global_batch // (slots * mbs)
            value = model.metrics(candidate, slots, noisy=False)[metric_key]
            better = best_value is None or (
                value < best_value if smaller_is_better else value > best_value
            )
            if better:
                best_value, best_config = value, candidate
    if best_value is None:
        raise ValueError(f"{model.name}: no configuration fits on {slots} slots")
    return best_value, best_config
