"""A denoised estimate of each tried configuration's metric, pooling its neighbours' trials.

One short trial measures a configuration with a percent or two of noise, and the luckiest of
dozens of trials is typically two or three percent above its true value: picking (or stopping on)
the best single measurement picks the luckiest one. Neighbouring trials carry information about
each other: within a ZeRO stage the metric is a smooth function of the micro-batch, and the knobs
(bucket sizes, switches) shift it by a roughly constant factor, each setting by its own. So every
trial of a stage is fitted together, in log space, locally around the micro-batch being estimated:

    log y = a + b u + c u^2 + sum_s f_s + e_config + sum_k g_k [mbs divisible by k],

with u = log(mbs / mbs_0), weighted by a kernel in u, and a ridge on the curvature ``c``, on each
knob setting's effect ``f_s`` (``rb5e7``, ``overlap``: every configuration with that setting
informs it, so a configuration tried once borrows its level from the others that share its
settings), on what is a configuration's own beyond its settings, ``e`` (small: one lucky trial
keeps little of its luck; a configuration tried at many micro-batches keeps its own level), and
on each alignment's ``g``: on real GPUs micro-batches divisible by 8, 16, 32 or 64 fill
tensor-core tiles and can run several percent faster than their neighbours, which a smooth curve
would pool away. The estimate at (configuration, mbs_0) is ``a``, its settings' ``f``, its ``e``
and the alignments mbs_0 has.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Hashable, Sequence

import numpy as np

# Kernel width in log micro-batch: trials within about +-30% of a micro-batch inform it most.
BANDWIDTH = 0.3
# Prior spreads, in units of one measurement's noise: how far a configuration's level may sit from
# its stage's (knob effects of a few percent against about 1.5% of noise); where the observations
# say what each configuration sets, how far a setting may move the level and how far a
# configuration may sit from what its settings say; and how curved the curve may be (log-log
# curvature; a saturating throughput has at most 1/8).
EFFECT_SPREAD = 2.0
SETTING_SPREAD = 2.0
BEYOND_SETTINGS_SPREAD = 0.5
CURVATURE_SPREAD = 10.0
SLOPE_SPREAD = 100.0
# An alignment's effect, like a configuration's: a few percent at most, worth fitting only where
# both aligned and unaligned micro-batches ran.
ALIGN_SPREAD = 2.0
ALIGNMENTS = (8, 16, 32, 64)
MIN_WEIGHT = 1e-3


def alignments(mbs: int) -> list[int]:
    """The tile sizes ``mbs`` is a multiple of."""
    return [k for k in ALIGNMENTS if mbs % k == 0]


@dataclasses.dataclass(frozen=True)
class Observation:
    """One measurement: a configuration (any hashable key), its stage group, micro-batch and the
    metric, oriented so that larger is better and positive; ``settings``: what the configuration
    sets apart from the defaults (zero_space.knob_tags), each assumed to act alike wherever it is
    set."""

    config: Hashable
    group: Hashable
    mbs: int
    value: float
    settings: tuple[str, ...] = ()


def estimate(observations: Sequence[Observation], config: Hashable, mbs: int) -> float | None:
    """The denoised metric of ``config`` at ``mbs`` (None when nothing of its group ran)."""
    group = next((o.group for o in observations if o.config == config), None)
    points = [o for o in observations if o.group == group and o.value > 0]
    if not points:
        return None
    near = tuple(o for o in points if _weight(o.mbs, mbs) >= MIN_WEIGHT)
    if not any(o.config == config for o in near):
        return None
    own = next(o.settings for o in points if o.config == config)
    return _fit(near, config, own, mbs)


def _weight(observed: int, mbs: int) -> float:
    return math.exp(-((math.log(observed / mbs) / BANDWIDTH) ** 2) / 2)


# A search asks again after each trial for the estimates of configurations whose neighbourhood
# that trial did not change: the fit is worked out once for each.
@functools.lru_cache(maxsize=4096)
def _fit(near: tuple[Observation, ...], config: Hashable, own: tuple[str, ...], mbs: int) -> float:
    """The estimate from the observations within the kernel, ``near``."""
    used = [(o, _weight(o.mbs, mbs)) for o in near]
    configs = sorted({o.config for o, _ in used}, key=repr)
    # A setting is fitted where some configurations have it and some do not.
    everywhere = {s for s in used[0][0].settings if all(s in o.settings for o, _ in used)}
    settings = sorted({s for o, _ in used for s in o.settings} - everywhere)
    own_spread = BEYOND_SETTINGS_SPREAD if settings else EFFECT_SPREAD
    # An alignment is fitted where some trials have it and some do not.
    tiles = [
        k
        for k in ALIGNMENTS
        if len({o.mbs % k == 0 for o, _ in used}) == 2 and any(o.mbs % k == 0 for o, _ in used)
    ]
    column = {c: 3 + i for i, c in enumerate(configs)}
    tile_column = {k: 3 + len(configs) + i for i, k in enumerate(tiles)}
    setting_column = {s: 3 + len(configs) + len(tiles) + i for i, s in enumerate(settings)}
    rows = np.zeros((len(used), 3 + len(configs) + len(tiles) + len(settings)))
    targets = np.zeros(len(used))
    sqrt_w = np.zeros(len(used))
    for i, (o, w) in enumerate(used):
        u = math.log(o.mbs / mbs)
        rows[i, :3] = (1.0, u, u * u)
        rows[i, column[o.config]] = 1.0
        for k in tiles:
            rows[i, tile_column[k]] = float(o.mbs % k == 0)
        for setting in o.settings:
            if setting in setting_column:
                rows[i, setting_column[setting]] = 1.0
        targets[i] = math.log(o.value)
        sqrt_w[i] = math.sqrt(w)
    # Ridge rows, in units of one measurement's noise: a prior of 0 with the given spread.
    priors = np.zeros((2 + len(configs) + len(tiles) + len(settings), rows.shape[1]))
    priors[0, 1] = 1.0 / SLOPE_SPREAD
    priors[1, 2] = 1.0 / CURVATURE_SPREAD
    for i in range(len(configs)):
        priors[2 + i, 3 + i] = 1.0 / own_spread
    for i, k in enumerate(tiles):
        priors[2 + len(configs) + i, tile_column[k]] = 1.0 / ALIGN_SPREAD
    for i, setting in enumerate(settings):
        priors[2 + len(configs) + len(tiles) + i, setting_column[setting]] = 1.0 / SETTING_SPREAD
    design = np.vstack([rows * sqrt_w[:, None], priors])
    rhs = np.concatenate([targets * sqrt_w, np.zeros(len(priors))])
    solution, *_ = np.linalg.lstsq(design, rhs, rcond=None)
    aligned = sum(solution[tile_column[k]] for k in tiles if mbs % k == 0)
    set_here = sum(solution[setting_column[s]] for s in own if s in setting_column)
    return float(math.exp(solution[0] + solution[column[config]] + aligned + set_here))
