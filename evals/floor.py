"""The quality floor: a paired score interval over items decides whether a configuration is good enough.

Definition (per task, items scored 0/1 by both the test configuration and the unquantized reference on the
same documents):

* relative floor ``f`` in (0, 1]: margin m = acc_test - f * acc_ref;
* absolute floor ``a`` in [0, 1]: margin m = acc_test - a.

The interval of m is a **score interval** (``score_interval``): each item's m takes one of four values (the
cells test/ref correct/wrong); for a candidate mean θ0 the cell probabilities are fitted by maximum likelihood
under mean(m) = θ0 (an unseen cell, e.g. no loss observed, may get mass), and θ0 is inside the interval while
|mean - θ0| / sqrt(Var_θ0(m) / n) <= z. The variance is the one the null implies, not the sample's: with few
expected losses (floor 0.98 on 200 items, ~2.4) ~9% of samples show no loss at all, and the percentile
bootstrap, seeing no variability, passed ~9% of configurations sitting exactly at the floor instead of 2.5%.
The score interval holds the one-sided level (1 - confidence) / 2 in both regimes (tests/test_floor.py); where
losses are that few it is conservative, as any valid test must be: the most extreme outcome (no loss) alone is
likelier than 2.5% at the floor. The configuration **passes iff the interval's lower bound is >= 0**; when the
test configuration *is* the reference (``identical``, same outputs by construction) a relative floor holds
exactly. Alongside: the point estimate and a paired percentile-bootstrap interval (items resampled ``n_boot``
times, seeded) of Δ = acc_test - acc_ref, and the flips (items whose correctness changes between reference and
test; Dutta et al. 2024), which accuracy alone hides: +3 gained and -3 lost leave Δ = 0.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from statistics import NormalDist

import numpy as np

from runtime.errors import UserError


@dataclass(frozen=True)
class Floor:
    value: float
    relative: bool = True

    @classmethod
    def parse(cls, text: str | float | None) -> "Floor | None":
        """``0.99`` (relative to the reference) or ``abs:0.40`` (absolute accuracy)."""
        if text is None or text == "":
            return None
        raw = str(text).strip()
        relative = not raw.startswith("abs:")
        try:
            value = float(raw.removeprefix("abs:"))
        except ValueError:
            raise UserError(f"--floor {raw!r}: use a relative fraction like 0.99 or an absolute accuracy like abs:0.40") from None
        if relative and not 0 < value <= 1:
            raise UserError(f"relative --floor must be in (0, 1], got {value}; use abs:{value} for an absolute accuracy")
        if not relative and not 0 <= value <= 1:
            raise UserError(f"absolute --floor must be an accuracy in [0, 1], got {value}")
        return cls(value, relative)

    @property
    def label(self) -> str:
        return f"{self.value:g}x reference" if self.relative else f"acc >= {self.value:g}"


@dataclass
class Flips:
    lost: int  # correct in the reference, wrong in the test configuration
    gained: int  # wrong in the reference, correct in the test configuration

    @property
    def total(self) -> int:
        return self.lost + self.gained


@dataclass
class FloorResult:
    n: int
    acc_test: float
    acc_ref: float
    delta: float
    delta_ci: tuple[float, float]
    margin: float
    margin_ci: tuple[float, float]
    flips: Flips
    floor: str
    confidence: float
    passed: bool
    method: str = "score interval of the margin; bootstrap interval of Δ"
    decidable: bool = True  # the best outcome here (``best_outcome``) would pass at these items
    items_to_decide: int | None = None  # when not: about how many such items would let it pass (None: > 100x n)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["flips"]["total"] = self.flips.total
        return d


def count_flips(test: np.ndarray, ref: np.ndarray) -> Flips:
    test, ref = np.asarray(test, bool), np.asarray(ref, bool)
    return Flips(lost=int((ref & ~test).sum()), gained=int((~ref & test).sum()))


def paired_bootstrap(test: np.ndarray, ref: np.ndarray, weight: float, offset: float, confidence: float,
                     n_boot: int, seed: int) -> tuple[float, tuple[float, float]]:
    """Point estimate and percentile interval of mean(test) - weight * mean(ref) - offset, items resampled in pairs."""
    test, ref = np.asarray(test, float), np.asarray(ref, float)
    diff = test - weight * ref - offset
    rng = np.random.default_rng(seed)
    means = np.concatenate([diff[rng.integers(0, len(diff), (min(1000, n_boot - done), len(diff)))].mean(1)
                            for done in range(0, n_boot, 1000)])
    alpha = (1 - confidence) / 2
    lo, hi = np.quantile(means, [alpha, 1 - alpha])
    return float(diff.mean()), (float(lo), float(hi))


def _null_variance(counts: np.ndarray, values: np.ndarray, theta0: np.ndarray) -> np.ndarray:
    """Var(m) under the maximum-likelihood cell probabilities with mean theta0 (rows: independent samples).

    The constrained MLE is p_c = n_c / (n + λ (a_c - θ0)), λ the root of Σ p_c (a_c - θ0) = 0 (decreasing in λ;
    bisection inside the range where every denominator is positive)."""
    b = values[None, :] - theta0[:, None]
    n = counts.sum(1)
    with np.errstate(divide="ignore", invalid="ignore"):
        lo = np.max(np.where(b > 0, -n[:, None] / b, -np.inf), 1)
        hi = np.min(np.where(b < 0, -n[:, None] / b, np.inf), 1)
    lo, hi = np.where(np.isfinite(lo), lo, -1e12), np.where(np.isfinite(hi), hi, 1e12)
    for _ in range(60):
        mid = (lo + hi) / 2
        up = (counts * b / (n[:, None] + mid[:, None] * b)).sum(1) > 0
        lo, hi = np.where(up, mid, lo), np.where(up, hi, mid)
    p = counts / (n[:, None] + ((lo + hi) / 2)[:, None] * b)
    p /= p.sum(1, keepdims=True)
    return (p * b ** 2).sum(1)


def score_interval(counts: np.ndarray, values: np.ndarray, confidence: float,
                   pseudo: float = 1e-3) -> tuple[np.ndarray, np.ndarray]:
    """Two-sided score interval of the mean of a discrete variable, vectorised over rows of ``counts`` (R, C):
    cell counts over the support ``values`` (C,). Cells never observed get ``pseudo`` counts so that the fitted
    null can put mass there (e.g. a loss when none was seen)."""
    counts = np.atleast_2d(np.asarray(counts, float))
    values = np.asarray(values, float)
    n = counts.sum(1)
    mean = (counts * values).sum(1) / n
    smoothed = np.where(counts > 0, counts, pseudo)
    z = float(NormalDist().inv_cdf(1 - (1 - confidence) / 2))

    # both bounds at once (rows stacked): θ0 on each side of the mean where |mean - θ0| / sd_θ0 = z
    sign = np.r_[np.ones_like(mean), -np.ones_like(mean)]
    mean2, n2, smoothed2 = np.r_[mean, mean], np.r_[n, n], np.r_[smoothed, smoothed]
    lo = np.r_[np.full_like(mean, values.min()), mean]
    hi = np.r_[mean, np.full_like(mean, values.max())]
    for _ in range(45):
        mid = (lo + hi) / 2
        stat = sign * (mean2 - mid) / np.sqrt(np.maximum(_null_variance(smoothed2, values, mid), 1e-300) / n2)
        move_lo = (stat <= z) != (sign > 0)  # lower bound: inside -> go down; upper bound: inside -> go up
        lo, hi = np.where(move_lo, mid, lo), np.where(move_lo, hi, mid)
    bounds = (lo + hi) / 2
    return bounds[:len(mean)], bounds[len(mean):]


def margin_cells(test: np.ndarray, ref: np.ndarray, weight: float, offset: float) -> tuple[np.ndarray, np.ndarray]:
    """Counts and values of m = test - weight * ref - offset: the four test/ref cells for 0/1 scores (unseen
    ones with count 0), else the distinct observed values."""
    test, ref = np.asarray(test, float), np.asarray(ref, float)
    if np.isin(test, (0.0, 1.0)).all() and np.isin(ref, (0.0, 1.0)).all():
        cells = [(1, 1), (0, 1), (1, 0), (0, 0)]
        counts = np.array([((test == t) & (ref == r)).sum() for t, r in cells], float)
        return counts, np.array([t - weight * r - offset for t, r in cells], float)
    values, counts = np.unique(test - weight * ref - offset, return_counts=True)
    return counts.astype(float), values


# how many copies of the items to try when the best outcome cannot pass at the items there are
_SCALES = np.array([1, 2, 3, 4, 5, 6, 8, 10, 12, 15, 20, 25, 30, 40, 50, 60, 80, 100])


def best_outcome(ref: np.ndarray, floor: Floor) -> np.ndarray:
    """The best per-item scores a configuration that does not beat the reference can show: the reference's own
    (relative floor), every item right (absolute floor)."""
    return ref if floor.relative else np.ones_like(ref)


def items_to_decide(ref: np.ndarray, floor: Floor, confidence: float) -> int | None:
    """None when ``best_outcome`` passes at these items; else about how many items (the same mix, repeated)
    would let it pass, or 0 when even 100 times as many would not (e.g. a relative floor of 1.0)."""
    weight, offset = (floor.value, 0.0) if floor.relative else (0.0, floor.value)
    best = best_outcome(ref, floor)
    margin = float((best - weight * ref - offset).mean())
    if margin <= 0:  # the lower bound never exceeds the mean: no number of items lets it pass
        return 0
    counts, values = margin_cells(best, ref, weight, offset)
    lo, _ = score_interval(counts[None] * _SCALES[:, None], values, confidence)
    passes = np.minimum(lo, margin) >= 0
    if passes[0]:
        return None
    return int(_SCALES[passes.argmax()] * len(ref)) if passes.any() else 0


def how_to_decide(needed: int | None) -> str:
    """What would decide an undecidable floor, from ``FloorResult.items_to_decide`` (None: no number of items)."""
    return (f"about {needed} items (--limit) would decide it" if needed else
            "no number of items decides it: only a configuration beating the reference could pass")


def check_floor(test, ref, floor: Floor, confidence: float = 0.95, n_boot: int = 10_000, seed: int = 0,
                identical: bool = False) -> FloorResult:
    """Paired per-item comparison of a configuration against the reference; see the module docstring.
    ``identical``: the test configuration is the reference itself (its outputs equal by construction)."""
    test, ref = np.asarray(test, float), np.asarray(ref, float)
    if test.shape != ref.shape or test.ndim != 1 or len(test) == 0:
        raise ValueError(f"need equal-length 1-D per-item scores, got {test.shape} and {ref.shape}")
    if not 0 < confidence < 1:
        raise UserError(f"--confidence must be in (0, 1), got {confidence}")
    delta, delta_ci = paired_bootstrap(test, ref, 1.0, 0.0, confidence, n_boot, seed)
    weight, offset = (floor.value, 0.0) if floor.relative else (0.0, floor.value)
    margin = float((test - weight * ref - offset).mean())
    if identical and floor.relative:  # m = (1 - f) * ref exactly: the relative floor holds by construction
        margin_ci = (margin, margin)
    else:
        counts, values = margin_cells(test, ref, weight, offset)
        lo, hi = score_interval(counts[None], values, confidence)
        margin_ci = (min(float(lo[0]), margin), max(float(hi[0]), margin))
    passed = margin_ci[0] >= 0
    needed = None if passed else items_to_decide(ref, floor, confidence)
    return FloorResult(n=len(test), acc_test=float(test.mean()), acc_ref=float(ref.mean()), delta=delta,
                       delta_ci=delta_ci, margin=margin, margin_ci=margin_ci, flips=count_flips(test, ref),
                       floor=floor.label, confidence=confidence, passed=passed, decidable=needed is None,
                       items_to_decide=needed or None)
