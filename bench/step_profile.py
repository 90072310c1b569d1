"""Where a compiled one-token decode step's time goes: bf16, int8 (W8A16) and int4 g32 steps of the default model
under torch.profiler, the C++ kernels inductor generates (its GEMM templates, weight-only int8/int4 ones included)
built with ``cpp.enable_kernel_profile`` so each is timed by name beside the ATen ops the graph calls. Time is
grouped into weight matmuls, attention, dynamo's guard check and the rest; the matmuls' achieved read bandwidth
(the bytes a step streams, LM head included, over their time) is printed beside the measured bandwidth.

Usage: flock /tmp/qs-bench.lock .venv/bin/python bench/step_profile.py [--compile MODE] [--steps 64]
Writes bench/results/step_profile.<machine tag>.json.
"""
import argparse
import re
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from evals.decode_speed import DEFAULT_PROMPT
from evals.record import (ArrivalProcess, EngineCondition, LengthDistribution, MetricCondition, ModelCondition,
                          RunRecord, hardware_info)
from evals.roofline import decode_bytes_per_token, measure_bandwidth
from quant.quantize import quantize_model
from runtime.compiled import MODES
from runtime.generate import Decoder, encode_prompt
from runtime.hardware import kernels_used, probe
from runtime.loading import load_model, set_threads
from runtime.model_store import SMOLLM2, resolve_model, weights_hash
from runtime.argtypes import positive_int

CONFIGS = [("bf16", None), ("int8 W8A16", "W8A16"), ("int4 g32", "w4g32-sym")]
# by event name: ATen/mkldnn matmuls, quantspec's GEMV ops, inductor's GEMM templates (graph_N_gemm_m1n..k.._kernel)
# and its weight-only int8 template (profiled as plain graph_N_kernel). Inductor's fused element-wise / reduction
# kernels (cpp_fused_<the nodes around them>) are never matmuls, even when named after one ("..._int4_gemv_..."):
# the one with the softmax is the compiled step's attention; the rest is "other"
FUSED = r"(graph_\d+_)?cpp_fused"
GROUPS = {"weight matmuls": re.compile(rf"^(?!{FUSED}).*(mm|linear|gemm|gemv|woq)|^graph_\d+_kernel$", re.I),
          "attention": re.compile(r"attention|sdpa|softmax", re.I),
          "dynamo guard check": re.compile(r"cache lookup", re.I)}
PROFILE_KERNELS = {"cpp.enable_kernel_profile": True}  # generated kernels record profiler events by name


def group_of(name: str) -> str:
    return next((g for g, pattern in GROUPS.items() if pattern.search(name)), "other")


def layer_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the decoder layers' linear weights (packed, with scales), the LM head apart."""
    return sum(t.numel() * t.element_size() for name, t in [*model.named_parameters(), *model.named_buffers()]
               if ".layers." in f".{name}" and "norm" not in name and "rotary" not in name and "rope" not in name)


