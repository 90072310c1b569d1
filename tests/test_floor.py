"""Paired-bootstrap quality floor and flip counting on synthetic per-item data."""
import numpy as np
import pytest

from evals.floor import Floor, check_floor, count_flips
from runtime.errors import UserError


def _pair(n, p_ref, p_test, seed):
    rng = np.random.default_rng(seed)
    ref = rng.random(n) < p_ref
    test = ref.copy()
    flip = rng.random(n) < abs(p_test - p_ref) / max(1 - p_ref if p_test > p_ref else p_ref, 1e-9)
    test[flip & (ref if p_test < p_ref else ~ref)] = p_test > p_ref
    return test.astype(float), ref.astype(float)


def test_clearly_better_passes_and_clearly_worse_fails():
    better, ref = _pair(1000, 0.5, 0.6, 0)
    worse, ref2 = _pair(1000, 0.5, 0.4, 1)
    assert check_floor(better, ref, Floor(0.99)).passed
    assert not check_floor(worse, ref2, Floor(0.99)).passed


def test_identical_passes_relative_floor_of_one():
    _, ref = _pair(300, 0.5, 0.5, 2)
    res = check_floor(ref, ref, Floor(1.0))
    assert res.passed and res.delta == 0 and res.flips.total == 0 and res.delta_ci == (0.0, 0.0)


def test_absolute_floor():
    test, ref = _pair(2000, 0.5, 0.5, 3)
    assert check_floor(test, ref, Floor(0.45, relative=False), n_boot=2000).passed
    assert not check_floor(test, ref, Floor(0.55, relative=False), n_boot=2000).passed


def binomial_band(rate: float, trials: int, sigmas: float = 3.0) -> tuple[float, float]:
    half = sigmas * np.sqrt(rate * (1 - rate) / trials)
    return rate - half, rate + half


def test_ci_covers_true_difference_at_nominal_rate():
    """300 seeded trials: the 90% interval of Δ covers the true Δ at 0.9 within 3 binomial sigmas (±0.052)."""
    rng = np.random.default_rng(4)
    true_delta, covered, trials = -0.03, 0, 300
    for i in range(trials):
        ref = rng.random(400) < 0.6
        lose = rng.random(400) < 0.1  # E[Δ] = -0.6 * 0.1 + 0.4 * 0.075 = -0.03
        gain = rng.random(400) < 0.075
        test = (ref & ~lose) | (~ref & gain)
        res = check_floor(test, ref, Floor(1.0), confidence=0.9, n_boot=1000, seed=i)
        covered += res.delta_ci[0] <= true_delta <= res.delta_ci[1]
    lo, hi = binomial_band(0.9, trials)
    assert lo <= covered / trials <= hi, covered / trials


def test_pass_rate_exactly_at_the_floor_is_the_one_sided_level():
    """A configuration exactly at a relative floor of 0.9 (each reference-correct item kept with probability 0.9,
    400 items, ~24 expected losses) passes only when the 95% interval's lower bound is >= 0: one-sided level
    2.5%. Over 600 seeded repetitions the pass rate must lie within 3 binomial sigmas of it ([0.6%, 4.4%]); just
    above the floor (keep 0.96) it must pass far more often and just below (0.84) never.

    Not covered: with few expected losses (floor 0.98 on 200 items, ~2.4 expected losses) the percentile
    bootstrap passes ~7.5% at the floor: ~9% of such samples contain no loss at all and show no variability."""
    rng = np.random.default_rng(11)

    def pass_rate(keep, trials):
        passed = 0
        for i in range(trials):
            ref = rng.random(400) < 0.6
            test = ref & (rng.random(400) < keep)  # E[acc_test] = keep * E[acc_ref]
            passed += check_floor(test, ref, Floor(0.9), confidence=0.95, n_boot=1000, seed=i).passed
        return passed / trials

    lo, hi = binomial_band(0.025, 600)
    assert lo <= pass_rate(0.9, 600) <= hi
    assert pass_rate(0.96, 100) > 0.5 and pass_rate(0.84, 100) == 0


def test_seeded_and_reproducible():
    test, ref = _pair(500, 0.5, 0.48, 5)
    assert check_floor(test, ref, Floor(0.99), seed=7) == check_floor(test, ref, Floor(0.99), seed=7)


def test_flips_show_what_accuracy_hides():
    ref = np.array([1, 1, 1, 0, 0, 0, 1, 0])
    test = np.array([0, 0, 1, 1, 1, 0, 1, 0])
    flips = count_flips(test, ref)
    assert (flips.lost, flips.gained, flips.total) == (2, 2, 4)
    assert check_floor(test, ref, Floor(1.0)).delta == 0


@pytest.mark.parametrize("text", ["0", "1.5", "-0.2", "abs:1.2", "nope"])
def test_bad_floors(text):
    with pytest.raises(UserError):
        Floor.parse(text)


def test_floor_parse():
    assert Floor.parse("0.99") == Floor(0.99, True)
    assert Floor.parse("abs:0.4") == Floor(0.4, False)
    assert Floor.parse(None) is None
