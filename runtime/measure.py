"""Speed you can trust: paired, interleaved ratios with a CI, absolute figures with their spread, a noise guard,
and the machine's load around every measurement. The one home of these rules: bench/, the search, the demo and
``quantspec bench --repeats`` call it.

A ratio (candidate over reference) is measured in rounds of blocks: for each unit of work (one prompt, one
generation) the reference and the candidate run back to back in a seeded random order (AB or BA), so both see the
same load; each round gives one ratio, the point estimate is the median of the per-round ratios and its CI the
Student-t interval of their mean log (``median_ci``). When the CI's relative half-width exceeds ``threshold`` more rounds
are measured up to ``max_rounds`` (or ``budget_s``); a ratio still wider is ``noisy``: a flag every table shows,
never a silent drop.
"""
from __future__ import annotations

import math
import os
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import numpy as np

from runtime.errors import UserError

CONFIDENCE = 0.95
BOOTSTRAP_RESAMPLES = 4000
DEFAULT_THRESHOLD = 0.10  # relative CI half-width above which a ratio is noisy
MIN_ROUNDS, MAX_ROUNDS = 3, 12


@dataclass(frozen=True)
class Sample:
    """One block of work: ``tokens`` produced in ``seconds``."""

    tokens: int
    seconds: float

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class Spread:
    """A statistic over repeats: ``value`` (median, or mean for ``mean_ci``) with its 95% CI and IQR."""

    value: float
    ci: tuple[float, float]
    n: int
    iqr: tuple[float, float] | None = None

    @property
    def rel_halfwidth(self) -> float:
        """Half the CI's width over the value (inf when the value is 0 or the CI is unknown)."""
        if not self.value or not all(map(math.isfinite, self.ci)):
            return math.inf
        return (self.ci[1] - self.ci[0]) / 2 / abs(self.value)

    def to_dict(self) -> dict:
        return asdict(self) | {"rel_halfwidth": self.rel_halfwidth}


def _t_interval(y: np.ndarray) -> tuple[float, float]:
    """Student-t 95% interval of the mean of ``y`` (infinite below 2 values: no spread to speak of)."""
    from scipy import stats

    if len(y) < 2:
        return -math.inf, math.inf
    half = float(stats.t.ppf((1 + CONFIDENCE) / 2, len(y) - 1) * y.std(ddof=1) / math.sqrt(len(y)))
    return float(y.mean() - half), float(y.mean() + half)


def _iqr(x: np.ndarray) -> tuple[float, float]:
    q1, q3 = np.quantile(x, [0.25, 0.75])
    return float(q1), float(q3)


def median_ci(values: Sequence[float], log: bool = False) -> Spread:
    """Median with a 95% CI: the Student-t interval of the mean (of the logs when ``log``, for ratios and rates),
    widened to hold the median where the two differ; none below 3 values. At 3-4 rounds this has its stated
    coverage under roughly log-normal noise, where a bootstrap of the median gives the range of the values (75%
    coverage at 3)."""
    x = np.asarray(values, dtype=float)
    if len(x) == 0:
        raise ValueError("no samples")
    med = float(np.median(x))
    if len(x) < 3:
        return Spread(med, (-math.inf, math.inf), len(x), _iqr(x))
    lo, hi = _t_interval(np.log(x) if log else x)
    if log:
        lo, hi = math.exp(lo), math.exp(hi)
    return Spread(med, (min(lo, med), max(hi, med)), len(x), _iqr(x))


def mean_ci(values: Sequence[float]) -> Spread:
    """Mean with the Student-t 95% CI across repeats (what AIPerf reports per metric)."""
    x = np.asarray(values, dtype=float)
    return Spread(float(x.mean()), _t_interval(x), len(x), _iqr(x))


