"""Native greedy decode vs HF generate on the default model: tok/s, ratio, % of memory roofline.

Usage: python bench/decode.py [--dtype fp32|bf16] [--device auto|cpu|cuda] [--new-tokens 128] [--repeats 3]
Writes bench/results/decode-<dtype>.<machine tag>.json (a full run record; one file per CPU kind; -cuda beside
the tag when it ran on a GPU).

With --compile: the eager step vs the compiled one-token step (runtime/compiled.py) per dtype (fp32, bf16) and
compile mode, same prompt and length, runs interleaved; compile time (first calls) apart from steady-state tok/s.
Usage: flock /tmp/qs-bench.lock python bench/decode.py --compile [--new-tokens 64] [--repeats 3] [--threads N]
Writes bench/results/decode_compiled.<machine tag>.t<threads>.json. Target: compiled >= 1.3x eager, greedy tokens
equal (fp32).
"""
import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from evals.decode_speed import DEFAULT_PROMPT, compare_decode
from evals.record import (ArrivalProcess, EngineCondition, LengthDistribution, MetricCondition, ModelCondition,
                          RunRecord, hardware_info)
from runtime.compiled import MODES
from runtime.generate import Decoder, encode_prompt
from runtime.hardware import probe, resolve_device
from runtime.loading import load_model, set_threads
from runtime.model_store import SMOLLM2, is_default_model, weights_hash
from quantspec.report import print_decode_comparison
from runtime.argtypes import positive_int

TARGET = 1.3  # compiled / eager decode tok/s, same dtype (issue 15)


