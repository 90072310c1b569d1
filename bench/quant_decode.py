"""Batch-1 native decode speed of the default model: fp32, bf16, int8 (W8A16, int8pack) and int4 g32/g64
(int4pack), side by side in one run, each as % of its own memory roofline and as a ratio to fp32.

Usage: flock /tmp/qs-bench.lock python bench/quant_decode.py [--new-tokens 128] [--repeats 3] [--threads N]
Writes bench/results/quant_decode.<machine tag>.json (a full run record, one per CPU kind). Targets: int8 >= 2x fp32, int4 >= 2.5x fp32.
"""
import argparse
import os
from dataclasses import asdict
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from evals.decode_speed import DEFAULT_PROMPT, native_decode
from evals.record import (ArrivalProcess, EngineCondition, LengthDistribution, MetricCondition, ModelCondition,
                          RunRecord, hardware_info)
from evals.roofline import decode_bytes_per_token, measure_bandwidth
from runtime.loading import load_model, set_threads
from runtime.model_store import SMOLLM2, is_default_model, weights_hash
from quant.quantize import quantize_model
from runtime.hardware import kernels_used, probe
from runtime.generate import encode_prompt

# (label, dtype, scheme or None, target ratio to fp32)
CONFIGS = [("fp32", "fp32", None, None), ("bf16", "bf16", None, None), ("int8 W8A16", "bf16", "W8A16", 2.0),
           ("int4 g32", "bf16", "w4g32-sym", 2.5), ("int4 g64", "bf16", "w4g64-sym", 2.5)]


def run(model: str, new_tokens: int, repeats: int) -> RunRecord:
    bandwidth = measure_bandwidth()
    rows, path, prompt_ids = [], None, None
    for label, dtype, scheme, target in CONFIGS:
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
        rows.append(row)
    fp32 = rows[0]["decode_tok_s"]
    for row in rows:
        row["vs_fp32"] = row["decode_tok_s"] / fp32
        row["meets_target"] = None if row["target_vs_fp32"] is None else row["vs_fp32"] >= row["target_vs_fp32"]
    return RunRecord(
        name="quant-decode",
        model=ModelCondition(model, weights_hash(path), "fp32 / bf16 / W8A16 / W4A16-g32 / W4A16-g64",
                             scheme="see rows", note=SMOLLM2.note if is_default_model(path) else ""),
        hardware=hardware_info(),
        lengths=LengthDistribution(1, {"fixed": len(prompt_ids)}, {"fixed": new_tokens},
                                   f"one chat prompt: {DEFAULT_PROMPT!r}", True),
        arrival=ArrivalProcess("batch-1 sequential", 1),
        engine=EngineCondition("native", {"threads": torch.get_num_threads(),
                                          "quantized": "rtn weights, bf16 activations, tied lm_head/embedding bf16"},
                               warmup="one 8-token generation per configuration, excluded",
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
    for col in ("config", "kernels", "tok/s", "vs fp32", "target", "MiB/token", "% roofline"):
        table.add_column(col, justify="right")
    for r in record.results["rows"]:
        target = "" if r["target_vs_fp32"] is None else f">= {r['target_vs_fp32']}x {'ok' if r['meets_target'] else 'MISSED'}"
        table.add_row(r["engine"], ", ".join(f"{k}:{v}" for k, v in r["kernels"].items()), f"{r['decode_tok_s']:.1f}",
                      f"{r['vs_fp32']:.2f}x", target, f"{r['bytes_per_token'] / 2**20:.0f}", f"{r['roofline_pct']:.0f}%")
    Console().print(table)
    Console().print(f"read bandwidth {record.results['bandwidth_gb_s']:.1f} GB/s, "
                    f"{record.engine.config['threads']} torch threads, "
                    f"load average at the end {record.results['load_average_1_5_15'][0]:.1f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    set_threads(args.threads)
    record = run(args.model, args.new_tokens, args.repeats)
    print_table(record)
    out = record.write(Path(__file__).parent / "results" / f"quant_decode.{probe().tag}.json")
    print(f"wrote {out}")
