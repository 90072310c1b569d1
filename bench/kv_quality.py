"""KV-cache quantization quality on the default model: WikiText-2 PPL and mean KL vs the fp32 cache.

Teacher-forced decoding *through the cache*: each window is fed in chunks (64 tokens), so every chunk attends
to quantized history (a single full-window forward would attend to its own full-precision K/V and hide the
error). The reference is the same chunked run with the dense fp32 cache. Static specs (``...s``) are
calibrated on WikiText-2 *validation* windows (quant.calibration) with the minmax observer.

Usage: python bench/kv_quality.py [--specs a,b,..] [--windows-512 2] [--windows-2048 1] [--chunk 64]
       flock /tmp/qs-vllm.lock python bench/kv_quality.py --vllm   (afterwards: native vs vLLM fp8 KV, greedy)
Writes bench/results/kv_quality.json (a RunRecord). Prints the table and the KIVI key-granularity verdict.
"""
import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import track
from rich.table import Table

from evals.data import data_file
from evals.perplexity import WIKITEXT2_TEST
from evals.record import (ArrivalProcess, EngineCondition, LengthDistribution, MetricCondition, ModelCondition,
                          RunRecord, hardware_info)
from quant.calibration import CalibConfig, calibration_batches
from quant.kvcache import calibrate_kv_scales, make_cache_factory, parse_kv_spec
from quant.loading import load_model
from quant.model_store import SMOLLM2, is_default_model, weights_hash
from specdec.generate import Decoder

GRANULARITY_SPECS = [f"k{b}{g}-v{b}{g}" for b in (8, 4, 2) for g in ("ts", "hs", "tok", "ch")]
KEY_ONLY_SPECS = [f"k{b}{g}-v16" for b in (4, 2) for g in ("tok", "ch")]  # isolates the key granularity
DEFAULT_SPECS = GRANULARITY_SPECS + KEY_ONLY_SPECS + ["kivi4", "kivi2", "kivi2-r32", "fp8_e4m3", "fp8_e5m2"]


@torch.inference_mode()
def chunked_logprobs(lm, ids: list[int], chunk: int, cache_factory) -> torch.Tensor:
    """log-softmax [len(ids), V] from feeding ``ids`` through a fresh cache ``chunk`` tokens at a time."""
    dec = Decoder(lm, len(ids), cache_factory)
    return torch.cat([torch.log_softmax(dec.forward(ids[i:i + chunk]).float(), -1)
                      for i in range(0, len(ids), chunk)])


def score(ref: torch.Tensor, test: torch.Tensor, ids: list[int]) -> tuple[float, float, int]:
    """(summed NLL of next tokens, summed KL(ref || test), count) over positions 0..n-2."""
    targets = torch.tensor(ids[1:])
    nll = F.nll_loss(test[:-1], targets, reduction="sum").item()
    kl = (ref[:-1].exp() * (ref[:-1] - test[:-1])).sum(-1).clamp_min(0).sum().item()
    return nll, kl, targets.numel()


