"""Harness overhead: our vLLM backend's closed loop vs a bare ``LLM.generate`` on the same engine and prompts.

At C=1 the bare loop calls ``llm.generate([prompt])`` per prompt; at C=N it hands all N prompts to one
``llm.generate`` (vLLM batches them, as our closed loop with N clients does). Rounds alternate bare/ours and
the median tok/s over rounds is compared. Target: overhead <= 3%.

Usage: flock /tmp/qs-bench.lock flock /tmp/qs-vllm.lock python bench/harness_overhead.py [--num-prompts 8]
Writes bench/results/harness_overhead.json (a run record).
"""
import argparse
import os
import statistics
import time
from pathlib import Path
from runtime.argtypes import positive_int



def bare_generate(llm, requests, concurrency: int) -> tuple[float, int]:
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": r.prompt_ids} for r in requests]
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True, seed=0) for r in requests]
    t = time.perf_counter()
    outs = []
    for i in range(0, len(prompts), concurrency):
        outs += llm.generate(prompts[i:i + concurrency], params[i:i + concurrency], use_tqdm=False)
    return time.perf_counter() - t, sum(len(o.outputs[0].token_ids) for o in outs)


def ours(backend, requests, concurrency: int) -> tuple[float, int]:
    t = time.perf_counter()
    results = backend.closed_loop(requests, concurrency)
    return time.perf_counter() - t, sum(r.output_tokens for r in results)


def main(args):
    from serving.backends import open_backend
    from serving.backends.base import ServingConfig
    from evals.config import Config
    from evals.record import (ArrivalProcess, EngineCondition, LengthDistribution, MetricCondition, ModelCondition,
                              RunRecord, hardware_info)
    from serving.workloads import build_requests
    from runtime.model_store import SMOLLM2, resolve_model, weights_hash

    config = ServingConfig(Config(backend="vllm"), max_model_len=1024)
    rows = []
    with open_backend(config) as backend:
        requests, source = build_requests("spec_bench", backend.tokenizer(), args.num_prompts, args.output_len)
        bare_generate(backend.llm, requests[:2], 2)  # engine warm-up, excluded
        for concurrency in (1, args.num_prompts):
            bare_tok_s, our_tok_s = [], []
            for _ in range(args.rounds):
                secs, tokens = bare_generate(backend.llm, requests, concurrency)
                bare_tok_s.append(tokens / secs)
                secs, tokens = ours(backend, requests, concurrency)
                our_tok_s.append(tokens / secs)
            bare, our = statistics.median(bare_tok_s), statistics.median(our_tok_s)
            rows.append({"concurrency": concurrency, "bare_llm_generate_tok_s": bare, "harness_tok_s": our,
                         "overhead_pct": 100 * (1 - our / bare), "rounds_bare": bare_tok_s, "rounds_harness": our_tok_s})
            print(f"C={concurrency}: bare LLM.generate {bare:.1f} tok/s, harness {our:.1f} tok/s, "
                  f"overhead {rows[-1]['overhead_pct']:+.1f}% (target <= 3%)", flush=True)
        engine_config = backend.engine_config()
    path = resolve_model("default")
    record = RunRecord(
        name="harness-overhead",
        model=ModelCondition("default", weights_hash(path), "bf16", "none", SMOLLM2.note),
        hardware=hardware_info(),
        lengths=LengthDistribution(len(requests), {"mean": statistics.mean(len(r.prompt_ids) for r in requests)},
                                   {"fixed": args.output_len}, source, True),
        arrival=ArrivalProcess("closed-loop (bare: batches of C prompts per LLM.generate call)", args.num_prompts),
        engine=EngineCondition("vllm (one in-process engine shared by both loops)", engine_config,
                               warmup="one 2-prompt LLM.generate before the first round, excluded",
                               cache_warmth="prefix cache on (vLLM default): every round after the first sees the "
                                            "same prompts in both loops, so both loops are equally warm"),
        metric=MetricCondition({"tok_s": "output tokens (from returned ids) / wall time of the whole loop, median "
                                          "over alternating rounds",
                                "overhead_pct": "100 * (1 - harness tok/s / bare LLM.generate tok/s)"},
                               "greedy, ignore_eos, fixed output length"),
        results={"rows": rows, "target_overhead_pct": 3.0, "load_avg_1m_end": os.getloadavg()[0]},
    )
    out = record.write(Path(__file__).parent / "results" / "harness_overhead.json")
    print(f"wrote {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=positive_int, default=8)
    parser.add_argument("--output-len", type=positive_int, default=32)
    parser.add_argument("--rounds", type=positive_int, default=3)
    main(parser.parse_args())
