"""WikiText-2 perplexity of weight-quantization methods (rtn, mse, gptq, awq) on the default model.

Usage: python bench/quant_quality.py [--max-windows 16] [--ctx 512] [--calib-samples 32] [--threads 1]
Each configuration loads the fp32 model fresh, quantizes it with ``quant.quantize.quantize_model`` (kernels as
it picks them: int4pack runs bf16 activations, 3-bit runs the simulated kernel) and scores the first
``--max-windows`` non-overlapping windows of ``--ctx`` tokens of wiki.test.raw (every token after the first of
each window). Calibration: WikiText-2 *validation* (tokenized release), ``--calib-samples`` x 512 tokens.
Writes bench/results/quant_quality.json (a full run record).
"""
import argparse
import time
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from evals.perplexity import wikitext2_perplexity
from evals.record import (ArrivalProcess, EngineCondition, LengthDistribution, MetricCondition, ModelCondition,
                          RunRecord, hardware_info)
from quant.calibration import CalibConfig
from runtime.loading import load_model, set_threads
from runtime.model_store import SMOLLM2, is_default_model, resolve_model, weights_hash
from quant.quantize import quantize_model
from runtime.argtypes import positive_int

SCHEMES = ("w4g64-sym", "w4g32-sym", "w3g32-sym")
NEAR_LOSSLESS = "w4g32-asym"
METHODS = ("rtn", "mse", "gptq", "awq")
console = Console()


def evaluate(args, calib, config: tuple[str, str] | None = None) -> dict:
    set_threads(args.threads)
    scheme, method = config or (None, None)
    lm = load_model(args.model, "fp32")
    row = {"scheme": scheme or "fp32", "method": method or "-", "quantize_s": 0.0, "kernels": {}}
    if scheme:
        t0 = time.perf_counter()
        report = quantize_model(lm, scheme, method, calib, progress=True)
        row.update(quantize_s=time.perf_counter() - t0, kernels=report.kernels,
                   mean_weight_rel_error=report.mean_weight_error)
    t0 = time.perf_counter()
    ppl = wikitext2_perplexity(lm, args.data_dir, args.ctx, args.stride, args.max_windows)
    row.update(ppl.to_dict(), eval_s=time.perf_counter() - t0)
    console.print(f"{row['scheme']:>11} {row['method']:>4}: ppl {ppl.ppl:8.3f}  quantize {row['quantize_s']:6.1f} s"
                  f"  eval {row['eval_s']:6.1f} s  {row['kernels']}")
    return row


def print_tables(rows: list[dict], fp32: dict, caption: str) -> None:
    by = {(r["scheme"], r["method"]): r for r in rows}
    methods = [m for m in METHODS if any(k[1] == m for k in by)]
    table = Table(title=f"WikiText-2 test perplexity (fp32 {fp32['ppl']:.3f})", caption=caption)
    table.add_column("method")
    for scheme in SCHEMES:
        table.add_column(scheme, justify="right")
    table.add_column("quantize s (per scheme)", justify="right")
    for m in methods:
        cells = [f"{by[s, m]['ppl']:.3f}" if (s, m) in by else "-" for s in SCHEMES]
        times = "/".join(f"{by[s, m]['quantize_s']:.0f}" for s in SCHEMES if (s, m) in by)
        table.add_row(m, *cells, times)
    console.print(table)
    special = Table(title=f"{NEAR_LOSSLESS}: the special case of this model, whose body is already on a 4-bit "
                          "group-32 asymmetric grid (Q4_1-dequantized: w = d*q + m with a float offset m)",
                    caption="compressed-tensors' integer zero point (round(qmin - m / scale)) cannot place the grid "
                            "at m exactly, so re-quantizing it is not lossless (see README)")
    special.add_column("method")
    special.add_column("ppl", justify="right")
    special.add_column("Δ vs fp32", justify="right")
    for m in methods:
        if (NEAR_LOSSLESS, m) in by:
            r = by[NEAR_LOSSLESS, m]
            special.add_row(m, f"{r['ppl']:.3f}", f"{r['ppl'] - fp32['ppl']:+.3f}")
    console.print(special)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--ctx", type=positive_int, default=512)
    parser.add_argument("--stride", type=positive_int, default=None)
    parser.add_argument("--max-windows", type=positive_int, default=16)
    parser.add_argument("--calib-samples", type=positive_int, default=32)
    parser.add_argument("--calib-seqlen", type=positive_int, default=512)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--threads", type=positive_int, default=None, help="torch threads per job (1 is fastest on a busy box)")
    parser.add_argument("--jobs", type=positive_int, default=1, help="configurations evaluated in parallel processes")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "quant_quality.json"))
    args = parser.parse_args()
    calib = CalibConfig("wikitext2", args.calib_samples, args.calib_seqlen, data_dir=args.data_dir)
    methods = args.methods.split(",")
    t_start = time.perf_counter()
    configs = [None] + [(scheme, m) for scheme in (*SCHEMES, NEAR_LOSSLESS) for m in methods]
    with ProcessPoolExecutor(args.jobs) as pool:
        fp32, *rows = pool.map(partial(evaluate, args, calib), configs)
    stride = f"stride {args.stride}" if args.stride else "non-overlapping windows"
    caption = (f"ctx {args.ctx}, {stride}, first {args.max_windows} windows ({fp32['n_tokens']} scored tokens); "
               f"calibration {calib.label} (WikiText-2 valid, tokenized release); one-pass statistics")
    print_tables(rows, fp32, caption)

    path = resolve_model(args.model)
    record = RunRecord(
        name="quant_quality",
        model=ModelCondition(str(path.name), weights_hash(path), "fp32 runtime; quantized per row", "per row",
                             SMOLLM2.note if is_default_model(path) else ""),
        hardware=hardware_info(),
        lengths=LengthDistribution(fp32["n_tokens"] // max(1, args.ctx - 1), {"fixed": args.ctx}, {"fixed": 0},
                                   "wikitext2/wiki.test.raw", True),
        arrival=ArrivalProcess(kind="offline scoring, batches of 4 windows"),
        engine=EngineCondition("native", {"ctx": args.ctx, "stride": args.stride, "max_windows": args.max_windows,
                                          "calibration": calib.label, "statistics": "one pass on the fp32 model"},
                               warmup="none (quality metric)", cache_warmth="KV cache rebuilt per batch"),
        metric=MetricCondition({"ppl": "exp(mean NLL) over every token after the first of each window",
                                "quantize_s": "wall time of quantize_model incl. calibration (shared CPU)"},
                               "same windows for every row; fp32 row is the reference"),
        results={"rows": [fp32, *rows], "total_s": time.perf_counter() - t_start, "jobs": args.jobs,
                 "torch_threads_per_job": args.threads or torch.get_num_threads()},
    )
    console.print(f"wrote {record.write(args.out)}")


if __name__ == "__main__":
    main()