def main(args) -> RunRecord:
    torch.manual_seed(0)
    lm = load_model(args.model, "fp32", args.threads)
    ids = lm.tokenizer.encode(data_file(WIKITEXT2_TEST, args.data_dir).read_text(), add_special_tokens=False)
    windows = {ctx: [ids[i * ctx:(i + 1) * ctx] for i in range(n)] for ctx, n in ((512, args.windows_512),
                                                                                  (2048, args.windows_2048)) if n}
    calib = [torch.tensor([b]) for b in calibration_batches(CalibConfig(samples=4, seqlen=512,
                                                                        data_dir=args.data_dir), lm)]
    t0 = time.perf_counter()
    refs = {ctx: [chunked_logprobs(lm, w, args.chunk, None) for w in ws] for ctx, ws in windows.items()}
    ref_rows = {ctx: [score(r, r, w) for r, w in zip(rs, windows[ctx])] for ctx, rs in refs.items()}
    rows = [row_of("fp32 (dense cache)", None, ref_rows, time.perf_counter() - t0)]
    for label in track(args.specs.split(","), description="KV specs"):
        spec = parse_kv_spec(label)
        t = time.perf_counter()
        scales = calibrate_kv_scales(lm.model, calib, spec) if spec.needs_calibration else None
        factory = make_cache_factory(spec, scales)
        results = {ctx: [score(r, chunked_logprobs(lm, w, args.chunk, factory), w) for r, w in zip(refs[ctx], ws)]
                   for ctx, ws in windows.items()}
        bpt = factory(1, 1, lm.model.args.n_kv_heads, lm.model.args.head_dim, torch.float32).bytes_per_token()
        rows.append(row_of(spec.label, bpt * lm.model.args.n_layers, results, time.perf_counter() - t))
        Console().print(f"{spec.label}: " + ", ".join(f"ctx {c}: ppl {rows[-1][f'ppl_{c}']:.3f} kl {rows[-1][f'kl_{c}']:.5f}"
                                                       for c in windows) + f" ({rows[-1]['seconds']:.0f} s)")
    dense_bpt = 2 * lm.model.args.n_kv_heads * lm.model.args.head_dim * 4 * lm.model.args.n_layers
    rows[0]["bytes_per_token"] = dense_bpt
    return RunRecord(
        name="kv-quality",
        model=ModelCondition(args.model, weights_hash(lm.path), "fp32 weights; KV cache per row",
                             note=SMOLLM2.note if is_default_model(lm.path) else ""),
        hardware=hardware_info(),
        lengths=LengthDistribution(sum(len(ws) for ws in windows.values()),
                                   {str(c): len(ws) for c, ws in windows.items()}, {"scored": "every next token"},
                                   "wikitext2/wiki.test.raw: first N non-overlapping windows per context", True),
        arrival=ArrivalProcess("batch-1 sequential", 1),
        engine=EngineCondition("native", {"dtype": "fp32", "prefill_chunk": args.chunk, "threads": torch.get_num_threads()},
                               warmup="none (quality only)",
                               cache_warmth="fresh KV cache per window; static scales calibrated on 4x512 "
                                            "WikiText-2 validation tokens (minmax)"),
        metric=MetricCondition(
            {"ppl_<ctx>": "exp(mean NLL of next tokens) over the windows of that context",
             "kl_<ctx>": "mean over tokens of KL(p_fp32-cache || p_quantized-cache), nats",
             "bytes_per_token": "KV bytes stored per token, all layers (codes + dynamic scales; a full-precision "
                                "window of -r tokens is extra)"},
            "teacher forcing through the cache in chunks; reference = same chunking with the dense fp32 cache"),
        results={"rows": rows, "kivi_key_verdict": kivi_verdict(rows, list(windows))},
    )


def greedy_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of generated positions where two greedy runs emit the same token."""
    return sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb)) / sum(len(r) for r in a)


def vllm_side_by_side(model: str, n_prompts: int, new_tokens: int, data_dir, threads: int) -> dict:
    """Greedy tokens with fp8 vs full-precision KV, native (bf16 weights) and vLLM (bf16), on spec_bench prompts:
    each backend's fp8 run is compared with its own unquantized-KV run (weights/kernels differ across backends)."""
    from vllm import LLM, SamplingParams

    from evals.backends.vllm_engine import set_engine_env
    from evals.data import load_prompts
    from quant.kvcache import vllm_kv_cache_dtype
    from specdec.generate import encode_prompt

    lm = load_model(model, "bf16", threads)
    prompts = [encode_prompt(lm.tokenizer, p) for p in load_prompts("spec_bench", data_dir, n_prompts)]
    specs = ["none", "fp8_e4m3", "fp8_e5m2"]
    native = {}
    for spec in specs:
        dec = Decoder(lm, max(map(len, prompts)) + new_tokens + 1, make_cache_factory(spec))
        native[spec] = [dec.generate(p, new_tokens, ignore_eos=True).tokens for p in prompts]
    set_engine_env()
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    vllm = {}
    for spec in specs:
        llm = LLM(model=str(lm.path), dtype="bfloat16", enforce_eager=True, max_model_len=2048, seed=0,
                  kv_cache_dtype=vllm_kv_cache_dtype(spec))
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        vllm[spec] = [list(o.outputs[0].token_ids) for o in outs]
        llm.llm_engine.engine_core.shutdown()
        del llm
    return {"prompts": len(prompts), "new_tokens": new_tokens, "weights": "bf16 (both backends)",
            "native_vs_own_fp_kv": {s: greedy_agreement(native["none"], native[s]) for s in specs[1:]},
            "vllm_vs_own_fp_kv": {s: greedy_agreement(vllm["none"], vllm[s]) for s in specs[1:]},
            "native_vs_vllm": {s: greedy_agreement(native[s], vllm[s]) for s in specs}}


