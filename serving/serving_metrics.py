"""Serving metrics from per-request results: effective tok/s, latency percentiles, goodput, α/τ.

``METRIC_DEFINITIONS`` states each definition and goes into every RunRecord. α/τ follow specdec.metrics
(vLLM's definitions), so native and vLLM numbers are comparable field by field.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from serving.requests import RequestResult, SpecCounters
from runtime.errors import UserError
from specdec.metrics import AcceptanceStats

PERCENTILES = (50, 90, 99)

METRIC_DEFINITIONS = {
    "effective_tok_s": "output tokens actually emitted (counted from the returned token ids, after acceptance) "
                       "summed over successful requests / measured window (first send to last completion)",
    "requests_s": "successful requests / measured window",
    "ttft_s": "first token arrival - real send time (includes queueing in the engine and, for native, behind "
              "earlier requests)",
    "tpot_s": "(end - first token) / (output tokens - 1), per request",
    "itl_s": "gaps between successive streamed chunks (one chunk can carry several tokens under speculation); "
             "native: when each decode or verification step finished (in-process, no transport)",
    "e2e_s": "completion - real send time",
    "queue_s": "engine start of service - send time (native batch-1 only; vLLM does not expose it per request "
               "in-process)",
    "send_lag_s": "open loop: real send - planned Poisson send time (client-side lag, never hidden)",
    "goodput_rps": "requests/s that met the SLO (TTFT and TPOT both within bounds)",
    "alpha": "accepted draft tokens / drafted tokens over the measured window",
    "tau": "1 + accepted / drafts (a draft = one verification step that carried >= 1 draft token)",
    "accepted_per_pos": "drafts whose first i+1 tokens were all accepted / drafts",
    "speedup": "effective tok/s of this config / the same backend without speculation on the same workload and "
               "load, measured in the same run",
    "peak_rss_mib": "peak resident memory (VmHWM): native = the whole benchmark process; vLLM = the engine-core "
                    "and worker processes (+ the vllm serve process tree), not the client",
}


@dataclass(frozen=True)
class SLO:
    """Goodput bounds in seconds (defaults 2 s TTFT, 0.2 s TPOT); an unbounded one is ``inf``."""

    ttft_s: float = 2.0
    tpot_s: float = 0.2

    @classmethod
    def parse(cls, text: str) -> "SLO":
        """``vllm bench serve``'s ``--goodput``: "ttft:2000,tpot:200" (ms, comma or space separated); a bound left
        out does not count, as there."""
        bounds = {}
        for item in text.replace(",", " ").split():
            key, _, value = item.partition(":")
            try:
                ms = float(value)
            except ValueError:
                ms = -1.0
            if key not in ("ttft", "tpot") or f"{key}_s" in bounds or not ms > 0:
                raise UserError(f"--goodput takes ttft:MS and/or tpot:MS, each once and > 0 "
                                f"(e.g. ttft:2000,tpot:200), got {text!r}")
            bounds[f"{key}_s"] = ms / 1e3
        if not bounds:
            raise UserError("--goodput needs at least one bound, e.g. ttft:2000,tpot:200")
        return cls(**{"ttft_s": float("inf"), "tpot_s": float("inf"), **bounds})

    def met(self, r: RequestResult) -> bool:
        ttft, tpot = _ttft(r), _tpot(r)
        return r.ok and ttft is not None and ttft <= self.ttft_s and (tpot is None or tpot <= self.tpot_s)


def _ttft(r: RequestResult) -> float | None:
    return r.first_token - r.sent if r.first_token is not None else None


def _tpot(r: RequestResult) -> float | None:
    if r.first_token is None or r.end is None or r.output_tokens < 2:
        return None
    return (r.end - r.first_token) / (r.output_tokens - 1)


def percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    arr = np.asarray(values, dtype=float)
    out = {f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}
    out["mean"] = float(arr.mean())
    return out


def length_stats(values: list[int]) -> dict:
    if not values:
        return {}
    return {"mean": float(np.mean(values)), "min": int(min(values)), "max": int(max(values))}


def summarize(results: list[RequestResult], slo: SLO = SLO()) -> dict:
    """The headline numbers of one measured window."""
    ok = [r for r in results if r.ok]
    window = (max(r.end for r in ok) - min(r.sent for r in results)) if ok else 0.0
    tokens = sum(r.output_tokens for r in ok)
    itl = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    out = {
        "n_requests": len(results),
        "n_failed": len(results) - len(ok),
        "window_s": window,
        "output_tokens": tokens,
        "effective_tok_s": tokens / window if window > 0 else 0.0,
        "requests_s": len(ok) / window if window > 0 else 0.0,
        "goodput_rps": sum(slo.met(r) for r in ok) / window if window > 0 else 0.0,
        "slo": asdict(slo),
        "ttft_s": percentiles([t for r in ok if (t := _ttft(r)) is not None]),
        "tpot_s": percentiles([t for r in ok if (t := _tpot(r)) is not None]),
        "itl_s": percentiles(itl),
        "e2e_s": percentiles([r.end - r.sent for r in ok]),
        "finish_reasons": {k: sum(r.finish_reason == k for r in ok) for k in sorted({r.finish_reason for r in ok})},
    }
    queue = [r.started - r.sent for r in ok if r.started is not None]
    if queue:
        out["queue_s"] = percentiles(queue)
    lag = [r.sent - r.scheduled for r in results if r.scheduled is not None]
    if lag:
        out["send_lag_s"] = percentiles(lag) | {"max": float(max(lag))}
    errors = [r.error for r in results if r.error]
    if errors:
        out["errors"] = sorted(set(errors))[:5]
    return out


def spec_summary(delta: SpecCounters) -> dict:
    """α, τ and per-position acceptance from counter deltas over the measured window (specdec's definitions)."""
    stats = AcceptanceStats(len(delta.accepted_per_pos), delta.drafts, delta.draft_tokens, delta.accepted,
                            accepted_per_pos=list(delta.accepted_per_pos))
    return {"alpha": stats.alpha if stats.drafts else None, "tau": stats.tau if stats.drafts else None,
            "accepted_per_pos": stats.acceptance_per_pos, "drafts": stats.drafts,
            "draft_tokens": stats.draft_tokens, "accepted": stats.accepted}


def length_distribution_stats(results: list[RequestResult]) -> tuple[dict, dict]:
    """(input, output) token-count stats of what was really served."""
    return (length_stats([r.prompt_tokens for r in results]),
            length_stats([r.output_tokens for r in results if r.ok]))
