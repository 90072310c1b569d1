"""The output-length gate (MLPerf's second gate), decided on paired prompts or said undecidable.

Each prompt is generated with natural end-of-turn (up to a token limit) by the configuration and by the reference;
the statistic is the ratio of mean output tokens R = mean(c) / mean(r) over the same prompts. Its interval is
Fieller's: the ratios R0 that a paired t-test of mean(c - R0 * r) = 0 does not reject, a quadratic in R0 solved in
closed form (exact for normal differences). It tests the band's edges directly, so four prompts that are all far
longer than the reference's decide the gate (the delta-method interval around R, whose residuals c - R * r swing
both ways when the reference's lengths vary, read 0.19-4.6 for the demo's 2.4x on four prompts that each ran
longer, and decided nothing). One prompt gives no interval, nor does a reference whose mean the prompts leave
indistinguishable from 0 (unbounded set).

Verdicts against the band [lo, hi]: **pass** (interval inside), **fail** (interval outside, on one side) or
**undecidable** (it straddles an edge). Only a fail is enforced (constraint > 0): the gate catches a configuration
that demonstrably answers longer or shorter; an undecidable row is recorded and marked, not made infeasible, with
the number of prompts that would decide it left to ``--length-prompts``. A single prompt decided it before, and a
bf16 kernel near-tie that moved the reference's end of turn from ~124 to 60 tokens failed every quantized point
of the demo at 2.1x.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from math import sqrt

import numpy as np


@dataclass(frozen=True)
class LengthVerdict:
    n: int  # prompts, paired with the reference's
    mean_tokens: float
    reference_mean_tokens: float
    ratio: float
    ratio_ci: tuple[float, float] | None  # None: one prompt, no interval
    band: tuple[float, float] | None
    verdict: str  # "pass" | "fail" | "undecidable" | "off"

    @property
    def constraint(self) -> float | None:
        """Optuna's constraint (feasible <= 0), set only where the prompts decide: the interval's distance past the
        band (fail, > 0) or inside it (pass, <= 0); None when undecidable or the band is off."""
        if self.verdict not in ("pass", "fail"):
            return None
        (lo, hi), (b_lo, b_hi) = self.ratio_ci, self.band
        return max(b_lo - hi, lo - b_hi) if self.verdict == "fail" else max(b_lo - lo, hi - b_hi)

    @property
    def text(self) -> str:
        ci = f" (95% CI {self.ratio_ci[0]:.2f}-{self.ratio_ci[1]:.2f})" if self.ratio_ci else ""
        return f"output length {self.ratio:.2f}x the reference's{ci} on {self.n} prompt{'s' * (self.n != 1)}"

    def to_dict(self) -> dict:
        return asdict(self) | {"constraint": self.constraint, "text": self.text}


def ratio_interval(counts: list[int], reference: list[int], confidence: float = 0.95
                   ) -> tuple[float, tuple[float, float] | None]:
    """R = mean(counts) / mean(reference) over paired prompts and its Fieller interval (None: n < 2 or unbounded)."""
    from scipy.stats import t

    c, r = np.asarray(counts, float), np.asarray(reference, float)
    if c.shape != r.shape or not len(c):
        raise ValueError(f"paired counts needed, got {len(c)} and {len(r)}")
    ratio = c.mean() / r.mean()
    if len(c) < 2:
        return ratio, None
    # (mean(c) - R0 mean(r))^2 <= t^2 Var(c - R0 r) / n, i.e. a R0^2 - 2 b R0 + k <= 0
    q = t.ppf((1 + confidence) / 2, len(c) - 1) ** 2 / len(c)
    (s_cc, s_cr), (_, s_rr) = np.cov(c, r)
    a, b, k = r.mean() ** 2 - q * s_rr, c.mean() * r.mean() - q * s_cr, c.mean() ** 2 - q * s_cc
    if a <= 0:
        return ratio, None
    half = sqrt(max(b * b - a * k, 0.0))  # >= 0 but for rounding: R itself always lies inside
    return ratio, ((b - half) / a, (b + half) / a)


def decide_length(counts: list[int], reference: list[int], band: tuple[float, float] | None,
                  identical: bool = False) -> LengthVerdict:
    """The gate's verdict for output lengths ``counts`` against the reference's on the same prompts;
    ``identical``: the same outputs by construction (the reference itself, or its exact speculative twin)."""
    ratio, ci = (1.0, (1.0, 1.0)) if identical else ratio_interval(counts, reference)
    if band is None:
        verdict = "off"
    elif ci is not None and band[0] <= ci[0] and ci[1] <= band[1]:
        verdict = "pass"
    elif ci is not None and (ci[1] < band[0] or ci[0] > band[1]):
        verdict = "fail"
    else:
        verdict = "undecidable"
    return LengthVerdict(len(counts), float(np.mean(counts)), float(np.mean(reference)), float(ratio),
                         None if ci is None else (float(ci[0]), float(ci[1])), band and tuple(band), verdict)
