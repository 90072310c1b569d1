"""KV-cache quantization quality on the default model: WikiText-2 PPL and mean KL vs the fp32 cache.

Teacher-forced decoding *through the cache*: each window is fed in chunks (64 tokens), so every chunk attends
to quantized history (a single full-window forward would attend to its own full-precision K/V and hide the
error). The reference is the same chunked run with the dense fp32 cache. Static specs (``...s``) are
calibrated on WikiText-2 *validation* windows (quant.calibration) with the minmax observer.

Usage: python bench/kv_quality.py [--specs a,b,..] [--windows-512 2] [--windows-2048 1] [--chunk 64]
       flock /tmp/qs-vllm.lock python bench/kv_quality.py --vllm   (afterwards: native vs vLLM fp8 KV, teacher-forced)
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

from runtime.data import data_file
from evals.perplexity import WIKITEXT2_TEST
from evals.record import (ArrivalProcess, EngineCondition, LengthDistribution, MetricCondition, ModelCondition,
                          RunRecord, hardware_info)
from quant.calibration import CalibConfig, calibration_batches
from quant.kvcache import calibrate_kv_scales, make_cache_factory, parse_kv_spec
from runtime.loading import load_model
from runtime.model_store import SMOLLM2, is_default_model, weights_hash
from runtime.generate import Decoder
from runtime.argtypes import positive_int

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


def teacher_forced(logprobs_per_window: list[torch.Tensor], windows: list[list[int]]) -> dict:
    """PPL of next tokens and the argmax token at every position, from [len, V] log-probs per window."""
    nll = sum(F.nll_loss(lp[:-1], torch.tensor(w[1:]), reduction="sum").item()
              for lp, w in zip(logprobs_per_window, windows))
    return {"ppl": math.exp(nll / sum(len(w) - 1 for w in windows)),
            "top1": [lp[:-1].argmax(-1).tolist() for lp in logprobs_per_window]}


def vllm_teacher_forced(llm, windows: list[list[int]]) -> dict:
    """The same measure from vLLM: ``prompt_logprobs=1`` gives each position's actual-token logprob and its top-1."""
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": w} for w in windows],
                        SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0), use_tqdm=False)
    nll, top1 = 0.0, []
    for out, w in zip(outs, windows):
        positions = out.prompt_logprobs[1:]  # entry i scores token i given tokens < i
        nll -= sum(pos[tok].logprob for pos, tok in zip(positions, w[1:]))
        top1.append([next(t for t, lp in pos.items() if lp.rank == 1) for pos in positions])
    return {"ppl": math.exp(nll / sum(len(w) - 1 for w in windows)), "top1": top1}


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of teacher-forced positions where two runs have the same top-1 token."""
    return sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb)) / sum(len(r) for r in a)


def vllm_side_by_side(model: str, n_windows: int, ctx: int, chunk: int, data_dir, threads: int) -> dict:
    """fp8 KV on both backends, teacher-forced through the cache on WikiText-2 windows (bf16 weights on both).

    Each backend's fp8 run is compared with its own unquantized-KV run (kernels differ across backends, and a
    free-running comparison diverges after the first near-tie, so only teacher forcing separates the fp8
    implementations). vLLM prefills in ``chunk``-token pieces (max_num_batched_tokens), like the native
    chunked feed, so later chunks attend to fp8 history on both."""
    from vllm import LLM

    from serving.backends.vllm_engine import set_engine_env
    from quant.kvcache import vllm_kv_cache_dtype

    lm = load_model(model, "bf16", threads)
    ids = lm.tokenizer.encode(data_file(WIKITEXT2_TEST, data_dir).read_text(), add_special_tokens=False)
    windows = [ids[i * ctx:(i + 1) * ctx] for i in range(n_windows)]
    specs = ["none", "fp8_e4m3", "fp8_e5m2"]
    native = {s: teacher_forced([chunked_logprobs(lm, w, chunk, make_cache_factory(s)) for w in windows], windows)
              for s in specs}
    set_engine_env()
    vllm = {}
    for spec in specs:
        llm = LLM(model=str(lm.path), dtype="bfloat16", enforce_eager=True, max_model_len=ctx + 16, seed=0,
                  kv_cache_dtype=vllm_kv_cache_dtype(spec),
                  max_num_batched_tokens=chunk, max_num_seqs=1, enable_prefix_caching=False)
        vllm[spec] = vllm_teacher_forced(llm, windows)
        llm.llm_engine.engine_core.shutdown()
        del llm
    return {"windows": n_windows, "ctx": ctx, "prefill_chunk": chunk, "weights": "bf16 (both backends)",
            "ppl": {"native": {s: native[s]["ppl"] for s in specs}, "vllm": {s: vllm[s]["ppl"] for s in specs}},
            "top1_agreement_vs_own_unquantized_kv": {
                "native": {s: agreement(native["none"]["top1"], native[s]["top1"]) for s in specs[1:]},
                "vllm": {s: agreement(vllm["none"]["top1"], vllm[s]["top1"]) for s in specs[1:]}},
            "top1_agreement_native_vs_vllm": {s: agreement(native[s]["top1"], vllm[s]["top1"]) for s in specs}}


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
    if "fp8_native_vs_vllm" in record.results:
        Console().print(f"fp8 KV, native vs vLLM (teacher-forced): {record.results['fp8_native_vs_vllm']}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--specs", default=",".join(DEFAULT_SPECS))
    parser.add_argument("--windows-512", type=positive_int, default=2)
    parser.add_argument("--windows-2048", type=positive_int, default=1)
    parser.add_argument("--chunk", type=positive_int, default=64)
    parser.add_argument("--vllm", action="store_true", help="only add native vs vLLM fp8-KV (teacher-forced PPL and top-1) to "
                        "the existing --out record (run under flock /tmp/qs-vllm.lock)")
    parser.add_argument("--threads", type=positive_int, default=1)  # 2 threads thrash when the CPU is shared
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "kv_quality.json"))
    args = parser.parse_args()
    if args.vllm:  # adds to the record an earlier run wrote
        record = RunRecord.from_dict(json.loads(Path(args.out).read_text()))
        record.results.pop("vllm_fp8_greedy_agreement", None)  # superseded by the teacher-forced comparison
        record.results["fp8_native_vs_vllm"] = vllm_side_by_side(args.model, args.windows_512, 512, args.chunk,
                                                                  args.data_dir, args.threads)
    else:
        record = main(args)
    print_table(record)
    print(f"wrote {record.write(args.out)}")
