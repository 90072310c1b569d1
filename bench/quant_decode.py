"""Batch-1 native decode speed of the default model: fp32, bf16, int8 (W8A16, int8pack) and int4 g32/g64
(int4pack), side by side in one run, each as % of its own memory roofline and as a ratio to fp32.

Usage: flock /tmp/qs-bench.lock python bench/quant_decode.py [--new-tokens 128] [--repeats 3] [--threads N]
Writes bench/results/quant_decode.<machine tag>.json (a full run record, one per CPU kind). Targets: int8 >= 2x fp32, int4 >= 2.5x fp32.

With --compile MODE: bf16, int8 and int4 g32, each on the eager and the compiled one-token step (runtime/compiled.py,
compile time apart), as ratios to the compiled bf16 step (issue 28's targets: int8 >= 1.6x, int4 g32 >= 2.2x) and
shares of their roofline; writes quant_decode_compiled.<machine tag>.json.
"""
import argparse
import os
from dataclasses import asdict
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from evals.decode_speed import DEFAULT_PROMPT, first_diff, native_decode
from runtime.compiled import MODES, gemm_backends
from evals.record import (ArrivalProcess, EngineCondition, LengthDistribution, MetricCondition, ModelCondition,
                          RunRecord, hardware_info)
from evals.roofline import decode_bytes_per_token, measure_bandwidth
from runtime.loading import load_model, set_threads
from runtime.model_store import SMOLLM2, is_default_model, weights_hash
from quant.quantize import quantize_model
from runtime.hardware import kernels_used, probe
from runtime.generate import encode_prompt
from runtime.argtypes import positive_int

# (label, dtype, scheme or None, target ratio to fp32)
CONFIGS = [("fp32", "fp32", None, None), ("bf16", "bf16", None, None), ("int8 W8A16", "bf16", "W8A16", 2.0),
           ("int4 g32", "bf16", "w4g32-sym", 2.5), ("int4 g64", "bf16", "w4g64-sym", 2.5)]
COMPILED_TARGETS = {"bf16": None, "int8 W8A16": 1.6, "int4 g32": 2.2}  # vs the compiled bf16 step


def run(model: str, new_tokens: int, repeats: int, compile_mode: str | None = None) -> RunRecord:
    bandwidth = measure_bandwidth()
    rows, path, prompt_ids = [], None, None
    configs = [c for c in CONFIGS if not compile_mode or c[0] in COMPILED_TARGETS]
    for label, dtype, scheme, target in configs:
        lm = load_model(model, dtype)
        path = lm.path
        prompt_ids = encode_prompt(lm.tokenizer, DEFAULT_PROMPT)
        kernels = {"dense": len(lm.model.layers) * 7}
        if scheme:
            kernels = quantize_model(lm, scheme, progress=False).kernels
        speed = native_decode(lm, prompt_ids, new_tokens, repeats, bandwidth, label)
        row = {k: v for k, v in asdict(speed).items() if k != "tokens"}
        row.update(dtype=dtype, scheme=scheme or "none", kernels=kernels, kernels_run=kernels_used(lm.model),
                   target_vs_fp32=target,
                   bytes_per_token=decode_bytes_per_token(lm.model), first_tokens=speed.tokens[:16])
        if compile_mode:
            compiled = native_decode(lm, prompt_ids, new_tokens, repeats, bandwidth, label, compile_mode)
            row.update(target_vs_fp32=None, compiled_tok_s=compiled.decode_tok_s,
                       compiled_roofline_pct=compiled.roofline_pct, compile_s=compiled.compile_s,
                       fallback=compiled.fallback, compiled_over_eager=compiled.decode_tok_s / speed.decode_tok_s,
                       first_diff_vs_eager=first_diff(compiled.tokens, speed.tokens),
                       target_vs_bf16_compiled=COMPILED_TARGETS[label])
        rows.append(row)
    for row in rows:
        row["vs_fp32"] = row["decode_tok_s"] / rows[0]["decode_tok_s"]  # compiled runs: rows[0] is bf16
        row["meets_target"] = None if row["target_vs_fp32"] is None else row["vs_fp32"] >= row["target_vs_fp32"]
        if compile_mode:
            row["vs_bf16_compiled"] = row["compiled_tok_s"] / rows[0]["compiled_tok_s"]
            target = row["target_vs_bf16_compiled"]
            row["meets_target"] = None if target is None else row["vs_bf16_compiled"] >= target
    return RunRecord(
        name="quant-decode-compiled" if compile_mode else "quant-decode",
        model=ModelCondition(model, weights_hash(path), "fp32 / bf16 / W8A16 / W4A16-g32 / W4A16-g64",
                             scheme="see rows", note=SMOLLM2.note if is_default_model(path) else ""),
        hardware=hardware_info(),
        lengths=LengthDistribution(1, {"fixed": len(prompt_ids)}, {"fixed": new_tokens},
                                   f"one chat prompt: {DEFAULT_PROMPT!r}", True),
        arrival=ArrivalProcess("batch-1 sequential", 1),
        engine=EngineCondition("native", {"threads": torch.get_num_threads(), "compile_mode": compile_mode,
                                          "gemm_backends": gemm_backends(compile_mode),
                                          "quantized": "rtn weights, bf16 activations, tied lm_head/embedding bf16"},
                               warmup="one 8-token generation per configuration and step, excluded (it compiles "
                                      "the compiled step: compile_s)" if compile_mode else
                                      "one 8-token generation per configuration, excluded",
                               cache_warmth="KV cache reset per request; weights resident in RAM"),
        metric=MetricCondition(
            {"decode_tok_s": "median over repeats of (new_tokens-1)/decode seconds, prefill excluded",
             "roofline_pct": "decode tok/s / (measured read bandwidth / bytes streamed per token incl. packed "
                             "weights, scales and the tied bf16/fp32 LM head)",
             "vs_fp32": "decode tok/s / fp32 decode tok/s in the same run"},
            "greedy, ignore_eos, fixed output length; speed only (quality: quantspec quantize / bench/quant_quality.py)"),
        results={"bandwidth_gb_s": bandwidth / 1e9, "load_average_1_5_15": os.getloadavg(), "rows": rows},
    )


