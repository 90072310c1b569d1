"""What each way of compiling the native bf16 decode step costs and gives on this CPU: its decode speed (paired with
the eager step), its 5-token verification step (cost V(4) over the one-token step, and whether its rows are bitwise
the one-token step's, which greedy speculation needs), and its build time three ways -- in a fresh process with a
cold inductor cache, in a second process with that cache warm, and for a second model of the same shapes in the same
process (what each further trial of a search would pay).

Options (``OPTIONS``):
  product           the product's step (runtime/compiled.py): max-autotune-no-cudagraphs, each transformer block
                    a nested compile region (built once, called per layer), bf16 linears calling quantspec's
                    ``bf16gemv`` op (runtime/cpu_ops.py) as extern kernels on the layout the eager decode rows use
                    (q/k/v and gate/up one call each), the weights left as graph inputs (nothing to prepack: one
                    cached graph for every model of the same shapes), inductor's Python wrapper
  unrolled          the product's step as one unrolled graph (every layer's code generated and built apart)
  cpp-wrapper       the product's step with inductor's C++ wrapper (no Python between the kernels of a step):
                    ``--compile max-autotune-cpp-wrapper``
  frozen            the same with the weights frozen into the graph
  frozen-cpp-wrapper  frozen, with inductor's C++ wrapper
  frozen-templates  no ``bf16gemv``: bf16 linears as ``F.linear`` frozen and prepacked by inductor, GEMMs chosen
                    among inductor's C++ templates only (``CPU_GEMM_BACKENDS``): the product's step before
                    ``bf16gemv``
Every option but ``product`` and ``cpp-wrapper`` is an alternative this bench measures, not a product setting:
each worker process patches it in. Every option runs in its own processes with its own inductor cache directory.

Usage: flock /tmp/qs-bench.lock python bench/compile_options.py [--new-tokens 64] [--threads 2] [--options a,b]
                                                                 [--scheme w4g32-asym]
Writes bench/results/compile_options.<machine tag>.json (all options) or compile_options-<options>[-<scheme>].<tag>.json
(``--scheme``: the bf16 model quantized first, RTN; its second model is quantized from weights times 1.001).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from evals.decode_speed import DEFAULT_PROMPT, decoder_block
from evals.record import (ArrivalProcess, EngineCondition, LengthDistribution, MetricCondition, ModelCondition,
                          RunRecord, hardware_info)
from evals.roofline import measure_bandwidth
from runtime import compiled, packed_linear
from runtime.argtypes import positive_int
from runtime.generate import Decoder, encode_prompt
from runtime.hardware import probe
from quant.quantize import quantize_model
from runtime.loading import load_model, set_threads
from runtime.measure import SpeedProtocol, paired_ratio, with_ci
from runtime.model_store import SMOLLM2, is_default_model, resolve_model, weights_hash
from specdec.speculative import compiled_rows_differing

VERIFY_ROWS = 5  # K = 4


@dataclass(frozen=True)
class Option:
    name: str
    what: str
    mode: str
    freezing: bool | None  # None: as the product decides (runtime.compiled.CompiledStep.freezing)
    bf16gemv: bool  # bf16 linears on quantspec's op (the product), or F.linear (inductor's GEMMs)
    regions: bool | None = None  # None: per-block regions where they build (the product); False: one unrolled graph


OPTIONS = {o.name: o for o in (
    Option("product", "the product's step: each block a nested compile region, bf16 linears on bf16gemv (extern; "
           "q/k/v, gate/up fused), weights as graph inputs, Python wrapper", compiled.DEFAULT_MODE, None, True),
    Option("unrolled", "the product's step as one unrolled graph, no per-block regions (the product before them)",
           compiled.DEFAULT_MODE, None, True, regions=False),
    Option("frozen", "the product's step with the weights frozen into the graph", compiled.DEFAULT_MODE, True, True),
    Option("cpp-wrapper", "the product's step with inductor's C++ wrapper (--compile max-autotune-cpp-wrapper)",
           "max-autotune-cpp-wrapper", None, True),
    Option("frozen-cpp-wrapper", "frozen, with inductor's C++ wrapper", "max-autotune-cpp-wrapper", True, True),
    Option("frozen-templates", "weights frozen and prepacked, bf16 linears as F.linear on inductor's C++ GEMM "
           "templates (the product before bf16gemv)", compiled.DEFAULT_MODE, True, False),
)}


def patch(option: Option) -> None:
    """Make this process's compiled steps build as ``option`` says (the bench's alternatives; ``product`` is as is)."""
    build = compiled.CompiledStep.__init__

    def init(step, model, mode=compiled.DEFAULT_MODE):
        build(step, model, mode)
        step.freezing = option.freezing
        step.regions = option.regions

    compiled.CompiledStep.__init__ = init
    if not option.bf16gemv:
        packed_linear.gemv_missing = lambda *args: f"off in option {option.name}"


def median_s(fn, repeats: int = 15) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def load(model: str, scheme: str, scale: float = 1.0):
    """The bf16 model (bf16 speculation's attention), its weights times ``scale``, quantized with ``scheme``."""
    lm = load_model(model, "bf16", attn_implementation="eager")
    if scale != 1.0:
        for p in lm.model.parameters():
            p.mul_(scale)
    if scheme != "none":
        quantize_model(lm, scheme, progress=False)
    return lm


def worker(option: Option, model: str, new_tokens: int, cold: bool, scheme: str = "none") -> dict:
    """One process's measurements (cold: everything; warm: the one-token step's build only)."""
    patch(option)
    lm = load(model, scheme)
    prompt_ids = encode_prompt(lm.tokenizer, DEFAULT_PROMPT)
    max_len = len(prompt_ids) + new_tokens + 8
    step = Decoder(lm, max_len, compile_mode=option.mode)
    step.generate(prompt_ids, 2, ignore_eos=True)  # builds the one-token step
    out = {"one_token_build_s": step.compile_s, "fallback": step.step.fallback, "weights_frozen": step.step.freezing,
           "regions": step.step.regions}
    if not cold:
        return out
    eager = Decoder(lm, max_len)
    eager.generate(prompt_ids, 8, ignore_eos=True)  # warm-up, excluded
    paired = paired_ratio(decoder_block(eager, prompt_ids, new_tokens), decoder_block(step, prompt_ids, new_tokens),
                          1, SpeedProtocol(), "one greedy generation")
    step.reset()
    step.forward(prompt_ids)
    start = step.pos
    _, differing = compiled_rows_differing(step, prompt_ids[-VERIFY_ROWS:])
    out["verify_build_s"] = step.steps[VERIFY_ROWS].compile_s

    def at_start(n: int):
        def run():
            step.rollback(start)
            step.forward(prompt_ids[-n:], compiled=True)
        return run

    one, verify = median_s(at_start(1)), median_s(at_start(VERIFY_ROWS))
    second = load(model, scheme, 1.001)  # other weights, same shapes: a search's next trial
    other = Decoder(second, max_len, compile_mode=option.mode)
    other.generate(prompt_ids, 2, ignore_eos=True)
    return out | {"compiled_tok_s": paired.candidate.value, "eager_tok_s": paired.reference.value,
                  "compiled_over_eager": paired.ratio.value, "compiled_over_eager_ci": list(paired.ratio.ci),
                  "noisy": paired.noisy, "rounds": paired.rounds, "one_token_step_ms": one * 1e3,
                  "verify_step_ms": verify * 1e3, "verify_cost": verify / one, "verify_rows_differing": differing,
                  "second_model_build_s": other.compile_s}


def run_worker(option: Option, model: str, new_tokens: int, threads: int | None, cache: Path, cold: bool,
               scheme: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", option.name, "--model", model, "--new-tokens", str(new_tokens),
           "--scheme", scheme]
    cmd += ["--threads", str(threads)] if threads else []
    cmd += [] if cold else ["--warm"]
    env = os.environ | {"TORCHINDUCTOR_CACHE_DIR": str(cache)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(model: str, new_tokens: int, threads: int | None, options: list[Option], scheme: str = "none") -> RunRecord:
    bandwidth = measure_bandwidth()
    path = resolve_model(model)
    rows = []
    with tempfile.TemporaryDirectory(prefix="qs-compile-options-") as tmp:
        for option in options:
            cache = Path(tmp) / option.name
            cold = run_worker(option, model, new_tokens, threads, cache, True, scheme)
            warm = run_worker(option, model, new_tokens, threads, cache, False, scheme)
            rows.append({"option": option.name, **asdict(option), **cold,
                         "warm_one_token_build_s": warm.get("one_token_build_s"), "warm_error": warm.get("error")})
            print(f"{option.name}: {rows[-1]}", flush=True)
    return RunRecord(
        name="compile-options",
        model=ModelCondition(model, weights_hash(path), "bf16, attention eager (batch-invariant)", scheme=scheme,
                             note=SMOLLM2.note if is_default_model(path) else ""),
        hardware=hardware_info(),
        lengths=LengthDistribution(1, {"source": "one chat prompt"}, {"fixed": new_tokens},
                                   f"one chat prompt: {DEFAULT_PROMPT!r}", True),
        arrival=ArrivalProcess("batch-1 sequential", 1),
        engine=EngineCondition("native", {"threads": threads or torch.get_num_threads(),
                                          "verify_rows": VERIFY_ROWS},
                               warmup="builds (first calls) timed apart; one eager generation excluded",
                               cache_warmth="cold: a fresh inductor cache directory per option; warm: a second "
                                            "process on the same directory"),
        metric=MetricCondition(
            {"compiled_over_eager": "paired, interleaved ratio of decode tok/s (prefill excluded) over the eager "
                                    "step; CI: 95% t-interval of the mean log ratio",
             "verify_cost": "median 5-token compiled step time / median one-token compiled step time, same position",
             "verify_rows_differing": "rows of the 5-token step's logits not bitwise the one-token step's at the "
                                      "same positions (greedy speculation needs 0)",
             "*_build_s": "seconds of the first call of a step (tracing, lowering, C++ build, autotuning)"},
            "greedy, ignore_eos, fixed length; speed and exactness only"),
        results={"bandwidth_gb_s": bandwidth / 1e9, "load_average_1_5_15": os.getloadavg(), "rows": rows},
    )


def print_table(record: RunRecord) -> None:
    table = Table(title=f"compiling the bf16 decode step, {record.hardware['cpu']}")
    for col in ("option", "tok/s", "vs eager", "V(4)", "rows differing", "build cold s", "build warm s",
                "2nd model s", "5-token build s"):
        table.add_column(col, justify="right")
    for r in record.results["rows"]:
        if "error" in r:
            table.add_row(r["option"], r["error"])
            continue
        table.add_row(r["option"], f"{r['compiled_tok_s']:.1f}",
                      with_ci(r["compiled_over_eager"], r["compiled_over_eager_ci"], ".2f", "x"),
                      f"{r['verify_cost']:.2f}", str(r["verify_rows_differing"]), f"{r['one_token_build_s']:.0f}",
                      f"{r['warm_one_token_build_s'] or 0:.0f}", f"{r['second_model_build_s']:.0f}",
                      f"{r['verify_build_s']:.0f}")
    Console().print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--new-tokens", type=positive_int, default=64)
    parser.add_argument("--threads", type=positive_int, default=None)
    parser.add_argument("--options", default=",".join(OPTIONS), help=f"some of {', '.join(OPTIONS)}")
    parser.add_argument("--scheme", default="none", help="a weight scheme to quantize with (RTN), e.g. w4g32-asym")
    parser.add_argument("--worker", choices=sorted(OPTIONS), help=argparse.SUPPRESS)
    parser.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help="default: bench/results/compile_options.<tag>.json")
    args = parser.parse_args()
    if args.threads:
        set_threads(args.threads)
    if args.worker:
        with torch.no_grad():
            print(json.dumps(worker(OPTIONS[args.worker], args.model, args.new_tokens, not args.warm, args.scheme)))
        return
    names = args.options.split(",")
    unknown = sorted(set(names) - set(OPTIONS))
    if unknown:
        parser.error(f"--options: unknown {', '.join(unknown)}; use some of {', '.join(OPTIONS)}")
    record = run(args.model, args.new_tokens, args.threads, [OPTIONS[n] for n in names], args.scheme)
    print_table(record)
    subset = ("" if names == list(OPTIONS) else "-" + "-".join(names)) + ("" if args.scheme == "none" else
                                                                          f"-{args.scheme}")
    out = record.write(args.out or Path(__file__).parent / "results" / f"compile_options{subset}.{probe().tag}.json")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
