"""W8A8 on the default model: dynamic per-token vs static per-tensor (minmax / percentile / MSE observers) vs
SmoothQuant, and FP8 (E4M3) W8A8 dynamic beside INT8 W8A8 dynamic, scored by WikiText-2 PPL and mean KL vs fp32,
plus prefill and decode tok/s of the real int8 x int8 kernel (``torch._int_mm``) and the FP8 kernel (whichever
product its probe picked: ``torch._scaled_mm`` or the exact fp32 upcast, named in ``kernel_details``) against
the dense fp32 and bf16 models in the same run.

Usage: python bench/act_quality.py --no-speed                     (quality: bench/results/act_quality.json)
       flock /tmp/qs-bench.lock python bench/act_quality.py --speed-rows-only --windows 1 \
             --out bench/results/act_speed.json                      (speed of fp32, bf16 and the W8A8 kernels)
Options: [--windows 4] [--calib-samples 8] [--threads 1] [--rows "fp32,W8A8 dynamic,FP8 W8A8 dynamic"].
Each run writes a RunRecord.
"""
import argparse
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from runtime.data import data_file
from evals.fidelity import token_fidelity
from evals.perplexity import WIKITEXT2_TEST
from evals.record import (ArrivalProcess, EngineCondition, LengthDistribution, MetricCondition, ModelCondition,
                          RunRecord, hardware_info)
from quant.calibration import CalibConfig
from runtime.hardware import kernels_used
from runtime.loading import load_model
from runtime.model_store import SMOLLM2, is_default_model, weights_hash
from quant.quantize import quantize_w8a8
from runtime.generate import Decoder, encode_prompt
from runtime.sampling import SamplingConfig
from runtime.argtypes import positive_int

# (row name, model dtype, scheme or None for dense, observer, SmoothQuant alpha)
CONFIGS = [
    ("fp32", "fp32", None, None, None),
    ("bf16", "bf16", None, None, None),
    ("W8A8 dynamic", "fp32", "w8ch-sym_a8tok-dyn", None, None),
    ("FP8 W8A8 dynamic", "fp32", "FP8_DYNAMIC", None, None),
    ("W8A8 static minmax", "fp32", "w8ch-sym_a8t-static", "minmax", None),
    ("W8A8 static percentile", "fp32", "w8ch-sym_a8t-static", "percentile", None),
    ("W8A8 static mse", "fp32", "w8ch-sym_a8t-static", "mse", None),
    ("FP8 static minmax", "fp32", "FP8", "minmax", None),
    ("FP8 static mse", "fp32", "FP8", "mse", None),
    ("SmoothQuant 0.5 + dynamic", "fp32", "w8ch-sym_a8tok-dyn", None, 0.5),
    ("SmoothQuant 0.5 + static minmax", "fp32", "w8ch-sym_a8t-static", "minmax", 0.5),
]
SPEED_ROWS = ("fp32", "bf16", "W8A8 dynamic", "FP8 W8A8 dynamic", "W8A8 static minmax")
PROMPT = "Write a short story about a robot who learns to paint."


@torch.inference_mode()
def window_logits(lm, windows: list[torch.Tensor]) -> list[torch.Tensor]:
    out = []
    for w in windows:
        lm.model.setup_cache(1, w.numel())
        out.append(lm.model(w[None], torch.arange(w.numel()))[0].float())
    return out


def nll(logits: list[torch.Tensor], windows: list[torch.Tensor]) -> float:
    parts = [torch.nn.functional.cross_entropy(lg[:-1], w[1:], reduction="sum") for lg, w in zip(logits, windows)]
    return (sum(parts) / sum(w.numel() - 1 for w in windows)).item()