def row_of(label: str, bytes_per_token, per_ctx: dict, seconds: float) -> dict:
    row = {"spec": label, "bytes_per_token": bytes_per_token, "seconds": round(seconds, 1)}
    for ctx, parts in per_ctx.items():
        nll, kl, n = (sum(p[i] for p in parts) for i in range(3))
        row.update({f"ppl_{ctx}": math.exp(nll / n), f"kl_{ctx}": kl / n, f"tokens_{ctx}": n})
    return row


def kivi_verdict(rows: list[dict], contexts: list[int]) -> dict:
    """Keys per-channel vs per-token (values unquantized) at 4 and 2 bits: KIVI expects per-channel to win."""
    by = {r["spec"]: r for r in rows}
    out = {}
    for bits in (4, 2):
        tok, ch = by.get(f"k{bits}tok-v16"), by.get(f"k{bits}ch-v16")
        if tok and ch:
            out[f"{bits}bit"] = {f"kl_{c}": {"per_token": tok[f"kl_{c}"], "per_channel": ch[f"kl_{c}"],
                                             "channel_better": ch[f"kl_{c}"] < tok[f"kl_{c}"]} for c in contexts}
    return out


def print_table(record: RunRecord) -> None:
    rows = record.results["rows"]
    ctxs = sorted({k.split("_")[1] for r in rows for k in r if k.startswith("ppl_")}, key=int)
    table = Table(title="KV-cache quantization on WikiText-2 (teacher-forced through the cache)")
    for col in ["spec", "KiB/token", *[f"{h} {c}" for c in ctxs for h in ("PPL", "KL")], "s"]:
        table.add_column(col, justify="left" if col == "spec" else "right")
    for r in rows:
        table.add_row(r["spec"], f"{r['bytes_per_token'] / 1024:.1f}",
                      *[f"{r[f'{h}_{c}']:.4f}" if h == "kl" else f"{r[f'{h}_{c}']:.3f}" for c in ctxs for h in ("ppl", "kl")],
                      f"{r['seconds']:.0f}")
    Console().print(table)
    Console().print(f"keys per-channel vs per-token (values fp32): {record.results['kivi_key_verdict']}")
    if "vllm_fp8_greedy_agreement" in record.results:
        Console().print(f"fp8 KV greedy agreement: {record.results['vllm_fp8_greedy_agreement']}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--specs", default=",".join(DEFAULT_SPECS))
    parser.add_argument("--windows-512", type=int, default=2)
    parser.add_argument("--windows-2048", type=int, default=1)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--vllm", action="store_true", help="only add native vs vLLM fp8-KV greedy agreement to "
                        "the existing --out record (run under flock /tmp/qs-vllm.lock)")
    parser.add_argument("--threads", type=int, default=1)  # 2 threads thrash when the CPU is shared
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "kv_quality.json"))
    args = parser.parse_args()
    if args.vllm:  # adds to the record an earlier run wrote
        record = RunRecord.from_dict(json.loads(Path(args.out).read_text()))
        record.results["vllm_fp8_greedy_agreement"] = vllm_side_by_side(args.model, 4, 64, args.data_dir, args.threads)
    else:
        record = main(args)
    print_table(record)
    print(f"wrote {record.write(args.out)}")
