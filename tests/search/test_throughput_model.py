"""The denoised estimate: neighbouring trials of a stage pull a lucky measurement back."""

from __future__ import annotations

import dataclasses

import pytest

from dsat.search.throughput_model import Observation, estimate


def throughput(mbs: int, overhead: float = 4.0) -> float:
    """A step's time grows linearly with the micro-batch: throughput = mbs / (overhead + mbs)."""
    return mbs / (overhead + mbs)


def curve(
    config: str, sizes: range, factor: float = 1.0, settings: tuple[str, ...] = ()
) -> list[Observation]:
    return [Observation(config, 2, m, factor * throughput(m), settings) for m in sizes]


def test_a_noise_free_curve_is_reproduced() -> None:
    observations = curve("a", range(4, 21, 2))
    for m in (4, 10, 20):
        assert estimate(observations, "a", m) == pytest.approx(throughput(m), rel=0.002)


def test_a_lucky_measurement_is_pulled_towards_its_neighbours() -> None:
    observations = curve("a", range(4, 21, 2))
    lucky = Observation("a", 2, 15, throughput(15) * 1.03)
    found = estimate([*observations, lucky], "a", 15)
    assert found is not None and found < throughput(15) * 1.012


def test_a_configuration_seen_at_many_micro_batches_keeps_its_own_level() -> None:
    observations = curve("a", range(4, 21, 2)) + curve(
        "b", range(6, 21, 4), factor=1.06, settings=("overlap",)
    )
    found = estimate(observations, "b", 14)
    assert found is not None and found > throughput(14) * 1.05


def test_a_setting_is_learnt_from_every_configuration_that_has_it() -> None:
    """``overlap`` is 6% faster in two configurations: a third tried once with it is pulled much
    of the way to that level, though its own trial measured 2% less (unlucky); one without it
    towards the stage's level, though its trial measured 3% more (lucky)."""
    observations = [
        *curve("a", range(4, 21, 2)),
        *curve("b", range(6, 21, 4), factor=1.06, settings=("overlap",)),
        *curve("c", range(5, 21, 5), factor=1.06, settings=("overlap", "rb5e7")),
        Observation("d", 2, 16, throughput(16) * 1.06 * 0.98, ("overlap", "rb5e7")),
        Observation("e", 2, 16, throughput(16) * 1.03, ()),
    ]
    unlucky = estimate(observations, "d", 16)
    assert unlucky is not None
    assert unlucky - observations[-2].value > 0.4 * throughput(16) * 1.06 * 0.02
    lucky = estimate(observations, "e", 16)
    assert lucky is not None and lucky < throughput(16) * 1.015
    # Without the settings, each configuration keeps more of its own trial's luck.
    bare = [dataclasses.replace(o, settings=()) for o in observations]
    assert (estimate(bare, "e", 16) or 0.0) > lucky


def test_a_configuration_tried_once_is_pulled_towards_its_stage() -> None:
    observations = [*curve("a", range(4, 21, 2)), Observation("b", 2, 16, throughput(16) * 1.03)]
    found = estimate(observations, "b", 16)
    assert found is not None and throughput(16) < found < throughput(16) * 1.03


def test_other_stages_do_not_count() -> None:
    observations = [*curve("a", range(4, 21, 2)), Observation("z3", 3, 16, 5.0)]
    assert estimate(observations, "z3", 16) == pytest.approx(5.0)
    assert estimate(observations, "a", 16) == pytest.approx(throughput(16), rel=0.002)


def test_nothing_to_say_of_an_untried_configuration() -> None:
    assert estimate(curve("a", range(4, 21, 2)), "b", 8) is None


def test_an_aligned_micro_batch_keeps_its_own_level() -> None:
    """Micro-batches divisible by 8 run 5% faster (tensor-core tiles): the estimate keeps that,
    where a smooth curve would pool it away with the neighbours."""
    bump = {m: 1.05 if m % 8 == 0 else 1.0 for m in range(100, 141)}
    observations = [Observation("a", 2, m, bump[m] * throughput(m)) for m in range(100, 141, 3)]
    observations += [Observation("a", 2, m, bump[m] * throughput(m)) for m in (104, 112, 128)]
    aligned = estimate(observations, "a", 128)
    plain = estimate(observations, "a", 127)
    assert aligned is not None and plain is not None
    assert aligned > 1.03 * plain
    assert aligned == pytest.approx(1.05 * throughput(128), rel=0.015)


def test_an_estimate_follows_a_changed_measurement_though_fits_are_reused() -> None:
    """The fit is worked out once per neighbourhood: a measurement that changes (a confirmation
    run averaged in) changes the neighbourhood, and so the estimate."""
    observations = curve("a", range(4, 21, 2))
    before = estimate(observations, "a", 12)
    raised = [
        dataclasses.replace(o, value=o.value * 1.1) if o.mbs == 12 else o for o in observations
    ]
    after = estimate(raised, "a", 12)
    assert before is not None and after is not None and after > before
    assert estimate(observations, "a", 12) == before
