import math

import torch

from evals.fidelity import token_fidelity


def test_identical_logits_have_zero_kl_full_agreement():
    x = torch.randn(50, 10)
    s = token_fidelity(x, x)
    assert s.mean_kl < 1e-6 and s.top1_agreement == 1.0 and s.n_tokens == 50


def test_kl_matches_closed_form():
    p = torch.tensor([[0.7, 0.2, 0.1]])
    q = torch.tensor([[0.1, 0.2, 0.7]])
    s = token_fidelity(p.log(), q.log())
    expected = sum(a * math.log(a / b) for a, b in zip(p[0].tolist(), q[0].tolist()))
    assert abs(s.mean_kl - expected) < 1e-5 and s.top1_agreement == 0.0
