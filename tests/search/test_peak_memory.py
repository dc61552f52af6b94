"""Where a configuration stops leaving the memory margin free, from measured peaks."""

from __future__ import annotations

from dsat.search.peak_memory import bytes_per_sample, largest_within


def test_one_more_sample_costs_the_median_slope_of_the_configurations_peaks() -> None:
    linear = {2: 1200.0, 6: 1600.0, 4: 1400.0}  # 100 a sample
    steeper = {1: 1000.0, 3: 1300.0}  # 150 a sample
    steepest = {1: 500.0, 2: 700.0}  # 200 a sample
    assert bytes_per_sample([linear]) == 100.0
    assert bytes_per_sample([linear, steeper, steepest]) == 150.0
    assert bytes_per_sample([{4: 1000.0}]) is None  # one trial says nothing of the slope
    assert bytes_per_sample([]) is None
    assert bytes_per_sample([{1: 900.0, 2: 900.0}]) is None  # flat: nothing to go on


def test_the_largest_micro_batch_within_the_limit() -> None:
    assert largest_within(4, 1400.0, 100.0, 1900.0) == 9  # 1400 + 5 x 100 = 1900: exactly
    assert largest_within(4, 1400.0, 100.0, 1899.0) == 8
    assert largest_within(8, 2000.0, 100.0, 1900.0) == 7  # over already: below it
