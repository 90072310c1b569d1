"""The one prepared GPU check: the CUDA tests, decode speed per weight format against the measured memory-bandwidth
roofline, and speculative decoding's speed and greedy token-exactness, in one go of at most 8 minutes.

Models are built from configs with seeded random weights (the default model's SmolLM2-135M Llama shape, and a
Llama-3.2-1B shape for a memory-bound case), so nothing has to be downloaded: the numbers are valid for speed and
exactness only; quality is measured on CPU with the real weights (bench/quant_quality.py, bench/kv_quality.py).
Imports nothing of vLLM, lm-eval, Optuna, datasets, gguf or compressed-tensors.

Usage, on the GPU machine from the repository root:
    python bench/gpu_check.py [--device cuda] [--out-dir DIR]
    python bench/gpu_check.py --device cpu --tiny --out-dir DIR   # tiny shapes, seconds (tests/test_gpu_check.py)
Writes DIR/gpu-check.<device>.json (gpu-check.tiny.json under --tiny; DIR defaults to $OUT, else bench/results/)
atomically after every stage. Each stage is time-boxed; a failing stage is recorded and the rest still run. Exit 0
when no stage failed, 1 otherwise. ``--fail-stage NAME`` makes a stage fail (the test's negative control).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from evals.decode_speed import hf_model_decode, native_decode  # noqa: E402
from evals.record import hardware_info, write_json_atomic  # noqa: E402
from evals.roofline import decode_bytes_per_token, measure_bandwidth  # noqa: E402
from quant.qlinear import QuantizedLinear  # noqa: E402
from quant.qmath import compute_qparams, quantize  # noqa: E402
from quant.quantize import quantize_model  # noqa: E402
from quant.scheme import parse_scheme  # noqa: E402
from runtime.errors import UserError  # noqa: E402
from runtime.generate import Decoder  # noqa: E402
from runtime.hardware import kernels_used, resolve_device, sync  # noqa: E402
from runtime.compiled import CUDA_DEFAULT_MODE  # noqa: E402
from runtime.loading import LoadedModel, build_model  # noqa: E402
from runtime.transformer import ModelArgs, Transformer  # noqa: E402
from specdec.speculative import SpeculativeDecoder  # noqa: E402

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5}
SHAPES = {  # HF configs: the architectures the check times, weights random
    "smollm2-135m": {**LLAMA, "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
                     "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                     "max_position_embeddings": 8192, "rope_theta": 100000.0, "tie_word_embeddings": True},
    "llama-3.2-1b": {**LLAMA, "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
                     "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
                     "max_position_embeddings": 131072, "rope_theta": 500000.0, "tie_word_embeddings": True,
                     "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    "tiny": {**LLAMA, "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
             "rope_theta": 10000.0, "tie_word_embeddings": False},
}
FORMATS = ("bf16", "w8ch-sym", "w4g32-sym")  # dense bf16, int8 weight-only per channel, int4 groups of 32
# CUDA graphs on the GPU (gpt-fast's mode: a batch-1 step is hundreds of launches); max-autotune's kernel search
# would not fit the time box
COMPILE_MODES = {"cuda": CUDA_DEFAULT_MODE, "cpu": "default"}
NOTE = ("seeded random weights (no checkpoint travels to the GPU machine): speed and token-exactness only; "
        "quality is measured on CPU with the real weights")


@dataclass
class Plan:
    """What one run measures: per model shape the engines timed per weight format, and the speculation sweep."""

    kernel_shape: str  # the shape whose MLP matrices the kernels stage times one product of
    decode: dict[str, dict[str, tuple[str, ...]]]  # shape -> format -> engines (eager, compiled, hf)
    new_tokens: int
    repeats: int
    prompt_len: int
    spec_shape: str
    spec_proposers: tuple[str, ...]
    spec_ks: tuple[int, ...]
    bandwidth_gib: float
    budgets_s: dict[str, float]  # stage -> time box


FULL = Plan(  # the memory-bound 1B shape first: its rows are the targets
    kernel_shape="llama-3.2-1b",
    decode={"llama-3.2-1b": {"bf16": ("eager", "compiled", "hf"), "w8ch-sym": ("eager", "compiled"),
                             "w4g32-sym": ("eager", "compiled")},
            "smollm2-135m": {"bf16": ("eager", "compiled", "hf"), "w8ch-sym": ("eager",), "w4g32-sym": ("eager",)}},
    new_tokens=128, repeats=2, prompt_len=64, spec_shape="smollm2-135m",
    spec_proposers=("ngram:min=1,max=3", "selfquant:w4g32-sym"), spec_ks=(2, 4), bandwidth_gib=2.0,
    budgets_s={"bandwidth": 10, "kernels": 25, "cuda_tests": 60, "decode": 250, "speculative": 70})  # 6.9 min
TINY = Plan(
    kernel_shape="tiny",
    decode={"tiny": {"bf16": ("eager", "compiled", "hf"), "w8ch-sym": ("eager",), "w4g32-sym": ("eager",)}},
    new_tokens=8, repeats=1, prompt_len=16, spec_shape="tiny",
    spec_proposers=("ngram:min=1,max=3", "selfquant:w4g32-sym"), spec_ks=(2, 4), bandwidth_gib=0.0625,
    budgets_s={"bandwidth": 30, "kernels": 60, "cuda_tests": 120, "decode": 240, "speculative": 120})


class _NoTokenizer:
    """Random weights have no tokenizer: token ids in, nothing to detokenize, no end-of-sequence token."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True) -> str:
        return ""


