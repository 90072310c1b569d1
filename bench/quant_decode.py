"""Batch-1 native decode speed of the default model: fp32, bf16, int8 (W8A16) and int4 g32/g64, each on the
kernel the registry picks here (``quant.gemv``'s int4gemv / int8gemv where they run and are faster, else torch's
int8pack / int4pack), side by side in one run, each as % of its own memory roofline and as a ratio to fp32.

Usage: flock /tmp/qs-bench.lock python bench/quant_decode.py [--new-tokens 128] [--repeats 3] [--threads N]
Writes bench/results/quant_decode.<machine tag>.json (a full run record, one per CPU kind). Targets: int8 >= 2x fp32, int4 >= 2.5x fp32.

With --compile MODE: bf16, int8 and int4 g32, each with the LM head kept bf16 (the default schemes) and quantized
too (``@ignore=``), on the eager and the compiled one-token step (runtime/compiled.py, compile time apart); each
compiled quantized step is timed in paired, interleaved rounds with the compiled bf16 step (resident beside it), as a
ratio with its 95% CI (issue 28's targets: int8 >= 1.6x, int4 g32 >= 2.2x), beside its byte ceiling (bf16 bytes per
token over its own: the ratio a purely bandwidth-bound step would reach) and its share of the roofline; writes
quant_decode_compiled.<machine tag>.json. Some rows run the same weights on another kernel than the registry's
pick (int4 on torch's int4pack, int8 on torch's int8pack), so the kernels compare in one run.
"""
import argparse
import os
import statistics
from dataclasses import asdict
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from evals.decode_speed import DEFAULT_PROMPT, decoder_block, first_diff, native_decode
from runtime.compiled import MODES, gemm_backends
from evals.record import (ArrivalProcess, EngineCondition, LengthDistribution, MetricCondition, ModelCondition,
                          RunRecord, hardware_info)
from evals.roofline import decode_bytes_per_token, measure_bandwidth
from runtime.loading import load_model, set_threads
from runtime.model_store import SMOLLM2, is_default_model, weights_hash
from quant.qlinear import QuantizedLinear, select_kernel
from quant.scheme import parse_scheme
from runtime.errors import UserError
from quant.quantize import quantize_model
from runtime.hardware import kernels_used, probe
from runtime.generate import Decoder, encode_prompt
from runtime.measure import SpeedProtocol, paired_ratio, with_ci
from runtime.sampling import SamplingConfig
from runtime.argtypes import positive_int

# (label, dtype, scheme or None, target ratio to fp32)
CONFIGS = [("fp32", "fp32", None, None, None), ("bf16", "bf16", None, None, None),
           ("int8 W8A16", "bf16", "W8A16", 2.0, None), ("int4 g32", "bf16", "w4g32-sym", 2.5, None),
           ("int4 g64", "bf16", "w4g64-sym", 2.5, None)]
MLP_SHAPE = (1536, 576)
# compiled: target vs the compiled bf16 step; the last field names a kernel to run instead of the registry's pick
COMPILED = [("bf16", "bf16", None, None, None), ("int8 W8A16", "bf16", "W8A16", 1.6, None),
            ("int8 W8A16 on int8pack", "bf16", "W8A16", 1.6, "int8pack"),
            ("int8 W8A16 + head", "bf16", "w8ch-sym@ignore=", 1.6, None), ("int4 g32", "bf16", "w4g32-sym", 2.2, None),
            ("int4 g32 on int4pack", "bf16", "w4g32-sym", 2.2, "int4pack"),
            ("int4 g32 + head", "bf16", "w4g32-sym@ignore=", 2.2, None),
            ("int4 g32 + head on int4pack", "bf16", "w4g32-sym@ignore=", 2.2, "int4pack")]


