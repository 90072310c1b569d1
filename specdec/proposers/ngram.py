"""Prompt lookup (n-gram) drafting with vLLM's semantics: the longest suffix n-gram with
``prompt_lookup_min <= n <= prompt_lookup_max`` that occurs earlier in prompt + output (its earliest
occurrence on ties) proposes the tokens that followed it, at most K and never past the context end."""
from __future__ import annotations

import numpy as np

from runtime.errors import UserError
from specdec.proposers.base import Proposal, Proposer, parse_params, register_proposer


def lookup(context: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    total = len(context)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(context[:-1], n)
        hits = np.flatnonzero((windows == context[total - n:]).all(axis=1))
        if len(hits):
            start = int(hits[0]) + n
            return context[start:start + k].tolist()
    return []


DEFAULT_N = 5  # vLLM's prompt_lookup_min/max when neither is given


@register_proposer("ngram")
class NgramProposer(Proposer):
    def __init__(self, min_n: int = DEFAULT_N, max_n: int = DEFAULT_N):
        if not 1 <= min_n <= max_n:
            raise UserError(f"ngram: need 1 <= min <= max, got min={min_n}, max={max_n}")
        self.min_n, self.max_n = min_n, max_n

    @classmethod
    def from_spec(cls, arg, target):
        params = parse_params(arg, {"min": int, "max": int}, "ngram")
        min_n = params.get("min", params.get("max", DEFAULT_N))  # vLLM: a missing bound copies the other
        return cls(min_n, params.get("max", min_n))

    @property
    def label(self) -> str:
        return f"ngram:min={self.min_n},max={self.max_n}"

    def propose(self, context, k, sampling, generator):
        if k == 0:
            return Proposal([])
        return Proposal(lookup(np.asarray(context, dtype=np.int64), k, self.min_n, self.max_n))
