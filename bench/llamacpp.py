"""llama.cpp beside the native path, one CPU, one run. Decode: the default model's own GGUF (Q4_1 as shipped, and
Q8_0 re-quantized by the gguf package) through llama-cpp-python against native int4 g32 (bf16 head, and int8 head as
llama.cpp's Q4_1 file has a Q8_0 one), int8 and bf16 on compiled steps, one greedy generation each per round in a
shuffled order (paired ratios to llama.cpp Q4_1 with CIs), tokens compared with native fp32 on the same dequantized
weights. Speculation: llama.cpp's prompt-lookup decoding beside quantspec's n-gram proposer at the same K on
Spec-Bench prompts, each as a speedup over its own plain decoding, with greedy token identity, and quantspec's
verification cost V(K) on the eager and the compiled step.

Usage: make llamacpp   (once: pip builds llama-cpp-python from source with the host's flags, about 5 min on 2 cores)
       flock /tmp/qs-bench.lock .venv/bin/python bench/llamacpp.py [--new-tokens 128] [--rounds 5] [--k 2,4]
Writes bench/results/llamacpp.<machine tag>.json (or --out). Target (issue 28): native int4 g32 >= 0.8x llama.cpp Q4_1 decode.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from contextlib import ExitStack, closing
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from rich.console import Console
from rich.table import Table

from evals.decode_speed import DEFAULT_PROMPT, first_diff
from evals.record import (ArrivalProcess, EngineCondition, LengthDistribution, MetricCondition, ModelCondition,
                          RunRecord, hardware_info)
from evals.roofline import decode_bytes_per_token, measure_bandwidth
from quant.quantize import quantize_model
from runtime.compiled import MODES
from runtime.data import load_prompts
from runtime.generate import Decoder, encode_prompt
from runtime.gguf_requant import requantize_gguf
from runtime.hardware import probe
from runtime.loading import load_model, set_threads
from runtime.measure import Sample, median_ci, ratio_of_totals, with_ci
from runtime.model_store import SMOLLM2, default_gguf, resolve_model, weights_hash
from runtime.sampling import SamplingConfig
from specdec.proposers import build_proposer
from specdec.sweep import run_sweep
from runtime.argtypes import positive_int

INSTALL = "llama-cpp-python is not installed: run `make llamacpp` (pip builds it from source, about 5 min on 2 cores)"
# the third is llama.cpp's Q4_1 layout: a 4-bit body beside an 8-bit head (its Q8_0 token embedding is the LM head)
NATIVE = [("native int4 g32", "w4g32-sym"), ("native int8 W8A16", "W8A16"),
          ("native int4 g32 + int8 head", "w4g32-sym@head=w8ch-sym"), ("native bf16", None)]
TARGET_INT4 = 0.8  # native int4 g32 over llama.cpp Q4_1
Generate = Callable[[list[int], int], tuple[list[int], float]]  # prompt ids, new tokens -> tokens, decode seconds


@dataclass
class Engine:
    label: str
    weights: str
    generate: Generate
    bytes_per_token: int
    step: str
    compile_s: float = 0.0


def llama_cpp_module():
    try:
        import llama_cpp
    except ImportError:
        print(INSTALL, file=sys.stderr)
        raise SystemExit(2) from None
    return llama_cpp


def gguf_bytes(path: Path) -> int:
    """Bytes a decode step streams: every tensor once (the Q8_0 token embedding is also the LM head)."""
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)


def llama_generate(llm) -> Generate:
    """Greedy llama.cpp generation of exactly ``n`` tokens (no end-of-turn stop: ``Llama.generate`` has none),
    KV cache reset per request; decode time runs from the first token to the last, as native's."""
    def generate(ids: list[int], n: int) -> tuple[list[int], float]:
        llm.reset()
        tokens, t0 = [], None
        for token in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            t0 = t0 or time.perf_counter()
            tokens.append(token)
            if len(tokens) == n:
                break
        return tokens, time.perf_counter() - t0
    return generate


def native_generate(decoder: Decoder) -> Generate:
    def generate(ids: list[int], n: int) -> tuple[list[int], float]:
        r = decoder.generate(ids, n, SamplingConfig(), ignore_eos=True)
        return r.tokens, r.decode_s
    return generate


