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
from quant.quantize import quantize_model  # noqa: E402
from runtime.errors import UserError  # noqa: E402
from runtime.generate import Decoder  # noqa: E402
from runtime.hardware import kernels_used, resolve_device, sync  # noqa: E402
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
COMPILE_MODE = "default"  # max-autotune's kernel search would not fit the time box
NOTE = ("seeded random weights (no checkpoint travels to the GPU machine): speed and token-exactness only; "
        "quality is measured on CPU with the real weights")


@dataclass
class Plan:
    """What one run measures: per model shape the engines timed per weight format, and the speculation sweep."""

    decode: dict[str, dict[str, tuple[str, ...]]]  # shape -> format -> engines (eager, compiled, hf)
    new_tokens: int
    repeats: int
    prompt_len: int
    spec_shape: str
    spec_proposers: tuple[str, ...]
    spec_ks: tuple[int, ...]
    bandwidth_gib: float
    budgets_s: dict[str, float]  # stage -> time box


FULL = Plan(
    decode={"smollm2-135m": {"bf16": ("eager", "compiled", "hf"), "w8ch-sym": ("eager",), "w4g32-sym": ("eager",)},
            "llama-3.2-1b": {"bf16": ("eager", "compiled", "hf"), "w8ch-sym": ("eager",),
                             "w4g32-sym": ("eager", "compiled")}},
    new_tokens=128, repeats=2, prompt_len=64, spec_shape="smollm2-135m",
    spec_proposers=("ngram:min=1,max=3", "selfquant:w4g32-sym"), spec_ks=(2, 4, 8), bandwidth_gib=2.0,
    budgets_s={"bandwidth": 20, "cuda_tests": 60, "decode": 270, "speculative": 90})  # 7.3 min + start-up
TINY = Plan(
    decode={"tiny": {"bf16": ("eager", "compiled", "hf"), "w8ch-sym": ("eager",), "w4g32-sym": ("eager",)}},
    new_tokens=8, repeats=1, prompt_len=16, spec_shape="tiny",
    spec_proposers=("ngram:min=1,max=3", "selfquant:w4g32-sym"), spec_ks=(2, 4), bandwidth_gib=0.0625,
    budgets_s={"bandwidth": 30, "cuda_tests": 120, "decode": 240, "speculative": 120})


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
                                              COMPILE_MODE if engine == "compiled" else None)
                except Exception as exc:  # noqa: BLE001  (recorded; the other engines still run)
                    rows.append({**row, "status": "failed", "error": _error(exc)})
                    continue
                eager_tokens = speed.tokens if engine == "eager" else eager_tokens
                rows.append({**row, "status": "ok", "compile_fallback": speed.fallback,
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
    """Plain greedy decoding vs speculative decoding per proposer and K on the same fp32 model: token-exactness
    and speed; one bf16 row shows whether bf16 speculation is token-exact by construction on this device."""
    plan, rows = ctx.plan, out.setdefault("rows", [])
    ids = prompt(plan.spec_shape, plan.prompt_len)
    max_len = len(ids) + plan.new_tokens + max(plan.spec_ks) + 2
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
    inexact = [f"{r['proposer']} K={r['k']}" for r in rows if r["dtype"] == "fp32" and not r["exact"]]
    out["all_fp32_exact"] = not inexact
    out["inexact"] = inexact  # fp32 GEMMs are not batch-invariant: recorded, not a failure of the check


STAGES: dict[str, Callable[[Context, dict], None]] = {
    "bandwidth": stage_bandwidth, "cuda_tests": stage_cuda_tests, "decode": stage_decode,
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes and lengths: the end-to-end test on CPU")
    parser.add_argument("--out-dir", default=os.environ.get("OUT") or str(ROOT / "bench" / "results"))
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {', '.join(STAGES)}")
    parser.add_argument("--fail-stage", action="append", default=[], help="make this stage fail (negative control)")
    args = parser.parse_args(argv)
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
              "plan": asdict(ctx.plan), "compile_mode": COMPILE_MODE,
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
    write_json_atomic(path, record)
    print(f"wrote {path}" + (f"; failed stages: {', '.join(failed)}" if failed else "; every stage ok"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
