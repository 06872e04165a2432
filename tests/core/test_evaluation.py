import math

import pytest

from gyre_core.evaluation import paired, paired_difference, summarize


def test_paired_difference_by_hand():
    before = [1, 0, 0, 1, 0]
    after = [1, 1, 0, 1, 1]
    # d = [0, 1, 0, 0, 1]: mean 0.4, sample variance = (3·0.16 + 2·0.36)/4 = 0.3
    d = paired_difference(before, after)
    assert d.mean == pytest.approx(0.4)
    assert d.se == pytest.approx(math.sqrt(0.3 / 5))
    assert d.ci95_low == pytest.approx(0.4 - 1.959963984540054 * math.sqrt(0.06))
    assert d.ci95_high == pytest.approx(0.4 + 1.959963984540054 * math.sqrt(0.06))


def test_paired_refuses_different_seeds():
    a = summarize("before", "sampled", [1, 2], [True, False], [1.0, 0.2], [3, 9])
    b = summarize("after", "sampled", [1, 3], [True, True], [1.0, 1.0], [3, 4])
    with pytest.raises(ValueError, match="different seeds"):
        paired(a, b)
    assert a.success == 0.5 and a.partial == pytest.approx(0.6) and a.mean_turns == 6