def open_llama(stack: ExitStack, path: Path, threads: int, n_batch: int, draft=None):
    """A llama.cpp model closed with ``stack`` (left to the interpreter's exit, its destructor fails noisily)."""
    from llama_cpp import Llama

    return stack.enter_context(closing(Llama(str(path), n_ctx=2048, n_threads=threads, n_threads_batch=threads,
                                             n_batch=n_batch, verbose=False, draft_model=draft)))


def decode_rounds(engines: list[Engine], ids: list[int], new_tokens: int, rounds: int, seed: int = 0) -> dict:
    """``rounds`` rounds, one generation per engine each, in a seeded shuffled order; per engine its tok/s."""
    order, rates, tokens = random.Random(seed), {e.label: [] for e in engines}, {}
    for _ in range(rounds):
        for e in order.sample(engines, len(engines)):
            out, seconds = e.generate(ids, new_tokens)
            rates[e.label].append((len(out) - 1) / seconds)
            tokens[e.label] = out
    return {"rates": rates, "tokens": tokens}


def decode_part(stack: ExitStack, args, lm_fp32_path: Path, q4: Path, q8: Path, threads: int, n_batch: int) -> tuple[dict, list[int]]:
    bandwidth = measure_bandwidth()
    engines = [Engine(f"llama.cpp {name}", f"GGUF {name}", llama_generate(open_llama(stack, path, threads, n_batch)),
                      gguf_bytes(path), "llama.cpp graph") for name, path in (("Q4_1", q4), ("Q8_0", q8))]
    for label, scheme in NATIVE:
        lm = load_model(args.model, "bf16")
        if scheme:
            quantize_model(lm, scheme, progress=False)
        ids = encode_prompt(lm.tokenizer, DEFAULT_PROMPT)
        decoder = Decoder(lm, len(ids) + args.new_tokens + 8, compile_mode=args.compile)
        decoder.generate(ids, 8, ignore_eos=True)  # warm-up (compiles the step), excluded
        engines.append(Engine(label, scheme or "bf16", native_generate(decoder),
                              decode_bytes_per_token(lm.model), decoder.step_label, decoder.compile_s))
    for e in engines[:2]:
        e.generate(ids, 8)  # warm-up, excluded
    fp32 = load_model(lm_fp32_path, "fp32")  # the dequantized GGUF weights: the token reference
    reference = native_generate(Decoder(fp32, len(ids) + args.new_tokens + 8))(ids, args.new_tokens)[0]
    measured = decode_rounds(engines, ids, args.new_tokens, args.rounds)
    base = measured["rates"][engines[0].label]
    rows = []
    for e in engines:
        rates = measured["rates"][e.label]
        tok_s = median_ci(rates, log=True)
        ratio = median_ci([r / b for r, b in zip(rates, base)], log=True)
        rows.append({"engine": e.label, "weights": e.weights, "step": e.step, "compile_s": e.compile_s,
                     "decode_tok_s": tok_s.value, "decode_tok_s_ci": list(tok_s.ci), "per_round_tok_s": rates,
                     "vs_llamacpp_q4_1": ratio.value, "vs_llamacpp_q4_1_ci": list(ratio.ci),
                     "bytes_per_token": e.bytes_per_token,
                     "roofline_pct": 100 * tok_s.value * e.bytes_per_token / bandwidth,
                     "first_diff_vs_native_fp32": first_diff(measured["tokens"][e.label], reference),
                     "first_tokens": measured["tokens"][e.label][:16]})
    return {"bandwidth_gb_s": bandwidth / 1e9, "prompt_tokens": len(ids), "rows": rows,
            "target_int4_vs_q4_1": TARGET_INT4,  # each int4 row's median ratio against it
            "meets_target": {r["engine"]: r["vs_llamacpp_q4_1"] >= TARGET_INT4 for r in rows
                             if r["engine"].startswith("native int4")},
            "reference_tokens": "native fp32 eager greedy on the dequantized GGUF weights"}, ids