def speed(lm, prompt_ids: list[int], prefill_len: int, new_tokens: int, repeats: int) -> dict:
    """Median decode tok/s (fixed length, ignore_eos) and prefill tok/s of a ``prefill_len``-token input."""
    dec = Decoder(lm, max(prefill_len, len(prompt_ids) + new_tokens) + 8)
    dec.generate(prompt_ids, 8, ignore_eos=True)  # warm-up, excluded
    runs = [dec.generate(prompt_ids, new_tokens, SamplingConfig(), ignore_eos=True) for _ in range(repeats)]
    long_prompt = (prompt_ids * (prefill_len // len(prompt_ids) + 1))[:prefill_len]
    prefill = []
    for _ in range(repeats):
        dec.reset()
        t = time.perf_counter()
        dec.forward(long_prompt)
        prefill.append(time.perf_counter() - t)
    return {"decode_tok_s": statistics.median(r.decode_tokens_per_s for r in runs),
            "prefill_tok_s": prefill_len / statistics.median(prefill), "tokens": runs[0].tokens}


def main(args) -> RunRecord:
    torch.manual_seed(0)
    base = load_model(args.model, "fp32", args.threads)
    ids = base.tokenizer.encode(data_file(WIKITEXT2_TEST, args.data_dir).read_text(), add_special_tokens=False)
    windows = [torch.tensor(ids[i * args.ctx:(i + 1) * args.ctx]) for i in range(args.windows)]
    ref = window_logits(base, windows)
    prompt_ids = encode_prompt(base.tokenizer, PROMPT)
    calib = CalibConfig(samples=args.calib_samples, seqlen=512, data_dir=args.data_dir)
    rows, ref_tokens = [], None
    configs = [c for c in CONFIGS if c[0] in SPEED_ROWS] if args.speed_rows_only else CONFIGS
    if args.rows:
        unknown = set(args.rows.split(",")) - {c[0] for c in CONFIGS}
        if unknown:
            raise SystemExit(f"error: unknown rows {sorted(unknown)}: pick from {[c[0] for c in CONFIGS]}")
        configs = [c for c in configs if c[0] in args.rows.split(",")]
    for name, dtype, scheme, observer, alpha in configs:
        t0 = time.perf_counter()
        lm = load_model(args.model, dtype, args.threads)
        row = {"config": name, "dtype": dtype, "scheme": scheme or dtype, "observer": observer, "smoothquant": alpha}
        if scheme:
            report = quantize_w8a8(lm, scheme, "rtn", calib, observer or "minmax", alpha, progress=False)
            row.update(kernels=report.kernels, simulated=report.simulated, calibration=report.calibration,
                       kernel_details=sorted(set(kernels_used(lm.model).values())))
        logits = window_logits(lm, windows)
        fid = token_fidelity(torch.cat(ref), torch.cat(logits))
        row.update(ppl=float(torch.tensor(nll(logits, windows)).exp()), mean_kl=fid.mean_kl,
                   top1_agreement=fid.top1_agreement)
        if name in SPEED_ROWS and not args.no_speed:
            s = speed(lm, prompt_ids, args.prefill_len, args.new_tokens, args.repeats)
            ref_tokens = ref_tokens or s["tokens"]
            row.update(decode_tok_s=s["decode_tok_s"], prefill_tok_s=s["prefill_tok_s"],
                       greedy_agreement_vs_fp32=sum(a == b for a, b in zip(s["tokens"], ref_tokens)) / len(ref_tokens))
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        Console().print({k: v for k, v in row.items() if k != "kernels"})
    fp32 = next((r for r in rows if r["config"] == "fp32" and "decode_tok_s" in r), None)
    for r in rows:
        if fp32 is not None and "decode_tok_s" in r:
            r["decode_vs_fp32"] = r["decode_tok_s"] / fp32["decode_tok_s"]
            r["prefill_vs_fp32"] = r["prefill_tok_s"] / fp32["prefill_tok_s"]
    return RunRecord(
        name="act-quality",
        model=ModelCondition(args.model, weights_hash(base.path), "per row",
                             ("W8A8 rows: w8ch-sym + a8; FP8 rows: wfp8ch-sym + afp8tok-dyn, or FP8 = "
                              "wfp8t-sym + afp8t-static (rtn weights)"),
                             note=SMOLLM2.note if is_default_model(base.path) else ""),
        hardware=hardware_info(),
        lengths=LengthDistribution(args.windows, {"fixed": args.ctx}, {"scored": "every next token"},
                                   "wikitext2/wiki.test.raw first windows; speed: one chat prompt "
                                   f"({len(prompt_ids)} tok) and a {args.prefill_len}-token prefill", True),
        arrival=ArrivalProcess("batch-1 sequential", 1),
        engine=EngineCondition("native", {"threads": torch.get_num_threads(),
                                          "kernel": "int8xint8 (torch._int_mm); fp8xfp8 (see each row's kernel_details)"},
                               warmup="one 8-token generation per model, excluded",
                               cache_warmth=f"KV cache reset per request; calibration {calib.label} (WikiText-2 validation)"),
        metric=MetricCondition(
            {"ppl": f"exp(mean NLL) over {args.windows} windows of {args.ctx} tokens (full-window forward)",
             "mean_kl": "mean over tokens of KL(p_fp32 || p_config), nats",
             "decode_tok_s": f"median of {args.repeats} runs of (new_tokens-1)/decode s, {args.new_tokens} new tokens, greedy, ignore_eos",
             "prefill_tok_s": f"{args.prefill_len} tokens / median prefill seconds"},
            "greedy; W8A8 tokens compared with the fp32 run (greedy_agreement_vs_fp32)"),
        results={"rows": rows},
    )


def print_table(record: RunRecord) -> None:
    table = Table(title="W8A8 activation quantization (native, WikiText-2)")
    cols = ["config", "PPL", "KL", "top-1", "decode tok/s", "x fp32", "prefill tok/s", "x fp32"]
    for c in cols:
        table.add_column(c, justify="left" if c == "config" else "right")
    for r in record.results["rows"]:
        fmt = lambda k, f: f.format(r[k]) if k in r else "-"  # noqa: E731
        table.add_row(r["config"], fmt("ppl", "{:.3f}"), fmt("mean_kl", "{:.4f}"), fmt("top1_agreement", "{:.3f}"),
                      fmt("decode_tok_s", "{:.1f}"), fmt("decode_vs_fp32", "{:.2f}"), fmt("prefill_tok_s", "{:.0f}"),
                      fmt("prefill_vs_fp32", "{:.2f}"))
    Console().print(table)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "act_quality.json"))
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--windows", type=positive_int, default=4)
    parser.add_argument("--ctx", type=positive_int, default=512)
    parser.add_argument("--calib-samples", type=positive_int, default=8)
    parser.add_argument("--prefill-len", type=positive_int, default=256)
    parser.add_argument("--new-tokens", type=positive_int, default=64)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--threads", type=positive_int, default=1)  # 2 threads thrash when the CPU is shared
    parser.add_argument("--no-speed", action="store_true", help="quality only (no lock needed)")
    parser.add_argument("--speed-rows-only", action="store_true", help=f"only the rows {', '.join(SPEED_ROWS)}")
    parser.add_argument("--rows", default=None, help="comma list of rows to run, of: "
                        + ", ".join(c[0] for c in CONFIGS))
    args = parser.parse_args()
    record = main(args)
    print_table(record)
    print(f"wrote {record.write(args.out)}")