def print_table(record: RunRecord) -> None:
    table = Table(title=f"batch-1 native decode, default model, {record.lengths.output_tokens['fixed']} new tokens")
    compiled = record.engine.config.get("compile_mode")
    cols = ["config", "kernels", "tok/s", "vs fp32", "target", "MiB/token", "% roofline"]
    if compiled:
        cols[2:4] = ["eager tok/s", "compiled tok/s", "vs compiled bf16", "compile s"]
    for col in cols:
        table.add_column(col, justify="right")
    for r in record.results["rows"]:
        goal = r.get("target_vs_bf16_compiled") if compiled else r["target_vs_fp32"]
        target = "" if goal is None else f">= {goal}x {'ok' if r['meets_target'] else 'MISSED'}"
        speeds = [f"{r['decode_tok_s']:.1f}", f"{r['vs_fp32']:.2f}x"]
        if compiled:
            speeds = [f"{r['decode_tok_s']:.1f}", f"{r['compiled_tok_s']:.1f}" + (" (eager: fallback)" if r["fallback"]
                      else ""), f"{r['vs_bf16_compiled']:.2f}x", f"{r['compile_s']:.0f}"]
        roof = f"{r['compiled_roofline_pct']:.0f}%" if compiled else f"{r['roofline_pct']:.0f}%"
        table.add_row(r["engine"], ", ".join(f"{k}:{v}" for k, v in r["kernels"].items()), *speeds, target,
                      f"{r['bytes_per_token'] / 2**20:.0f}", roof)
    Console().print(table)
    Console().print(f"read bandwidth {record.results['bandwidth_gb_s']:.1f} GB/s, "
                    f"{record.engine.config['threads']} torch threads, "
                    f"load average at the end {record.results['load_average_1_5_15'][0]:.1f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--new-tokens", type=positive_int, default=128)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--threads", type=positive_int, default=None)
    parser.add_argument("--compile", choices=MODES, default=None, help="Also time each config's compiled step.")
    args = parser.parse_args()
    set_threads(args.threads)
    record = run(args.model, args.new_tokens, args.repeats, args.compile)
    print_table(record)
    name = "quant_decode_compiled" if args.compile else "quant_decode"
    out = record.write(Path(__file__).parent / "results" / f"{name}.{probe().tag}.json")
    print(f"wrote {out}")
