"""Is speculative decoding lossless? Token-exact greedy equality, and sampled outputs against the target's own
distribution, with tests of known size and power:

* **TV test.** ``tv`` = total variation between the empirical distribution of n samples and the reference p.
  For an exact sampler E[tv] <= B = 1/2 Σ sqrt(p(1-p)/n) (Jensen, cell by cell), and tv moves by at most 1/n
  when one sample changes, so P(tv >= B + t) <= exp(-2 n t²) (McDiarmid). The check fails when
  ``tv > threshold = B + sqrt(ln(1/alpha) / (2n))``: a false alarm has probability <= alpha, whatever p is.
  A sampler whose true distribution p1 lies at TV δ from p fails with probability >= ``power`` once
  δ >= ``detectable_tv`` = threshold + B + sqrt(ln(1/(1-power)) / (2n)) (triangle inequality, the same bound
  on p1's own noise, taking p1's B equal to p's, e.g. on the same support).
* **Acceptance test.** The first draft token is accepted with probability Σ min(p, q) (Leviathan et al.,
  Corollary 3.6; one-hot drafts: p(draft)). The count over n rounds is binomial; the check fails outside the
  exact two-sided binomial acceptance region at level alpha. ``detectable_shift`` is the normal-approximation
  shift of the rate found with probability >= ``power``.

Model level: :func:`first_step_test` (first emitted token and first-position acceptance after a fixed prefix).
Synthetic level (:class:`Chain`, a bigram target and draft over a small vocabulary, all seeded):
:func:`joint_test` checks the joint distribution of the first few emitted tokens of whole speculative
generations (bonus tokens and positions >= 1 included) against the target chain, :func:`bonus_test` the bonus
token drawn after K accepted one-hot drafts. Both take the verification rule as a parameter, so the tests can
inject broken rules (negative controls) into the same check.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np
import torch

from runtime.generate import Decoder
from specdec.metrics import AcceptanceStats
from runtime.sampling import logits_to_probs
from specdec.speculative import SpeculativeDecoder
from specdec.verify import Verdict, verify_sampling

ALPHA = 1e-3  # false-alarm bound of every distribution and acceptance check
POWER = 0.999  # detection probability at which detectable_tv / detectable_shift are stated
MIN_EXPECTED = 5.0  # chi-square (information only) merges bins with fewer expected samples

VerifyRule = Callable[[torch.Tensor, list[int], "torch.Tensor | None", "torch.Generator | None"], Verdict]


def mcdiarmid(n: int, prob: float) -> float:
    """t with exp(-2 n t²) = prob: how far above its mean an n-sample TV rises with probability <= prob."""
    return math.sqrt(math.log(1 / prob) / (2 * n))


@dataclass
class DistributionTest:
    samples: int
    cells: int  # outcomes with nonzero reference probability
    tv: float  # total variation between the empirical and the reference distribution
    tv_bound: float  # B: upper bound on E[tv] of an exact sampler at this sample count
    tv_threshold: float  # fail above this (false alarm <= alpha)
    detectable_tv: float  # a true TV this large fails with probability >= power
    alpha: float
    power: float
    chi2: float  # Pearson chi-square, rare bins merged: information only
    dof: int
    p_value: float

    @property
    def passed(self) -> bool:
        return self.tv <= self.tv_threshold

    def to_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed}


def compare_to_reference(samples: np.ndarray, p: np.ndarray, alpha: float = ALPHA,
                         power: float = POWER) -> DistributionTest:
    n = len(samples)
    p = np.asarray(p, float) / np.sum(p)
    counts = np.bincount(samples, minlength=len(p)).astype(float)
    bound = 0.5 * float(np.sqrt(p * (1 - p) / n).sum())
    threshold = bound + mcdiarmid(n, alpha)
    tv = 0.5 * float(np.abs(counts / n - p).sum())
    chi2, dof, p_value = _chi_square(counts, p * n)
    return DistributionTest(n, int((p > 0).sum()), tv, bound, threshold, threshold + bound + mcdiarmid(n, 1 - power),
                            alpha, power, chi2, dof, p_value)


def _chi_square(counts: np.ndarray, expected: np.ndarray) -> tuple[float, int, float]:
    common = expected >= MIN_EXPECTED
    obs = np.array([*counts[common], counts[~common].sum()])
    exp = np.array([*expected[common], expected[~common].sum()])
    if exp[-1] < MIN_EXPECTED and obs[-1] == 0:  # an empty rare bin carries no information
        obs, exp = obs[:-1], exp[:-1]
    if (exp == 0).any() and (obs[exp == 0] > 0).any():  # a token the target never emits was sampled
        return float("inf"), max(len(obs) - 1, 0), 0.0
    from scipy import stats as scipy_stats  # here: scipy.stats costs every CLI start 0.7 s

    chi2, p_value = scipy_stats.chisquare(obs, exp * obs.sum() / exp.sum())
    return float(chi2), max(len(obs) - 1, 0), float(p_value)


@dataclass
class AcceptanceTest:
    rounds: int
    accepted: int  # rounds whose first draft token was accepted
    expected: float  # Σ min(p, q) at the first position
    region: tuple[int, int]  # accepted counts in [lo, hi] pass (exact binomial, two-sided, level alpha)
    detectable_shift: float  # |rate - expected| found with probability >= power (normal approximation)
    alpha: float
    power: float

    @property
    def rate(self) -> float:
        return self.accepted / self.rounds

    @property
    def passed(self) -> bool:
        return self.region[0] <= self.accepted <= self.region[1]

    def to_dict(self) -> dict:
        return {**asdict(self), "rate": self.rate, "passed": self.passed}


def acceptance_test(accepted: int, rounds: int, expected: float, alpha: float = ALPHA,
                    power: float = POWER) -> AcceptanceTest:
    from scipy import stats as scipy_stats

    expected = min(max(float(expected), 0.0), 1.0)
    binom = scipy_stats.binom(rounds, expected)
    region = (int(binom.ppf(alpha / 2)), int(binom.isf(alpha / 2)))
    z = scipy_stats.norm.isf(alpha / 2) + scipy_stats.norm.isf(1 - power)
    shift = float(z) * math.sqrt(max(expected * (1 - expected), 1e-12) / rounds)
    return AcceptanceTest(rounds, int(accepted), expected, region, shift, alpha, power)


def greedy_mismatches(spec: SpeculativeDecoder, prompts: list[list[int]], max_new_tokens: int,
                      tick: Callable[[], None] = lambda: None) -> list[dict]:
    """Prompts where greedy speculative output differs from plain greedy decoding (first differing index), the
    plain decoding compiled as ``spec``'s is."""
    plain = Decoder(spec.decoder.lm, spec.decoder.max_len, compile_mode=spec.decoder.compile_mode)
    bad = []
    for i, ids in enumerate(prompts):
        ref = plain.generate(ids, max_new_tokens, ignore_eos=True).tokens
        got = spec.generate(ids, max_new_tokens, ignore_eos=True).tokens
        if got != ref:
            first = next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
            bad.append({"prompt": i, "first_difference": first, "plain": ref[first:first + 5],
                        "speculative": got[first:first + 5]})
        tick()
    return bad


