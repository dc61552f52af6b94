"""Tokens/s and MFU of a trial: how users compare training runs (torchtitan, NeMo), worked out
from what a trial measured (samples/s, achieved FLOPS per GPU) and what the search knows.

The sequence length comes from ``--seq-len``, a hyperparameter that names it, or the
entrypoint's flag (HF's ``--max_seq_length``/``--block_size``); the device's
peak from ``--peak-tflops``, or what the trial reported for its GPU (dsat.device_peaks).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from dsat.experiment.config import entrypoint_flag
from dsat.experiment.metric import positive_number

# What ``derived`` adds to a trial's metrics: worked out from them, not measured.
TOKENS_KEY = "tokens_per_second"
MFU_KEY = "mfu"
# The peak ``mfu`` is against: --peak-tflops where given, which the trial's own
# ``device_peak_flops`` (its GPU's in dsat's table) beside it would not say.
MFU_PEAK_KEY = "mfu_peak_flops"
DERIVED_KEYS = (TOKENS_KEY, MFU_KEY, MFU_PEAK_KEY)
# Hyperparameters that name the sequence length, in the spellings training scripts use.
SEQ_LEN_KEYS = ("seq_len", "seq_length", "sequence_length", "max_seq_length", "block_size")
# Entrypoint flags that do (HF's example scripts: --max_seq_length, --block_size).
SEQ_LEN_FLAGS = tuple(f"--{key}" for key in SEQ_LEN_KEYS) + tuple(
    f"--{key.replace('_', '-')}" for key in SEQ_LEN_KEYS if "_" in key
)


@dataclasses.dataclass(frozen=True)
class Utilization:
    seq_len: int | None = None  # tokens per sample
    peak_flops: float | None = None  # per GPU per second (--peak-tflops); else the trial's

    @classmethod
    def of(
        cls,
        hparams: Mapping[str, Any],
        seq_len: int | None,
        peak_tflops: float | None,
        entrypoint: str | Sequence[str] | None = None,
    ) -> Utilization:
        """From dsat's flags, else the experiment's hyperparameters, else its entrypoint's."""
        if seq_len is None:
            found = [positive_number(hparams.get(key)) for key in SEQ_LEN_KEYS]
            given = entrypoint_flag(entrypoint, SEQ_LEN_FLAGS)
            if given is not None and given.isdigit():
                found.append(positive_number(int(given)))
            seq_len = next((int(v) for v in found if v is not None), None)
        return cls(seq_len, None if peak_tflops is None else peak_tflops * 1e12)

    def derived(self, metrics: Mapping[str, Any], flops: float | None = None) -> dict[str, float]:
        """``tokens_per_second`` (of the whole trial) and ``mfu`` (a fraction), where known;
        ``flops``: its FLOPS_per_gpu counting the model once (TrialTracker.model_flops), else
        the trial's own."""
        found: dict[str, float] = {}
        throughput = positive_number(metrics.get("throughput"))
        if self.seq_len and throughput is not None:
            found[TOKENS_KEY] = throughput * self.seq_len
        flops = positive_number(metrics.get("FLOPS_per_gpu")) if flops is None else flops
        peak = self.peak_flops or positive_number(metrics.get("device_peak_flops"))
        if flops is not None and peak:
            found[MFU_KEY] = flops / peak
            found[MFU_PEAK_KEY] = peak
        return found

    def line(
        self,
        metrics: Mapping[str, Any],
        flops: float | None = None,
        gpus: int = 1,
        runs: int = 1,
    ) -> str:
        """The summary's line on the handed-over configuration (``metrics`` the mean of its
        ``runs``, on ``gpus`` per trial); empty when neither is known. Tokens/s is the trial's
        whole and per GPU: torchtitan reports it per GPU, a trial's throughput is its whole."""
        found = self.derived(metrics, flops)
        parts = []
        if TOKENS_KEY in found:
            tokens = found[TOKENS_KEY]
            each = f", {tokens / gpus:.4g} per GPU" if gpus > 1 else ""
            parts.append(f"{tokens:.4g} tokens/s (sequence {self.seq_len}{each})")
        if MFU_KEY in found:
            peak = found[MFU_PEAK_KEY]
            parts.append(f"MFU {found[MFU_KEY]:.1%} of {peak / 1e12:.4g} TFLOPS per GPU")
        if not parts:
            return ""
        over = f" (the mean of its {runs} runs)" if runs > 1 else ""
        return f"handed-over throughput{over}: {', '.join(parts)}"
