"""``vllm bench serve``'s result file from a quantspec run (``quantspec bench --save-result``).

``vllm_result(run)`` maps one BenchResult (one configuration at one load point) to the dict ``vllm bench serve
--save-result --save-detailed`` writes: its setup keys (date, backend, label, model_id, ...), traffic keys
(request_rate, burstiness, max_concurrency) and every key ``benchmark()`` puts in its result (duration,
completed, throughputs, per-request lists, mean/median/std/pNN of TTFT, TPOT, ITL and E2EL in ms, client queue
time under a concurrency cap, spec_decode_* when speculating), computed with vLLM's definitions from the same
per-request timestamps quantspec's summary uses. quantspec's own numbers (effective tok/s, α, τ, speedup, the
run record with its six conditions) go under one key, ``quantspec``. A closed loop of C clients is vLLM's
``--request-rate inf --max-concurrency C``; an open loop is ``--request-rate λ --burstiness b``. File names follow
vLLM's default, ``{label}-{request_rate}qps[-concurrency{C}]-{model}-{date}.json``.
"""
from __future__ import annotations

import math
import re
import time
from pathlib import Path

import numpy as np

from serving.bench_api import BenchResult
from evals.record import write_json_atomic
from runtime.loading import load_tokenizer
from runtime.model_store import resolve_model

PERCENTILES = (50, 90, 99)  # vLLM's --metric-percentiles (its default: 99)
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")  # all of them (vLLM's default for generation: ttft,tpot,itl)


def _stats(name: str, values: list[float]) -> dict:
    """vLLM's ``process_one_metric``: mean/median/std/pNN of ``values`` (seconds) in ms; 0 when empty."""
    arr = np.asarray(values or [0.0], dtype=float) * 1000
    out = {f"mean_{name}_ms": float(arr.mean()), f"median_{name}_ms": float(np.median(arr)),
           f"std_{name}_ms": float(arr.std())}
    out.update({f"p{p}_{name}_ms": float(np.percentile(arr, p)) for p in PERCENTILES})
    return out


def _peaks(ok: list) -> tuple[float, int]:
    """vLLM's max_output_tokens_per_s / max_concurrent_requests: one-second buckets from the first send; a
    streamed chunk counts once (as in vLLM, whose ITLs are chunk gaps), each request in every second it spans."""
    if not ok:
        return 0.0, 0
    t0 = min(r.sent for r in ok)
    n = int(np.ceil(max(r.end for r in ok) - t0)) + 1
    tokens, active = np.zeros(n), np.zeros(n)
    for r in ok:
        for t in r.chunk_times or [r.first_token]:
            if t is not None and 0 <= int(t - t0) < n:
                tokens[int(t - t0)] += 1
        for second in range(int(r.sent - t0), int(r.end - t0) + 1):
            active[second] += 1
    return float(tokens.max()), int(active.max())


