import math

import pytest

from gyre_core.evaluation import Z95, paired, paired_difference, summarize


def test_paired_difference_by_hand():
    before = [1, 0, 0, 1, 0]
    after = [1, 1, 0, 1, 1]
    # d = [0, 1, 0, 0, 1]: mean 0.4, sample variance = (3·0.16 + 2·0.36)/4 = 0.3
    d = paired_difference(before, after)
    assert d.mean == pytest.approx(0.4)
    assert d.se == pytest.approx(math.sqrt(0.3 / 5))
    assert d.ci95_low == pytest.approx(0.4 - 1.959963984540054 * math.sqrt(0.06))
    assert d.ci95_high == pytest.approx(0.4 + 1.959963984540054 * math.sqrt(0.06))


def test_paired_partial_score_by_hand():
    before = summarize("before", "sampled", [4, 5, 6], [False, True, False], [0.2, 1.0, 0.1], [9, 3, 9])
    after = summarize("after", "sampled", [4, 5, 6], [False, True, False], [0.4, 1.0, 0.4], [9, 2, 9])
    # d = [0.2, 0, 0.3]: mean 1/6, sample variance ((1/30)² + (1/6)² + (2/15)²)/2 = 7/300
    d = paired(before, after, "partial")
    assert d.mean == pytest.approx(1 / 6)
    assert d.ci95_high == pytest.approx(1 / 6 + 1.959963984540054 * math.sqrt(7 / 300 / 3))
    assert paired(before, after).mean == 0.0                 # the same successes: no success difference
    with pytest.raises(ValueError, match="metric"):
        paired(before, after, "turns")


def test_paired_refuses_different_seeds():
    a = summarize("before", "sampled", [1, 2], [True, False], [1.0, 0.2], [3, 9])
    b = summarize("after", "sampled", [1, 3], [True, True], [1.0, 1.0], [3, 4])
    with pytest.raises(ValueError, match="different seeds"):
        paired(a, b)
    assert a.success == 0.5 and a.partial == pytest.approx(0.6) and a.mean_turns == 6


def test_success_interval_is_wilsons():
    from gyre_core.evaluation import success_interval

    z2 = 1.959963984540054 ** 2
    half = success_interval(8, 16)            # p̂ = 1/2: centred, half-width z/(1+z²/n)·√(1/64 + z²/1024)
    assert half.rate == 0.5 and half.ci95_low + half.ci95_high == pytest.approx(1.0)
    assert half.ci95_high - 0.5 == pytest.approx(1.959963984540054 / (1 + z2 / 16) * math.sqrt(1 / 64 + z2 / 1024))
    assert (round(half.ci95_low, 4), round(half.ci95_high, 4)) == (0.28, 0.72)          # textbook table value
    none, every = success_interval(0, 16), success_interval(16, 16)
    assert none.ci95_low == 0.0 and none.ci95_high == pytest.approx(z2 / (16 + z2))     # not empty at 0/n
    assert every.ci95_high == 1.0 and every.ci95_low == pytest.approx(16 / (16 + z2))
    one = success_interval(1, 10)
    assert (round(one.ci95_low, 4), round(one.ci95_high, 4)) == (0.0179, 0.4042)
    with pytest.raises(ValueError):
        success_interval(3, 2)


def test_paired_success_uses_agresti_min_and_never_collapses():
    from gyre_core.evaluation import paired_binary

    # 3/100 before and after, on the same seeds: no discordant pair. By hand: m = 102, p_gain = p_loss = 0.5/102,
    # centre 0, se = sqrt((1/102) / 102) = 1/102; the interval ±1.96/102 (±1.92 points), not [0, 0]
    same = [1, 1, 1] + [0] * 97
    d = paired_binary(same, same)
    assert d.mean == 0.0
    assert d.ci95_low == pytest.approx(-Z95 / 102) and d.ci95_high == pytest.approx(Z95 / 102)
    assert paired_difference(same, same).ci95_high == 0.0          # what the plain interval said
    # 5 seeds, one gained and none lost: m = 7, p_gain = 1.5/7, p_loss = 0.5/7, centre 1/7,
    # var = (2/7 − 1/49)/7 = 13/343
    d = paired_binary([1, 0, 0, 1, 0], [1, 1, 0, 1, 0])
    assert d.mean == pytest.approx(0.2)
    assert d.se == pytest.approx(math.sqrt(13 / 343))
    assert d.ci95_low == pytest.approx(1 / 7 - Z95 * math.sqrt(13 / 343))
    # many seeds: within 0.1 points of the plain interval
    rng = __import__("random").Random(0)
    b = [int(rng.random() < 0.4) for _ in range(1000)]
    a = [x if rng.random() < 0.8 else 1 - x for x in b]
    adj, plain = paired_binary(b, a), paired_difference(b, a)
    assert abs(adj.ci95_low - plain.ci95_low) < 1e-3 and abs(adj.ci95_high - plain.ci95_high) < 1e-3
    with pytest.raises(ValueError, match="0 or 1"):
        paired_binary([2], [1])
