"""Render bench/results/README.md and its topic pages from the JSON in bench/results/ (json and runtime.measure).

    python bench/render_results.py                              # rewrite bench/results/*.md
    python bench/render_results.py --results DIR --out-dir DIR  # render another folder / to another folder
    python bench/render_results.py --check                      # exit 1 if a committed page is stale

Every number on the generated pages is read from a JSON field; the prose only explains. One small render
function per bench kind is registered in ``RENDERERS`` by file-name pattern (the most specific pattern wins),
on one topic ``Page``; a JSON file no pattern claims is listed under "Not rendered" in README.md, so nothing
disappears silently. README.md opens with a one-screen summary (``render_summary``): per CPU kind, the headline
figure of each ``SUMMARY`` column, picked from the same JSON and linked to the section (``<a id>`` in its heading,
on its topic page) it comes from; its contents link every section.
Each section states the conditions its run record carries (model + precision, hardware + ISA + kernels,
lengths, arrival process, engine config + warmth, metric + correctness requirement).
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import re
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable

from runtime.measure import with_ci

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

Q4_1_CAVEAT = (
    "> **4-bit caveat (default model).** SmolLM2-135M-Instruct comes from a Q4_1 GGUF: its body weights were "
    "Q4_1-dequantized, i.e. they sit on a 4-bit group-32 grid with a free *float* offset per block. "
    "compressed-tensors' int4-g32-asym stores an *integer* zero point, which cannot express that offset, so "
    "re-quantizing this model to int4-g32-asym is **not** near-lossless (see the KL columns on this page), and "
    "4-bit results on this model need not transfer to natively trained checkpoints."
)
FOUR_BIT = re.compile(r"\bw4|W4A|int4|selfquant:w4")
NOTE = re.compile(r'"note": "(?:[^"\\]|\\.)*"')


# ----------------------------------------------------------------------------------------------- formatting

def num(x: Any, nd: int = 2) -> str:
    """A JSON number as text with ``nd`` decimals; None -> an en dash; bools and strings as they are."""
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        if x != 0 and abs(x) < 10 ** -nd:
            return f"{x:.1e}"
        return f"{x:.{nd}f}"
    return str(x)


def pct(x: Any, nd: int = 1) -> str:
    return "–" if x is None else f"{100 * x:.{nd}f}"


def compact(o: Any) -> str:
    """A JSON value in one line (dicts as ``k=v``), for the conditions lists."""
    if isinstance(o, dict):
        return "{" + ", ".join(f"{k}={compact(v)}" for k, v in o.items()) + "}"
    if isinstance(o, list):
        return "[" + ", ".join(compact(v) for v in o) + "]"
    if isinstance(o, float):
        return f"{o:g}"
    return "null" if o is None else str(o)


def cell(x: Any) -> str:
    return str(x).replace("|", "\\|").replace("\n", " ")


def table(header: list[str], rows: list[list[Any]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def kernels_text(k: Any) -> str:
    if not k:
        return "–"
    if not isinstance(k, dict):
        return str(k)
    if all(isinstance(n, int) for n in k.values()):
        return ", ".join(f"{name} x{n}" for name, n in k.items())
    groups: dict[str, list[str]] = {}
    for layer, kern in k.items():
        groups.setdefault(str(kern), []).append(layer)
    return "; ".join(f"{kern} ({', '.join(layers)})" for kern, layers in groups.items())


def best_by(rows: list[dict], key: str) -> dict | None:
    """The row with the largest ``key`` (the first of equals); rows without it are skipped."""
    rows = [r for r in rows if r.get(key) is not None]
    return max(rows, key=lambda r: r[key]) if rows else None


def anchor(name: str) -> str:
    """The explicit HTML anchor of a record's section (written into its heading): ``decode-bf16.x.json`` ->
    ``decode-bf16-x-json``; GitHub's own heading ids drop the dots, so the summary links to these instead."""
    return re.sub(r"[^a-z0-9_-]+", "-", name.lower())


def run_record(d: dict) -> dict:
    """The run record of a result file: at the top, beside the results (compare-backends), or in an lm-eval
    file's quantspec (eval --json)."""
    return d.get("run_record") or (d.get("quantspec") or {}).get("run_record") or d


# ----------------------------------------------------------------------------------------------- conditions

