from stats import mean, median


def test_mean():
    assert mean([1, 2, 3]) == 2


def test_median_odd():
    assert median([3, 1, 2]) == 2


def test_median_even():
    assert median([4, 1, 3, 2]) == 2.5
    assert median([10, 20]) == 15


def test_median_single_and_unsorted():
    assert median([7]) == 7
    assert median([5, -1, 9, 3, 3, 8]) == 4
