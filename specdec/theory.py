"""Expected speedup of speculative decoding (Leviathan et al. 2023, §3.3-3.5) and a refined variant.

α: acceptance rate, K (the paper's γ): draft tokens per step, c: draft step time / target decode step time.
"""
from __future__ import annotations

from typing import Callable


def expected_tokens(alpha: float, k: int) -> float:
    """E[tokens per verification] = (1 - α^(K+1)) / (1 - α)  (Eq. 1; K+1 when α = 1)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def walltime_speedup(alpha: float, k: int, c: float) -> float:
    """Theorem 3.8: (1 - α^(K+1)) / ((1 - α)(Kc + 1)); assumes verifying K+1 tokens costs one decode step."""
    return expected_tokens(alpha, k) / (k * c + 1.0)


def operations_factor(alpha: float, k: int, c_hat: float = 0.0) -> float:
    """Theorem 3.11: increase in total arithmetic operations, (1 - α)(Kĉ + K + 1) / (1 - α^(K+1))."""
    return (k * c_hat + k + 1.0) / expected_tokens(alpha, k)


def refined_speedup(alpha: float, k: int, c: float, verify_cost: float) -> float:
    """Theorem 3.8 with the measured cost of verifying K+1 tokens (in decode steps) instead of 1."""
    return expected_tokens(alpha, k) / (k * c + verify_cost)


def best_k(alpha: float, c: float, verify_cost: Callable[[int], float] | None = None, k_max: int = 32) -> int:
    """The K maximising the (refined when ``verify_cost`` is given) predicted speedup (§3.5)."""
    cost = verify_cost or (lambda k: 1.0)
    return max(range(1, k_max + 1), key=lambda k: refined_speedup(alpha, k, c, cost(k)))
