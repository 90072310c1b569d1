"""Verification of a draft against the target's logits at the K+1 positions it was scored on.

Exact speculative sampling (Leviathan et al. 2023, Chen et al. 2023): accept draft token x with probability
min(1, p(x)/q(x)); on the first rejection draw from norm(max(0, p - q)); after K acceptances draw one bonus
token from p. The emitted tokens are distributed exactly as the target's own samples. Greedy verification
accepts while the draft equals the target argmax and then emits the argmax: token-exact greedy decoding.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.proposers.base import Proposal
from runtime.sampling import SamplingConfig, logits_to_probs, sample_from


@dataclass
class Verdict:
    accepted: int  # leading draft tokens kept
    token: int  # the target's correction (after a rejection) or bonus token (after K acceptances)


def verify_greedy(target_logits: torch.Tensor, draft: list[int]) -> Verdict:
    best = target_logits.argmax(-1).tolist()
    n = 0
    while n < len(draft) and draft[n] == best[n]:
        n += 1
    return Verdict(n, best[n])


def verify_sampling(p: torch.Tensor, draft: list[int], q: torch.Tensor | None,
                    generator: torch.Generator | None) -> Verdict:
    """``p`` [K+1, V] target probabilities, ``q`` [K, V] draft probabilities (None: one-hot drafts)."""
    for i, token in enumerate(draft):
        p_x = float(p[i, token])
        q_x = 1.0 if q is None else float(q[i, token])
        if float(torch.rand((), generator=generator, device=p.device)) * q_x < p_x:
            continue
        if q is None:
            residual = p[i].clone()
            residual[token] = 0.0
        else:
            residual = (p[i] - q[i]).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: rejection had probability ~0
            residual = p[i]
        return Verdict(i, int(sample_from(residual / residual.sum(), generator)))
    return Verdict(len(draft), int(sample_from(p[len(draft)], generator)))


def verify(target_logits: torch.Tensor, proposal: Proposal, sampling: SamplingConfig,
           generator: torch.Generator | None) -> Verdict:
    if sampling.greedy:
        return verify_greedy(target_logits, proposal.tokens)
    return verify_sampling(logits_to_probs(target_logits, sampling), proposal.tokens, proposal.q, generator)
