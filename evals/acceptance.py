"""Acceptance and speed vs K (``quantspec.measure_acceptance``) and the lossless check
(``quantspec.check_lossless``) as run records: specdec/ measures, this module writes the conditions down."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from evals.record import (ArrivalProcess, EngineCondition, LengthDistribution, MetricCondition, ModelCondition,
                          RunRecord, hardware_info)
from runtime.data import load_prompts
from runtime.errors import UserError
from runtime.progress import Tick, log_ticks
from runtime.generate import encode_prompt
from runtime.loading import LoadedModel, load_model
from runtime.model_store import SMOLLM2, is_default_model, weights_hash
from runtime.sampling import SamplingConfig
from specdec.lossless import (ALPHA, Chain, DistributionTest, FirstStepTest, JointTest, bonus_test, first_step_test,
                              greedy_mismatches, joint_test)
from specdec.proposers import Proposer, build_proposer
from specdec.proposers.base import MAX_K, check_k
from specdec.speculative import SpeculativeDecoder
from specdec.sweep import SweepResult, run_sweep
from specdec.theory import best_k

logger = logging.getLogger(__name__)

SYNTHETIC_VOCAB = 6

METRICS = {
    "alpha": "accepted draft tokens / drafted tokens (vLLM draft acceptance rate)",
    "beta": "accepted / tested draft tokens, tested = up to and including the first rejection (the per-token "
            "acceptance probability of Leviathan et al.; the predictions use it)",
    "tau": "1 + accepted / drafts, a draft = a verification step carrying >= 1 draft token (vLLM mean "
           "acceptance length, Spec-Bench)",
    "acceptance_per_pos": "drafts whose first i+1 tokens were accepted / drafts (vLLM per-position rate)",
    "tok_s": "decode tok/s = (new tokens - 1) / decode seconds, summed over requests, prefill excluded",
    "speedup": "speculative tok/s / plain-decoding tok/s, same target, prompts, sampling and length",
    "c": "proposer seconds per drafted token / plain decode seconds per token",
    "verify_cost": "target forward over K+1 tokens / one decode step (min of 7 after each prompt and half its "
                   "answer; summed over prompts weighted by decode steps)",
    "predicted_speedup": "Leviathan et al. Thm 3.8: (1-b^(K+1)) / ((1-b)(Kc+1)) with b = beta",
    "refined_speedup": "expected tokens per step over the measured mix of draft lengths / (drafted tokens per "
                       "step * c + measured verify cost of each length)",
}


def model_condition(target: str, lm: LoadedModel) -> ModelCondition:
    return ModelCondition(target, weights_hash(lm.path), lm.precision,
                          note=SMOLLM2.note if is_default_model(lm.path) else "")


def sweep_record(target: str, lm: LoadedModel, proposer: str, sampling: SamplingConfig, source: str,
                 prompts: list[list[int]], max_new_tokens: int, sweep: SweepResult) -> RunRecord:
    lengths = [len(p) for p in prompts]
    emitted, ignore_eos = sweep.baseline.output_tokens, sweep.ignore_eos
    output = {"fixed": max_new_tokens} if ignore_eos else {
        "max": max_new_tokens, "stop": "end of turn", "mean": sum(emitted) / len(emitted), "min": min(emitted)}
    return RunRecord(
        name="specdec-accept",
        model=model_condition(target, lm),
        hardware=hardware_info(lm.model),
        lengths=LengthDistribution(len(prompts), {"mean": sum(lengths) / len(lengths), "min": min(lengths),
                                                  "max": max(lengths)}, output, source, ignore_eos),
        arrival=ArrivalProcess("batch-1 sequential", 1),
        engine=EngineCondition("native", {"dtype": lm.precision, "attention": lm.model.attn_implementation,
                                          "threads": torch.get_num_threads(),
                                          "proposer": proposer, "sampling": vars(sampling),
                                          "compile_mode": sweep.compile_mode, "step": sweep.step,
                                          "compile_s": sweep.compile_s},
                               warmup=("each K's verification step (K+1 rows) compiled and probed (compile_s, one-time); "
                                       if sweep.compile_mode else "") +
                                      "one 8-token request per engine (plain and each K), excluded",
                               cache_warmth="KV caches reset per request; weights resident in RAM"),
        metric=MetricCondition(METRICS, "greedy rows: tokens compared with plain greedy decoding "
                                        "(greedy_equal = identical requests); " + (
                                            "ignore_eos, fixed output length" if ignore_eos else
                                            "stop at end of turn (same tokens for plain and greedy speculation)")),
        results={"proposer": proposer, "baseline": sweep.baseline.to_dict(), "rows": [r.to_dict() for r in sweep.rows],
                 "verify_cost_curve": sweep.verify_cost, "best_k_measured": sweep.best_k,
                 "best_k_theory": best_k(sweep.rows[-1].stats.beta, sweep.rows[-1].c,
                                         lambda k: sweep.verify_cost[min(k, len(sweep.verify_cost) - 1)],
                                         k_max=len(sweep.verify_cost) - 1)},
    )


def prompt_ids(lm: LoadedModel, texts: list[str]) -> list[list[int]]:
    return [encode_prompt(lm.tokenizer, text) for text in texts]


def measure_acceptance(lm: LoadedModel | str, target: str, spec: Proposer | str, ks: list[int], texts: list[str],
                       source: str, max_new_tokens: int, sampling: SamplingConfig = SamplingConfig(),
                       reference: LoadedModel | None = None, ignore_eos: bool = True,
                       tick: Tick | None = None, compile_mode: str | None = None) -> RunRecord:
    """Acceptance (α, β, τ, per position) and speedup vs K of one proposer, one row per K, beside Leviathan's
    prediction. ``lm``: a loaded target or a model name (loaded bf16 with eager attention); ``spec``: a
    Proposer or its spec text (``ngram:min=2,max=4``); ``reference``, ``ignore_eos``, ``compile_mode``: see
    specdec.sweep.run_sweep; ``tick(what)`` after every request (default: INFO log lines, runtime.progress). The
    Python API behind ``quantspec accept``."""
    tick = tick or log_ticks(logger)
    if isinstance(lm, str):
        lm = load_model(lm, "bf16", None, "eager")
    proposer = build_proposer(spec, lm) if isinstance(spec, str) else spec
    prompts = prompt_ids(lm, texts)
    sweep = run_sweep(lm, proposer, ks, prompts, max_new_tokens, sampling, tick, reference, ignore_eos, compile_mode)
    return sweep_record(target, lm, proposer.label, sampling, source, prompts, max_new_tokens, sweep)


@dataclass
class LosslessReport:
    """What ``check_lossless`` found: ``rows`` are (check, passed or None for information, detail)."""
    label: str
    k: int
    precision: str
    limit: int
    max_new_tokens: int
    alpha: float
    mismatches: list
    rows: list[tuple[str, bool | None, str]]
    record: RunRecord

    @property
    def passed(self) -> bool:
        return not self.mismatches and not any(passed is False for _, passed, _ in self.rows)


def distribution_detail(t: DistributionTest) -> str:
    detect = (f"detectable TV {t.detectable_tv:.3f} at power {t.power:g}" if t.detectable_tv < 1 else
              "detects no TV at this sample count (raise --samples or set --top-k)")
    return (f"TV {t.tv:.3f} vs threshold {t.tv_threshold:.3f} (exact sampler E[TV] <= {t.tv_bound:.3f}); {detect}; "
            f"chi2 p={t.p_value:.3g} (info)")


def acceptance_detail(a) -> str:
    return (f"{a.rate:.3f} vs Σmin(p,q) = {a.expected:.3f} over {a.rounds} rounds, region "
            f"[{a.region[0] / a.rounds:.3f}, {a.region[1] / a.rounds:.3f}]; detectable shift {a.detectable_shift:.3f}")


def lossless_rows(model_tests: list[FirstStepTest], joint: JointTest, bonus: DistributionTest, samples: int,
                  temperature: float) -> list[tuple[str, bool | None, str]]:
    """(check, passed or None for information, detail): one fact per row."""
    rows = []
    for i, t in enumerate(model_tests):
        rows.append((f"prefix {i}: first token ({samples} samples, T={temperature})", t.distribution.passed,
                     distribution_detail(t.distribution)))
        rows.append((f"prefix {i}: first-position acceptance", None, "no draft after this prefix") if t.acceptance is None
                    else (f"prefix {i}: first-position acceptance", t.acceptance.passed, acceptance_detail(t.acceptance)))
    rows.append((f"synthetic V={SYNTHETIC_VOCAB}: first 3 tokens jointly (K=2)", joint.distribution.passed,
                 distribution_detail(joint.distribution)))
    rows.append((f"synthetic V={SYNTHETIC_VOCAB}: first-position acceptance", joint.acceptance.passed,
                 acceptance_detail(joint.acceptance)))
    rows.append((f"synthetic V={SYNTHETIC_VOCAB}: bonus token after K=2 accepted", bonus.passed,
                 f"{bonus.samples} bonus tokens; " + distribution_detail(bonus)))
    return rows


def check_lossless(model: str = "default", spec: str = "ngram", k: int = 4, prompts: str = "spec_bench",
                   limit: int = 4, max_new_tokens: int = 48, samples: int = 400, prefixes: int = 2,
                   synthetic_samples: int = 20000, sampling: SamplingConfig = SamplingConfig(1.0),
                   dtype: str = "bf16", threads: int | None = None, alpha: float = ALPHA,
                   data_dir: str | None = None, tick: Tick | None = None,
                   compile_mode: str | None = None) -> LosslessReport:
    """Greedy token equality with plain decoding on ``limit`` prompts; sampled first steps on ``prefixes``
    prompts (TV beyond the exact-sampler noise, first-position acceptance vs Σ min(p, q)); a synthetic
    joint/bonus test with known p, q. ``tick(what)`` per greedy prompt and per sample (default: INFO log lines).
    ``compile_mode``: both decodings through compiled steps."""
    tick = tick or log_ticks(logger)
    if not 0 < alpha < 1:
        raise UserError(f"--alpha must be in (0, 1), got {alpha}")
    check_k(k)
    lm = load_model(model, dtype, threads, "eager")
    ids = prompt_ids(lm, load_prompts(prompts, data_dir, max(limit, prefixes)))
    max_len = max(len(p) for p in ids) + max_new_tokens + MAX_K + 1
    decoder = SpeculativeDecoder(lm, spec, k, SamplingConfig(), max_len, compile_mode)
    mismatches = greedy_mismatches(decoder, ids[:limit], max_new_tokens, lambda: tick("greedy equality"))
    decoder.sampling = sampling
    model_tests = [first_step_test(decoder, p, samples, lambda: tick("first-step distribution"), alpha)
                   for p in ids[:prefixes]]
    chain = Chain.random(SYNTHETIC_VOCAB, sampling.seed or 0)
    joint = joint_test(chain, k=2, length=3, n=synthetic_samples, seed=sampling.seed or 0, alpha=alpha)
    bonus = bonus_test(chain, k=2, n=synthetic_samples, seed=sampling.seed or 0, alpha=alpha)
    rows = lossless_rows(model_tests, joint, bonus, samples, sampling.temperature)
    failed = bool(mismatches) or any(passed is False for _, passed, _ in rows)
    record = RunRecord(
        name="specdec-check-lossless", model=model_condition(model, lm), hardware=hardware_info(lm.model),
        lengths=LengthDistribution(limit, {"prompts": [len(p) for p in ids]}, {"fixed": max_new_tokens}, prompts, True),
        arrival=ArrivalProcess("batch-1 sequential", 1),
        engine=EngineCondition("native", {"dtype": lm.precision, "attention": lm.model.attn_implementation,
                                          "proposer": decoder.proposer.label, "k": k,
                                          "sampling": vars(sampling), "compile_mode": compile_mode}),
        metric=MetricCondition({"tv": "0.5 * sum |empirical - target p|; fails above tv_threshold = "
                                      "tv_bound + sqrt(ln(1/alpha)/(2n)) (McDiarmid)",
                                "detectable_tv": "true TV failed with probability >= power",
                                "acceptance": "first draft token accepted / rounds vs Σ min(p, q); fails "
                                              "outside the exact binomial region at level alpha",
                                "p_value": "scipy chisquare, bins with < 5 expected samples merged (info)"},
                               f"greedy token-exact; every TV and acceptance test passes at alpha={alpha:g}"),
        results={"passed": not failed, "greedy_mismatches": mismatches,
                 "first_step": [t.to_dict() for t in model_tests],
                 "synthetic": {"vocab": SYNTHETIC_VOCAB, "joint": joint.to_dict(), "bonus": bonus.to_dict()}},
    )
    return LosslessReport(decoder.proposer.label, k, lm.precision, limit, max_new_tokens, alpha, mismatches, rows,
                          record)
