"""Batch-1 native decode of the W8A8 kernels on this CPU, each paired with the bf16 model: INT8 W8A8 dynamic
(``int8xint8``: ``torch._int_mm`` or its exact fp32 twin, as the probe picked) and FP8 W8A8 dynamic
(``fp8xfp8``) with each of its two products forced -- ``torch._scaled_mm`` and the exact fp32 upcast -- and as the
probe picked. Every row is a paired, interleaved ratio over the bf16 reference with its 95% CI
(``runtime.measure.paired_ratio``), plus the read bandwidth each row achieves.

Usage: flock /tmp/qs-bench.lock python bench/w8a8_decode.py [--new-tokens 64] [--units 2] [--threads 2]
Writes bench/results/w8a8_decode.<machine tag>.json. Target (issue 30): FP8's ``_scaled_mm`` decode measured
beside int8 on this CPU.
"""
import argparse
import os
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from evals.decode_speed import DEFAULT_PROMPT, native_block
from evals.record import (ArrivalProcess, EngineCondition, LengthDistribution, MetricCondition, ModelCondition,
                          RunRecord, hardware_info)
from evals.roofline import decode_bytes_per_token, measure_bandwidth
from quant import fp8
from quant.qlinear import QuantizedLinear
from quant.quantize import quantize_model
from runtime.generate import Decoder, encode_prompt
from runtime.hardware import kernels_used, probe
from runtime.loading import load_model, set_threads
from runtime.measure import SpeedProtocol, paired_ratio, with_ci
from runtime.model_store import SMOLLM2, is_default_model, weights_hash
from runtime.sampling import SamplingConfig
from runtime.argtypes import positive_int

# (row, scheme, the FP8 product forced on every fp8xfp8 layer or None for the probe's pick)
ROWS = [("INT8 W8A8 dynamic", "W8A8", None), ("FP8 W8A8 dynamic, probe's pick", "FP8_DYNAMIC", None),
        ("FP8 W8A8 dynamic, _scaled_mm", "FP8_DYNAMIC", fp8.SCALED_MM),
        ("FP8 W8A8 dynamic, fp32 upcast", "FP8_DYNAMIC", fp8.UPCAST)]


def force_product(model: torch.nn.Module, product: str) -> None:
    """Run every FP8 layer on ``product`` at every shape class."""
    for module in model.modules():
        if isinstance(module, fp8.Fp8xFp8Kernel):
            module.pick = {cls: product for cls in module.pick}


def greedy(lm, prompt_ids: list[int], new_tokens: int) -> list[int]:
    return Decoder(lm, len(prompt_ids) + new_tokens + 8).generate(prompt_ids, new_tokens, SamplingConfig(),
                                                                  ignore_eos=True).tokens


