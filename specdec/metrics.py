"""Acceptance statistics of speculative decoding, with vLLM's definitions (v1 ``SpecDecodingStats``):

- a *draft* is one verification step that carried >= 1 draft token (steps without a draft are not counted);
- α (draft acceptance rate) = accepted tokens / drafted tokens;
- β (per-token acceptance probability, the α of Leviathan et al.'s theory) = accepted / tested tokens, where a
  draft tests its tokens up to and including the first rejection. α understates β: tokens after a rejection
  count as drafted but were never tested, so predictions plug in β, tables show α next to it;
- τ (mean acceptance length, Spec-Bench's) = 1 + accepted tokens / drafts (the bonus token included);
- acceptance at position i = drafts whose first i+1 tokens were all accepted / drafts.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AcceptanceStats:
    k: int
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    rejected: int = 0  # drafts that ended in a rejection (fewer accepted than drafted)
    steps: int = 0  # target verification forwards, with or without a draft
    draft_tokens_per_pos: list[int] = field(default_factory=list)
    accepted_per_pos: list[int] = field(default_factory=list)
    propose_s: float = 0.0  # time inside the proposer (draft forwards, lookups, draft prefill)
    verify_s: float = 0.0  # target forwards of K+1 tokens + the accept/reject test + rollback

    def __post_init__(self):
        self.draft_tokens_per_pos = self.draft_tokens_per_pos or [0] * self.k
        self.accepted_per_pos = self.accepted_per_pos or [0] * self.k

    def observe(self, drafted: int, accepted: int, propose_s: float, verify_s: float) -> None:
        self.steps += 1
        self.propose_s += propose_s
        self.verify_s += verify_s
        if drafted == 0:
            return
        self.drafts += 1
        self.draft_tokens += drafted
        self.accepted += accepted
        self.rejected += accepted < drafted
        for i in range(drafted):
            self.draft_tokens_per_pos[i] += 1
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    def merge(self, other: "AcceptanceStats") -> "AcceptanceStats":
        k = max(self.k, other.k)
        pad = lambda v: list(v) + [0] * (k - len(v))  # noqa: E731
        return AcceptanceStats(
            k, self.drafts + other.drafts, self.draft_tokens + other.draft_tokens, self.accepted + other.accepted,
            self.rejected + other.rejected, self.steps + other.steps,
            [a + b for a, b in zip(pad(self.draft_tokens_per_pos), pad(other.draft_tokens_per_pos))],
            [a + b for a, b in zip(pad(self.accepted_per_pos), pad(other.accepted_per_pos))],
            self.propose_s + other.propose_s, self.verify_s + other.verify_s)

    @property
    def alpha(self) -> float:
        return self.accepted / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def beta(self) -> float:
        tested = self.accepted + self.rejected
        return self.accepted / tested if tested else 0.0

    @property
    def tau(self) -> float:
        return 1.0 + self.accepted / self.drafts if self.drafts else 1.0

    @property
    def acceptance_per_pos(self) -> list[float]:
        return [a / self.drafts if self.drafts else 0.0 for a in self.accepted_per_pos]

    @classmethod
    def from_dict(cls, d: dict) -> "AcceptanceStats":
        return cls(**{name: d[name] for name in cls.__dataclass_fields__})

    def to_dict(self) -> dict:
        return {"k": self.k, "drafts": self.drafts, "draft_tokens": self.draft_tokens, "accepted": self.accepted,
                "rejected": self.rejected, "steps": self.steps, "alpha": self.alpha, "beta": self.beta, "tau": self.tau,
                "acceptance_per_pos": self.acceptance_per_pos, "draft_tokens_per_pos": self.draft_tokens_per_pos,
                "accepted_per_pos": self.accepted_per_pos, "propose_s": self.propose_s, "verify_s": self.verify_s}
