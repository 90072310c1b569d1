"""The requests a serving backend serves and what each one saw: plain records shared by the backends, the load
generator and the serving metrics (no engine imports, so any of them can import it first)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from runtime.errors import UserError


@dataclass
class Request:
    """One prompt to serve: token ids (chat template applied) and the output budget."""

    index: int
    prompt_ids: list[int]
    max_tokens: int
    ignore_eos: bool = True


@dataclass
class RequestResult:
    """What one request saw, timestamps in seconds on the client's ``time.perf_counter`` clock.

    ``scheduled`` is the planned send time (open loop) or None; ``sent`` is when the request really entered
    the engine's queue; ``chunk_times`` are the arrival times of each streamed chunk of tokens (several tokens
    per chunk under speculation); empty when the backend does not stream."""

    index: int
    prompt_tokens: int
    sent: float
    scheduled: float | None = None
    started: float | None = None  # when the engine began serving it (native: known; vLLM: unknown -> None)
    first_token: float | None = None
    end: float | None = None
    token_ids: list[int] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None

    @property
    def output_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None


@dataclass
class SpecCounters:
    """Cumulative proposer counters; deltas over a measured window give α, τ and per-position acceptance."""

    drafts: int = 0  # verification steps that carried a draft
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __sub__(self, other: "SpecCounters") -> "SpecCounters":
        n = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        pad = lambda v: list(v) + [0] * (n - len(v))  # noqa: E731
        return SpecCounters(self.drafts - other.drafts, self.draft_tokens - other.draft_tokens,
                            self.accepted - other.accepted,
                            [a - b for a, b in zip(pad(self.accepted_per_pos), pad(other.accepted_per_pos))])

    def __add__(self, other: "SpecCounters") -> "SpecCounters":
        return other - SpecCounters(-self.drafts, -self.draft_tokens, -self.accepted,
                                    [-a for a in self.accepted_per_pos])


Progress = Callable[[RequestResult], None]


def now() -> float:
    return time.perf_counter()


def check_fits(requests: list[Request], max_model_len: int) -> None:
    longest = max(len(r.prompt_ids) + r.max_tokens for r in requests)
    if longest > max_model_len:
        raise UserError(f"a request needs {longest} tokens (prompt + output) but max_model_len is {max_model_len}; "
                        "raise --max-model-len or lower --output-len")
