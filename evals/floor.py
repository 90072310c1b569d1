"""The quality floor: a paired bootstrap over items decides whether a configuration is good enough.

Definition (per task, items scored 0/1 by both the test configuration and the unquantized reference on the
same documents):

* relative floor ``f`` in (0, 1]: margin m = acc_test - f * acc_ref;
* absolute floor ``a`` in [0, 1]: margin m = acc_test - a.

Resample the items with replacement ``n_boot`` times (numpy, seeded), pairing test and reference on each item,
and take the two-sided ``confidence`` percentile interval of m. The configuration **passes iff the interval's
lower bound is >= 0**. Alongside: the point estimate and the same interval for Δ = acc_test - acc_ref, and the
flips (items whose correctness changes between reference and test; Dutta et al. 2024), which accuracy alone
hides: +3 gained and -3 lost leave Δ = 0.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

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


def check_floor(test, ref, floor: Floor, confidence: float = 0.95, n_boot: int = 10_000, seed: int = 0) -> FloorResult:
    """Paired per-item comparison of a configuration against the reference; see the module docstring."""
    test, ref = np.asarray(test, float), np.asarray(ref, float)
    if test.shape != ref.shape or test.ndim != 1 or len(test) == 0:
        raise ValueError(f"need equal-length 1-D per-item scores, got {test.shape} and {ref.shape}")
    if not 0 < confidence < 1:
        raise UserError(f"--confidence must be in (0, 1), got {confidence}")
    delta, delta_ci = paired_bootstrap(test, ref, 1.0, 0.0, confidence, n_boot, seed)
    weight, offset = (floor.value, 0.0) if floor.relative else (0.0, floor.value)
    margin, margin_ci = paired_bootstrap(test, ref, weight, offset, confidence, n_boot, seed)
    return FloorResult(n=len(test), acc_test=float(test.mean()), acc_ref=float(ref.mean()), delta=delta,
                       delta_ci=delta_ci, margin=margin, margin_ci=margin_ci, flips=count_flips(test, ref),
                       floor=floor.label, confidence=confidence, passed=margin_ci[0] >= 0)
