"""Acceptance and speed vs K for one proposer: measured beside Leviathan's prediction and a refined one.

Batch 1, sequential requests, fixed output length (ignore_eos). The plain-decoding baseline runs on the same
target, prompts, sampling and max length; speedup = speculative decode tok/s / plain decode tok/s (prefill
excluded from both; a draft model's own prefill counts against speculation).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import NamedTuple

import torch

from runtime.compiled import longest_per_span
from runtime.errors import UserError
from runtime.progress import Tick
from runtime.loading import LoadedModel
from runtime.measure import Sample, ratio_of_totals
from runtime.generate import Decoder, GenerationResult
from specdec.metrics import AcceptanceStats
from specdec.proposers import Proposer
from runtime.sampling import SamplingConfig
from specdec.proposers.base import MAX_K, check_k
from specdec.speculative import SpeculativeDecoder
from specdec.theory import expected_tokens, refined_speedup, walltime_speedup



def parse_ks(text: str) -> list[int]:
    """The one grammar of ``--k``: "1,2,4,8" -> [1, 2, 4, 8], "1-4" -> [1, 2, 3, 4], "1-4,8" -> [1, 2, 3, 4, 8];
    sorted, each a valid draft length."""
    ks: set[int] = set()
    for item in text.split(","):  # an empty item ("2,,4") is a typo, not a skip
        low, dash, high = item.strip().partition("-")
        try:
            low_k, high_k = int(low), int(high if dash else low)
        except ValueError:
            raise UserError(f"--k takes integers as a list (1,2,4,8), a range (1-8) or both (1-4,8), got {text!r}") \
                from None
        if low_k > high_k:
            raise UserError(f"--k range {item.strip()!r} runs backwards: write LOW-HIGH, e.g. {high_k}-{low_k}")
        ks.update(check_k(k) for k in range(low_k, high_k + 1))
    return sorted(ks)


class RunContext(NamedTuple):
    """Where a run verifies: a context, its weight (decode steps), and the positions its request reserved
    (``Decoder.reserve``: the span its compiled steps read; None: the decoder's)."""

    ids: list[int]
    weight: int
    positions: int | None = None


@torch.inference_mode()
def verify_cost_curve(decoder: Decoder, contexts: list[RunContext], max_draft: int,
                      repeats: int = 7) -> list[float]:
    """cost[n] = time of one target forward over n+1 new tokens / time of a 1-token decode step, through
    ``decoder``'s steps (compiled ones where it compiles), after a prefill of each ``RunContext``; times are
    summed over the contexts with their weights, so attention over long histories costs what it costs in the run.
    Sizes are interleaved and the minimum of ``repeats`` is kept: on a shared CPU noise only ever adds time."""
    total = [0.0] * (max_draft + 1)
    for ids, weight, positions in (RunContext(*c) for c in contexts):
        decoder.rollback(0)
        if positions:
            decoder.reserve(positions)
        decoder.forward(ids)
        start = decoder.pos
        tokens = (ids * (max_draft + 1))[: max_draft + 1]
        best = [float("inf")] * (max_draft + 1)
        for _ in range(repeats):
            for n in range(max_draft + 1):
                decoder.rollback(start)
                t = time.perf_counter()
                decoder.forward(tokens[: n + 1], compiled=True)
                best[n] = min(best[n], time.perf_counter() - t)
        total = [t + weight * b for t, b in zip(total, best)]
    return [t / total[0] for t in total]


def run_contexts(prompts: list[list[int]], base: list[GenerationResult],
                 max_new_tokens: int | None = None) -> list[RunContext]:
    """Where a run's verifications happen: each prompt plus the first half of its plain answer (its mean context
    during decoding), weighted by the answer's decode steps; with ``max_new_tokens``, the positions its request
    reserved."""
    return [RunContext(ids + r.tokens[: len(r.tokens) // 2], len(r.tokens) - 1,
                       max_new_tokens and len(ids) + max_new_tokens) for ids, r in zip(prompts, base)
            if len(r.tokens) > 1]


def decode_rate(results: list[GenerationResult]) -> tuple[float, float]:
    """(decode tok/s, seconds per token) over all results: tokens after the first / decode seconds."""
    tokens = sum(len(r.tokens) - 1 for r in results)
    seconds = sum(r.decode_s for r in results)
    return tokens / seconds, seconds / tokens


def decode_samples(results: list[GenerationResult]) -> list[Sample]:
    """Each result's decode tokens (after the first) and seconds."""
    return [Sample(len(r.tokens) - 1, r.decode_s) for r in results]


def draft_length_histogram(stats: AcceptanceStats) -> list[float]:
    """P(a verification step carried n draft tokens), n = 0..K."""
    per_pos = [*stats.draft_tokens_per_pos, 0]
    counts = [stats.steps - stats.drafts] + [per_pos[n - 1] - per_pos[n] for n in range(1, stats.k + 1)]
    return [c / stats.steps for c in counts]


@dataclass
class Predictions:
    predicted_speedup: float  # Leviathan et al. Thm 3.8
    refined_speedup: float  # measured mix of draft lengths and verify costs
    refined_no_mix: float  # every step drafts K, measured verify cost of K
    draft_length_hist: list[float]  # P(a step carried n draft tokens), n = 0..K


def predictions(stats: AcceptanceStats, c: float, verify_cost: list[float], padded: bool = False) -> Predictions:
    """Thm 3.8 (every step drafts K, verification costs one decode step) and the refined prediction: the
    measured mix of draft lengths (0..K, as a lookup proposer may find nothing), K·c for the drafted tokens
    and the measured verify cost of each length (``padded``: compiled verification runs every draft as K+1
    rows, ``SpeculativeDecoder.width``). Both use β, the per-token acceptance probability."""
    hist = draft_length_histogram(stats)
    tokens = sum(p * expected_tokens(stats.beta, n) for n, p in enumerate(hist))
    cost = stats.draft_tokens / stats.steps * c + sum(p * verify_cost[stats.k if padded and n else n]
                                                      for n, p in enumerate(hist))
    return Predictions(walltime_speedup(stats.beta, stats.k, c), tokens / cost,
                       refined_speedup(stats.beta, stats.k, c, verify_cost[stats.k]), hist)


@dataclass
class SweepRow:
    """One K of a sweep: acceptance, measured speed and the predictions (``to_dict`` is the record's row)."""
    k: int
    stats: AcceptanceStats
    tok_s: float
    speedup: float  # over plain decoding
    c: float  # proposer seconds per drafted token / plain decode seconds per token
    verify_cost: float  # V(K) from the verify-cost curve
    verify_cost_in_run: float
    predictions: Predictions
    per_request: list[dict]
    greedy_equal: int | None = None  # greedy runs: requests token-identical to plain decoding
    speedup_vs_reference: float | None = None  # with a reference build of the target
    speedup_ended: float | None = None  # to the end of turn: over the requests that ended
    speedup_ci: tuple[float, float] | None = None  # bootstrap 95% CI over the prompts (each ran both, interleaved)

    def to_dict(self) -> dict:
        p = self.predictions
        row = {"k": self.k, **self.stats.to_dict(), "tok_s": self.tok_s, "speedup": self.speedup, "c": self.c,
               "verify_cost": self.verify_cost, "verify_cost_in_run": self.verify_cost_in_run,
               "predicted_speedup": p.predicted_speedup, "refined_speedup": p.refined_speedup,
               "refined_no_mix": p.refined_no_mix, "draft_length_hist": p.draft_length_hist,
               "measured_over_predicted": self.speedup / p.predicted_speedup,
               "measured_over_refined": self.speedup / p.refined_speedup, "per_request": self.per_request}
        for key in ("greedy_equal", "speedup_vs_reference", "speedup_ended", "speedup_ci"):
            if getattr(self, key) is not None:
                row[key] = getattr(self, key)
        return row


@dataclass
class ReferenceRate:
    attention: str
    tok_s: float
    per_request_tok_s: list[float]


@dataclass
class Baseline:
    """Plain decoding on the same target, prompts, sampling and length (``to_dict`` is the record's baseline)."""
    tok_s: float
    step_ms: float
    requests: int
    per_request_tok_s: list[float]
    output_tokens: list[int]
    ended: list[bool]  # finished at the end of turn
    reference: ReferenceRate | None = None

    def to_dict(self) -> dict:
        out = asdict(self)
        if self.reference is None:
            del out["reference"]
        return out


@dataclass
class SweepResult:
    baseline: Baseline
    rows: list[SweepRow]
    verify_cost: list[float]
    ignore_eos: bool = True
    compile_mode: str | None = None
    step: str = "eager"  # what decoding ran (``Decoder.step_label``)
    compile_s: float = 0.0  # one-time build of the compiled steps, apart from every rate

    @property
    def best_k(self) -> int:
        return max(self.rows, key=lambda r: r.speedup).k


def run_sweep(target: LoadedModel, proposer: Proposer, ks: list[int], prompts: list[list[int]],
              max_new_tokens: int, sampling: SamplingConfig, tick: Tick = lambda _: None,
              reference: LoadedModel | None = None, ignore_eos: bool = True,
              compile_mode: str | None = None) -> SweepResult:
    """Per prompt: plain decoding, then speculative decoding at every K (interleaved, so load drift on a
    shared machine hits all rows alike); one excluded warm-up request per engine and K first. ``reference``:
    plain decoding on another build of the target too (e.g. its faster, not batch-invariant attention), so
    rows also carry the speedup over that. ``ignore_eos=False`` stops every run at the model's end of turn
    (Spec-Bench's protocol); greedy runs then emit the same tokens as plain decoding, so rates stay comparable.
    ``compile_mode``: plain and speculative decoding, and the verify cost curve, through compiled steps, each K's
    verification step (K+1 rows) compiled and probed before the timed runs."""
    if max_new_tokens < 2:
        raise UserError(f"a sweep times decoding after the first token: --output-len must be >= 2, "
                        f"got {max_new_tokens}")
    max_len = max(len(p) for p in prompts) + max_new_tokens + MAX_K + 1
    plain = Decoder(target, max_len, compile_mode=compile_mode)
    reference_plain = Decoder(reference, max_len) if reference else None
    spec = SpeculativeDecoder(target, proposer, ks[0], sampling, max_len, compile_mode)
    # one prompt of each cache span the runs reach (Decoder.reserve): its steps are built first
    longest = longest_per_span(prompts, lambda ids: len(ids) + max_new_tokens, max_len)
    # each K's step, until one refuses
    fell = next(filter(None, (spec.prepare(ids, k, len(ids) + max_new_tokens) for ids in longest.values()
                              for k in ks)), None)
    if fell:  # plain decoding on the step speculation runs, so that speedup, c and V(K) compare like with like
        plain.fall_back(f"as speculation: {fell}")
    for ids in longest.values():
        warm = dict(ignore_eos=True, positions=len(ids) + max_new_tokens)
        for decoder in filter(None, (plain, reference_plain)):
            decoder.generate(ids, min(8, max_new_tokens), sampling, **warm)
        for k in ks:
            spec.k = k
            spec.generate(ids, min(8, max_new_tokens), **warm)
    base, ref, runs = [], [], {k: [] for k in ks}
    for ids in prompts:
        base.append(plain.generate(ids, max_new_tokens, sampling, ignore_eos=ignore_eos))
        tick("plain")
        if reference_plain:
            ref.append(reference_plain.generate(ids, max_new_tokens, sampling, ignore_eos=ignore_eos))
            tick("reference plain")
        for k in ks:
            spec.k = k
            runs[k].append(spec.generate(ids, max_new_tokens, ignore_eos=ignore_eos))
            tick(f"K={k}")
    contexts = run_contexts(prompts, base, max_new_tokens)  # the answers with a decode step
    if not contexts:
        raise UserError("every answer ended at its first token, so there is no decoding to time: use more prompts "
                        "or drop --natural-eos")
    plain_tok_s, step_s = decode_rate(base)
    ref_tok_s = decode_rate(ref)[0] if ref else None
    # to the end of turn: also the rate over the answers the model finished, apart from runs that loop to the limit
    ended = [i for i, b in enumerate(base) if b.finish_reason == "eos"]
    ended_tok_s = decode_rate([base[i] for i in ended])[0] if ended and not ignore_eos else None
    curve = verify_cost_curve(spec.decoder, contexts, max(ks))
    rows = []
    for k, results in runs.items():
        stats = AcceptanceStats(k)
        for r in results:
            stats = stats.merge(AcceptanceStats.from_dict(r.stats))
        tok_s, _ = decode_rate(results)
        c = (stats.propose_s / max(stats.draft_tokens, 1)) / step_s
        rows.append(SweepRow(
            k, stats, tok_s, tok_s / plain_tok_s, c, curve[k], stats.verify_s / stats.steps / step_s,
            predictions(stats, c, curve, padded=spec.decoder.compile_mode is not None),
            [{"alpha": r.stats["alpha"], "tau": r.stats["tau"], "tok_s": r.decode_tokens_per_s,
              "acceptance_per_pos": r.stats["acceptance_per_pos"],
              **{n: r.stats[n] for n in ("accepted", "draft_tokens", "drafts")}} for r in results],  # for α/τ CIs
            greedy_equal=sum(r.tokens == b.tokens for r, b in zip(results, base)) if sampling.greedy else None,
            speedup_vs_reference=tok_s / ref_tok_s if ref_tok_s else None,
            speedup_ended=decode_rate([results[i] for i in ended])[0] / ended_tok_s if ended_tok_s else None,
            speedup_ci=ratio_of_totals(decode_samples(base), decode_samples(results)).ci))
    reference_rate = ReferenceRate(reference.model.attn_implementation, ref_tok_s,
                                   [r.decode_tokens_per_s for r in ref]) if reference else None
    baseline = Baseline(plain_tok_s, step_s * 1e3, len(prompts), [r.decode_tokens_per_s for r in base],
                        [len(r.tokens) for r in base], [r.finish_reason == "eos" for r in base], reference_rate)
    return SweepResult(baseline, rows, curve, ignore_eos, compile_mode, spec.decoder.step_label,
                       plain.compile_s + spec.decoder.compile_s)
