"""What the calibrated-quantization store (quant/store.py) saves a second process: GPTQ / AWQ on the default model,
quantized in a fresh process with an empty store (it calibrates and writes the entry), then in another fresh process
(it reads the entry), each followed by the same greedy decode, whose tokens must be equal.

Usage: flock /tmp/qs-bench.lock python bench/quant_store.py [--points w4g32-sym:gptq,w4g32-asym:awq]
Writes bench/results/quant_store.json (a run record). Prints the side-by-side seconds and their ratio.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

PROMPT = "Explain how a bicycle works."
NEW_TOKENS = 32


def child(scheme: str, method: str) -> None:
    """One process: load bf16, quantize (timed), decode greedily; one JSON line."""
    import time

    from quant.quantize import quantize_fresh
    from runtime.generate import Decoder, encode_prompt
    from runtime.loading import load_model
    from runtime.model_store import resolve_model

    lm = load_model(resolve_model("default"), "bf16")
    t = time.perf_counter()
    report = quantize_fresh(lm, scheme, method, progress=False)
    seconds = time.perf_counter() - t
    tokens = Decoder(lm, 256).generate(encode_prompt(lm.tokenizer, PROMPT), NEW_TOKENS).tokens
    print(json.dumps({"seconds": seconds, "stored": report.stored, "kernels": report.kernels,
                      "calibration": report.calibration, "tokens": tokens}))


def run_child(scheme: str, method: str, store: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", f"{scheme}:{method}"], check=True, text=True,
                         capture_output=True, env={**os.environ, "QUANTSPEC_QUANT_STORE": store})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(args) -> None:
    from rich.console import Console
    from rich.table import Table

    from evals.record import (ArrivalProcess, EngineCondition, LengthDistribution, MetricCondition, ModelCondition,
                              RunRecord, hardware_info)
    from runtime.model_store import SMOLLM2, resolve_model, weights_hash

    rows = []
    table = Table(title="calibrated quantization: first process (calibrates) vs second (reads the store)")
    for col in ("point", "calibration", "first s", "second s", "first / second", "entry MB", "tokens equal"):
        table.add_column(col)
    for point in args.points.split(","):
        scheme, method = point.split(":")
        with tempfile.TemporaryDirectory(prefix="qs-quant-store-") as store:
            first, second = run_child(scheme, method, store), run_child(scheme, method, store)
            size = sum(f.stat().st_size for f in Path(store).rglob("*") if f.is_file())
        assert first["stored"] is None and second["stored"], (first["stored"], second["stored"])
        rows.append({"scheme": scheme, "method": method, "calibration": first["calibration"],
                     "first_s": first["seconds"], "second_s": second["seconds"],
                     "ratio": first["seconds"] / second["seconds"], "entry_bytes": size,
                     "kernels": second["kernels"], "tokens_equal": first["tokens"] == second["tokens"]})
        r = rows[-1]
        table.add_row(point, r["calibration"], f"{r['first_s']:.1f}", f"{r['second_s']:.1f}", f"{r['ratio']:.0f}x",
                      f"{size / 1e6:.0f}", str(r["tokens_equal"]))
    Console(width=160).print(table)
    record = RunRecord(
        name="quant-store",
        model=ModelCondition("default", weights_hash(resolve_model("default")), "bf16 runtime",
                             ", ".join(args.points.split(",")), SMOLLM2.note),
        hardware=hardware_info(),
        lengths=LengthDistribution(1, {"source": PROMPT}, {"fixed": NEW_TOKENS}, "one chat prompt (token check only)",
                                   True),
        arrival=ArrivalProcess("one process after another", 1),
        engine=EngineCondition("native (quant.quantize.quantize_fresh in a fresh process)",
                               {"points": args.points, "calibration": "default (wikitext2 128 x 512)"},
                               warmup="none: each process is new (model load excluded from the timing)",
                               cache_warmth="first process: empty store; second: the entry the first wrote"),
        metric=MetricCondition({"first_s / second_s": "wall seconds of quantize_fresh (calibration, method, kernels "
                                                      "/ reading the entry, kernels)",
                                "entry_bytes": "the store's size on disk after both"},
                               f"greedy tokens of both processes equal over {NEW_TOKENS} new tokens"),
        results={"rows": rows},
    )
    print(f"wrote {record.write(Path(__file__).parent / 'results' / 'quant_store.json')}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", default="w4g32-sym:gptq,w4g32-asym:awq", help="scheme:method,...")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child.split(":"))
    else:
        main(args)
