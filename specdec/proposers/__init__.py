"""Draft proposers for speculative decoding, registered by name and built from one spec string.

Spec grammar: ``NAME[:ARG]`` — ``ngram:min=2,max=4``, ``draft:PATH[@SCHEME[:METHOD]]``, ``layerskip:L``,
``selfquant:SCHEME[:METHOD]``, ``eagle:PATH``. Each proposer yields up to K draft tokens and their draft distributions q.
"""
from specdec.proposers.base import PROPOSERS, Proposal, Proposer, build_proposer, register_proposer
from specdec.proposers import draft, eagle, layerskip, ngram  # noqa: F401  (register proposers)

__all__ = ["PROPOSERS", "Proposal", "Proposer", "build_proposer", "register_proposer"]