def profiled(decoder: Decoder, ids: list[int], n: int) -> tuple[dict[str, tuple[float, int]], float]:
    """Self CPU microseconds and calls per profiler event over one greedy generation of ``n`` tokens, and its
    decode seconds."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = decoder.generate(ids, n, ignore_eos=True)
    return {e.key: (e.self_cpu_time_total, e.count) for e in prof.key_averages()}, out.decode_s


def profile(model: str, label: str, scheme: str | None, compile_mode: str | None, steps: int, bandwidth: float):
    lm = load_model(model, "bf16")
    if scheme:
        quantize_model(lm, scheme, progress=False)
    ids = encode_prompt(lm.tokenizer, DEFAULT_PROMPT)
    decoder = Decoder(lm, len(ids) + steps + 8, compile_mode=compile_mode)
    with torch._inductor.config.patch(PROFILE_KERNELS):
        decoder.generate(ids, 8, ignore_eos=True)  # warm-up (compiles), excluded
        plain = decoder.generate(ids, steps, ignore_eos=True)
        prefill, _ = profiled(decoder, ids, 1)  # the eager prefill and the first token: subtracted below
        full, wall = profiled(decoder, ids, steps + 1)
    step_s = wall / steps
    per_step = {k: (t - prefill.get(k, (0, 0))[0], n - prefill.get(k, (0, 0))[1]) for k, (t, n) in full.items()}
    events = sorted(((k, t / steps, n / steps) for k, (t, n) in per_step.items() if t > 0), key=lambda e: -e[1])
    ops = [{"op": k, "group": group_of(k), "calls_per_step": n, "us_per_step": us, "share_of_step": us / 1e6 / step_s}
           for k, us, n in events[:16]]
    groups = {g: sum(us for k, us, _ in events if group_of(k) == g) for g in [*GROUPS, "other"]}
    matmul_us = groups["weight matmuls"]
    streamed = decode_bytes_per_token(lm.model)
    return {"config": label, "scheme": scheme or "none", "step": decoder.step_label, "compile_s": decoder.compile_s,
            "prompt_tokens": len(ids), "decode_tok_s": plain.decode_tokens_per_s, "profiled_step_ms": step_s * 1e3,
            "bytes_per_token": streamed, "layer_weight_bytes": layer_weight_bytes(lm.model),
            "us_per_step_by_group": groups, "matmul_us_per_step": matmul_us, "matmul_share": matmul_us / 1e6 / step_s,
            "matmul_gb_s": streamed / (matmul_us / 1e6) / 1e9 if matmul_us else None,
            "step_gb_s": streamed / step_s / 1e9, "bandwidth_gb_s": bandwidth / 1e9,
            "kernels_run": kernels_used(lm.model), "top_ops": ops}


def run(model: str, compile_mode: str | None, steps: int) -> RunRecord:
    bandwidth = measure_bandwidth()
    rows = [profile(model, label, scheme, compile_mode, steps, bandwidth) for label, scheme in CONFIGS]
    return RunRecord(
        name="step-profile",
        model=ModelCondition(model, weights_hash(resolve_model(model)), "bf16 / W8A16 / W4A16-g32-sym", scheme="see rows",
                             note=SMOLLM2.note),
        hardware=hardware_info(),
        lengths=LengthDistribution(1, {"fixed": rows[0]["prompt_tokens"]}, {"fixed": steps}, f"one chat prompt: {DEFAULT_PROMPT!r}", True),
        arrival=ArrivalProcess("batch-1 sequential", 1),
        engine=EngineCondition("native", {"threads": torch.get_num_threads(), "compile_mode": compile_mode},
                               warmup="one 8-token generation (compiles), then one unprofiled timed generation",
                               cache_warmth="KV cache reset per request; weights resident in RAM"),
        metric=MetricCondition(
            {"us_per_step": "torch.profiler self CPU time of the op or generated kernel over the profiled "
                            "generation / steps (profiling adds time: profiled_step_ms vs decode_tok_s)",
             "matmul_gb_s": "bytes streamed per token (layers and LM head) / time of the weight matmul events per step",
             "step_gb_s": "bytes streamed per token / profiled step time"},
            "greedy, ignore_eos; profiling only (speeds: bench/quant_decode.py --compile)"),
        results={"bandwidth_gb_s": bandwidth / 1e9, "rows": rows},
    )


def print_tables(record: RunRecord) -> None:
    console = Console()
    for r in record.results["rows"]:
        table = Table(title=f"{r['config']}: {r['step']}, {r['profiled_step_ms']:.1f} ms/step profiled, matmuls "
                            f"{100 * r['matmul_share']:.0f}% at {r['matmul_gb_s'] or 0:.1f} GB/s "
                            f"(read bandwidth {r['bandwidth_gb_s']:.1f} GB/s)")
        for col in ("op", "calls/step", "us/step", "share"):
            table.add_column(col, justify="right")
        for op in r["top_ops"]:
            table.add_row(op["op"][:60], f"{op['calls_per_step']:.0f}", f"{op['us_per_step']:.0f}",
                          f"{100 * op['share_of_step']:.0f}%")
        console.print(table)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--steps", type=positive_int, default=64)
    parser.add_argument("--threads", type=positive_int, default=None)
    parser.add_argument("--compile", choices=MODES, default="max-autotune-no-cudagraphs")
    args = parser.parse_args()
    set_threads(args.threads)
    record = run(args.model, args.compile, args.steps)
    print_tables(record)
    out = record.write(Path(__file__).parent / "results" / f"step_profile.{probe().tag}.json")
    print(f"wrote {out}")