def vllm_result(run: BenchResult, decode=None, date: str | None = None, label: str | None = None) -> dict:
    """One run in ``vllm bench serve``'s result schema (see the module docstring). ``decode(token_ids) -> str``
    fills ``generated_texts`` (None per request without it); ``date`` is vLLM's ``%Y%m%d-%H%M%S``."""
    rec, summary = run.record, run.summary
    config = rec.engine.config.get("serving_config", {})
    arrival = rec.arrival
    closed = arrival.kind == "closed-loop"
    results = sorted(run.results, key=lambda r: r.index)
    ok = [r for r in results if r.ok]
    duration = summary.get("window_s", 0.0)
    t0 = min((r.sent for r in results), default=0.0)
    ttft = lambda r: r.first_token - r.sent if r.ok and r.first_token is not None else 0.0  # noqa: E731
    itls = [[b - a for a, b in zip(r.chunk_times, r.chunk_times[1:])] if r.ok else [] for r in results]
    # vLLM: time a request waited for a free client; a closed loop's requests all arrive at the start
    queue = [(r.sent - t0 if closed else r.sent - r.scheduled if r.scheduled is not None else 0.0) for r in results]
    total_in = sum(r.prompt_tokens for r in ok)
    out_lens = [r.output_tokens if r.ok else 0 for r in results]
    max_tok_s, max_active = _peaks(ok)
    model_id = str(rec.model.model_id)
    result = {
        "date": date or time.strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": rec.engine.backend,
        "backend": rec.engine.backend,
        "label": label or default_label(run),
        "model_id": model_id,
        "tokenizer_id": model_id,
        "num_prompts": rec.lengths.n_requests,
        "request_rate": "inf" if closed else arrival.rate_rps,
        "burstiness": 1.0 if closed else arrival.burstiness,
        "max_concurrency": arrival.concurrency if closed else None,
        # benchmark()'s result
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": sum(out_lens),
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "request_goodput": summary.get("goodput_rps"),
        "output_throughput": sum(out_lens) / duration if duration > 0 else 0.0,
        "total_token_throughput": (total_in + sum(out_lens)) / duration if duration > 0 else 0.0,
        "input_lens": [r.prompt_tokens for r in results],
        "output_lens": out_lens,
        "ttfts": [ttft(r) for r in results],
        "itls": itls,
        "latencies": [r.end - r.sent if r.ok else 0.0 for r in results],
        "start_times": [r.sent for r in results],
        "queue_times": queue,
        "generated_texts": [decode(r.token_ids) if decode and r.ok else None for r in results],
        "errors": [r.error or "" for r in results],
        "max_output_tokens_per_s": max_tok_s,
        "max_concurrent_requests": max_active,
        "rtfx": 0.0,  # audio real-time factor: no audio input
    }
    spec = summary.get("spec") or {}
    if spec.get("draft_tokens"):  # vLLM reports these when the server drafted in the window
        result.update({
            "spec_decode_acceptance_rate": 100 * spec["accepted"] / spec["draft_tokens"],
            "spec_decode_acceptance_length": spec["tau"] if spec.get("tau") is not None else 0.0,
            "spec_decode_num_drafts": int(spec["drafts"]),
            "spec_decode_draft_tokens": int(spec["draft_tokens"]),
            "spec_decode_accepted_tokens": int(spec["accepted"]),
            "spec_decode_per_position_acceptance_rates": list(spec.get("accepted_per_pos") or []),
        })
    tpots = [(r.end - r.first_token) / (r.output_tokens - 1) for r in ok
             if r.first_token is not None and r.output_tokens > 1]
    per_metric = {"ttft": [ttft(r) for r in ok], "tpot": tpots, "itl": [g for gaps in itls for g in gaps],
                  "e2el": [r.end - r.sent for r in ok]}
    for name in PERCENTILE_METRICS:
        result.update(_stats(name, per_metric[name]))
    if closed:  # vLLM: under --max-concurrency
        result.update(_stats("client_queue_time", [q for q, r in zip(queue, results) if r.ok]))
    result["quantspec"] = {
        "proposer": config.get("spec") or "no speculation", "k": config.get("k") if config.get("spec") else None,
        "effective_tok_s": summary.get("effective_tok_s"),
        "alpha": spec.get("alpha"), "tau": spec.get("tau"),
        "speedup": summary.get("speedup"), "baseline_effective_tok_s": summary.get("baseline_effective_tok_s"),
        "greedy_match_baseline": summary.get("greedy_match_baseline"),
        "goodput_slo_s": summary.get("slo"), "repeats": summary.get("repeats"),
        "notes": "vLLM fields from quantspec's per-request timestamps (seconds in the lists, ms in the stats); "
                 "output_throughput counts tokens emitted, after acceptance (= effective_tok_s)",
        "run_record": rec.to_dict(),
    }
    return result


def default_label(run: BenchResult) -> str:
    """vLLM's label defaults to the backend; a speculative run adds its proposer, so it and its baseline at one
    load point get different files."""
    config = run.record.engine.config.get("serving_config", {})
    spec = config.get("spec")
    label = run.record.engine.backend + (f"-{spec}-k{config.get('k')}" if spec else "")
    return re.sub(r"[^A-Za-z0-9._=-]+", "_", label)


def _load_tag(result: dict) -> str:
    rate = result["request_rate"]
    rate = "inf" if rate == "inf" or (isinstance(rate, float) and math.isinf(rate)) else str(float(rate))
    concurrency = f"-concurrency{result['max_concurrency']}" if result["max_concurrency"] is not None else ""
    return f"{result['label']}-{rate}qps{concurrency}"


def result_filename(result: dict) -> str:
    """vLLM's default name: ``{label}-{request_rate}qps[-concurrency{C}]-{base_model_id}-{date}.json``."""
    base_model_id = Path(str(result["model_id"]).rstrip("/")).name or "model"
    return f"{_load_tag(result)}-{base_model_id}-{result['date']}.json"


def _decoder(model_id: str):
    """``token_ids -> text`` with the model's tokenizer (None where it cannot be loaded: texts stay None)."""
    try:
        tokenizer = load_tokenizer(resolve_model(model_id))
    except Exception:  # noqa: BLE001 - generated_texts are optional in vLLM's schema too
        return None
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def save_results(runs: list[BenchResult], result_dir: str | None = None, filename: str | None = None,
                 decode=None) -> list[Path]:
    """Write one ``vllm bench serve`` result file per successful run (configuration x load point) under
    ``result_dir`` (default: the current directory), named as vLLM names them. ``filename`` (vLLM's
    ``--result-filename``) names the file when there is one run; with several, each is
    ``{stem}-{label}-{rate}qps[-concurrencyC]{suffix}``. Failed runs (no per-request results) are skipped.
    ``decode`` defaults to the model's tokenizer (generated_texts)."""
    ok = [r for r in runs if not r.failed]
    if ok and decode is None:
        decode = _decoder(ok[0].record.model.model_id)
    date = time.strftime("%Y%m%d-%H%M%S")
    results = [vllm_result(r, decode, date) for r in ok]
    paths = []
    for result in results:
        name = result_filename(result)
        if filename:
            given = Path(filename)
            name = str(given if len(results) == 1 else
                       given.with_name(f"{given.stem}-{_load_tag(result)}{given.suffix or '.json'}"))
        paths.append(write_json_atomic(Path(result_dir or ".") / name, result))
    return paths