def another_kernel_here(scheme: str, kernel: str | None) -> bool:
    """Whether a row naming ``kernel`` runs here on another kernel than the registry's pick (else it is left out)."""
    if kernel is None:
        return True
    spec = parse_scheme(scheme).weights
    try:
        return select_kernel(spec, None, MLP_SHAPE, kernel).name != select_kernel(spec, None, MLP_SHAPE).name
    except UserError:
        return False


def compiled_step(lm, prompt_ids: list[int], new_tokens: int, mode: str) -> Decoder:
    """A decoder on ``lm``'s compiled one-token step, built in an excluded 8-token warm-up."""
    decoder = Decoder(lm, max_len=len(prompt_ids) + new_tokens + 8, compile_mode=mode)
    decoder.generate(prompt_ids, 8, ignore_eos=True)
    return decoder


def compiled_speed(tok_s: float | None, row: dict, eager_tok_s: float, bandwidth: float) -> dict:
    """A row's compiled tok/s with its share of the roofline and its ratio to the eager step."""
    if tok_s is None:
        return {"compiled_tok_s": None}
    return {"compiled_tok_s": tok_s, "compiled_roofline_pct": 100 * tok_s * row["bytes_per_token"] / bandwidth,
            "compiled_over_eager": tok_s / eager_tok_s}


def run(model: str, new_tokens: int, repeats: int, compile_mode: str | None = None) -> RunRecord:
    bandwidth = measure_bandwidth()
    rows, path, prompt_ids, reference, picks = [], None, None, None, {}
    for label, dtype, scheme, target, kernel in COMPILED if compile_mode else CONFIGS:
        if not another_kernel_here(scheme, kernel):
            continue
        lm = load_model(model, dtype)
        path = lm.path
        prompt_ids = encode_prompt(lm.tokenizer, DEFAULT_PROMPT)
        kernels = {"dense": len(lm.model.layers) * 7}
        if scheme:
            kernels = quantize_model(lm, scheme, progress=False).kernels
        if kernel:
            for layer in lm.model.modules():
                if isinstance(layer, QuantizedLinear) and layer.kernel_name != kernel:
                    layer.use_kernel(kernel)
            kernels = {kernel: sum(kernels.values())}
        speed = native_decode(lm, prompt_ids, new_tokens, repeats, bandwidth, label)
        row = {k: v for k, v in asdict(speed).items() if k != "tokens"}
        row.update(dtype=dtype, scheme=scheme or "none", kernels=kernels, kernels_run=kernels_used(lm.model),
                   target_vs_fp32=None if compile_mode else target,
                   bytes_per_token=decode_bytes_per_token(lm.model), first_tokens=speed.tokens[:16])
        if compile_mode:
            step = compiled_step(lm, prompt_ids, new_tokens, compile_mode)
            tokens = step.generate(prompt_ids, new_tokens, SamplingConfig(), ignore_eos=True).tokens
            block = decoder_block(step, prompt_ids, new_tokens)
            paired = None
            if reference is None:  # the compiled bf16 step: every other row is paired with it
                reference = block
            else:
                paired = paired_ratio(reference, block, 1, SpeedProtocol(), "one greedy generation")
            if kernel:  # the same weights on another kernel: also paired with the registry's pick, head to head
                against = paired_ratio(picks[scheme], block, 1, SpeedProtocol(), "one greedy generation")
                row.update(vs_pick=against.ratio.value, vs_pick_ci=list(against.ratio.ci))
            elif scheme:
                picks[scheme] = block
            row.update(compile_s=step.compile_s, fallback=step.step.fallback, step=step.step_label,
                       first_diff_vs_eager=first_diff(tokens, speed.tokens), target_vs_bf16_compiled=target,
                       bytes_ceiling=rows[0]["bytes_per_token"] / row["bytes_per_token"] if rows else 1.0,
                       vs_bf16_compiled=paired.ratio.value if paired else 1.0,
                       vs_bf16_compiled_ci=list(paired.ratio.ci) if paired else None,
                       paired=paired.to_dict() if paired else None, **compiled_speed(
                           paired.candidate.value if paired else None, row, speed.decode_tok_s, bandwidth))
        rows.append(row)
    if compile_mode:  # bf16's compiled speed: the median of its rates in the rounds it was paired in
        bf16 = statistics.median(r["paired"]["reference"]["value"] for r in rows[1:])
        rows[0].update(compiled_speed(bf16, rows[0], rows[0]["decode_tok_s"], bandwidth))
    for row in rows:
        row["vs_fp32"] = row["decode_tok_s"] / rows[0]["decode_tok_s"]  # compiled runs: rows[0] is bf16
        goal = row["target_vs_bf16_compiled"] if compile_mode else row["target_vs_fp32"]
        achieved = row["vs_bf16_compiled"] if compile_mode else row["vs_fp32"]
        row["meets_target"] = None if goal is None else achieved >= goal
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
                                          "quantized": "rtn weights, bf16 activations; lm_head bf16 (tied to "
                                                       "the embedding) unless the row's scheme has @ignore= (then "
                                                       "quantized as an untied copy; the embedding stays bf16)"},
                               warmup="one 8-token generation per configuration and step, excluded (it compiles "
                                      "the compiled step: compile_s)" if compile_mode else
                                      "one 8-token generation per configuration, excluded",
                               cache_warmth="KV cache reset per request; weights resident in RAM"),
        metric=MetricCondition(
            {"decode_tok_s": "median over repeats of (new_tokens-1)/decode seconds, prefill excluded",
             "roofline_pct": "decode tok/s / (measured read bandwidth / bytes streamed per token incl. packed "
                             "weights, scales and the LM head, bf16/fp32 or quantized)",
             "vs_fp32": "decode tok/s / fp32 decode tok/s in the same run",
             "vs_bf16_compiled": "compiled step: median over paired, interleaved rounds (one greedy generation "
                                 "each, seeded AB/BA order) of its tok/s over the compiled bf16 step's, with the 95% "
                                 "CI of the mean log ratio",
             "bytes_ceiling": "bf16 bytes streamed per token / the row's (the ratio to bf16 at equal bandwidth)",
             "vs_pick": "a row on another kernel than the registry's pick: its compiled tok/s over the pick's on "
                        "the same weights, in its own paired, interleaved rounds with the pick's step (CI as above)"},
            "greedy, ignore_eos, fixed output length; speed only (quality: quantspec quantize / bench/quant_quality.py)"),
        results={"bandwidth_gb_s": bandwidth / 1e9, "load_average_1_5_15": os.getloadavg(), "rows": rows},
    )


