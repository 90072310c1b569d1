"""``run_benchmark``: one configuration, one workload, one load level -> a BenchResult with its RunRecord.

Pass ``backend=`` to reuse a started engine across runs (the Optuna studies and the CLI do); otherwise one is
started and closed here. A spec-decode run given ``baseline=`` (the same backend without speculation, same
workload and load, measured in the same process) also reports its speedup and greedy token agreement.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from serving.backends import open_backend
from serving.backends.base import Backend, EngineFailure, ServingConfig
from serving.requests import Progress, Request, RequestResult
from serving.loadgen import LoadSpec, arrival_offsets
from evals.record import (EngineCondition, LengthDistribution, MetricCondition, ModelCondition, RunRecord,
                          hardware_info)
from serving.serving_metrics import METRIC_DEFINITIONS, SLO, length_distribution_stats, spec_summary, summarize
from serving.workloads import build_requests, WORKLOADS
from evals.build import model_weights_hash
from runtime.model_store import SMOLLM2, is_default_model, resolve_model
from runtime.generate import encode_prompt

WARMUP_PROMPT = "Say hello in three languages."  # not part of any workload: measured prompts stay cold
WARMUP_TOKENS = 8


@dataclass
class BenchResult:
    record: RunRecord
    results: list[RequestResult] = field(default_factory=list)

    @property
    def summary(self) -> dict:
        return self.record.results

    @property
    def failed(self) -> bool:
        return bool(self.summary.get("failed"))

    @property
    def effective_tok_s(self) -> float:
        return self.summary.get("effective_tok_s", 0.0)

    @property
    def alpha(self) -> float | None:
        return (self.summary.get("spec") or {}).get("alpha")

    @property
    def tau(self) -> float | None:
        return (self.summary.get("spec") or {}).get("tau")

    @property
    def speedup(self) -> float | None:
        return self.summary.get("speedup")


def warm_up(backend: Backend, load_kind: str) -> str:
    """Engine warm-up once per engine, on a prompt no workload uses; later runs find it warm."""
    engine = backend.engine_for(load_kind)
    if engine in backend.warm_runs:
        return f"{engine} already warm ({backend.warm_runs[engine]} earlier run(s) on it in this process)"
    ids = encode_prompt(backend.tokenizer(), WARMUP_PROMPT)
    what = backend.warm_up([Request(-1, ids, WARMUP_TOKENS), Request(-2, ids, WARMUP_TOKENS)], load_kind)
    backend.warm_runs[engine] = 0
    return f"{engine}: {what}; prompt {WARMUP_PROMPT!r} is not in the workload"


def run_benchmark(config: ServingConfig, workload: str, load: LoadSpec, *, backend: Backend | None = None,
                  num_prompts: int = 16, output_len: int | None = None, ignore_eos: bool = True,
                  data_dir: str | Path | None = None, slo: SLO = SLO(), baseline: BenchResult | None = None,
                  progress: Progress | None = None, seed: int = 0, max_total_tokens: int | None = None) -> BenchResult:
    own = backend is None
    backend = backend or open_backend(config)
    try:
        requests, source = build_requests(workload, backend.tokenizer(), num_prompts, output_len, ignore_eos,
                                          data_dir, seed, max_total_tokens)
        warmup = "; ".join(filter(None, (warm_up(backend, load.kind), backend.prepare(requests))))
        try:
            before = backend.spec_counters(load.kind)
            if load.kind == "closed":
                results = backend.closed_loop(requests, load.concurrency, progress)
            else:
                offsets = arrival_offsets(len(requests), load.rate, load.burstiness, load.seed)
                results = backend.open_loop(requests, offsets, progress)
            after = backend.spec_counters(load.kind)
        except EngineFailure as exc:
            backend.close()
            return BenchResult(_record(config, backend, workload, load, source, requests, [], warmup, ignore_eos,
                                       {"failed": True, "error": str(exc), "log_tail": exc.log_tail}))
        backend.warm_runs[backend.engine_for(load.kind)] += 1
        summary = summarize(results, slo)
        summary["peak_rss_mib"] = backend.peak_rss_bytes() / 2**20
        if after is not None:
            summary["spec"] = spec_summary(after - before)
        if baseline is not None and not baseline.failed:
            summary.update(_against_baseline(summary, results, baseline))
        return BenchResult(_record(config, backend, workload, load, source, requests, results, warmup, ignore_eos,
                                   summary), results)
    finally:
        if own:
            backend.close()


def _against_baseline(summary: dict, results: list[RequestResult], baseline: BenchResult) -> dict:
    base = {r.index: r.token_ids for r in baseline.results if r.ok}
    same = [r.token_ids == base[r.index] for r in results if r.ok and r.index in base]
    return {"speedup": summary["effective_tok_s"] / baseline.effective_tok_s if baseline.effective_tok_s else None,
            "baseline_effective_tok_s": baseline.effective_tok_s,
            "baseline_config": baseline.record.engine.config.get("spec") or "no speculation",
            "greedy_match_baseline": sum(same) / len(same) if same else None}


def _record(config: ServingConfig, backend: Backend, workload: str, load: LoadSpec, source: str,
            requests: list[Request], results: list[RequestResult], warmup: str, ignore_eos: bool,
            summary: dict) -> RunRecord:
    point = config.config
    path = resolve_model(point.model)
    in_stats, out_stats = length_distribution_stats(results) if results else ({}, {})
    if not results:
        in_stats = {"planned": [len(r.prompt_ids) for r in requests][:3]}
    sampling = "greedy (temperature 0)" if config.temperature == 0 else f"temperature {config.temperature}"
    return RunRecord(
        name=f"bench-{point.backend}-{workload if workload in _named() else Path(workload).stem}-{load.label}",
        model=ModelCondition(point.model, model_weights_hash(str(path)), f"bf16 activations, weights "
                             f"{point.scheme_label}, KV {point.kv}", point.scheme_label,
                             SMOLLM2.note if is_default_model(path) else ""),
        hardware=hardware_info(),
        lengths=LengthDistribution(len(requests), in_stats, out_stats | {"requested": requests[0].max_tokens},
                                   source, ignore_eos),
        arrival=load.arrival(),
        engine=EngineCondition(point.backend, {"serving_config": config.to_dict(), **backend.engine_config()},
                               warmup=warmup, cache_warmth=backend.cache_warmth),
        metric=MetricCondition(METRIC_DEFINITIONS,
                               f"{sampling}; {'ignore_eos, fixed output length' if ignore_eos else 'natural EOS'}; "
                               "tokens counted from returned ids; speculative runs compared token-by-token with "
                               "their baseline when one is given (greedy_match_baseline)"),
        results=summary,
    )


def _named() -> set[str]:
    return set(WORKLOADS)


__all__ = ["BenchResult", "run_benchmark", "ServingConfig", "LoadSpec", "SLO"]
