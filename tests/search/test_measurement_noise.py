"""How noisy a measurement is, as a search saw it: the prior until trials say otherwise."""

from __future__ import annotations

import math

import pytest

from dsat.search.measurement_noise import PRIOR_NOISE, noise_scale, relative_noise, repeat_spread


def test_with_nothing_seen_the_prior() -> None:
    assert relative_noise([]) == pytest.approx(PRIOR_NOISE)


def test_repeats_that_differ_by_3_percent_raise_it() -> None:
    repeats = [[1.0, 1.0 * math.exp(0.06 * sign)] for sign in (1, -1)] * 10
    noise = relative_noise([], repeats)
    assert 0.035 < noise < 0.045  # a run differing by 6% in log from its pair: about 4% a run
    assert noise_scale(noise) > 2


def test_repeats_that_agree_lower_it_but_not_to_nothing() -> None:
    noise = relative_noise([], [[2.0, 2.0, 2.0]] * 4)
    assert 0.0 < noise < PRIOR_NOISE
    assert noise_scale(noise) == 1.0  # never narrower than on a quiet machine


def test_the_spread_of_repeats_alone_has_no_prior() -> None:
    assert repeat_spread([[2.0, 2.0], [3.0, 3.0, 3.0]]) == 0.0  # a quiet machine: nothing
    assert repeat_spread([[1.0], []]) is None  # nothing ran twice
    spread = repeat_spread([[1.0, math.exp(0.02)], [5.0, 5.0 * math.exp(-0.02)]])
    # Four runs, each 1% (in log) off its pair's mean; two degrees of freedom.
    assert spread == pytest.approx(math.sqrt(4 * 0.01**2 / 2))


def test_residuals_from_the_estimate_count() -> None:
    quiet = relative_noise([(1.0, 1.0)] * 20)
    noisy = relative_noise([(1.03, 1.0), (0.97, 1.0)] * 10)
    assert quiet < PRIOR_NOISE < noisy