def print_table(record: RunRecord) -> None:
    table = Table(title=f"batch-1 native decode, default model, {record.lengths.output_tokens['fixed']} new tokens")
    compiled = record.engine.config.get("compile_mode")
    cols = ["config", "kernels", "tok/s", "vs fp32", "target", "MiB/token", "% roofline"]
    if compiled:
        cols[2:4] = ["eager tok/s", "compiled tok/s", "vs compiled bf16 [95% CI]", "byte ceiling", "compile s"]
    for col in cols:
        table.add_column(col, justify="right")
    for r in record.results["rows"]:
        goal = r.get("target_vs_bf16_compiled") if compiled else r["target_vs_fp32"]
        target = "" if goal is None else f">= {goal}x {'ok' if r['meets_target'] else 'MISSED'}"
        speeds = [f"{r['decode_tok_s']:.1f}", f"{r['vs_fp32']:.2f}x"]
        if compiled:
            speeds = [f"{r['decode_tok_s']:.1f}", f"{r['compiled_tok_s']:.1f}" + (" (eager: fallback)" if r["fallback"]
                      else ""), with_ci(r["vs_bf16_compiled"], r["vs_bf16_compiled_ci"], ".2f", "x"),
                      f"{r['bytes_ceiling']:.2f}x", f"{r['compile_s']:.0f}"]
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