def _proc_stat() -> tuple[int, int] | None:
    """(steal ticks, total ticks) of all CPUs from /proc/stat; None where there is none."""
    try:
        with open("/proc/stat") as f:
            parts = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (parts[7] if len(parts) > 7 else 0), sum(parts[:8])


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def cpus_available() -> int:
    """Cores in this process's affinity mask (what it may run on), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@dataclass
class LoadWindow:
    """The machine's load around a measurement: 1-minute load average before and after, and the share of CPU
    time stolen by the hypervisor in between (/proc/stat)."""

    load_1m_before: float | None = None
    load_1m_after: float | None = None
    steal_pct: float | None = None
    cpus: int = field(default_factory=cpus_available)
    _stat: tuple[int, int] | None = field(default=None, repr=False)

    @classmethod
    def start(cls) -> "LoadWindow":
        return cls(load_1m_before=_loadavg(), _stat=_proc_stat())

    def stop(self) -> "LoadWindow":
        self.load_1m_after = _loadavg()
        end = _proc_stat()
        if self._stat and end and end[1] > self._stat[1]:
            self.steal_pct = round(100 * (end[0] - self._stat[0]) / (end[1] - self._stat[1]), 2)
        return self

    def to_dict(self) -> dict:
        return {"load_1m_before": self.load_1m_before, "load_1m_after": self.load_1m_after,
                "steal_pct": self.steal_pct, "cpus": self.cpus}


@dataclass
class SpeedProtocol:
    """How a paired comparison is measured (stored with every result; workers of one study must agree)."""

    min_rounds: int = MIN_ROUNDS
    max_rounds: int = MAX_ROUNDS
    threshold: float = DEFAULT_THRESHOLD  # relative CI half-width above which the ratio is noisy
    budget_s: float | None = None  # stop adding rounds after this many seconds (then noisy if still wide)
    seed: int = 0

    def __post_init__(self):
        if not 3 <= self.min_rounds <= self.max_rounds:
            raise UserError(f"need 3 <= min rounds <= max rounds, got {self.min_rounds} and {self.max_rounds}")
        if not 0 < self.threshold < 1:
            raise UserError(f"--noise-threshold must be in (0, 1) (a relative CI half-width, e.g. 0.1), got "
                            f"{self.threshold}")


@dataclass
class PairedRatio:
    """Candidate over reference, measured in interleaved rounds (one ratio per round)."""

    ratio: Spread  # median of per-round candidate/reference rate ratios, t-interval of their mean log
    reference: Spread  # reference rate per round (tokens / seconds over the round's blocks)
    candidate: Spread
    rounds: int
    blocks: int  # timed blocks of both, warm-up excluded
    noisy: bool
    protocol: SpeedProtocol
    load: LoadWindow
    elapsed_s: float
    granularity: str  # what one block is, e.g. "one request"
    retuned: list = field(default_factory=list)  # what the noise guard's hook changed, if it ran
    stopped: str = ""  # what ended the rounds: the threshold, the protocol's limits, or a caller's hold

    def to_dict(self) -> dict:
        return {"ratio": self.ratio.to_dict(), "reference": self.reference.to_dict(),
                "candidate": self.candidate.to_dict(), "rounds": self.rounds, "blocks": self.blocks,
                "noisy": self.noisy, "protocol": asdict(self.protocol), "load": self.load.to_dict(),
                "elapsed_s": self.elapsed_s, "granularity": self.granularity, "retuned": self.retuned,
                "stopped": self.stopped}


def paired_ratio(run_reference: Callable[[int], Sample], run_candidate: Callable[[int], Sample], units: int,
                 protocol: SpeedProtocol = SpeedProtocol(), granularity: str = "one unit of work",
                 on_noisy: Callable[[], object] | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> PairedRatio:
    """Rounds of ``run_reference(u)`` and ``run_candidate(u)`` until the protocol stops them (``PairedRounds``)."""
    return PairedRounds(run_reference, run_candidate, units, protocol, granularity, on_noisy, clock).measure()


class PairedRounds:
    """Rounds of ``run_reference(u)`` and ``run_candidate(u)`` over units 0..units-1, back to back per unit in a
    seeded random order (AB or BA). Each round gives one ratio (the candidate's tokens/s over the round's units
    divided by the reference's), so units that differ (prompts of other lengths, other acceptance) weigh alike in
    every ratio and only the machine's noise spreads them. ``measure`` stops once the ratio's CI is within
    ``protocol.threshold`` (after ``min_rounds``), or at ``max_rounds``/``budget_s`` (then noisy); a caller may hold
    it at fewer rounds and call ``measure`` again later to go on from there (the search: the noise guard's rounds
    only for points still feasible once their quality is known). ``on_noisy`` runs once, the first time the CI is
    too wide (e.g. re-choose threads); what it returns is recorded."""

    def __init__(self, run_reference: Callable[[int], Sample], run_candidate: Callable[[int], Sample], units: int,
                 protocol: SpeedProtocol = SpeedProtocol(), granularity: str = "one unit of work",
                 on_noisy: Callable[[], object] | None = None, clock: Callable[[], float] = time.perf_counter):
        if units < 1:
            raise ValueError("paired_ratio needs at least one unit of work")
        self.run_reference, self.run_candidate, self.units = run_reference, run_candidate, units
        self.protocol, self.granularity, self.on_noisy, self.clock = protocol, granularity, on_noisy, clock
        self._order = random.Random(protocol.seed)
        self._rounds: list[tuple[list[Sample], list[Sample]]] = []
        self._retuned: list = []
        self._window: LoadWindow | None = None
        self._elapsed = 0.0

    @property
    def elapsed_s(self) -> float:
        """Seconds spent in rounds so far."""
        return self._elapsed

    def measure(self, hold_at: int | None = None) -> PairedRatio:
        """Rounds until the rule stops them, or ``hold_at`` rounds at most (then not noisy: cut short by the
        caller, ``PairedRatio.stopped`` says so)."""
        protocol, t0 = self.protocol, self.clock()
        self._window = self._window or LoadWindow.start()
        limit = protocol.max_rounds if hold_at is None else min(max(hold_at, protocol.min_rounds), protocol.max_rounds)
        while True:
            if len(self._rounds) >= protocol.min_rounds:
                estimate = median_ci([_rate(c) / _rate(r) for r, c in self._rounds if _rate(r) > 0], log=True)
                wide = estimate.rel_halfwidth > protocol.threshold
                out_of_budget = protocol.budget_s is not None and self._elapsed + self.clock() - t0 >= protocol.budget_s
                held = wide and not out_of_budget and protocol.max_rounds > len(self._rounds) >= limit
                stopped = ("within the threshold" if not wide else "the protocol's budget" if out_of_budget else
                           f"held at {limit} rounds by the caller" if held else
                           "the protocol's max rounds" if len(self._rounds) >= protocol.max_rounds else None)
                if stopped:
                    break
                if self.on_noisy is not None and not self._retuned:
                    self._retuned.append(self.on_noisy())
            refs, cands = [], []
            for unit in range(self.units):
                if self._order.random() < 0.5:
                    refs.append(self.run_reference(unit))
                    cands.append(self.run_candidate(unit))
                else:
                    cands.append(self.run_candidate(unit))
                    refs.append(self.run_reference(unit))
            self._rounds.append((refs, cands))
        self._elapsed += self.clock() - t0
        rounds = self._rounds
        return PairedRatio(estimate, median_ci([_rate(r) for r, _ in rounds], log=True),
                           median_ci([_rate(c) for _, c in rounds], log=True), len(rounds),
                           2 * self.units * len(rounds), wide and not held, protocol,
                           self._window.stop(), self._elapsed, self.granularity, list(self._retuned), stopped)


def _rate(blocks: list[Sample]) -> float:
    """Tokens per second over a round's blocks."""
    seconds = sum(s.seconds for s in blocks)
    return sum(s.tokens for s in blocks) / seconds if seconds > 0 else 0.0


def ratio_of_totals(reference: list[Sample], candidate: list[Sample], seed: int = 0) -> Spread:
    """Candidate over reference tokens/s summed over paired units (unit i ran on both, interleaved), with the
    bootstrap percentile 95% CI over units: how far the ratio could move on other prompts of the same kind."""
    ref_t, ref_s = np.array([s.tokens for s in reference], float), np.array([s.seconds for s in reference], float)
    cand_t, cand_s = np.array([s.tokens for s in candidate], float), np.array([s.seconds for s in candidate], float)

    def ratio(idx: np.ndarray) -> np.ndarray:  # units picked by each row of ``idx``
        return (cand_t[idx].sum(-1) / cand_s[idx].sum(-1)) / (ref_t[idx].sum(-1) / ref_s[idx].sum(-1))

    n = len(reference)
    value = float(ratio(np.arange(n)))
    if n < 3:
        return Spread(value, (-math.inf, math.inf), n)
    boots = ratio(np.random.default_rng(seed).integers(0, n, size=(BOOTSTRAP_RESAMPLES, n)))
    lo, hi = np.quantile(boots, [(1 - CONFIDENCE) / 2, (1 + CONFIDENCE) / 2])
    return Spread(value, (float(lo), float(hi)), n)


def single_shot_ratio(reference: Sample, candidate: Sample) -> float:
    """The old protocol, kept as the negative control: one candidate run over one reference run timed earlier."""
    return candidate.rate / reference.rate


def with_ci(value: float, ci, spec: str = ".2f", unit: str = "") -> str:
    """``1.23x [1.10, 1.35]``: a value and its CI, as every table prints them; without a finite CI the value alone."""
    text = format(value, spec) + unit
    if ci and all(map(math.isfinite, ci)):
        text += f" [{format(ci[0], spec)}, {format(ci[1], spec)}]"
    return text


def load_line(load: dict) -> str:
    """``load 1.2 -> 1.5 on 2 cores, steal 0.3%``: a ``LoadWindow.to_dict()``, as every table prints it."""
    return (f"load {load.get('load_1m_before')} -> {load.get('load_1m_after')} on {load.get('cpus')} cores, "
            f"steal {load.get('steal_pct')}%")