def run(model: str, new_tokens: int, units: int, protocol: SpeedProtocol) -> RunRecord:
    bandwidth = measure_bandwidth()
    ref = load_model(model, "bf16")
    prompt_ids = encode_prompt(ref.tokenizer, DEFAULT_PROMPT)
    ref_block, ref_tokens = native_block(ref, prompt_ids, new_tokens), greedy(ref, prompt_ids, new_tokens)
    ref_block(0)  # warm-up
    rows = []
    for label, scheme, product in ROWS:
        lm = load_model(model, "bf16")
        report = quantize_model(lm, scheme, progress=False)
        if product:
            force_product(lm.model, product)
        block = native_block(lm, prompt_ids, new_tokens)
        block(0)  # warm-up
        paired = paired_ratio(ref_block, block, units, protocol, "one greedy generation")
        tokens = greedy(lm, prompt_ids, new_tokens)
        bytes_per_token = decode_bytes_per_token(lm.model)
        rows.append({"config": label, "scheme": report.scheme.label, "product": product or "probe's pick",
                     "kernels": report.kernels, "kernels_run": kernels_used(lm.model),
                     "kernel_details": sorted({m.kernel_detail for m in lm.model.modules()
                                               if isinstance(m, QuantizedLinear)}),
                     "vs_bf16": paired.ratio.value, "vs_bf16_ci": list(paired.ratio.ci),
                     "decode_tok_s": paired.candidate.value, "bf16_tok_s": paired.reference.value,
                     "noisy": paired.noisy, "rounds": paired.rounds,
                     "achieved_gb_s": paired.candidate.value * bytes_per_token / 1e9,
                     "bytes_per_token": bytes_per_token,
                     "greedy_agreement_vs_bf16": sum(a == b for a, b in zip(tokens, ref_tokens)) / len(ref_tokens),
                     "paired": paired.to_dict()})
        del lm
    return RunRecord(
        name="w8a8-decode",
        model=ModelCondition(model, weights_hash(ref.path), "bf16 activations; W8A8 int8 / FP8 E4M3 weights + "
                             "dynamic per-token activations (rtn)", scheme="see rows",
                             note=SMOLLM2.note if is_default_model(ref.path) else ""),
        hardware=hardware_info(),
        lengths=LengthDistribution(1, {"fixed": len(prompt_ids)}, {"fixed": new_tokens},
                                   f"one chat prompt: {DEFAULT_PROMPT!r}", True),
        arrival=ArrivalProcess("batch-1 sequential", 1),
        engine=EngineCondition("native", {"threads": torch.get_num_threads(), "step": "eager",
                                          "reference": "bf16 dense, resident"},
                               warmup="one generation per model, excluded",
                               cache_warmth="KV cache reset per request; weights resident in RAM"),
        metric=MetricCondition(
            {"vs_bf16": "median over rounds of (candidate tok/s / bf16 tok/s), generations interleaved in a seeded "
                        "random order; CI: 95% t-interval of the mean log ratio",
             "decode_tok_s": "median over rounds of decode tokens / decode seconds (prefill excluded)",
             "achieved_gb_s": "decode tok/s x bytes streamed per token (packed weights, scales, bf16 LM head)"},
            "greedy, ignore_eos, fixed output length; speed only (quality: bench/act_quality.py); "
            "greedy_agreement_vs_bf16 reported, not required"),
        results={"bandwidth_gb_s": bandwidth / 1e9, "load_average_1_5_15": os.getloadavg(),
                 "scaled_mm_missing": fp8.scaled_mm_missing(), "rows": rows},
    )


def print_table(record: RunRecord) -> None:
    table = Table(title=f"batch-1 native decode, W8A8 kernels vs bf16 (paired), "
                        f"{record.lengths.output_tokens['fixed']} new tokens, {record.hardware['cpu']}")
    for col in ("config", "kernel", "tok/s", "vs bf16 (95% CI)", "GB/s achieved", "rounds"):
        table.add_column(col, justify="right")
    for r in record.results["rows"]:
        table.add_row(r["config"], "/".join(r["kernels"]), f"{r['decode_tok_s']:.1f}",
                      with_ci(r["vs_bf16"], r["vs_bf16_ci"], ".2f", "x") + (" noisy" if r["noisy"] else ""),
                      f"{r['achieved_gb_s']:.1f}", str(r["rounds"]))
    Console().print(table)
    Console().print(f"read bandwidth measured: {record.results['bandwidth_gb_s']:.1f} GB/s; "
                    f"load average {record.results['load_average_1_5_15'][0]:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--new-tokens", type=positive_int, default=64)
    parser.add_argument("--units", type=positive_int, default=2, help="generations of each side per round")
    parser.add_argument("--threads", type=positive_int, default=None)
    parser.add_argument("--out", type=Path, default=None, help="default: bench/results/w8a8_decode.<tag>.json")
    args = parser.parse_args()
    if args.threads:
        set_threads(args.threads)
    record = run(args.model, args.new_tokens, args.units, SpeedProtocol())
    print_table(record)
    out = record.write(args.out or Path(__file__).parent / "results" / f"w8a8_decode.{probe().tag}.json")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