def speculation_part(stack: ExitStack, args, q4: Path, threads: int, n_batch: int) -> dict:
    """Per prompt: plain, then each K (interleaved), for llama.cpp prompt lookup; quantspec's sweep does the same
    on its eager and its compiled step."""
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    lm = load_model(args.model, "bf16", None, "eager")  # batch-invariant rows: exact greedy bf16 speculation
    prompts = [encode_prompt(lm.tokenizer, p) for p in load_prompts("spec_bench", limit=args.num_prompts)]
    quantspec = {}
    for step, mode in (("eager", None), ("compiled", args.compile)):
        sweep = run_sweep(lm, build_proposer(args.spec, lm), args.k, prompts, args.new_tokens, SamplingConfig(),
                          compile_mode=mode)
        quantspec[step] = {"step": sweep.step, "compile_s": sweep.compile_s, "plain_tok_s": sweep.baseline.tok_s,
                           "rows": [{"k": r.k, "speedup": r.speedup, "speedup_ci": r.speedup_ci,
                                     "token_identical": r.greedy_equal, "alpha": r.stats.alpha,
                                     "tau": r.stats.tau, "verify_cost": r.verify_cost}
                                    for r in sweep.rows]}
    lookup = LlamaPromptLookupDecoding(max_ngram_size=args.lookup_ngram, num_pred_tokens=max(args.k))
    plain, spec = (llama_generate(open_llama(stack, q4, threads, n_batch, d)) for d in (None, lookup))
    plain(prompts[0], 8)
    spec(prompts[0], 8)
    base, runs = [], {k: [] for k in args.k}
    for ids in prompts:
        base.append(plain(ids, args.new_tokens))
        for k in args.k:
            lookup.num_pred_tokens = k
            runs[k].append(spec(ids, args.new_tokens))
    samples = [Sample(len(t) - 1, s) for t, s in base]
    llama_rows = []
    for k, outs in runs.items():
        speedup = ratio_of_totals(samples, [Sample(len(t) - 1, s) for t, s in outs])
        llama_rows.append({"k": k, "speedup": speedup.value, "speedup_ci": list(speedup.ci),
                           "token_identical": sum(t == b[0] for (t, _), b in zip(outs, base)),
                           "first_diff_vs_plain": [first_diff(t, b[0]) for (t, _), b in zip(outs, base)]})
    return {"prompts": len(prompts), "prompt_tokens": [len(p) for p in prompts], "quantspec_spec": args.spec,
            "llamacpp_lookup": f"LlamaPromptLookupDecoding(max_ngram_size={args.lookup_ngram}, num_pred_tokens=K)",
            "quantspec": quantspec,
            "llamacpp": {"plain_tok_s": sum(s.tokens for s in samples) / sum(s.seconds for s in samples),
                         "rows": llama_rows}}


def run(args) -> RunRecord:
    llama_cpp = llama_cpp_module()
    threads = torch.get_num_threads()
    amx = "AMX" in probe().bf16_matmul
    n_batch = 1 if amx else 512  # pip's host-native build crashed on multi-token batches on the AMX machine
    q4 = default_gguf()
    q8 = q4.with_name(q4.stem.replace("Q4_1", "Q8_0") + ".gguf")
    if not q8.exists():
        requantize_gguf(q4, q8)
    lm_path = resolve_model(args.model)
    with ExitStack() as stack:
        speculation = speculation_part(stack, args, q4, threads, n_batch) if args.k else None
        decode, ids = decode_part(stack, args, lm_path, q4, q8, threads, n_batch) if args.decode else (None, [])
    return RunRecord(
        name="llamacpp",
        model=ModelCondition(args.model, weights_hash(lm_path),
                             "llama.cpp: GGUF Q4_1 (as shipped), Q8_0 (gguf re-quantization); native: bf16, "
                             "W8A16, W4A16-g32-sym (head bf16, or int8 per channel as its own row); token "
                             "reference: native fp32 (the dequantized GGUF)",
                             scheme="see rows", note=SMOLLM2.note),
        hardware=hardware_info() | {"llama_cpp": {"version": llama_cpp.__version__,
                                                  "system_info": llama_cpp.llama_print_system_info().decode()}},
        lengths=LengthDistribution(bool(ids) + (speculation or {}).get("prompts", 0), {"decode": len(ids)},
                                   {"fixed": args.new_tokens},
                                   f"decode: one chat prompt {DEFAULT_PROMPT!r}; speculation: the first "
                                   f"{args.num_prompts} Spec-Bench prompts", True),
        arrival=ArrivalProcess("batch-1 sequential", 1),
        engine=EngineCondition("llama.cpp (llama-cpp-python) vs native",
                               {"threads": threads, "n_batch": n_batch, "compile_mode": args.compile,
                                "rounds": args.rounds, "k": args.k},
                               warmup="one 8-token generation per engine, excluded (it compiles native steps: "
                                      "compile_s); speculation: one per engine and K",
                               cache_warmth="KV cache reset per request (llama.cpp: Llama.reset); weights in RAM"),
        metric=MetricCondition(
            {"decode_tok_s": "median over rounds of (new_tokens-1)/(last token - first token seconds)",
             "vs_llamacpp_q4_1": "median of per-round ratios to llama.cpp Q4_1, t-interval of the mean log",
             "roofline_pct": "decode tok/s x bytes streamed per token / measured read bandwidth",
             "speedup": "speculative over plain decode tokens/s summed over prompts, bootstrap CI over prompts"},
            "greedy, fixed output length; tokens compared (first diverging position), not held equal"),
        results={"decode": decode, "speculation": speculation},
    )