def timed_call(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def compiled_rows(model: str, dtype: str, modes: list[str], new_tokens: int, repeats: int) -> tuple[list[dict], dict]:
    """One row per compile mode: eager and compiled decode tok/s side by side (median of interleaved repeats),
    the compiled step's first and second call times, and whether the greedy tokens are equal."""
    lm = load_model(model, dtype)
    ids = encode_prompt(lm.tokenizer, DEFAULT_PROMPT)
    max_len = len(ids) + new_tokens + 8
    eager = Decoder(lm, max_len)
    eager.generate(ids, 8, ignore_eos=True)  # warm-up, excluded
    rows = []
    for mode in modes:
        compiled = Decoder(lm, max_len, compile_mode=mode)
        token = int(compiled.forward(ids)[-1].argmax())  # eager prefill
        first = timed_call(lambda: compiled.forward([token]))  # traces, compiles, runs
        second = timed_call(lambda: compiled.forward([token]))
        compiled.generate(ids, 8, ignore_eos=True)  # warm-up, excluded
        runs = [(eager.generate(ids, new_tokens, ignore_eos=True), compiled.generate(ids, new_tokens, ignore_eos=True))
                for _ in range(repeats)]  # interleaved: a change in machine load hits both
        e, c = (statistics.median(r[i].decode_tokens_per_s for r in runs) for i in (0, 1))
        rows.append({"dtype": dtype, "mode": mode, "eager_tok_s": e, "compiled_tok_s": c, "compiled_over_eager": c / e,
                     "meets_target": c / e >= TARGET, "first_call_s": first, "second_call_s": second,
                     "greedy_tokens_equal": runs[0][0].tokens == runs[0][1].tokens,
                     "first_diff": next((i for i, (a, b) in enumerate(zip(runs[0][0].tokens, runs[0][1].tokens))
                                         if a != b), None),
                     "fallback": compiled.step.fallback, "load_average_1min": os.getloadavg()[0]})
    return rows, {"path": lm.path, "prompt_tokens": len(ids)}


def compiled_record(model: str, modes: list[str], new_tokens: int, repeats: int) -> RunRecord:
    load_before = os.getloadavg()
    rows = []
    for dtype in ("fp32", "bf16"):
        dtype_rows, info = compiled_rows(model, dtype, modes, new_tokens, repeats)
        rows += dtype_rows
    return RunRecord(
        name="decode-compiled",
        model=ModelCondition(model, weights_hash(info["path"]), "fp32 / bf16",
                             note=SMOLLM2.note if is_default_model(info["path"]) else ""),
        hardware=hardware_info(),
        lengths=LengthDistribution(1, {"fixed": info["prompt_tokens"]}, {"fixed": new_tokens},
                                   f"one chat prompt: {DEFAULT_PROMPT!r}", True),
        arrival=ArrivalProcess("batch-1 sequential", 1),
        engine=EngineCondition("native eager vs native compiled step (torch.compile, inductor C++, frozen weights)",
                               {"threads": torch.get_num_threads(), "attention": "sdpa", "torch": torch.__version__,
                                "compiled": "one-token step over the whole static KV cache; prefill eager"},
                               warmup="one 8-token generation per engine after the compiled step's first two calls, "
                                      "excluded",
                               cache_warmth="KV cache reset per request; weights resident in RAM; inductor's on-disk "
                                            "caches as this machine had them"),
        metric=MetricCondition(
            {"eager_tok_s / compiled_tok_s": "median over interleaved repeats of (new_tokens-1)/decode seconds, "
                                             "prefill excluded",
             "first_call_s": "wall time of the compiled step's first call (trace + inductor compile + one step)",
             "second_call_s": "wall time of its second call",
             "load_average_1min": "os.getloadavg()[0] after the row (2-core machine shared with other jobs)"},
            "greedy, ignore_eos, fixed output length; compiled tokens compared with eager (equal required in fp32, "
            "reported in bf16)"),
        results={"load_average_before_1_5_15": load_before, "target_compiled_over_eager": TARGET, "rows": rows},
    )


def print_compiled(record: RunRecord) -> None:
    table = Table(title=f"batch-1 greedy decode, eager vs compiled step, {record.lengths.output_tokens['fixed']} new "
                        f"tokens, {record.engine.config['threads']} threads, {record.hardware['cpu']} "
                        f"({record.hardware['isa']}), target compiled >= {TARGET}x eager")
    for col in ("dtype", "mode", "eager tok/s", "compiled tok/s", "compiled / eager", "first call s", "second call s",
                "tokens equal", "load 1m"):
        table.add_column(col, justify="right")
    for r in record.results["rows"]:
        table.add_row(r["dtype"], r["mode"], f"{r['eager_tok_s']:.1f}", f"{r['compiled_tok_s']:.1f}",
                      f"{r['compiled_over_eager']:.2f}x", f"{r['first_call_s']:.1f}",
                      f"{r['second_call_s']:.3f}", str(r["greedy_tokens_equal"]), f"{r['load_average_1min']:.1f}")
    Console(width=150).print(table)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--device", default="auto", help="cpu, cuda, or auto (cuda when torch sees a GPU); "
                                                        "the native-vs-HF comparison only")
    parser.add_argument("--new-tokens", type=positive_int, default=128)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--compile", action="store_true", help="eager vs compiled step, fp32 and bf16")
    parser.add_argument("--modes", default=",".join(MODES), help="compile modes for --compile")
    parser.add_argument("--threads", type=positive_int, default=None)
    args = parser.parse_args()
    set_threads(args.threads)
    if args.compile:
        record = compiled_record(args.model, args.modes.split(","), args.new_tokens, args.repeats)
        print_compiled(record)
        name = f"decode_compiled.{probe().tag}.t{torch.get_num_threads()}.json"
    else:
        device = resolve_device(args.device)
        record = compare_decode(args.model, args.dtype, args.new_tokens, args.repeats, device=device)
        print_decode_comparison(record)
        name = f"decode-{args.dtype}.{probe().tag}{'-cuda' if device.type == 'cuda' else ''}.json"
    out = record.write(Path(__file__).parent / "results" / name)
    print(f"wrote {out}")
