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


def test_ci_covers_true_difference_at_nominal_rate():
    rng = np.random.default_rng(4)
    true_delta, covered, trials = -0.03, 0, 60
    for i in range(trials):
        ref = rng.random(400) < 0.6
        lose = rng.random(400) < 0.1  # E[Δ] = -0.6 * 0.1 + 0.4 * 0.075 = -0.03
        gain = rng.random(400) < 0.075
        test = (ref & ~lose) | (~ref & gain)
        res = check_floor(test, ref, Floor(1.0), confidence=0.9, n_boot=2000, seed=i)
        covered += res.delta_ci[0] <= true_delta <= res.delta_ci[1]
    assert covered / trials >= 0.8  # nominal 0.9; percentile bootstrap is slightly anti-conservative


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