def print_tables(record: RunRecord) -> None:
    console = Console()
    d = record.results["decode"]
    if d:
        print_decode(console, record, d)
    s = record.results["speculation"]
    if s:
        print_speculation(console, s)


def print_decode(console: Console, record: RunRecord, d: dict) -> None:
    table = Table(title=f"batch-1 decode, {record.lengths.output_tokens['fixed']} tokens, "
                        f"{record.engine.config['threads']} threads, read bandwidth {d['bandwidth_gb_s']:.1f} GB/s")
    for col in ("engine", "step", "tok/s", "vs llama.cpp Q4_1", "MiB/token", "% roofline", "compile s",
                "first diff vs fp32"):
        table.add_column(col, justify="right")
    for r in d["rows"]:
        table.add_row(r["engine"], r["step"], f"{r['decode_tok_s']:.1f}",
                      with_ci(r["vs_llamacpp_q4_1"], r["vs_llamacpp_q4_1_ci"], unit="x"), f"{r['bytes_per_token'] / 2**20:.0f}",
                      f"{r['roofline_pct']:.0f}%", f"{r['compile_s']:.0f}", str(r["first_diff_vs_native_fp32"]))
    console.print(table)
    for engine, met in d["meets_target"].items():
        console.print(f"target: {engine} >= {d['target_int4_vs_q4_1']}x llama.cpp Q4_1: {'met' if met else 'MISSED'}")


def print_speculation(console: Console, s: dict) -> None:
    table = Table(title=f"speculation on {s['prompts']} Spec-Bench prompts: quantspec {s['quantspec_spec']} (bf16) "
                        f"vs llama.cpp {s['llamacpp_lookup']} (Q4_1)")
    for col in ("engine", "K", "plain tok/s", "speedup [95% CI]", "token-identical", "V(K)"):
        table.add_column(col, justify="right")
    for q in s["quantspec"].values():
        for r in q["rows"]:
            table.add_row(f"quantspec ({q['step']})", str(r["k"]), f"{q['plain_tok_s']:.1f}",
                          with_ci(r["speedup"], r["speedup_ci"], unit="x"), f"{r['token_identical']}/{s['prompts']}",
                          f"{r['verify_cost']:.2f}")
    for r in s["llamacpp"]["rows"]:
        table.add_row("llama.cpp prompt lookup", str(r["k"]), f"{s['llamacpp']['plain_tok_s']:.1f}",
                      with_ci(r["speedup"], r["speedup_ci"], unit="x"), f"{r['token_identical']}/{s['prompts']}", "")
    console.print(table)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--new-tokens", type=positive_int, default=128)
    parser.add_argument("--rounds", type=positive_int, default=5)
    parser.add_argument("--threads", type=positive_int, default=None)
    parser.add_argument("--compile", choices=MODES, default="max-autotune-no-cudagraphs")
    parser.add_argument("--k", type=lambda s: [int(k) for k in s.split(",") if k], default=[2, 4],
                        help="speculation lengths, comma-separated (empty: decode only)")
    parser.add_argument("--num-prompts", type=positive_int, default=6)
    parser.add_argument("--spec", default="ngram:min=1,max=2", help="quantspec's proposer (llama.cpp's lookup: "
                                                                  "n-grams of up to --lookup-ngram tokens)")
    parser.add_argument("--lookup-ngram", type=positive_int, default=2)
    parser.add_argument("--no-decode", dest="decode", action="store_false", help="speculation only")
    parser.add_argument("--out", type=Path, default=None, help="default: bench/results/llamacpp.<machine tag>.json")
    args = parser.parse_args()
    set_threads(args.threads)
    record = run(args)
    print_tables(record)
    out = record.write(args.out or Path(__file__).parent / "results" / f"llamacpp.{probe().tag}.json")
    print(f"wrote {out}")
