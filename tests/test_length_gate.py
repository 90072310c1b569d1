"""The output-length gate: a paired interval of the ratio of mean lengths decides pass / fail, or says undecidable."""
import numpy as np
import pytest

from studies.length_gate import decide_length, ratio_interval

BAND = (0.9, 1.1)


def delta_interval(c, r):
    """The linearised (delta-method) interval of a ratio of paired means: the negative control."""
    from scipy.stats import t

    c, r = np.asarray(c, float), np.asarray(r, float)
    ratio = c.mean() / r.mean()
    half = t.ppf(0.975, len(c) - 1) * (c - ratio * r).std(ddof=1) / (np.sqrt(len(c)) * r.mean())
    return ratio - half, ratio + half


def test_one_prompt_decides_nothing():
    """The demo's defect: the reference's one prompt ended at 60 tokens (a bf16 kernel near-tie), a quantized point's
    at 124; the old one-prompt rule failed it at 2.07x. One prompt gives no interval: undecidable, not enforced."""
    verdict = decide_length([124], [60], BAND)
    assert verdict.ratio == pytest.approx(124 / 60) and verdict.ratio_ci is None
    assert verdict.verdict == "undecidable" and verdict.constraint is None
    assert max(BAND[0] - verdict.ratio, verdict.ratio - BAND[1]) > 0  # negative control: the old rule's fail


def test_four_prompts_that_each_ran_far_longer_decide_it():
    """The demo's w4g32 point on its four length prompts: 128 tokens each (never an end of turn) where the reference
    ended at 60, 18, 43 and 91. Fieller's interval lies above the band: fail. Negative control: the delta-method
    interval around 2.4x, whose residuals swing both ways, straddles the band and decides nothing."""
    counts, reference = [128] * 4, [60, 18, 43, 91]
    verdict = decide_length(counts, reference, BAND)
    assert verdict.verdict == "fail" and verdict.ratio_ci[0] > BAND[1] and verdict.constraint > 0
    lo, hi = delta_interval(counts, reference)
    assert lo < BAND[0] and hi > BAND[1]


def test_prompts_that_agree_decide_both_ways():
    longer = decide_length([120, 126, 110, 128], [60, 63, 55, 64], BAND)  # every prompt twice as long
    assert longer.verdict == "fail" and longer.ratio_ci == pytest.approx((2.0, 2.0)) and longer.constraint > 0
    assert longer.constraint == pytest.approx(2.0 - BAND[1])
    close = decide_length([101, 99, 100, 100, 102, 98], [100, 100, 100, 100, 100, 100], BAND)
    assert close.verdict == "pass" and BAND[0] <= close.ratio_ci[0] <= close.ratio_ci[1] <= BAND[1]
    assert close.constraint <= 0


def test_prompts_that_disagree_are_undecidable_and_the_band_off_enforces_nothing():
    mixed = decide_length([124, 60, 128, 90], [60, 124, 128, 95], BAND)
    assert mixed.verdict == "undecidable" and mixed.ratio_ci[0] < BAND[0] and mixed.ratio_ci[1] > BAND[1]
    off = decide_length([120, 126, 110, 128], [60, 63, 55, 64], None)
    assert off.verdict == "off" and off.constraint is None and off.band is None


def test_identical_outputs_pass_on_any_number_of_prompts():
    same = decide_length([60], [60], BAND, identical=True)
    assert same.verdict == "pass" and same.ratio == 1.0 and same.constraint == pytest.approx(-0.1)
    assert decide_length([60], [60], BAND).verdict == "undecidable"  # equal counts by chance prove nothing


def test_the_interval_holds_its_level_on_few_prompts():
    """Paired lengths with a true ratio of 1 (prompt-to-prompt spread, per-config noise): Fieller's interval covers 1
    in 95-98% of draws at 4 and 8 prompts (an unbounded set, undecidable, counts as covering: about a fifth of the
    draws at 4 prompts, none at 8); negative control: the delta-method interval covers it in under 93% at 4."""
    rng = np.random.default_rng(0)
    draws = [(base * rng.lognormal(0, 0.3, n), base * rng.lognormal(0, 0.3, n))
             for n in (4, 8) for base in [rng.uniform(40, 250, n) for _ in range(3000)]]

    def coverage(n, interval):
        hits = [interval(c, r) for c, r in draws if len(c) == n]
        return np.mean([ci is None or ci[0] <= 1.0 <= ci[1] for ci in hits])

    fieller = lambda c, r: ratio_interval(list(c), list(r))[1]  # noqa: E731
    assert 0.95 <= coverage(4, fieller) <= 0.98 and 0.95 <= coverage(8, fieller) <= 0.98
    assert coverage(4, delta_interval) < 0.93