def conditions(rec: dict, title: str = "Conditions") -> str:
    """The six conditions a RunRecord carries, read from it (fields the record lacks say so)."""
    if "hardware" not in rec:
        return ""
    m, hw = rec.get("model", {}), rec.get("hardware", {})
    ln, arr, eng, met = rec.get("lengths", {}), rec.get("arrival", {}), rec.get("engine", {}), rec.get("metric", {})
    libs = hw.get("libraries", {})
    probe = hw.get("probe") or {}
    probe_txt = ", ".join(f"{k} {v}" for k, v in probe.items() if k not in ("cpu", "isa") and v) or "not recorded"
    picks = hw.get("kernel_speeds") or {}
    kernels = hw.get("kernels") or eng.get("config", {}).get("kernel") or eng.get("config", {}).get("kernels")
    lines = [
        f"**{title}** (from the run record):",
        f"- model + precision: `{m.get('model_id')}` (weights hash `{m.get('weights_hash')}`), "
        f"precision {m.get('precision')}, scheme {m.get('scheme')}",
        f"- hardware: {hw.get('cpu')}, ISA {hw.get('isa') or 'not recorded in this record'}, "
        f"{hw.get('cores')} cores, {hw.get('torch_threads')} torch threads, 1-min load average "
        f"{num(hw.get('load_avg_1m'))}; probe: {probe_txt}; "
        f"{libs.get('torch')}, {libs.get('vllm')}, {libs.get('lm_eval')}",
        f"- kernels: {kernels_text(kernels) if kernels else 'per row below, or not recorded in this record'}",
    ]
    if picks:
        lines.append("- kernel speed picks of the probe (decode / batch shape class): "
                     + "; ".join(f"{shape}: {v['rank']['decode'][0]} / {v['rank']['batch'][0]}"
                                 for shape, v in picks.items() if "rank" in v))
    lines += [
        f"- lengths: {ln.get('n_requests')} requests, input {compact(ln.get('input_tokens'))}, "
        f"output {compact(ln.get('output_tokens'))}, fixed output length {num(ln.get('fixed_output_length'))}; "
        f"source: {ln.get('source')}",
        f"- arrival: {arr.get('kind')}, concurrency {num(arr.get('concurrency'))}, "
        f"rate {num(arr.get('rate_rps'))} req/s, burstiness {num(arr.get('burstiness'))}",
        f"- engine: {eng.get('backend')}; config {compact(eng.get('config'))}; warm-up: {eng.get('warmup') or 'none'}; "
        f"cache warmth: {eng.get('cache_warmth')}",
        "- metric: " + "; ".join(f"`{k}` = {v}" for k, v in (met.get("metrics") or {}).items()),
        f"- correctness requirement: {met.get('correctness')}",
        f"- recorded: {rec.get('created')}",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- renderers

@dataclass(frozen=True)
class Page:
    """One generated page of this folder; README.md is the summary and the index of them all."""
    file: str
    title: str
    intro: str  # prose, no numbers


SPEED = Page("speed.md", "Decode speed: kernels, compiled steps, llama.cpp, GPU",
             "The native runtime's batch-1 decode, per CPU kind: against HF generate, quantized kernels, compiled "
             "steps and where their time goes, llama.cpp on the same weights, and the GPU check.")
SERVING = Page("serving.md", "Serving: native vs vLLM, harness overhead, speed through noise",
               "Serving backends under a load generator, what quantspec's harness adds on vLLM, and how the paired "
               "speed protocol holds up with one core hogged.")
QUALITY = Page("quality.md", "Quality: weight, activation and KV-cache schemes",
               "Accuracy, flips, KL and perplexity of each quantization against the unquantized model on the same "
               "items, and the native eval backend against lm-eval's.")
SPECULATION = Page("speculation.md", "Speculative decoding: acceptance, speedup, exactness",
                   "Acceptance and speedup vs K for each proposer beside the speedup theory predicts, EAGLE heads "
                   "trained here, speculation on quantized targets, and the lossless checks.")
SEARCH = Page("search.md", "Searches: cost and speed/quality tables",
              "Where a search's wall time goes, and the tables of the searches run here (the demo's included).")
PAGES = (SPEED, SERVING, QUALITY, SPECULATION, SEARCH)


@dataclass(frozen=True)
class Bench:
    page: Page
    title: str
    script: str          # the command that writes the JSON
    render: Callable[[dict], str]
    intro: str = ""      # prose, no numbers
    # seeded random weights and no RunRecord: the renderer states the six conditions itself, and the default
    # model's 4-bit caveat does not apply
    random_weights: bool = False


RENDERERS: dict[str, Bench] = {}


def bench(page: Page, pattern: str, title: str, script: str, intro: str = "", random_weights: bool = False):
    def deco(fn):
        RENDERERS[pattern] = Bench(page, title, script, fn, intro, random_weights)
        return fn
    return deco


@bench(SPEED, "decode-*.json", "Native decode vs HF generate", "bench/decode.py",
       "Batch size one, greedy, fixed output length; decode tok/s excludes prefill. One file per CPU kind: a table "
       "measured on one kind does not hold on another.")
def render_decode(d: dict) -> str:
    r = d["results"]
    rows = [[x["engine"], x["new_tokens"], num(x["decode_tok_s"], 1), num(x["prefill_ms"], 1), num(x["roofline_pct"], 1)]
            for x in r["rows"]]
    return "\n\n".join([
        table(["engine", "new tokens", "decode tok/s", "prefill ms", "% of read roofline"], rows),
        f"Read bandwidth {num(r['bandwidth_gb_s'], 1)} GB/s, {r['bytes_per_token']} weight bytes per token, roofline "
        f"{num(r['roofline_tok_s'], 1)} tok/s. Native / HF: {num(r['native_over_hf'])}x; greedy tokens equal: "
        f"{num(r['greedy_tokens_equal'])}.",
    ])


@bench(SPEED, "decode_compiled.*.json", "Compiled decode step vs eager", "bench/decode.py --compile",
       "The one-token decode step compiled by torch.compile (inductor's C++ backend, weights frozen) against the "
       "eager step, same dtype, prompt and length, runs interleaved; compile time (first call) apart from "
       "steady-state tok/s. One file per CPU kind; the machine's load average is in each row.")
def render_decode_compiled(d: dict) -> str:
    r = d["results"]
    rows = [[x["dtype"], x["mode"], num(x["eager_tok_s"], 1), num(x["compiled_tok_s"], 1),
             num(x["compiled_over_eager"]) + "x", num(x["meets_target"]), num(x["first_call_s"], 1),
             num(x["second_call_s"], 3), num(x["greedy_tokens_equal"]), num(x["first_diff"]), num(x["fallback"]),
             num(x["load_average_1min"], 1)] for x in r["rows"]]
    return "\n\n".join([
        table(["dtype", "mode", "eager tok/s", "compiled tok/s", "compiled / eager", "met", "first call s",
               "second call s", "greedy tokens equal", "first differing token", "fallback", "load 1 min"], rows),
        f"Target: compiled >= {num(r['target_compiled_over_eager'], 1)}x eager; load average (1/5/15 min) before "
        f"the run {' / '.join(num(x) for x in r['load_average_before_1_5_15'])}.",
    ])


@bench(SPEED, "quant_decode.*.json", "Quantized decode speed (weight-only kernels)", "bench/quant_decode.py",
       "Each scheme as a ratio to fp32 decode in the same run and as a share of its own read roofline (bytes per "
       "token count packed weights, scales and the tied LM head). A run with `QUANTSPEC_CPU_FEATURES=avx2` times "
       "the kernels an AVX2 CPU would pick on the machine named in its record; it is not an AVX2 measurement.")
def render_quant_decode(d: dict) -> str:
    r = d["results"]
    rows = [[x["engine"], x["dtype"], x["scheme"], kernels_text(x.get("kernels")), num(x["decode_tok_s"], 1),
             num(x["vs_fp32"]) + "x", "–" if x["target_vs_fp32"] is None else f">= {num(x['target_vs_fp32'], 1)}x",
             num(x["meets_target"]), num(x["bytes_per_token"] / 2 ** 20, 0), num(x["roofline_pct"], 0)]
            for x in r["rows"]]
    return "\n\n".join([
        table(["config", "dtype", "scheme", "kernels (layers)", "tok/s", "vs fp32", "target", "met",
               "MiB streamed/token", "% of read roofline"], rows),
        bandwidth_line(r),
    ])


@bench(SPEED, "w8a8_decode.*.json", "W8A8 decode: INT8 and FP8 kernels beside bf16", "bench/w8a8_decode.py",
       "Batch-1 eager decode, each row paired with the resident bf16 model in interleaved rounds; FP8 with each of "
       "its two products forced (`torch._scaled_mm`, the exact fp32 upcast) and as the probe picked. GB/s counts "
       "the fp8 / int8 codes streamed per token; the fp32 upcast actually reads its cached fp32 weights (four bytes "
       "per weight).")
def render_w8a8_decode(d: dict) -> str:
    r = d["results"]
    rows = [[x["config"], kernels_text(x.get("kernels")), num(x["decode_tok_s"], 1),
             with_ci(x["vs_bf16"], x["vs_bf16_ci"], ".2f", "x") + (" (noisy)" if x["noisy"] else ""),
             num(x["achieved_gb_s"], 1), x["rounds"], "; ".join(x["kernel_details"])] for x in r["rows"]]
    return "\n\n".join([
        table(["config", "kernels (layers)", "tok/s", "vs bf16 [95% CI]", "GB/s achieved", "rounds",
               "what ran"], rows),
        bandwidth_line(r),
    ])


def bandwidth_line(r: dict) -> str:
    return (f"Read bandwidth {num(r['bandwidth_gb_s'], 2)} GB/s; load average (1/5/15 min) at the end "
            f"{' / '.join(num(x) for x in r.get('load_average_1_5_15', []))}.")


@bench(SPEED, "quant_decode_compiled.*.json", "Quantized decode speed under compile",
       "bench/quant_decode.py --compile MODE",
       "bf16, int8 and int4 g32 on the eager and on the compiled one-token step (runtime/compiled.py: inductor, weights "
       "frozen), the quantized linears with their own kernels inside the graph (the registry's pick; the int4 rows "
       "again on torch's `int4pack`), with the LM head kept bf16 (the "
       "default schemes) and quantized too (`+ head`: `@ignore=`, an untied copy; the embedding lookup stays bf16); "
       "ratios to the compiled bf16 step (the compiled-path issue's targets), in paired, interleaved rounds where "
       "the record has a CI, beside the byte ceiling (bf16 bytes per token over the row's: what a purely "
       "bandwidth-bound step would reach), compile time apart, and where the compiled greedy output first differs "
       "from the eager one (bf16 rounding, or the quantized head; not a verdict).")
def render_quant_decode_compiled(d: dict) -> str:
    r = d["results"]
    rows = [[x["engine"], x["scheme"], kernels_text(x.get("kernels")), num(x["decode_tok_s"], 1),
             num(x["compiled_tok_s"], 1), num(x["compiled_over_eager"]) + "x",
             with_ci(x["vs_bf16_compiled"], x.get("vs_bf16_compiled_ci"), ".2f", "x"),
             "–" if x.get("bytes_ceiling") is None else num(x["bytes_ceiling"]) + "x",
             "–" if x["target_vs_bf16_compiled"] is None else f">= {num(x['target_vs_bf16_compiled'], 1)}x",
             num(x["meets_target"]), num(x["compiled_roofline_pct"], 0), num(x["compile_s"], 0),
             num(x["first_diff_vs_eager"]), num(x["fallback"]),
             with_ci(x["vs_pick"], x["vs_pick_ci"], ".2f", "x") if "vs_pick" in x else "–"] for x in r["rows"]]
    return "\n\n".join([
        table(["config", "scheme", "kernels (layers)", "eager tok/s", "compiled tok/s", "compiled / eager",
               "vs compiled bf16", "byte ceiling", "target", "met", "% of read roofline", "compile s",
               "first token differing from eager", "fallback", "vs the registry's kernel, same weights"], rows),
        f"Mode `{d['engine']['config']['compile_mode']}`"
        + (f", GEMMs chosen among `{d['engine']['config']['gemm_backends']}` only"
           if d["engine"]["config"].get("gemm_backends") else "") + ". " + bandwidth_line(r),
    ])


@bench(SPEED, "gemv.*.json", "quantspec's bf16 / int4 / int8 GEMV kernels beside torch's", "bench/gemv.py",
       "Each product of quantspec's AVX-512 / AVX2 kernels (`runtime/cpu_ops.py`: `bf16gemv` on bf16 weights, "
       "`int4gemv` on int4 g32, `int8gemv` on int8 per channel, a code made an exact bf16 with one OR; all multiply "
       "with `vdpbf16ps`, or its arithmetic in FMAs without AVX512-BF16, on 8-lane halves on AVX2) paired with the torch kernel it stands in for (oneDNN's prepacked bf16 GEMM, `int4pack`, "
       "`int8pack`: the same weights) at every linear shape of the default model, on one row "
       "(decode) and five (a four-token verification), each call on the next of enough distinct weights that they "
       "stream from memory; ratio with its CI, and the read bandwidth each kernel reaches beside the machine's.")
def render_gemv(d: dict) -> str:
    r = d["results"]
    rows = [[x["format"], x["kernel"], "not run: " + x["missing"]] if "missing" in x else
            [x["format"], f"{x['kernel']} / {x['torch_kernel']}", " x ".join(map(str, x["shape"])), x["rows"],
             num(x["us"], 1), num(x["torch_us"], 1), num(x["gb_s"], 1), num(x["torch_gb_s"], 1),
             with_ci(x["speedup"], x["speedup_ci"], ".2f", "x") + (" (noisy)" if x["noisy"] else "")]
            for x in r["rows"]]
    return "\n\n".join([table(["format", "kernel / torch's", "shape (out x in)", "rows", "us", "torch us", "GB/s",
                                "torch GB/s", "speedup [95% CI]"], rows), bandwidth_line(r)])


@bench(SPEED, "step_attention.*.json", "Attention inside the compiled step: SDPA, eager, fused reduce",
       "bench/step_attention.py",
       "Each step here reads every position of its preallocated KV cache (a span of the whole cache). The bf16 "
       "one-token step of the default model with torch's SDPA kernel (the step's attention for SDPA models before "
       "these records), with the batch-invariant `eager` attention (what the native serving backend loads, for "
       "exact bf16 speculation, and since the direct pairing here SDPA models' step attention in bf16 where the CPU "
       "multiplies bf16 natively) and with `reduce_attention` (fp32 multiply-reduce over head dim and keys, fused "
       "by inductor: SDPA models' step attention before that, and still where bf16 is emulated), each paired with "
       "SDPA in interleaved rounds and eager with reduce directly, over the span the product's step reads for the "
       "request and the whole cache `quantspec bench` allocates by default; over the short span, how many rows of each one's five-token verification step differ "
       "bitwise from its one-token step (greedy speculation needs none).")
def render_step_attention(d: dict) -> str:
    rows = [[x["cache_len"], x["attention"], num(x["tok_s"], 1), num(x["sdpa_tok_s"], 1),
             with_ci(x["over_sdpa"], x["over_sdpa_ci"], ".2f", "x") + (" (noisy)" if x["noisy"] else ""),
             with_ci(x["over_reduce"], x["over_reduce_ci"], ".2f", "x") if "over_reduce" in x else "–",
             x["rounds"], f"{num(x['build_s'], 0)} / {num(x['sdpa_build_s'], 0)}", num(x["first_diff_vs_sdpa"]),
             num(x["verify_rows_differing"])] for x in d["results"]["rows"]]
    return table(["cache positions", "attention", "tok/s", "SDPA tok/s", "vs SDPA [95% CI]", "vs reduce [95% CI]",
                  "rounds",
                  "build s (it / SDPA)", "first token differing from SDPA", "verification rows differing"], rows)


@bench(SPEED, "cache_span.*.json", "What reading the whole KV cache costs a compiled step", "bench/cache_span.py",
       "A compiled step attends over a span of its preallocated KV cache (masked: one graph per span). The product's "
       "steps read the span a request reserves (prompt + output rounded up to `runtime.compiled.SPAN_BLOCK` positions); "
       "before spans they read "
       "the whole cache `quantspec bench`, `search` and the demo allocate (`--max-model-len`). The bf16, int8 and "
       "int4 g32 compiled one-token steps of the default model over both, paired per config in interleaved rounds on "
       "one decoder; the KV bytes a step reads, and each quantized step's speed over the bf16 step's at the same "
       "span.")
def render_cache_span(d: dict) -> str:
    rows = [[x["config"], f"{x['short_len']} / {x['long_len']}", num(x["short_tok_s"], 1), num(x["long_tok_s"], 1),
             with_ci(x["short_over_long"], x["short_over_long_ci"], ".2f", "x") + (" (noisy)" if x["noisy"] else ""),
             f"{x['short_over_bf16']:.2f}x", f"{x['long_over_bf16']:.2f}x",
             f"{num(x['kv_mib_short'], 1)} / {num(x['kv_mib_long'], 1)}", "yes" if x["tokens_equal"] else "no"]
            for x in d["results"]["rows"]]
    return table(["config", "positions read (request's span / whole cache)", "tok/s request's span",
                  "tok/s whole cache", "span / whole [95% CI]", "vs bf16, span", "vs bf16, whole cache",
                  "KV MiB a step reads", "same greedy tokens"], rows)


@bench(SPEED, "compile_options*.json", "Ways to compile the decode step: speed, verification, build cost",
       "bench/compile_options.py",
       "The bf16 step as the product builds it (each transformer block one nested compile region, built once and "
       "called for every layer; bf16 linears calling quantspec's `bf16gemv` op as extern kernels, q/k/v and gate/up "
       "fused into one call each; weights left as graph inputs, so one cached graph serves every model of the same "
       "shapes), the same as one unrolled graph, with the weights frozen, frozen with inductor's C++ wrapper, and the "
       "step before `bf16gemv` (weights frozen and prepacked for inductor's C++ GEMM templates); each file holds the "
       "options of one run. Per option: decode speed paired with the eager step (which runs `bf16gemv` too where the "
       "option does), the five-token verification step's cost over the one-token step and how many of its rows "
       "differ bitwise from the one-token step (greedy speculation needs none), and build seconds in a fresh process "
       "(cold cache), a second process (warm cache) and for a second model of the same shapes in the same process.")
def render_compile_options(d: dict) -> str:
    r = d["results"]
    rows = [[x["option"], x["what"], "error: " + x["error"]] if "error" in x else
            [x["option"], x["what"], num(x["compiled_tok_s"], 1),
             with_ci(x["compiled_over_eager"], x["compiled_over_eager_ci"], ".2f", "x"), num(x["verify_cost"]),
             x["verify_rows_differing"], num(x["one_token_build_s"], 0), num(x["warm_one_token_build_s"], 0),
             num(x["second_model_build_s"], 0), num(x["verify_build_s"], 0)] for x in r["rows"]]
    return "\n\n".join([
        table(["option", "what", "tok/s", "vs eager [95% CI]", "V(4)", "rows differing (of 5)", "build s, cold",
               "build s, warm cache", "build s, second model", "5-token step build s"], rows),
        bandwidth_line(r),
    ])


@bench(SPEED, "llamacpp*.json", "llama.cpp beside the native path", "make llamacpp && bench/llamacpp.py",
       "Decode: llama.cpp (llama-cpp-python, built by pip with the host's flags) on the default model's own GGUF (Q4_1 "
       "as shipped; Q8_0 written by the gguf package) and native int4 g32 / int8 / bf16 on compiled steps (where a "
       "record has it, also int4 g32 with its LM head int8 per channel: the Q4_1 file's layout, whose Q8_0 token "
       "embedding is its head; the other native rows keep the head bf16), one greedy generation each per round in a shuffled order, ratios per round to llama.cpp Q4_1. Tokens are compared with "
       "native fp32 on the same dequantized weights (first differing position, not a verdict: llama.cpp multiplies "
       "8-bit-quantized activations). Speculation: each engine's speedup over its own plain decoding on the same "
       "prompts at the same K, and how many outputs stayed token-identical to it.")
def render_llamacpp(d: dict) -> str:
    r, parts = d["results"]["decode"], []
    if r:
        rows = [[x["engine"], x["step"], num(x["decode_tok_s"], 1),
                 with_ci(x["vs_llamacpp_q4_1"], x["vs_llamacpp_q4_1_ci"], unit="x"), num(x["bytes_per_token"] / 2**20, 0),
                 num(x["roofline_pct"], 0), num(x["compile_s"], 0), num(x["first_diff_vs_native_fp32"])] for x in r["rows"]]
        parts += [table(["engine", "step", "decode tok/s", "vs llama.cpp Q4_1 [CI]", "MiB/token",
                         "% of read roofline", "compile s", "first token differing from native fp32"], rows),
                  f"Target: native int4 >= {num(r['target_int4_vs_q4_1'], 1)}x llama.cpp Q4_1 (median), met: "
                  + ("; ".join(f"{e}: {num(m)}" for e, m in met.items()) if isinstance(met := r["meets_target"], dict)
                     else f"native int4 g32: {num(met)}")  # records before the int8-head row: one bool
                  + f". Read bandwidth {num(r['bandwidth_gb_s'], 1)} GB/s."]
    lcpp = d["hardware"]["llama_cpp"]
    parts.append(f"llama.cpp {lcpp['version']} (`{lcpp['system_info'].strip(' |')}`), n_batch "
                 f"{d['engine']['config']['n_batch']}; native compile mode `{d['engine']['config']['compile_mode']}`.")
    s = d["results"]["speculation"]
    if s:
        spec = [[f"quantspec `{s['quantspec_spec']}` ({q['step']})", x["k"], num(q["plain_tok_s"], 1),
                 with_ci(x["speedup"], x["speedup_ci"], unit="x"), f"{x['token_identical']}/{s['prompts']}", num(x["verify_cost"])]
                for q in s["quantspec"].values() for x in q["rows"]]
        spec += [[f"llama.cpp `{s['llamacpp_lookup']}`", x["k"], num(s["llamacpp"]["plain_tok_s"], 1),
                  with_ci(x["speedup"], x["speedup_ci"], unit="x"), f"{x['token_identical']}/{s['prompts']}", "–"]
                 for x in s["llamacpp"]["rows"]]
        parts.append(table(["speculation (Spec-Bench prompts)", "K", "plain tok/s", "speedup [CI]",
                            "token-identical to plain", "V(K)"], spec))
    return "\n\n".join(parts)


@bench(SPEED, "step_profile.*.json", "Where a compiled decode step's time goes", "bench/step_profile.py",
       "One-token compiled steps under torch.profiler, inductor's generated kernels timed by name "
       "(`cpp.enable_kernel_profile`), the eager prefill subtracted. Groups: weight matmuls (the layers' GEMMs and "
       "the LM head), attention (SDPA), dynamo's guard check before each call, and the rest (the graph's wrapper, "
       "fused element-wise kernels, argmax). Profiling adds time, so shares matter more than the absolute step time.")
def render_step_profile(d: dict) -> str:
    r = d["results"]
    groups = list(r["rows"][0]["us_per_step_by_group"])
    rows = [[x["config"], x["step"], num(x["decode_tok_s"], 1), num(x["profiled_step_ms"], 1),
             *[num(x["us_per_step_by_group"][g], 0) for g in groups], pct(x["matmul_share"], 0),
             num(x["matmul_gb_s"], 1), "; ".join(f"`{o['op'][:48]}` {num(o['us_per_step'], 0)}"
                                              for o in x["top_ops"][:4])] for x in r["rows"]]
    return "\n\n".join([table(["config", "step", "decode tok/s (unprofiled)", "profiled ms/step",
                                *[f"{g} µs/step" for g in groups], "weight matmuls % of step", "matmuls GB/s",
                                "top events (µs/step)"], rows),
                         f"Read bandwidth {num(r['bandwidth_gb_s'], 1)} GB/s."])


@bench(SPEED, "gpu-check.cuda*.json", "GPU check: the native runtime on a GPU", "bench/gpu_check.py",
       "The one prepared GPU check (docs/gpu.md) on seeded random weights of two Llama shapes: speed and greedy "
       "token-exactness only (quality is measured on CPU with the real weights). Kernels: one batch-1 product per "
       "weight format at the 1B shape's MLP matrices, by the kernel the registry picks on the GPU, as weight bytes "
       "streamed per second; the float8 row quantizes its activations per call in Python, so it times that more than "
       "the GEMM. Decode: greedy, batch size one, prefill excluded, eager, compiled and HF `generate` per format, as a share "
       "of the roofline (copy bandwidth / bytes streamed per token); compiled tokens are compared with the eager "
       "ones (bf16 rounding: not a verdict). Speculation: the eager fp32 step, n-gram and quantized self-draft "
       "proposers; random weights accept almost nothing, so it shows exactness, not speedups.", random_weights=True)
def render_gpu_check(d: dict) -> str:
    st, hw, plan = d["stages"], d["hardware"], d["plan"]
    cuda = hw.get("cuda")
    device = (f"{cuda['gpu']} (compute capability {cuda['capability']}, {num(cuda['memory_gib'], 1)} GiB), CUDA "
              f"{cuda['cuda']}, driver {cuda['driver']}" if cuda else "no GPU (a CPU run)")
    parts = [table(["stage", "status", "seconds", "error"],
                   [[name, x["status"], num(x["seconds"], 1), num(x.get("error"))] for name, x in st.items()]),
             table(["target", "shape", "measured", "target", "met"],
                   [[name, x["shape"], num(x["value"]), f">= {num(x['target'], 1)}", num(x["met"])]
                    for name, x in d["targets"].items()])]
    kernels = [x for x in st.get("kernels", {}).get("rows", []) if x["status"] == "ok"]
    if kernels:
        parts.append(table(["format", "matrix [N, K]", "kernel", "µs", "weight GB/s", "% of copy bandwidth",
                            "max relative error"],
                           [[x["format"], f"{x['shape'][0]} x {x['shape'][1]}", x["kernel"], num(x["us"], 1),
                             num(x["weight_gb_s"], 0), num(x["pct_of_copy_bandwidth"], 1), num(x["max_rel_error"], 4)]
                            for x in kernels]))
    decode = st.get("decode", {}).get("rows", [])
    parts.append(table(["shape", "format", "engine", "kernels", "decode tok/s", "vs bf16, same engine",
                        "% of roofline", "compile s", "tokens equal to eager", "status"],
                       [[x["shape"], x["format"], x.get("engine", "–"), ", ".join(x.get("kernels", [])),
                         num(x.get("decode_tok_s"), 1), num(x.get("vs_bf16_same_engine")), num(x.get("roofline_pct"), 1),
                         num(x.get("compile_s"), 1), num(x.get("tokens_equal_to_eager")),
                         x["status"] + (f": {x.get('error') or x.get('compile_fallback') or x.get('reason')}"
                                        if x["status"] != "ok" or x.get("compile_fallback") else "")]
                        for x in decode]))
    spec = st.get("speculative", {})
    if spec.get("rows"):
        parts.append(table(["dtype", "proposer", "K", "status", "token-exact", "decode tok/s", "speedup", "α"],
                           [[x["dtype"], x["proposer"], x["k"], x["status"] + (f": {x['reason']}" if "reason" in x else ""),
                             num(x.get("exact")), num(x.get("decode_tok_s"), 1), num(x.get("speedup")),
                             num(x.get("alpha"))] for x in spec["rows"]])
                     + f"\n\nPlain fp32 decoding {num(spec.get('plain_tok_s'), 1)} tok/s.")
    parts.append("\n".join([
        "**Conditions** (from the record):",
        f"- model + precision: seeded random weights of {', '.join(f'`{s}`' for s in plan['decode'])}; bf16 "
        "weights, int8 per channel and int4 groups of 32 (RTN) for decode, fp32 for speculation",
        f"- hardware: {device}, {hw['libraries']['torch']}; host {hw['cpu']}, "
        f"{hw['cores']} cores; copy bandwidth {num(st['bandwidth']['bandwidth_gb_s'], 1)} GB/s",
        f"- lengths: random prompt of {plan['prompt_len']} tokens, {plan['new_tokens']} new tokens "
        f"(ignore_eos), {plan['repeats']} timed repeats after a warm-up",
        "- arrival: one request at a time, batch size one",
        f"- engine: native runtime; compiled = `torch.compile` mode `{d['compile_mode']}` (weights frozen), compile "
        "time apart; warm-up excluded",
        "- metric: " + "; ".join(f"`{k}` = {v}" for k, v in d["metrics"].items()),
        f"- correctness requirement: speculative tokens equal plain greedy tokens; recorded {d['created']}",
    ]))
    return "\n\n".join(parts)


@bench(SERVING, "backends.json", "Serving backends: native vs vLLM", "bench/backends.py",
       "Effective tok/s = output tokens counted from the returned ids / window wall time (prefill and queueing "
       "included). The native backend serves one request at a time (others wait in a FIFO queue, inside their TTFT); vLLM "
       "batches continuously. Each (backend, config) ran in its own process with one engine for both loads.")
def render_backends(d: dict) -> str:
    rows = [[x["config"], x["concurrency"], x["backend"], num(x["effective_tok_s"], 1),
             num(x["vs_bf16_same_backend"]) + "x", "–" if x["vllm_over_native"] is None else num(x["vllm_over_native"]) + "x",
             num(x["tpot_p50_ms"], 1), num(x["ttft_p50_ms"], 0), num(x["alpha"]), num(x["tau"]),
             num(x["peak_rss_mib"], 0), num(x["load_avg_1m"], 1)]
            for x in d["table"]]
    parts = [f"Workload `{d['workload']}`, output length {d['output_len']}, load average at the end "
             f"{num(d['load_avg_1m_end'], 1)}.",
             table(["config", "C", "backend", "effective tok/s", "vs bf16 (same backend)", "vLLM / native",
                    "TPOT p50 ms", "TTFT p50 ms", "α", "τ", "peak RSS MiB", "load 1 min"], rows)]
    seen = set()
    for run in d["runs"]:
        if run["engine"]["backend"] not in seen:
            seen.add(run["engine"]["backend"])
            parts.append(conditions(run, f"Conditions of the first `{run['engine']['backend']}` run "
                                         f"(`{run['name']}`, config {run.get('bench_config')})"))
    return "\n\n".join(parts)


def _act_rows(rows: list[dict]) -> str:
    cols = [("config", "config", str), ("dtype", "dtype", str), ("scheme", "scheme", str),
            ("observer", "observer", num), ("SmoothQuant α", "smoothquant", num), ("kernels", "kernels", kernels_text),
            ("PPL", "ppl", lambda v: num(v, 2)), ("mean KL", "mean_kl", lambda v: num(v, 4)),
            ("top-1 agreement", "top1_agreement", lambda v: num(v, 3)),
            ("decode tok/s", "decode_tok_s", lambda v: num(v, 1)), ("decode x fp32", "decode_vs_fp32", num),
            ("prefill tok/s", "prefill_tok_s", lambda v: num(v, 0)), ("prefill x fp32", "prefill_vs_fp32", num),
            ("greedy agreement vs fp32", "greedy_agreement_vs_fp32", lambda v: num(v, 3))]
    cols = [c for c in cols if any(c[1] in r for r in rows)]
    return table([c[0] for c in cols], [[c[2](r.get(c[1])) for c in cols] for r in rows])


@bench(QUALITY, "act_quality.json", "W8A8 activation quantization: quality", "bench/act_quality.py --no-speed",
       "Perplexity and KL against the fp32 model on WikiText-2 windows; static scales and SmoothQuant calibrated "
       "as the record says. FP8 W8A8 dynamic is compressed-tensors' `FP8_DYNAMIC` (E4M3 weights per channel, "
       "E4M3 activations per token) beside INT8 W8A8 dynamic.")
def render_act_quality(d: dict) -> str:
    return _act_rows(d["results"]["rows"])


bench(QUALITY, "act_quality_fp8_static.json", "W8A8 activation quantization: static FP8 beside static INT8",
      "bench/act_quality.py --no-speed --rows \"fp32,W8A8 static mse,FP8 static minmax,FP8 static mse\" "
      "--out bench/results/act_quality_fp8_static.json",
      "compressed-tensors' `FP8` preset (E4M3 weights per tensor, one calibrated E4M3 input scale per layer) "
      "beside static INT8 W8A8 with its best observer, same windows and calibration as the quality table above "
      "(its `W8A8 static mse` row reproduces).")(render_act_quality)


bench(SPEED, "act_speed.json", "W8A8 activation quantization: speed",
      "bench/act_quality.py --speed-rows-only --out bench/results/act_speed.json",
      "The `int8xint8` kernel (`torch._int_mm`) against dense fp32 and bf16 in the same run. The quality columns "
      "here come from fewer windows than [the quality table](quality.md#act_quality-json), which is the quality "
      "result.")(render_act_quality)


@bench(QUALITY, "kv_quality.json", "KV-cache quantization: quality", "bench/kv_quality.py",
       "The fp8 rows on both backends come from `--vllm` (same file). Teacher-forced *through the cache* in chunks, so every chunk attends to quantized history; KL against the "
       "dense fp32 cache. Bytes per token = K+V over all layers (codes + dynamic scales).")
def render_kv(d: dict) -> str:
    r = d["results"]
    rows = [[x["spec"], num(x["bytes_per_token"] / 1024, 1), num(x["ppl_512"], 3), num(x["kl_512"], 4),
             num(x["ppl_2048"], 3), num(x["kl_2048"], 4)] for x in r["rows"]]
    parts = [table(["KV spec", "KiB/token", "PPL 512", "KL 512", "PPL 2048", "KL 2048"], rows)]
    if "kivi_key_verdict" in r:
        vr = [[bits, ctx, num(v["per_token"], 4), num(v["per_channel"], 4), num(v["channel_better"])]
              for bits, by_ctx in r["kivi_key_verdict"].items() for ctx, v in by_ctx.items()]
        parts += ["KIVI's key-granularity question, values left unquantized (keys per token vs per channel):",
                  table(["bits", "metric", "keys per token", "keys per channel", "per channel better"], vr)]
    if "fp8_native_vs_vllm" in r:
        f = r["fp8_native_vs_vllm"]
        own = f["top1_agreement_vs_own_unquantized_kv"]
        fr = [[kv, num(f["ppl"]["native"][kv]), num(own["native"].get(kv, 1.0 if kv == "none" else None), 3),
               num(f["ppl"]["vllm"][kv]), num(own["vllm"].get(kv, 1.0 if kv == "none" else None), 3),
               num(f["top1_agreement_native_vs_vllm"][kv], 3)] for kv in f["ppl"]["native"]]
        parts += [f"fp8 KV on both backends (key `fp8_native_vs_vllm`): weights {f['weights']}, {f['windows']} windows "
                  f"of {f['ctx']} tokens, chunks of {f['prefill_chunk']} tokens on both backends. Top-1 = teacher-forced "
                  "argmax agreement (with the same backend's unquantized-KV run, or between backends).",
                  table(["KV", "native PPL", "native top-1 vs own unquantized KV", "vLLM PPL",
                         "vLLM top-1 vs own unquantized KV", "native vs vLLM top-1"], fr)]
    return "\n\n".join(parts)


@bench(QUALITY, "eval_agreement*.json", "Native eval backend vs lm-eval's `hf` backend", "bench/eval_agreement.py",
       "Both backends through `lm_eval.simple_evaluate` on the same documents, 0-shot, local task YAMLs. CPU "
       "seconds were measured on shared cores: indicative only.")
def render_eval_agreement(d: dict) -> str:
    r = d["results"]
    rows = [[t, pct(v["native"]["acc,none"]), pct(v["hf"]["acc,none"]), pct(v["stderr"], 2),
             pct(v["native"]["acc_norm,none"]), pct(v["hf"]["acc_norm,none"]), f"{v['items_differing']}/{v['n']}",
             num(v["within_1se"])] for t, v in r["tasks"].items()]
    parts = [table(["task", "native acc %", "hf acc %", "stderr", "native acc_norm %", "hf acc_norm %",
                    "items answered differently", "within 1 stderr"], rows)]
    sec = r.get("seconds", {})
    if sec:
        parts.append(table(["job", "CPU s", "wall s"], [[k, num(v["cpu_s"], 1), num(v["wall_s"], 0)] for k, v in sec.items()]))
    if r.get("published"):
        parts.append("Published model-card scores (lighteval prompts and normalisation on the original bf16 weights; "
                     "not comparable one to one with lm-eval's prompts on the Q4_1-derived body): "
                     + ", ".join(f"{k} {num(v, 1)}" for k, v in r["published"].items()) + ".")
    return "\n\n".join(parts)


@bench(QUALITY, "eval_schemes.json", "Weight schemes: accuracy, flips, KL, floor verdict", "bench/eval_schemes.py",
       "Accuracy alone hides how many answers changed: flips count items whose correctness differs from the "
       "reference; the verdict is the lower end of the paired-bootstrap interval of the margin "
       "(see docs/methodology.md), so a small item count cannot certify a floor even when the point estimate "
       "is above the reference.")
def render_eval_schemes(d: dict, extra: dict[str, Callable[[dict], Any]] | None = None) -> str:
    """One row per (configuration, task); ``extra``: more columns (header -> cell of a row)."""
    extra = extra or {}
    rows = []
    for x in d["results"]["rows"]:
        lo, hi = x["delta_ci"]
        f = x["flips"]
        rows.append([x["config"], x["task"], x["n"], pct(x["acc_test"]), pct(x["acc_ref"]),
                     f"{pct(x['delta'])} [{pct(lo)}, {pct(hi)}]", f"{f['total']} (-{f['lost']}/+{f['gained']})",
                     f"{num(x['kl_mean'], 3)} / {num(x['kl_p99'], 2)}", pct(x["top1_agreement"]),
                     f"{num(x['ppl'])} (ref {num(x['ppl_ref'])})", f"{pct(x['margin_ci'][0])}",
                     "pass" if x["passed"] else "fail", x["verdict"], *(fn(x) for fn in extra.values())])
    return table(["method:scheme", "task", "items", "acc %", "ref %", "Δ pts [CI]", "flips (-lost/+gained)",
                  "KL mean / p99", "top-1 agree %", "PPL", "margin lower bound (pts)", "task verdict",
                  "config verdict (all tasks)", *extra], rows)


KERNEL_AND_CAVEAT = {"kernel": lambda x: kernels_text(x.get("kernels")), "caveat": lambda x: x.get("caveat") or "–"}


@bench(QUALITY, "eval_fp4.json", "FP4 microscaling vs int4: accuracy, flips, KL", "bench/eval_schemes.py --set fp4",
       "MXFP4A16 (E2M1 in g32 blocks, E8M0 power-of-two scales) and NVFP4A16 (E2M1 in g16 blocks, E4M3 scales "
       "under an fp32 global scale) beside int4 g32 asymmetric / symmetric and g16 symmetric, RTN, on the default "
       "model. The FP4 rows run the `simulated` kernel (dequantized weights, plain matmul): their quality is real, "
       "no speed is claimed. Read the caveat beside the 4-bit rows: this model's body weights were Q4_1-dequantized.")
def render_eval_fp4(d: dict) -> str:
    return render_eval_schemes(d, KERNEL_AND_CAVEAT)


bench(QUALITY, "eval_fp8.json", "FP8 formats: accuracy, flips, KL", "bench/eval_schemes.py --set fp8",
      "E4M3 weights per output channel (FP8A16) and per square block (`wfp8b…`: compressed-tensors' FP8_BLOCK "
      "weights; the full preset's per-group activations do not fit this model's layer widths), weight-only and "
      "with dynamic per-token E4M3 activations, compressed-tensors' FP8_DYNAMIC and static FP8 (one calibrated "
      "input scale per layer, mse observer) beside INT8 W8A8 dynamic, RTN. Weight-only and block rows run the "
      "`simulated` kernel (quality real, no speed claimed).")(render_eval_fp4)


@bench(QUALITY, "eval_rotation.json", "Hadamard rotation at W4A8 / W4A4: accuracy, flips, KL",
       "bench/eval_schemes.py --set rotation",
       "int4 g32 symmetric weights (RTN) with int8 per-token, int4 per-token and int4 per-group-of-32 dynamic "
       "activations, each without and with `--rotate hadamard` (quant/rotation.py: R1 and R2 fused into the weights, "
       "R4 online before down_proj). int4 activations run the `simulated` kernel (fake-quantized inputs): their "
       "quality is real, no speed is claimed. The factor is mean KL unrotated / rotated on the same WikiText-2 "
       "windows. On this model the rotation helps where activations are the loss (per-token int4) and costs where "
       "weights are (W4A8; weight-only int4 loses too in a quick check): its body weights were Q4_1-dequantized, "
       "which may favour the unrotated basis (not verified); 4-bit results here need not transfer.")
def render_eval_rotation(d: dict) -> str:
    factors = d["results"].get("kl_factor_unrotated_over_rotated", {})
    line = "KL unrotated / rotated: " + ", ".join(f"{s} **{num(f)}x**" for s, f in factors.items()) + "."
    return render_eval_schemes(d, KERNEL_AND_CAVEAT) + "\n\n" + line


@bench(QUALITY, "eval_fp4_act.json", "W4A4 in FP4 vs int4: accuracy, flips, KL", "bench/eval_schemes.py --set fp4a",
       "Weights and activations both four-bit, RTN: MXFP4 (E2M1 in g32 blocks with E8M0 scales, activations scaled "
       "per block as they arrive) beside int4 weights and activations in g32 groups, NVFP4 (g16 blocks, E4M3 scales "
       "under an fp32 global scale per tensor; each layer's input global scale calibrated on WikiText-2, as "
       "compressed-tensors' static min-max observer does) beside int4 in g16 groups, and the FP4 pair again with "
       "`--rotate hadamard`. Every row runs the `simulated` kernel (fake-quantized inputs, dequantized weights): "
       "quality is real, no speed is claimed. Read the caveat beside the rows: this model's body weights were "
       "Q4_1-dequantized.")
def render_eval_fp4_act(d: dict) -> str:
    return render_eval_rotation(d)


bench(QUALITY, "eval_head.json", "Quantizing the LM head too: accuracy, flips, KL", "bench/eval_schemes.py --set head",
      "int8 per channel and int4 g32 symmetric weights, RTN, with the LM head kept bf16 (the default schemes: "
      "compressed-tensors ignores `lm_head`) and quantized too (`@ignore=`: the tied head becomes its own quantized "
      "copy, the embedding lookup stays bf16). What the head's bytes buy at batch-one decode is in [the compiled "
      "decode table](speed.md#quant_decode_compiled-amd-epyc-avx512-json); this is what they cost in quality. Read the caveat beside the 4-bit rows.")(render_eval_fp4)


@bench(QUALITY, "quant_quality.json", "Weight-quantization methods: perplexity", "bench/quant_quality.py",
       "Each row quantized by `quantize_model` and scored on the same WikiText-2 windows; quantize seconds are "
       "wall time on shared cores (they rank methods, they are not speeds).")
def render_quant_quality(d: dict) -> str:
    r = d["results"]
    rows = [[x["scheme"], x["method"], kernels_text(x.get("kernels")), num(x.get("mean_weight_rel_error"), 3),
             num(x["ppl"], 3), x["n_tokens"], num(x["quantize_s"], 0)] for x in r["rows"]]
    return "\n\n".join([
        table(["scheme", "method", "kernels (layers)", "mean relative weight error", "PPL", "scored tokens",
               "quantize s"], rows),
        f"Total {num(r.get('total_s'), 0)} s, {r.get('jobs')} jobs, {r.get('torch_threads_per_job')} torch thread(s) per job.",
    ])


@bench(QUALITY, "quant_store.json", "Calibrated quantizations kept on disk", "bench/quant_store.py",
       "Each point quantized in a fresh process with an empty store (it calibrates and writes the entry, "
       "quant/store.py), then in another fresh process (it reads the entry); both decode the same prompt greedily. "
       "Seconds are `quantize_fresh`'s wall time, model load excluded.")
def render_quant_store(d: dict) -> str:
    rows = [[x["scheme"], x["method"], x["calibration"], num(x["first_s"], 1), num(x["second_s"], 1),
             num(x["ratio"], 0) + "x", num(x["entry_bytes"] / 1e6, 0), kernels_text(x.get("kernels")),
             num(x["tokens_equal"])] for x in d["results"]["rows"]]
    return table(["scheme", "method", "calibration", "first process s", "second process s", "first / second",
                  "entry MB", "kernels (layers)", "greedy tokens equal"], rows)


@bench(SERVING, "harness_overhead.json", "Harness overhead on vLLM", "bench/harness_overhead.py",
       "Our vLLM backend's closed loop against a bare `LLM.generate` on the same in-process engine and prompts, "
       "alternating rounds, median.")
def render_harness_overhead(d: dict) -> str:
    r = d["results"]
    target = r["target_overhead_pct"]
    rows = [[x["concurrency"], num(x["bare_llm_generate_tok_s"], 1), num(x["harness_tok_s"], 1),
             num(x["overhead_pct"], 1), num(x["overhead_pct"] <= target)] for x in r["rows"]]
    return "\n\n".join([
        table(["C", "bare LLM.generate tok/s", "harness tok/s", "overhead %", f"<= {num(target, 0)}% target met"], rows),
        f"Load average at the end {num(r.get('load_avg_1m_end'), 1)}.",
    ])


@bench(SPECULATION, "specdec-vllm.json", "Speculative decoding: native vs vLLM side by side", "bench/spec_vllm.py",
       "vLLM numbers are deltas of its spec-decode counters around the measured window; native numbers use the "
       "same definitions. With an identical draft an exact sampler must accept every draft token at any "
       "temperature.")
def render_spec_vllm(d: dict) -> str:
    n = d["lengths"]["n_requests"]
    rows = [[x["proposer"], num(x["temperature"], 0), x["k"], num(x["native"]["alpha"], 3), num(x["native"]["tau"]),
             *((f"failed: {x['vllm']['failed']}", "") if "failed" in x["vllm"] else
               (num(x["vllm"]["alpha"], 3), num(x["vllm"]["tau"]))),
             "(sampled)" if x["temperature"] else "-" if x["outputs_identical"] is None else f"{x['outputs_identical']}/{n}"]
            for x in d["results"]["rows"]]
    return table(["proposer", "T", "K", "native α", "native τ", "vLLM α", "vLLM τ", "identical outputs"], rows)


SWEEP_COLS = [  # (header, row field, format); a column shows when any row has the field
    ("K", "k", str), ("α", "alpha", num), ("β", "beta", num), ("τ", "tau", num),
    ("accept/pos", "acceptance_per_pos", lambda v: " ".join(f"{x:.2f}" for x in v)),
    ("no-draft steps", "draft_length_hist", lambda v: num(v[0])),
    ("tok/s", "tok_s", lambda v: num(v, 1)), ("speedup", "speedup", num), ("theory", "predicted_speedup", num),
    ("refined", "refined_speedup", num), ("meas/Thm", "measured_over_predicted", num),
    ("meas/refined", "measured_over_refined", num), ("c", "c", lambda v: num(v, 3)), ("V(K)", "verify_cost", num),
    ("=greedy", "greedy_equal", str), ("vs reference plain", "speedup_vs_reference", num),
    ("speedup, ended prompts", "speedup_ended", num),
]


@bench(SPECULATION, "specdec*.json", "Speculative decoding: acceptance and speedup vs K", "bench/spec_sweep.py",
       "Speedup = speculative decode tok/s / plain decode tok/s of the same target (prefill excluded). α = "
       "accepted / drafted; β = accepted / tested draft tokens (Leviathan's per-token acceptance); c = proposer "
       "cost per drafted token in plain decode steps; V(K) = measured cost of a verification over K drafted tokens plus the bonus in "
       "decode steps, at the run's contexts (records before 2026-12-02: after the first prompt only). The theory column is Leviathan et al.'s prediction (their Theorem `3.8`); refined uses the measured mix of draft lengths, "
       "K·c and V(K) (docs/methodology.md). `=greedy` counts prompts whose output is token-identical to plain "
       "greedy decoding. With fixed output length (ignore_eos) a finished answer keeps going and often repeats "
       "itself, which prompt lookup exploits; the end-of-turn run stops where the model stops.")
def render_sweeps(d: dict) -> str:
    n = d["lengths"]["n_requests"]
    parts = []
    for s in d["results"]["sweeps"]:
        b = s["baseline"]
        ref = b.get("reference")
        head = (f"**{s['proposer']}, T={num(s['sampling']['temperature'], 0)}** ({s['dtype']}, attention "
                f"{s.get('attention', 'not recorded')}, {s['threads']} threads"
                + (f", decode and verification steps compiled ({s['compile_mode']})" if s.get("compile_mode") else "")
                + f"): plain {num(b['tok_s'], 1)} tok/s"
                + (f" ({ref['attention']} plain {num(ref['tok_s'], 1)})" if ref else "")
                + f"; best K measured {s['best_k_measured']}, theory {s['best_k_theory']}")
        if "ended" in b:
            ended = [t for t, e in zip(b["output_tokens"], b["ended"]) if e]
            head += (f"; {len(ended)} of {len(b['ended'])} answers ended by themselves "
                     f"({min(ended)}-{max(ended)} tokens)" if ended else "; no answer ended by itself")
        rows = s["rows"]
        best = best_by(rows, "speedup")
        head += f"; highest speedup {num(best['speedup'])}x at K={best['k']}"
        if s.get("load_average_after"):
            head += f"; load average after the sweep {' / '.join(num(x, 1) for x in s['load_average_after'])}"
        cols = [c for c in SWEEP_COLS if any(c[1] in r for r in rows)]
        body = [[c[2](r[c[1]]) if c[1] in r else "–" for c in cols] for r in rows]
        if "greedy_equal" in rows[0]:
            body = [[f"{v}/{n}" if c[1] == "greedy_equal" and v != "–" else v for c, v in zip(cols, line)] for line in body]
        parts += [head, table([c[0] for c in cols], body)]
    return "\n\n".join(parts)


@bench(SPECULATION, "eagle_train_draft*.json", "EAGLE draft head: trained here, then acceptance and speedup vs K",
       "bench/train_draft.py",
       "An EAGLE-1 style head (eagle:PATH; one decoder layer unless the record says more) trained on this machine under a wall-clock budget from the "
       "target itself: its own greedy answers to Alpaca instructions (benchmark overlaps dropped), where recorded also "
       "to long-context prompts in Spec-Bench's summarization and RAG shapes built from WikiText-2 validation passages "
       "(`--context-prompts`), and WikiText-2 validation text, hidden-state regression plus token cross-entropy, optionally over chains of the head's "
       "own states (EAGLE-3's training-time test, `--ttt-steps`). Held-out acceptance is the share of held-out "
       "positions whose drafted token is the target's greedy token (teacher-forced tokens), per chain step where "
       "recorded (step s drafts from the head's own state after s-1 steps). The sweep columns are those of the "
       "speculative-decoding section.")
def render_eagle(d: dict) -> str:
    t = d["results"]["training"]
    split = d["results"]["time_split_s"]
    budget = t["budget"]
    held = " → ".join(num(e["heldout_top1"]) for e in t["epochs"])
    chain = t["epochs"][-1].get("heldout_chain")
    if chain:
        held += "; last epoch per chain step: " + " / ".join(num(a) for a in chain)
    if t["config"].get("ttt_steps", 1) > 1:
        held += f" (trained on chains of {t['config']['ttt_steps']} steps)"
    if t["config"].get("head_layers", 1) > 1:
        held += f"; the head has {t['config']['head_layers']} decoder layers"
    if t["config"].get("fuse_layers"):
        held += (f"; the head fuses the outputs of target layers {', '.join(map(str, t['config']['fuse_layers']))} "
                 "with the final state (EAGLE-3's feature fusion)")
    answers = (f" ({num(t['n_alpaca_answers'])} Alpaca and {num(t['n_context_answers'])} long-context answers)"
               if "n_context_answers" in t else "")
    head = (f"Training budget: answers capped at {num(budget['answer_seconds'], 0)} s, training at "
            f"{num(budget['train_seconds'], 0)} s. Time split: extraction (answers + hidden states) "
            f"{num(split['extraction'], 0)} s, training {num(split['training'], 1)} s, held-out evaluation "
            f"{num(split['heldout_evaluation'], 1)} s, Spec-Bench measurement {num(split['spec_bench_measurement'], 0)} s. "
            f"{num(t['n_sequences'])} sequences{answers}, {num(t['n_train_tokens'])} training positions, {num(t['steps'])} steps; "
            f"held-out acceptance per epoch: {held}.")
    if d["results"].get("notes"):
        head = f"Note: {d['results']['notes']}\n\n{head}"
    return head + "\n\n" + render_sweeps({**d, "results": {"sweeps": [eagle_sweep(d)]}})


def eagle_sweep(d: dict) -> dict:
    """An EAGLE training record's measured sweep in the shape of a ``specdec*.json`` sweep."""
    return {**d["engine"]["config"], **{k: v for k, v in d["results"].items()
                                        if k not in ("training", "time_split_s", "notes")}}


@bench(SPECULATION, "spec_quant.json", "Quantization x speculation: an EAGLE head on quantized targets",
       "bench/spec_quant.py",
       "The head trained on the unquantized target drafts for the same target with RTN-quantized weights (W8A8 = "
       "int8 per-channel weights with dynamic per-token int8 activations), the head itself unquantized or int8 "
       "weight-only. Speedup is over plain decoding of the same quantized target; the sweep columns are those of "
       "the speculative-decoding section.")
def render_spec_quant(d: dict) -> str:
    r, n = d["results"], d["lengths"]["n_requests"]
    rows = [(c, row) for c in r["conditions"] if "rows" in c for row in c["rows"]]
    cols = [c for c in SWEEP_COLS if any(c[1] in row for _, row in rows)]
    body = [[c["target"], c["head"], num(c["baseline"]["tok_s"], 1)]
            + [(f"{row[key]}/{n}" if key == "greedy_equal" else fmt(row[key])) if key in row else "–"
               for _, key, fmt in cols] for c, row in rows]
    cfg, training = r["head"].get("config", {}), r["head"].get("training")
    head = (f"Head `{d['engine']['config']['head_dir']}`: held-out first-token acceptance {num(cfg.get('heldout_top1'))} "
            f"after {num(cfg.get('steps'))} steps")
    if training:
        head += (f"; budget {compact(training['budget'])}, trained in {num(training['wall_s'], 0)} s (extraction "
                 f"{num(training['extract_s'], 0)} s, training {num(training['train_s'], 0)} s)")
    kernels = {c["target"]: c["target_kernels"] for c in r["conditions"] if "target_kernels" in c}
    parts = [f"Note: {r['notes']}" if r.get("notes") else "", head + ".",
             table(["target", "head", "plain tok/s", *(c[0] for c in cols)], body),
             "Target kernels: " + "; ".join(f"{t}: {kernels_text(k)}" for t, k in kernels.items()) + "."]
    parts += [f"Refused: {c['target']} x head {c['head']}: {c['refused']}" for c in r["conditions"] if "refused" in c]
    return "\n\n".join(p for p in parts if p)


@bench(SPECULATION, "eagle_tree_bound*.json", "EAGLE tree drafting: top-w acceptance and the speedup it predicts",
       "bench/eagle_tree_bound.py",
       "Before a tree decoder exists: a full tree of widths (w1, w2) drafts the head's top w1 tokens, then the top "
       "w2 of its second step under each, and greedy verification accepts a level when the target's token is among "
       "them. Acceptance is teacher-forced on the target's greedy Spec-Bench answers (the top-1 widths are chain "
       "drafting, checked against the chain record's measured acceptance); the predicted speedup is tau / (V + levels x c) with V the cost of a "
       "forward over the tree's rows relative to a decode step, measured here, and c the chain's measured one-row draft step (a lower bound on a "
       "wide level's cost). A prediction, not a measured speedup.")
def render_tree_bound(d: dict) -> str:
    r = d["results"]
    ck = r["chain_check"]
    head = (f"Head `{r['head']}` (chain record `{r['chain_record']}`), {num(r['positions'])} chain starts. Chain check "
            f"at K=2: acceptance per position teacher-forced {' / '.join(num(a) for a in ck['teacher_forced'])}, "
            f"measured {' / '.join(num(a) for a in ck['measured_k2'])}; measured speedup {num(ck['measured_speedup_k2'])}x "
            f"with c {num(ck['c'], 3)}. Depth-1 acceptance by width: "
            + ", ".join(f"top-{w} {num(a)}" for w, a in r["depth1"].items()) + ".")
    rows = [[" x ".join(map(str, s["widths"])), s["rows"], num(s["tau"]), num(s["verify_cost"]),
             num(s["predicted_speedup"]) + "x"] for s in r["shapes"]]
    return head + "\n\n" + table(["tree widths", "rows verified", "τ", "V(rows - 1)", "predicted speedup"], rows)


@bench(SPECULATION, "check-lossless-*.json", "Lossless checks of speculative sampling",
       "quantspec check-lossless --json FILE",
       "Greedy speculative output must equal plain greedy decoding; sampled outputs are judged by TV and "
       "acceptance tests of known false-alarm rate and power (docs/methodology.md). Over a full vocabulary a few "
       "hundred samples detect little: compare each TV threshold with its detectable TV.")
def render_lossless(d: dict) -> str:
    r = d["results"]

    def dist(name, x):
        return [name, x["samples"], x["cells"], num(x["tv"], 3), num(x["tv_threshold"], 3), num(x["detectable_tv"], 3),
                num(x["p_value"], 3), num(x["passed"])]

    def acc(name, x):
        return [name, x["rounds"], num(x["rate"], 3), num(x["expected"], 3), f"[{x['region'][0]}, {x['region'][1]}]",
                num(x["accepted"]), num(x["detectable_shift"], 3), num(x["passed"])]

    drows, arows = [], []
    for i, fs in enumerate(r["first_step"]):
        drows.append(dist(f"model, prefix {i}", fs["distribution"]))
        if fs.get("acceptance"):
            arows.append(acc(f"model, prefix {i}", fs["acceptance"]))
    syn = r.get("synthetic") or {}
    for key in ("joint", "first_token"):
        x = syn.get("joint", {}).get("distribution") if key == "joint" else syn.get("joint", {}).get(key)
        if x:
            drows.append(dist(f"synthetic chain, {key.replace('_', ' ')}", x))
    if syn.get("bonus"):
        drows.append(dist("synthetic chain, bonus token", syn["bonus"]))
    if syn.get("joint", {}).get("acceptance"):
        arows.append(acc("synthetic chain", syn["joint"]["acceptance"]))
    parts = [f"Overall: passed {num(r['passed'])}; greedy mismatches {len(r['greedy_mismatches'])}; synthetic "
             f"vocabulary {syn.get('vocab')}.",
             table(["distribution test", "samples", "cells", "TV", "threshold", "detectable TV", "χ² p (info)", "passed"], drows)]
    if arows:
        parts.append(table(["first-draft acceptance", "rounds", "rate", "Σ min(p, q)", "binomial region", "accepted",
                            "detectable shift", "passed"], arows))
    else:
        parts.append("No acceptance test ran on the model: the proposer drafted nothing after these prefixes.")
    return "\n\n".join(parts)


@bench(QUALITY, "compare-backends-*.json", "Native vs vLLM on the same weights, item by item",
       "quantspec eval default --scheme SCHEME --compare-backends --tasks TASKS --limit N --json FILE",
       "One configuration scored by both backends from the same compressed-tensors export, dtype and items. "
       "`differ` counts items whose answer differs (chosen choice, greedy flag, or generated text); McNemar's exact "
       "test asks whether the two accuracies differ beyond chance. The first differing items are listed.")
def render_compare_backends(d: dict, show: int = 8) -> str:
    a, b = d["backends"]
    rows = [[t, x["n"], pct(x["accuracy"][0]), pct(x["accuracy"][1]), len(x["diffs"]), x["only_first"],
             x["only_second"], num(x["mcnemar_p"], 3)] for t, x in d["tasks"].items()]
    items = [[t, i["doc_id"], i["answers"][0], i["answers"][1], num(i["correct"][0], 0), num(i["correct"][1], 0),
              "–" if i["diverge_at"] is None else f"#{i['diverge_at']}: {i['diverging_tokens']}"]
             for t, x in d["tasks"].items() for i in x["diffs"][:show]]
    return "\n\n".join([
        f"Configuration: `{compact(d['config'])}`.",
        table(["task", "n", f"{a} %", f"{b} %", "differ", f"only {a} right", f"only {b} right", "McNemar p"], rows),
        table(["task", "doc", f"{a} answer", f"{b} answer", f"{a} correct", f"{b} correct", "first diverging token"],
              items),
    ])


@bench(SEARCH, "study_cost.*json", "Search cost", "bench/study_cost.py",
       "Where the wall time of a TPE search goes, from an empty eval cache. A quantized model is memoised per "
       "(checkpoint, dtype, scheme, method, calibration set), so quality, fidelity, speed and the greedy twin of "
       "one point calibrate once, and a calibrated one is kept on disk for the next process (quant/store.py; "
       "`--cold` empties it too). One file per run: `study_cost.json` ran eager, before compiled steps were the "
       "default and before each point's speed was paired with the reference in rounds (it timed each point once); "
       "`study_cost.compiled.json` and `study_cost.eager.json` ran the same protocol with `--compile auto` and "
       "`--compile eager`, from empty eval and inductor caches, on the AMD EPYC; "
       "`study_cost.compiled.intel-xeon-avx512-amx.json` ran `--compile auto` on the AMX Xeon from empty eval, "
       "inductor and quantization caches, with the length gate and engines kept resident (sessions after the AMD "
       "runs; its `other` is almost all paired rounds, which later records count apart as `paired_rounds`); `study_cost.compiled-second.intel-xeon-avx512-amx.json` is the search run again on the "
       "caches that run left (eval results, inductor's cache, calibrated quantizations), with points already "
       "infeasible no longer given length runs. Records with rounds per point ran after a point infeasible already "
       "kept the minimum paired rounds and only feasible points got the noise guard's rounds. TPE picks its points from the numbers it measures, "
       "so two runs do not time the same mix: compare the rows per call as well as the wall.")
def render_study_cost(d: dict) -> str:
    r = d["results"]
    rows = [[k, num(v, 0), r["calls"].get(k, "–")] for k, v in r["seconds"].items()]
    return "\n\n".join([
        f"Decode step: `--compile {d['engine']['config'].get('compile', 'eager')}`.",
        table(["where", "seconds", "calls"], rows),
        f"Wall {num(r['wall_s'], 0)} s against a target of {num(r['target_wall_s'], 0)} s (within target: "
        f"{num(r['within_target'])}); {r['n_finished']} finished trials ("
        + ", ".join(f"{k} {v}" for k, v in r["states"].items()) + f"); {r['duplicates_reused']} re-sampled points "
        "reused their numbers." + held_rounds(r.get("paired_rounds_per_point")),
    ])


def held_rounds(rounds: dict | None) -> str:
    """Rounds per measured point, infeasible ones held at the minimum apart (records since the hold)."""
    if not rounds:
        return ""
    return (f" Paired rounds per measured point: {num(len(rounds['settled']), 0)} feasible "
            f"{rounds['settled']}, {num(len(rounds['held']), 0)} infeasible already, held at the minimum "
            f"{rounds['held']}.")


@bench(SEARCH, "demo-pareto.json", "`make demo` search: speed vs quality",
       "make demo (copied from runs/demo/pareto.json and pareto.png)",
       "(`quantspec pareto --json FILE` writes the same table from a study's storage.) Every trial of the demo study. `feasible` = the floor verdict passed; `*` marks the Pareto-optimal feasible "
       "rows, `~` those behind the front on point estimates only (no row beats them beyond both CIs); `speedup` is "
       "paired with the reference (median of per-round ratios, t-interval of their mean log over `rounds`; `noisy` where the CI "
       "stayed wider than the noise threshold; rows without a CI were measured before pairing); `greedy =` is the seeded check that a speculative point emits the same tokens as its non-speculative "
       "twin; `quality` says where a row's quality comes from (measured, exact by construction, verified equal to "
       "its twin, or why it has none); `len ×ref` is the mean output length with natural end-of-turn over the "
       "reference's (the search's second gate). Plot: [demo-pareto.png](demo-pareto.png).")
def render_demo(d: dict, plot: str | None = "demo-pareto.png") -> str:
    rows = []
    for x in d["rows"]:
        ci = x.get("ci") or [None, None]
        ex = x.get("exact")
        greedy = "" if not ex else ("yes" if ex["equal"] else f"NO {sum(ex['equal_per_prompt'])}/{ex['n_prompts']}")
        sci = x.get("speedup_ci")
        speedup = num(x["speedup"]) + "x" + (f" [{num(sci[0])}, {num(sci[1])}]" if sci else "") + \
            (" noisy" if x.get("noisy") else "")
        mark = "*" if x["pareto"] else "~" if x.get("not_separable") else ""
        rows.append([mark, x["number"], x["state"], x["label"], x["backend"], num(x["tok_s"], 1),
                     speedup, num(x.get("rounds")), pct(x["accuracy"]), f"{pct(x['delta'])} [{pct(ci[0])}, {pct(ci[1])}]",
                     num(x["flips"]), num(x["kl"], 4), f"{num(x['alpha'])} / {num(x['tau'])}", greedy,
                     x.get("quality_basis") or "not recorded", num(x.get("length_ratio")), num(x["feasible"]), "–" if x["duplicate_of"] is None else f"#{x['duplicate_of']}",
                     "; ".join(filter(None, [x["reason"], *(x.get("infeasible_because") or [])])),
                     ", ".join(x.get("notes") or [])])
    ref = d.get("reference", {})
    steps = sorted({x["step"] for x in d["rows"] if x.get("step")})
    return "\n\n".join([
        f"Study `{d['study']}`, mode {d['mode']}, floor {d['floor']}, length band "
        f"{compact(d.get('length_band', 'not recorded'))}; speedup reference: {compact(ref)}; decode step: "
        f"{' / '.join(steps) or 'not recorded'} (each row's one-time build, in no row's speed, is in the JSON). "
        "This file holds the table, not a run record: the speed and quality conditions of each trial live in the "
        "study's storage (see docs/methodology.md for the protocol).",
        table(["", "#", "state", "config", "backend", "tok/s", "speedup [CI]", "rounds", "acc %", "Δ pts [CI]", "flips", "KL",
               "α / τ", "greedy =", "quality", "len ×ref", "feasible", "same as", "pruned / infeasible because",
               "notes"], rows),
        "The `notes` column names the notes this JSON attaches to rows ("
        + ", ".join(f"`{k}`" for k in (d.get("notes") or {})) + "); `q4_1` is the 4-bit caveat at the top of "
        "this section.",
        *([f"![speed vs quality]({plot})"] if plot else []),
    ])


bench(SEARCH, "study_cost*-pareto.json", "Search cost: the searched tables", "bench/study_cost.py",
      "The tables of the studies timed above, columns as in the demo table below; each study is kept beside it "
      "(`study_cost/study.db` for `study_cost.json`: `quantspec pareto --study-dir bench/results/study_cost "
      "--study-name study-cost`; `study_cost_compiled/`, `study_cost_eager/` and `study_cost_compiled_amx/` for the "
      "others).")(partial(render_demo, plot=None))


@bench(SERVING, "noise.*.json", "Speed through the noise: idle vs one core hogged", "bench/noise.py",
       "The demo's configurations measured on an idle machine and with a busy-loop process pinned to one core "
       "(started and stopped by the script), under the old protocol (each configuration timed once against a "
       "reference timed once at the start, torch's default threads) and the new one (paired with the resident "
       "reference in interleaved rounds, threads chosen by the probe, the noise guard on). `error` = hogged "
       "speedup over idle speedup, as a change. Target: every new row within the tolerance or flagged noisy, at most a third "
       "flagged.")
def render_noise(d: dict) -> str:
    r = d["results"]["summary"]
    rows = [[x["config"], num(x["old_idle"]) + "x", num(x["old_hog"]) + "x", pct(x["old_error"], 0),
             f"{num(x['new_idle'])}x [{num(x['new_idle_ci'][0])}, {num(x['new_idle_ci'][1])}]",
             f"{num(x['new_hog'])}x [{num(x['new_hog_ci'][0])}, {num(x['new_hog_ci'][1])}]", pct(x["new_error"], 0),
             f"{x['rounds_idle']} / {x['rounds_hog']}", num(x["noisy"]), num(x["ok"]),
             f"{num(x['tok_s_idle'], 1)} / {num(x['tok_s_hog'], 1)}"] for x in r["rows"]]
    dec = [[how, num(v["idle_tok_s"], 1), v["threads_idle"], num(v["hog_tok_s"], 1), v["threads_hog"],
            num(v["idle_over_hog"]) + "x"] for how, v in r["decode"].items()]
    loads = {c: d["results"][c]["load"] for c in ("idle", "hog")}
    return "\n\n".join([
        table(["config", "old idle", "old hog", "old error %", "new idle [CI]", "new hog [CI]", "new error %",
               "rounds idle / hog", "noisy", "ok", "tok/s idle / hog (new)"], rows),
        f"Tolerance ±{pct(r['tolerance'], 0)}%; rows flagged noisy {r['flagged']} (at most {r['max_flagged']}); "
        f"target met: {num(r['target_met'])}.",
        table(["threads", "idle decode tok/s", "threads idle", "hogged decode tok/s", "threads hogged",
               "idle / hogged"], dec),
        f"Decode target: hogged within {num(r['decode_target_idle_over_hog'], 1)}x of idle with the probe's "
        f"threads: {num(r['decode_target_met'])}. Load: idle {compact(loads['idle'])}; hogged {compact(loads['hog'])}; "
        f"wall {num(d['results']['wall_s'], 0)} s.",
    ])


# ----------------------------------------------------------------------------------------------- summary

CPU_NOISE = re.compile(r"\(r\)|\(tm\)|\bprocessor\b|\bcpu\b|@.*|\d+-core", re.I)  # as runtime.hardware's tag drops
NOT_MEASURED = "not measured on this CPU"
NO_CPU = "CPU not recorded"


def cpu_kind(name: str, d: dict) -> str:
    """CPU model + ISA of a result file, e.g. ``AMD EPYC (AVX512)``, ``Intel Xeon (AVX512, AMX)`` or ``Intel Xeon
    (AVX2 forced)``, read from its run record's hardware; a record older than the ISA field takes it from the
    machine tag its bench wrote into the file name (``decode-bf16.amd-epyc-avx512.json``; runtime.hardware's
    ``Hardware.tag``) when the tag starts with the record's CPU, else says the ISA is not recorded."""
    hw = run_record(d).get("hardware") or {}
    if not hw.get("cpu"):
        return NO_CPU
    cpu = " ".join(CPU_NOISE.sub(" ", hw["cpu"]).split()) or hw["cpu"]
    probe = hw.get("probe") or {}
    isa, forced = hw.get("isa") or probe.get("isa"), bool(probe.get("forced"))
    amx = "AMX" in str(probe.get("bf16_matmul"))
    parts, words = name.split("."), cpu.lower().split()[:3]
    tag = parts[1].split("-") if len(parts) > 2 else []
    if not isa and tag[:len(words)] == words:
        rest = tag[len(words):]
        if rest[-1:] == ["forced"]:
            forced, rest = True, rest[:-1]
        if rest[-1:] == ["amx"]:
            amx, rest = True, rest[:-1]
        isa = rest[0].upper() if len(rest) == 1 else None
    what = [f"{isa}{' forced' if forced else ''}" if isa else "ISA not recorded", *(["AMX"] if amx else [])]
    gpu = f" + {hw['gpu']}" if hw.get("gpu") else ""
    return f"{cpu} ({', '.join(what)}){gpu}"


@dataclass(frozen=True)
class Figure:
    group: str   # the summary shows the best figure of each group (dtype, weight width), in order of first sight
    score: float  # larger is better
    text: str    # markdown; the figure links to its record's section


def link(name: str) -> str:
    """Where a record's section is: its page and the anchor in its heading."""
    return f"{RENDERERS[claim(name)].page.file}#{anchor(name)}"


def ratio(x: float, name: str, ci: Any = None) -> str:
    """A ratio linked to the section of the record it comes from, with its CI when the record has one."""
    return f"[{num(x)}×]({link(name)})" + (f" [{num(ci[0])}, {num(ci[1])}]" if ci else "")


def decode_figures(name: str, d: dict) -> list[Figure]:
    r, dtype = d["results"], d["engine"]["config"].get("dtype") or d["model"].get("precision")
    text = f"{dtype} {ratio(r['native_over_hf'], name, r.get('native_over_hf_ci'))}"
    return [Figure(str(dtype), r["native_over_hf"], text)]


def quant_figures(name: str, d: dict) -> list[Figure]:
    out = []
    for x in d["results"]["rows"]:
        bits = re.match(r"[wW](\d+)", x["scheme"])
        if bits and x.get("vs_fp32") is not None:
            out.append(Figure(f"int{bits[1]}", x["vs_fp32"],
                              f"int{bits[1]} {ratio(x['vs_fp32'], name, x.get('vs_fp32_ci'))} `{x['scheme']}`"))
    return out


def spec_sweeps(name: str, d: dict) -> list[tuple[str, dict]]:
    """(proposer as shown, sweep) of a speculative-decoding record, whichever bench wrote it."""
    kind = claim(name)
    if kind == "eagle_train_draft*.json":
        s = eagle_sweep(d)
        return [(f"`{s['proposer']}`", s)]
    if kind == "spec_quant.json":
        head = d["engine"]["config"]["head_dir"]
        return [(f"EAGLE head `{head}` (`{c['head']}`) on target `{c['target']}`", c)
                for c in d["results"]["conditions"] if "rows" in c]
    return [(f"`{s['proposer']}`", s) for s in d["results"]["sweeps"]]


def spec_figures(name: str, d: dict) -> list[Figure]:
    out = []
    fixed = (d.get("lengths") or {}).get("fixed_output_length")
    length = {True: ", fixed length", False: ", to end of turn"}.get(fixed, "")
    for proposer, s in spec_sweeps(name, d):
        row = best_by(s["rows"], "speedup")
        if row:
            temp = (s.get("sampling") or {}).get("temperature")
            out.append(Figure("", row["speedup"], f"{ratio(row['speedup'], name, row.get('speedup_ci'))} {proposer} "
                                                  f"K={row['k']}" + ("" if temp is None else f", T={num(temp, 0)}")
                                                  + length))
    return out


def search_figures(name: str, d: dict) -> list[Figure]:
    out = []
    for x in d["rows"]:
        if x["feasible"] and x["state"] == "COMPLETE" and x["duplicate_of"] is None and x.get("speedup") is not None:
            ci = x.get("ci")
            out.append(Figure("", x["speedup"], f"`{x['label']}` {ratio(x['speedup'], name, x.get('speedup_ci'))}, "
                                                f"{num(x['tok_s'], 1)} tok/s, Δ acc {pct(x['delta'])} pts"
                                                + (f" [{pct(ci[0])}, {pct(ci[1])}]" if ci else "")))
    return out


def llamacpp_figures(name: str, d: dict) -> list[Figure]:
    rows = (d["results"]["decode"] or {}).get("rows", [])
    return [Figure(x["engine"], x["vs_llamacpp_q4_1"], f"{x['engine'].removeprefix('native ')} "
                   f"{ratio(x['vs_llamacpp_q4_1'], name, x.get('vs_llamacpp_q4_1_ci'))}")
            for x in rows if x["engine"].startswith("native int4")]


SUMMARY = [  # (column, the renderer patterns whose files it reads, figures of one file)
    ("native / HF decode", ("decode-*.json",), decode_figures),
    ("best int8 · int4 decode vs fp32", ("quant_decode.*.json",), quant_figures),
    ("native int4 vs llama.cpp Q4_1 decode", ("llamacpp*.json",), llamacpp_figures),
    ("best speculative speedup", ("specdec*.json", "eagle_train_draft*.json", "spec_quant.json"), spec_figures),
    ("best feasible search point", ("study_cost*-pareto.json", "demo-pareto.json"), search_figures),
]
SUMMARY_INTRO = (
    "Per CPU kind (CPU and ISA of the run record, or of the machine tag in the file name where the record has no "
    "ISA), the best figure of each kind of run, linked to its section. Quantized decode is over **fp32** decode in "
    "the same run, native int4 over llama.cpp's Q4_1 file in the same run; speculative speedup is over plain "
    "decoding of the same target; the search point is the fastest "
    "feasible trial against the study's reference, accuracy Δ in points; [brackets]: confidence intervals.")


def study_records(data: dict[str, dict]) -> dict[str, str]:
    """Search tables -> the run record of the study that wrote them (its engine config names the table)."""
    out = {}
    for name, d in data.items():
        table_path = ((run_record(d).get("engine") or {}).get("config") or {}).get("table")
        if isinstance(table_path, str):
            out[Path(table_path).name] = name
    return out


def render_summary(data: dict[str, dict]) -> str:
    """The page's first screen: per CPU kind, the headline figure of each ``SUMMARY`` column."""
    owner = study_records(data)
    cells: dict[str, dict[int, tuple[list[str], list[Figure]]]] = {}
    for name, d in data.items():
        for col, (_, patterns, figures) in enumerate(SUMMARY):
            if claim(name) in patterns:
                src = owner.get(name, name)  # a search table runs on its study's machine
                files, figs = cells.setdefault(cpu_kind(src, data[src]), {}).setdefault(col, ([], []))
                files.append(name)
                figs.extend(figures(name, d))
    rows, cited = [], set()
    for kind in sorted(cells, key=lambda k: (k == NO_CPU, k)):
        row = [kind]
        for col in range(len(SUMMARY)):
            files, figs = cells[kind].get(col, ([], []))
            best: dict[str, Figure] = {}
            for f in figs:
                if f.group not in best or f.score > best[f.group].score:
                    best[f.group] = f
            shown = [f.text for f in best.values()]
            cited |= {n for n in files if any(f"({link(n)})" in t for t in shown)}
            if not shown and files:
                cited |= set(files)
            row.append(" · ".join(shown) if shown else
                       "none in " + ", ".join(f"[`{n}`]({link(n)})" for n in files) if files else NOT_MEASURED)
        rows.append(row)
    return "\n\n".join([
        "## Summary",
        SUMMARY_INTRO,
        "###### Records cited: " + ", ".join(f"`{n}`" for n in sorted(cited)),
        table(["CPU kind", *(c[0] for c in SUMMARY)], rows),
    ])


# ----------------------------------------------------------------------------------------------- page

TITLE = "# Measured results"
INDEX = "README.md"
ABOUT = """## About these pages

Generated by [`bench/render_results.py`](../render_results.py) from the JSON files in this folder (`make
results`): this summary and one page per topic below; do not edit by hand: `tests/test_results_page.py` fails when
a page and the JSON disagree. Every number is a JSON field. Each section names its source file, the script that
writes it and the conditions its run record carries; the definitions behind α, β, τ, c, the quality floor and
exactness are in [docs/methodology.md](../../docs/methodology.md)."""


def claim(name: str) -> str | None:
    """The renderer pattern of a file: the most specific that matches (fewest wildcards, then the longest)."""
    return max((p for p in RENDERERS if fnmatch.fnmatch(name, p)), key=lambda p: (-p.count("*"), len(p)),
               default=None)


def render_section(b: Bench, names: list[str], data: dict[str, dict], texts: dict[str, str]) -> str:
    """One bench's section: its heading and script, then each of its records with caveat and conditions."""
    out = [f"## {b.title}\n\nWritten by `{b.script}`. {b.intro}".rstrip()]
    for name in names:
        sec = [f'### [`{name}`]({name}) <a id="{anchor(name)}"></a>']
        if not b.random_weights and FOUR_BIT.search(NOTE.sub("", texts[name])):  # 4-bit results, not just the note
            sec.append(Q4_1_CAVEAT)
        sec.append(b.render(data[name]))
        cond = "" if b.random_weights else conditions(run_record(data[name]))
        if cond:
            sec.append(cond)
        out.append("\n\n".join(sec))
    return "\n\n".join(out)


def render_pages(results: Path) -> dict[str, str]:
    """File name -> text: ``README.md`` (summary, index, files no renderer claims) and one page per ``Page``."""
    texts = {f.name: f.read_text() for f in sorted(Path(results).glob("*.json"))}
    data = {name: json.loads(text) for name, text in texts.items()}
    by_pattern: dict[str, list[str]] = {p: [] for p in RENDERERS}
    unclaimed = []
    for name in texts:
        p = claim(name)
        (by_pattern[p] if p else unclaimed).append(name)
    shown = [(b, by_pattern[p]) for p, b in RENDERERS.items() if by_pattern[p]]
    contents, pages = [], {}
    for page in PAGES:
        benches = [(b, names) for b, names in shown if b.page is page]
        if not benches:
            continue
        contents.append(f"### [{page.title}]({page.file})\n\n"
                        + "\n".join(f"- [{b.title}]({link(names[0])})" for b, names in benches))
        pages[page.file] = "\n\n".join([
            f"# {page.title}", f"{page.intro} Summary and the other pages: [{INDEX}]({INDEX}).",
            *(render_section(b, names, data, texts) for b, names in benches)]).rstrip() + "\n"
    index = [TITLE, render_summary(data), ABOUT, "## Contents", *contents,
             "## Not rendered\n\nJSON files in this folder that no renderer claims (add a renderer in "
             "`bench/render_results.py`):\n\n" + ("\n".join(f"- `{n}`" for n in unclaimed) or "- none")]
    return {INDEX: "\n\n".join(index).rstrip() + "\n", **pages}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=RESULTS, help="folder of result JSON files")
    ap.add_argument("--out-dir", type=Path, default=None, help="folder to write the pages to (default: RESULTS)")
    ap.add_argument("--check", action="store_true", help="exit 1 if a page on disk differs from a fresh render")
    args = ap.parse_args(argv)
    out = args.out_dir or args.results
    pages = render_pages(args.results)
    if args.check:
        stale = [f for f, text in pages.items() if not (out / f).exists() or (out / f).read_text() != text]
        if stale:
            print(f"{', '.join(stale)} in {out} stale: run make results", file=sys.stderr)
            return 1
        return 0
    out.mkdir(parents=True, exist_ok=True)
    for f, text in pages.items():
        (out / f).write_text(text)
    print(f"wrote {', '.join(f'{f} ({len(t) // 1024} KiB)' for f, t in pages.items())} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