@dataclass
class FirstStepTest:
    distribution: DistributionTest  # first emitted token vs the target's p after the prefix
    acceptance: AcceptanceTest | None  # None when the proposer drafts nothing after this prefix

    @property
    def passed(self) -> bool:
        return self.distribution.passed and (self.acceptance is None or self.acceptance.passed)

    def to_dict(self) -> dict:
        return {"distribution": self.distribution.to_dict(),
                "acceptance": self.acceptance.to_dict() if self.acceptance else None, "passed": self.passed}


@torch.inference_mode()
def first_step_test(spec: SpeculativeDecoder, prefix: list[int], n: int, tick: Callable[[], None] = lambda: None,
                    alpha: float = ALPHA, power: float = POWER) -> FirstStepTest:
    """n independent speculative rounds after ``prefix`` (seeded by ``spec.sampling.seed``): their first emitted
    token against the target's p, and the acceptance of their first draft token against Σ min(p, q)."""
    spec.decoder.reset()
    spec.proposer.reset()
    spec.decoder.forward(prefix[:-1])
    p = logits_to_probs(spec.decoder.forward(prefix[-1:])[-1], spec.sampling)
    spec.decoder.rollback(len(prefix) - 1)
    generator = spec.sampling.generator()
    probe = spec.proposer.propose(prefix, spec.k, spec.sampling, torch.Generator().manual_seed(0))
    stats = AcceptanceStats(spec.k)
    samples = []
    for _ in range(n):
        spec.decoder.rollback(len(prefix) - 1)  # the target cache holds all of the prefix but its last token
        samples.append(spec.step(prefix, spec.k, generator, stats)[0])
        tick()
    acceptance = None
    if probe.tokens:  # the draft's first-position distribution depends on the prefix only
        q0 = probe.q[0] if probe.q is not None else torch.nn.functional.one_hot(torch.tensor(probe.tokens[0]), len(p))
        acceptance = acceptance_test(stats.accepted_per_pos[0], stats.drafts,
                                     float(torch.minimum(p, q0.float()).sum()), alpha, power)
    return FirstStepTest(compare_to_reference(np.array(samples), p.double().numpy(), alpha, power), acceptance)


