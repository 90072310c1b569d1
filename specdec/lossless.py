"""Is speculative decoding lossless? Token-exact greedy equality, and first-step sample distributions
against the target's own (chi-square with rare tokens binned, total variation), on a model or on a
synthetic vocabulary with known p and q."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np
import torch
from scipy import stats as scipy_stats

from specdec.generate import Decoder
from specdec.metrics import AcceptanceStats
from specdec.sampling import logits_to_probs
from specdec.speculative import SpeculativeDecoder
from specdec.verify import verify_sampling

MIN_EXPECTED = 5.0  # chi-square bins with fewer expected samples are merged into one


@dataclass
class DistributionTest:
    samples: int
    chi2: float
    dof: int
    p_value: float
    tv: float  # total-variation distance between the empirical and the reference distribution
    tv_noise: float  # E[TV] of an exact sampler with this many samples (simulated from the reference)

    def to_dict(self) -> dict:
        return asdict(self)


def compare_to_reference(samples: np.ndarray, p: np.ndarray, seed: int = 0) -> DistributionTest:
    n = len(samples)
    counts = np.bincount(samples, minlength=len(p)).astype(float)
    expected = p * n
    common = expected >= MIN_EXPECTED
    obs = [*counts[common], counts[~common].sum()]
    exp = [*expected[common], expected[~common].sum()]
    if exp[-1] < MIN_EXPECTED and obs[-1] == 0:  # an empty rare bin carries no information
        obs, exp = obs[:-1], exp[:-1]
    obs, exp = np.array(obs), np.array(exp)
    if (exp == 0).any() and (obs[exp == 0] > 0).any():  # a token the target never emits was sampled
        chi2, p_value = float("inf"), 0.0
    else:
        chi2, p_value = scipy_stats.chisquare(obs, exp * obs.sum() / exp.sum())
    tv = 0.5 * float(np.abs(counts / n - p).sum())
    rng = np.random.default_rng(seed)
    noise = np.mean([0.5 * np.abs(rng.multinomial(n, p / p.sum()) / n - p).sum() for _ in range(20)])
    return DistributionTest(n, float(chi2), max(len(obs) - 1, 0), float(p_value), tv, float(noise))


def greedy_mismatches(spec: SpeculativeDecoder, prompts: list[list[int]], max_new_tokens: int,
                      tick: Callable[[], None] = lambda: None) -> list[dict]:
    """Prompts where greedy speculative output differs from plain greedy decoding (first differing index)."""
    plain = Decoder(spec.decoder.lm, spec.decoder.max_len)
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


@torch.inference_mode()
def first_step_test(spec: SpeculativeDecoder, prefix: list[int], n: int,
                    tick: Callable[[], None] = lambda: None) -> DistributionTest:
    """n independent speculative rounds after ``prefix``: their first emitted token vs the target's p."""
    spec.decoder.reset()
    spec.proposer.reset()
    spec.decoder.forward(prefix[:-1])
    p = logits_to_probs(spec.decoder.forward(prefix[-1:])[-1], spec.sampling).numpy().astype(float)
    generator = spec.sampling.generator()
    stats = AcceptanceStats(spec.k)
    samples = []
    for _ in range(n):
        spec.decoder.rollback(len(prefix) - 1)  # the target cache holds all of the prefix but its last token
        samples.append(spec.step(prefix, spec.k, generator, stats)[0])
        tick()
    return compare_to_reference(np.array(samples), p)


def synthetic_test(vocab: int = 12, k: int = 3, n: int = 20000, one_hot: bool = False,
                   seed: int = 0) -> tuple[DistributionTest, float, float]:
    """Known p [K+1, V] and q [K, V] (random Dirichlet rows): drafts are drawn from q (or fixed, one-hot),
    each run through ``verify_sampling``. Returns the test of the first emitted token against p[0], the
    measured acceptance of the first draft token and its theoretical value Σ min(p0, q0) (Corollary 3.6)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.distributions.Dirichlet(torch.full((vocab,), 0.5)).sample((k + 1,))
    q = torch.distributions.Dirichlet(torch.full((vocab,), 0.5)).sample((k,))
    fixed = torch.multinomial(q, 1, generator=g)[:, 0].tolist()
    firsts, accepted_first = [], 0
    for _ in range(n):
        draft = fixed if one_hot else torch.multinomial(q, 1, generator=g)[:, 0].tolist()
        verdict = verify_sampling(p, draft, None if one_hot else q, g)
        firsts.append(draft[0] if verdict.accepted > 0 else verdict.token)
        accepted_first += verdict.accepted > 0
    q0 = torch.nn.functional.one_hot(torch.tensor(fixed[0]), vocab).float() if one_hot else q[0]
    expected_acceptance = float(torch.minimum(p[0], q0).sum())
    return compare_to_reference(np.array(firsts), p[0].double().numpy()), accepted_first / n, expected_acceptance