def random_model(shape: str, dtype: torch.dtype, device: torch.device, attention: str = "sdpa",
                 seed: int = 0) -> LoadedModel:
    """The native model of ``SHAPES[shape]`` with seeded random weights, built on ``device``: embeddings N(0, 1),
    matrices N(0, 4 / fan_in), norms 1 (HF's N(0, 0.02) makes a tied model repeat one token forever, which would
    make every exactness check trivial)."""
    config = SHAPES[shape]
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in Transformer(ModelArgs.from_hf_config(config)).named_parameters()}
    gen = torch.Generator(device).manual_seed(seed)

    def init(name: str, size: torch.Size) -> torch.Tensor:
        if "norm" in name:
            return torch.ones(size, device=device)
        std = 1.0 if "embed" in name or len(size) == 1 else 2 * size[-1] ** -0.5
        return torch.randn(size, generator=gen, device=device) * std

    state = {n: init(n, s) for n, s in shapes.items()}
    model = build_model(config, state, dtype, attention=attention, device=device, source=f"random {shape}")
    return LoadedModel(model, _NoTokenizer(), Path(tempfile.gettempdir()) / f"random-{shape}", config, dtype)


def prompt(shape: str, length: int, seed: int = 0) -> list[int]:
    """Seeded random ids, a quarter of the length repeated (so n-gram lookup has something to find)."""
    g = torch.Generator().manual_seed(seed)
    part = torch.randint(3, SHAPES[shape]["vocab_size"], (max(length // 4, 1),), generator=g).tolist()
    return (part * 4)[:length]


def hf_twin(lm: LoadedModel):
    """The same weights in transformers' LlamaForCausalLM on the same device (for HF ``generate``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device(lm.device):
        hf = LlamaForCausalLM(LlamaConfig(**lm.config)).to(lm.dtype).eval()
    state = {k if k.startswith("lm_head") else f"model.{k}": v for k, v in lm.model.state_dict().items()}
    hf.load_state_dict(state, strict=False)
    return hf


# ---- stages: each fills ``out`` as it goes (so a timed-out stage keeps what it measured) ----

@dataclass
class Context:
    device: torch.device
    plan: Plan
    bandwidth: float | None = None  # bytes/s, from the bandwidth stage


def stage_bandwidth(ctx: Context, out: dict) -> None:
    ctx.bandwidth = measure_bandwidth(ctx.plan.bandwidth_gib, device=ctx.device)
    out.update(bandwidth_gb_s=round(ctx.bandwidth / 1e9, 1), buffer_gib=ctx.plan.bandwidth_gib,
               how="CUDA: one big tensor copy (read + write); CPU: a full reduction (read)")


def _time_us(fn: Callable[[], object], device: torch.device, calls: int = 50, rounds: int = 3) -> float:
    """Median over ``rounds`` of the mean time of ``calls`` back-to-back calls, synchronized at the edges."""
    fn()
    times = []
    for _ in range(rounds):
        sync(device)
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        sync(device)
        times.append((time.perf_counter() - t) / calls)
    return sorted(times)[rounds // 2] * 1e6


def _fp8_linear(w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """W8A8 float8 (e4m3) with per-channel weight and per-token activation scales through ``torch._scaled_mm``
    (issue 30's FP8_DYNAMIC); rows padded to 16, which its GEMMs need."""
    fp8 = torch.float8_e4m3fn
    w_scale = w.float().abs().amax(1, keepdim=True).clamp(min=1e-12) / torch.finfo(fp8).max
    w8 = (w.float() / w_scale).to(fp8)

    def run(x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        xp = torch.nn.functional.pad(x, (0, 0, 0, -m % 16)).float()
        x_scale = xp.abs().amax(1, keepdim=True).clamp(min=1e-12) / torch.finfo(fp8).max
        y = torch._scaled_mm((xp / x_scale).to(fp8), w8.T, scale_a=x_scale, scale_b=w_scale.T,
                             out_dtype=torch.bfloat16)
        return y[:m]
    return run


def stage_kernels(ctx: Context, out: dict) -> None:
    """One batch-1 product per weight format at the MLP shapes of ``plan.kernel_shape`` (seeded random weights,
    RTN): the kernel the registry picks on this device, its time and the weight bytes it streams per second,
    and its largest error against the bf16 product of the dequantized weight; plus float8 ``_scaled_mm``."""
    config, rows = SHAPES[ctx.plan.kernel_shape], out.setdefault("rows", [])
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    g = torch.Generator(ctx.device).manual_seed(0)
    for n, k in ((inter, hidden), (hidden, inter)):
        w = torch.randn(n, k, generator=g, device=ctx.device, dtype=torch.bfloat16) * k ** -0.5
        x = torch.randn(1, k, generator=g, device=ctx.device, dtype=torch.bfloat16)
        runs = {"bf16": (lambda w=w: lambda x: torch.nn.functional.linear(x, w), lambda: w.numel() * 2)}
        for label in FORMATS[1:]:
            spec = parse_scheme(label).weights
            scale, zero = compute_qparams(w.float(), spec)
            layer = QuantizedLinear(quantize(w.float(), scale, zero, spec), scale, zero, spec, k,
                                    dtype=torch.bfloat16)
            runs[label] = (lambda layer=layer: layer, lambda layer=layer: layer.format_bytes())
        runs["fp8-e4m3 _scaled_mm"] = (lambda w=w: _fp8_linear(w), lambda: w.numel() + n * 4)
        for label, (make, nbytes) in runs.items():
            row = {"format": label, "shape": [n, k]}
            try:
                fn = make()
                kernel = getattr(fn, "kernel_detail", None)
                reference = x.float() @ (fn.dequantized_weight() if kernel else w.float()).T
                y = fn(x)
                us = _time_us(lambda: fn(x), ctx.device)
            except Exception as exc:  # noqa: BLE001  (recorded: this device cannot run it)
                rows.append({**row, "status": "failed", "error": _error(exc)})
                continue
            rows.append({**row, "status": "ok", "kernel": kernel or label, "us": round(us, 2),
                         "weight_gb_s": round(nbytes() / us / 1e3, 1),
                         "max_rel_error": round(float((y.float() - reference).abs().max() / reference.abs().max()), 4)})


def stage_cuda_tests(ctx: Context, out: dict) -> None:
    """``pytest -m cuda`` over the test files that have CUDA tests (the other files may import packages this
    machine lacks)."""
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                   if "pytest.mark.cuda" in p.read_text())
    out["files"] = files
    try:
        import pytest  # noqa: F401
    except ImportError:
        out.update(status="skipped", reason="pytest is not installed here")
        return
    if not files:
        out.update(status="skipped", reason="no test file has CUDA tests")
        return
    timeout = max(ctx.plan.budgets_s["cuda_tests"] - 10, 10)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", *files],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    out.update(returncode=proc.returncode, summary=proc.stdout.strip().splitlines()[-1:] or [""],
               tail=proc.stdout[-3000:] + proc.stderr[-1000:])
    if proc.returncode not in (0, 5):  # 5: nothing collected
        raise RuntimeError(f"pytest -m cuda exited {proc.returncode}: {out['summary'][0]}")


def build_format(shape: str, fmt: str, device: torch.device) -> tuple[LoadedModel, dict]:
    """bf16 model of ``shape`` with weights in ``fmt`` (RTN); what ran: kernels, simulated or not."""
    lm = random_model(shape, torch.bfloat16, device)
    report = quantize_model(lm, fmt, "rtn", progress=False) if fmt != "bf16" else None
    info = {"kernels": sorted(set(kernels_used(lm.model).values()))}
    if report is not None:
        info.update(simulated=report.simulated, quantized_kernels=report.kernels)
    return lm, info


def stage_decode(ctx: Context, out: dict) -> None:
    plan, rows = ctx.plan, out.setdefault("rows", [])
    bandwidth = ctx.bandwidth or measure_bandwidth(plan.bandwidth_gib, device=ctx.device)
    for shape, formats in plan.decode.items():
        ids = prompt(shape, plan.prompt_len)
        for fmt, engines in formats.items():
            base = {"shape": shape, "format": fmt}
            try:
                lm, info = build_format(shape, fmt, ctx.device)
            except UserError as exc:  # a format this device cannot run: refused, not broken
                rows.append({**base, "status": "refused", "reason": str(exc)})
                continue
            except Exception as exc:  # noqa: BLE001  (recorded; the other formats still run)
                rows.append({**base, "status": "failed", "error": _error(exc)})
                continue
            eager_tokens = None
            for engine in engines:
                row = {**base, **info, "engine": engine}
                try:
                    if engine == "hf":
                        speed = hf_model_decode(hf_twin(lm), ids, plan.new_tokens, plan.repeats, bandwidth)
                    else:
                        speed = native_decode(lm, ids, plan.new_tokens, plan.repeats, bandwidth, engine,
                                              COMPILE_MODES[ctx.device.type] if engine == "compiled" else None)
                except Exception as exc:  # noqa: BLE001  (recorded; the other engines still run)
                    rows.append({**row, "status": "failed", "error": _error(exc)})
                    continue
                eager_tokens = speed.tokens if engine == "eager" else eager_tokens
                rows.append({**row, "status": "ok", "compile_fallback": speed.fallback,
                             "compile_s": None if speed.compile_s is None else round(speed.compile_s, 1),
                             "decode_tok_s": round(speed.decode_tok_s, 1),
                             "roofline_pct": round(speed.roofline_pct, 1), "prefill_ms": round(speed.prefill_ms, 2),
                             "bytes_per_token": decode_bytes_per_token(lm.model),
                             "tokens_equal_to_eager": None if eager_tokens is None else speed.tokens == eager_tokens})
            del lm
            _free(ctx.device)
    failed = [f"{r['shape']}/{r['format']}/{r.get('engine', '-')}" for r in rows if r["status"] == "failed"]
    if failed:
        raise RuntimeError(f"{len(failed)} decode rows failed: {', '.join(failed)}")


def stage_speculative(ctx: Context, out: dict) -> None:
    """Whether bf16 speculation is token-exact by construction on this device (one row, first), then plain greedy
    decoding vs speculative decoding per proposer and K on the same fp32 model: token-exactness and speed."""
    plan, rows = ctx.plan, out.setdefault("rows", [])
    ids = prompt(plan.spec_shape, plan.prompt_len)
    max_len = len(ids) + plan.new_tokens + max(plan.spec_ks) + 2
    bf16 = random_model(plan.spec_shape, torch.bfloat16, ctx.device, attention="eager")
    row = {"dtype": "bf16", "proposer": plan.spec_proposers[0], "k": plan.spec_ks[-1]}
    try:
        spec = SpeculativeDecoder(bf16, row["proposer"], row["k"], max_len=max_len)
    except UserError as exc:
        rows.append({**row, "status": "refused", "reason": str(exc)})
    else:
        ref = Decoder(bf16, max_len).generate(ids, plan.new_tokens, ignore_eos=True)
        result = spec.generate(ids, plan.new_tokens, ignore_eos=True)
        rows.append({**row, "status": "ok", "exact": result.tokens == ref.tokens,
                     "decode_tok_s": round(result.decode_tokens_per_s, 1)})
    del bf16
    lm = random_model(plan.spec_shape, torch.float32, ctx.device)
    plain = Decoder(lm, max_len)
    plain.generate(ids, 4, ignore_eos=True)  # warm-up
    reference = plain.generate(ids, plan.new_tokens, ignore_eos=True)
    out["plain_tok_s"] = round(reference.decode_tokens_per_s, 1)
    for proposer in plan.spec_proposers:
        for k in plan.spec_ks:
            spec = SpeculativeDecoder(lm, proposer, k, max_len=max_len)
            spec.generate(ids, 4, ignore_eos=True)  # warm-up
            result = spec.generate(ids, plan.new_tokens, ignore_eos=True)
            rows.append({"dtype": "fp32", "proposer": proposer, "k": k, "status": "ok",
                         "exact": result.tokens == reference.tokens,
                         "decode_tok_s": round(result.decode_tokens_per_s, 1),
                         "speedup": round(result.decode_tokens_per_s / max(reference.decode_tokens_per_s, 1e-9), 3),
                         "alpha": result.stats.get("alpha"), "tau": result.stats.get("tau")})
    inexact = [f"{r['proposer']} K={r['k']}" for r in rows if r["dtype"] == "fp32" and not r["exact"]]
    out["all_fp32_exact"] = not inexact
    out["inexact"] = inexact  # fp32 GEMMs are not batch-invariant: recorded, not a failure of the check


STAGES: dict[str, Callable[[Context, dict], None]] = {
    "bandwidth": stage_bandwidth, "kernels": stage_kernels, "cuda_tests": stage_cuda_tests, "decode": stage_decode,
    "speculative": stage_speculative}


# ---- running stages: time-boxed, failures recorded, JSON after each ----

class StageTimeout(Exception):
    pass


@contextlib.contextmanager
def time_box(seconds: float):
    def expire(signum, frame):
        raise StageTimeout(f"stage exceeded its {seconds:.0f} s time box")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_stage(name: str, ctx: Context, forced: set[str]) -> dict:
    out: dict = {}
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    t0 = time.perf_counter()
    try:
        with time_box(ctx.plan.budgets_s[name]):
            if name in forced:
                raise RuntimeError("forced to fail (--fail-stage)")
            STAGES[name](ctx, out)
        sync(ctx.device)
        out.setdefault("status", "ok")
    except Exception as exc:  # noqa: BLE001  (a failing stage is recorded and the rest still run)
        out.update(status="failed", error=_error(exc), traceback=traceback.format_exc()[-3000:])
    out["seconds"] = round(time.perf_counter() - t0, 2)
    if ctx.device.type == "cuda":
        out["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated(ctx.device) / 2**30, 3)
    _free(ctx.device)
    return out


TARGETS = {"bf16_compiled_roofline_pct": 60.0, "int4_over_bf16_compiled": 2.0}  # issue 15's GPU targets


def derive(record: dict) -> dict:
    """The figures read off the rows: each kernel's share of the copy bandwidth, each decode row's ratio to bf16 on
    the same shape and engine, and the targets on the memory-bound shape (compiled bf16 at >= 60% of the
    roofline, compiled int4 >= 2x compiled bf16)."""
    stages = record["stages"]
    bandwidth = stages.get("bandwidth", {}).get("bandwidth_gb_s")
    for row in stages.get("kernels", {}).get("rows", []):
        if row["status"] == "ok" and bandwidth:
            row["pct_of_copy_bandwidth"] = round(100 * row["weight_gb_s"] / bandwidth, 1)
    rows = [r for r in stages.get("decode", {}).get("rows", []) if r["status"] == "ok"]
    speed = {(r["shape"], r["format"], r["engine"]): r["decode_tok_s"] for r in rows}
    for r in rows:
        bf16 = speed.get((r["shape"], "bf16", r["engine"]))
        r["vs_bf16_same_engine"] = round(r["decode_tok_s"] / bf16, 2) if bf16 else None
    shape = next(iter(record["plan"]["decode"]))  # the memory-bound shape comes first
    found = {"bf16_compiled_roofline_pct": next((r["roofline_pct"] for r in rows if (r["shape"], r["format"],
                                                 r["engine"]) == (shape, "bf16", "compiled")), None),
             "int4_over_bf16_compiled": next((r["vs_bf16_same_engine"] for r in rows if (r["shape"], r["format"],
                                              r["engine"]) == (shape, "w4g32-sym", "compiled")), None)}
    record["targets"] = {name: {"shape": shape, "value": value, "target": TARGETS[name],
                                "met": None if value is None else value >= TARGETS[name]}
                         for name, value in found.items()}
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes and lengths: the end-to-end test on CPU")
    parser.add_argument("--out-dir", default=os.environ.get("OUT") or str(ROOT / "bench" / "results"))
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {', '.join(STAGES)}")
    parser.add_argument("--fail-stage", action="append", default=[], help="make this stage fail (negative control)")
    parser.add_argument("--derive", metavar="JSON", help="recompute the derived figures of a written record, in place")
    args = parser.parse_args(argv)
    if args.derive:
        try:
            record = json.loads(Path(args.derive).read_text())
            if record.get("name") != "gpu-check":
                raise ValueError("not a gpu-check record")
        except (OSError, ValueError) as exc:
            print(f"error: --derive {args.derive}: {exc}; pass a gpu-check.*.json this script wrote", file=sys.stderr)
            return 2
        write_json_atomic(Path(args.derive), derive(record))
        return 0
    try:
        device = resolve_device(args.device)
        stages = [s for s in args.stages.split(",") if s]
        unknown = [s for s in stages + args.fail_stage if s not in STAGES]
        if unknown:
            raise UserError(f"unknown stage {unknown[0]!r}: use one of {', '.join(STAGES)}")
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    ctx = Context(device, TINY if args.tiny else FULL)
    path = Path(args.out_dir) / f"gpu-check.{'tiny' if args.tiny else device.type}.json"
    record = {"name": "gpu-check", "device": str(device), "tiny": args.tiny, "note": NOTE,
              "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "torch": torch.__version__,
              "plan": asdict(ctx.plan), "compile_mode": COMPILE_MODES[device.type],
              "metrics": {"decode_tok_s": "median over repeats of (new_tokens-1)/decode seconds, greedy, ignore_eos, "
                                          "batch 1, prefill excluded; CUDA synchronized at the edges",
                          "roofline_pct": "decode tok/s / (measured bandwidth / bytes_per_token); bytes_per_token "
                                          "counts every parameter and buffer once (a simulated kernel's codes and "
                                          "its dequantized weight both)",
                          "exact": "speculative tokens == plain greedy tokens, same model and prompt"},
              "stages": {}}
    for name in stages:
        print(f"gpu-check: {name} ...", flush=True)
        record["stages"][name] = run_stage(name, ctx, set(args.fail_stage))
        print(f"gpu-check: {name} {record['stages'][name]['status']} ({record['stages'][name]['seconds']} s)",
              flush=True)
        write_json_atomic(path, record)
    record["hardware"] = hardware_info(device=device)  # with CUDA: GPU, CUDA and driver versions, peak memory
    failed = [n for n, s in record["stages"].items() if s["status"] == "failed"]
    record["ok"] = not failed
    write_json_atomic(path, derive(record))
    print(f"wrote {path}" + (f"; failed stages: {', '.join(failed)}" if failed else "; every stage ok"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
