"""Where guided starts ZeRO-3's own knobs: from the model's hidden size, as DeepSpeed's and HF's
guidance sets them (``stage3_prefetch_bucket_size`` 0.9 h^2, ``stage3_param_persistence_threshold``
10 h), on the ladders it then steps them along (zero_space.stage3_ladders).

The hidden size comes from the experiment's hyperparameters when a script names it (HF's
``hidden_size``, GPT-2's ``n_embd``, ``d_model``), else from the parameter count of the model
profile, for a decoder of the usual shape (about 12 h^2 parameters a layer, h / 128 layers).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dsat.zero_space import PREFETCH_SIZES

HIDDEN_SIZE_HPARAMS = ("hidden_size", "n_embd", "d_model", "hidden_dim")


def hidden_size(hparams: Mapping[str, Any], num_params: int) -> int:
    """The model's hidden size: the hyperparameter, else estimated from ``num_params``."""
    for key in HIDDEN_SIZE_HPARAMS:
        value = hparams.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return int(value)
    estimate = float((128 * max(num_params, 1) / 12) ** (1 / 3))
    return max(64, round(estimate / 64) * 64)


def _nearest(value: float, ladder: tuple[Any, ...]) -> Any:
    """The rung nearest ``value`` by ratio (the ladder is logarithmic)."""
    return min(ladder, key=lambda rung: max(rung / value, value / rung))


def stage3_start(hidden: int) -> dict[str, Any]:
    """ZeRO-3's knobs from the hidden size: the prefetch bucket's rung nearest 0.9 h^2, the
    persistence threshold at 10 h (a rung of its own ladder)."""
    return {
        "stage3_prefetch_bucket_size": _nearest(0.9 * hidden * hidden, PREFETCH_SIZES),
        "stage3_param_persistence_threshold": 10 * hidden,
    }