# --- synthetic chains -----------------------------------------------------------------------------------------

@dataclass
class Chain:
    """A bigram target ``p`` [V, V] (row = previous token) and a draft ``q`` [V, V] that differs from it."""

    p: torch.Tensor
    q: torch.Tensor
    start: int = 0  # the context's last token

    @classmethod
    def random(cls, vocab: int = 6, seed: int = 0, concentration: float = 0.5, draft_noise: float = 0.7) -> "Chain":
        """Dirichlet target rows; the draft's logits are the target's log-probabilities plus Gaussian noise."""
        rng = np.random.default_rng(seed)
        p = rng.dirichlet(np.full(vocab, concentration), vocab).clip(1e-6)
        q_logits = np.log(p) + rng.normal(0, draft_noise, (vocab, vocab))
        p, q = torch.tensor(p / p.sum(1, keepdims=True)), torch.tensor(q_logits).softmax(-1)
        return cls(p.float(), q.float())

    @property
    def vocab(self) -> int:
        return self.p.shape[0]

    def joint(self, length: int) -> np.ndarray:
        """P(first ``length`` tokens) of plain sampling from the target, flattened (first token most significant)."""
        probs = self.p[self.start].double().numpy()
        p = self.p.double().numpy()
        for _ in range(length - 1):
            probs = (probs[:, None] * p[np.arange(len(probs)) % self.vocab]).reshape(-1)
        return probs

    def first_acceptance(self) -> float:
        return float(torch.minimum(self.p[self.start], self.q[self.start]).sum())


@dataclass
class JointTest:
    distribution: DistributionTest  # first ``length`` tokens, jointly
    first_token: DistributionTest  # the first token alone (what a first-token-only check sees)
    acceptance: AcceptanceTest  # first draft token of the first round

    @property
    def passed(self) -> bool:
        return self.distribution.passed and self.acceptance.passed

    def to_dict(self) -> dict:
        return {"distribution": self.distribution.to_dict(), "first_token": self.first_token.to_dict(),
                "acceptance": self.acceptance.to_dict(), "passed": self.passed}


def joint_test(chain: Chain, k: int = 2, length: int = 3, n: int = 20000, seed: int = 0,
               verify: VerifyRule = verify_sampling, alpha: float = ALPHA, power: float = POWER) -> JointTest:
    """n independent speculative generations of ``length`` tokens from ``chain.start`` (drafts sampled from q,
    K per round, each round checked by ``verify``): the joint distribution of the emitted tokens against plain
    sampling from the target, and the first round's first-position acceptance against Σ min(p, q)."""
    g = torch.Generator().manual_seed(seed)
    codes, accepted_first = np.zeros(n, np.int64), 0
    for s in range(n):
        out: list[int] = []
        while len(out) < length:
            context = out[-1] if out else chain.start
            draft = []
            for _ in range(k):
                draft.append(int(torch.multinomial(chain.q[draft[-1] if draft else context], 1, generator=g)))
            rows = [context, *draft]
            verdict = verify(chain.p[rows], draft, chain.q[rows[:-1]], g)
            accepted_first += not out and verdict.accepted > 0
            out += [*draft[:verdict.accepted], verdict.token]
        codes[s] = np.ravel_multi_index(out[:length], (chain.vocab,) * length)
    joint = chain.joint(length)
    firsts = codes // chain.vocab ** (length - 1)
    return JointTest(compare_to_reference(codes, joint, alpha, power),
                     compare_to_reference(firsts, chain.p[chain.start].double().numpy(), alpha, power),
                     acceptance_test(accepted_first, n, chain.first_acceptance(), alpha, power))


def bonus_test(chain: Chain, k: int = 2, n: int = 20000, seed: int = 0, verify: VerifyRule = verify_sampling,
               alpha: float = ALPHA, power: float = POWER) -> DistributionTest:
    """The bonus token on its own: a fixed one-hot draft (the target's most likely path) is verified n times;
    in the rounds that accept all K tokens the bonus must follow the target's row after the last draft token."""
    g = torch.Generator().manual_seed(seed)
    draft, context = [], chain.start
    for _ in range(k):
        draft.append(int(chain.p[draft[-1] if draft else context].argmax()))
    rows = [context, *draft]
    bonuses = []
    for _ in range(n):
        verdict = verify(chain.p[rows], draft, None, g)
        if verdict.accepted == k:
            bonuses.append(verdict.token)
    return compare_to_reference(np.array(bonuses, np.int64), chain.p[draft[-1]].double().numpy(), alpha, power)
