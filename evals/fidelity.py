"""Token-level fidelity of a model against a reference on the same tokens: KL, top-1 agreement."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class FidelityStats:
    mean_kl: float  # mean over tokens of KL(p_ref || p_test), nats
    p99_kl: float
    top1_agreement: float  # fraction of positions where argmaxes agree
    n_tokens: int


def token_fidelity(ref_logits: torch.Tensor, test_logits: torch.Tensor) -> FidelityStats:
    """Compare next-token distributions position by position (logits [N, V], same tokens)."""
    ref_logp = torch.log_softmax(ref_logits.float(), -1)
    test_logp = torch.log_softmax(test_logits.float(), -1)
    kl = (ref_logp.exp() * (ref_logp - test_logp)).sum(-1).clamp_min(0)
    agree = (ref_logits.argmax(-1) == test_logits.argmax(-1)).float()
    return FidelityStats(kl.mean().item(), torch.quantile(kl, 0.99).item(), agree.mean().item(), kl.numel())
