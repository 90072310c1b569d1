"""Native vs vLLM effective tok/s on the default model: bf16, W8A8, W4A16-g32 and bf16 + ngram K=4, at batch 1
(C=1) and concurrency 16, side by side in one run. Each (backend, configuration) runs in its own process (clean
peak-memory numbers, one engine serving both load levels); the parent prints the table and the ngram speedup
over bf16 of the same backend at the same load.

Usage: flock /tmp/qs-bench.lock flock /tmp/qs-vllm.lock python bench/backends.py [--num-prompts 6] [--output-len 32]
Writes bench/results/backends.json (every run record + the table).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from runtime.argtypes import positive_int


CONFIGS = {  # name -> Config.parse strings
    "bf16": {},
    "W8A8": {"scheme": "W8A8"},
    "W4A16-g32": {"scheme": "w4g32-sym"},
    "bf16+ngram K=4": {"spec": "ngram:min=2,max=4", "k": 4},
}
BACKENDS = ("native", "vllm")
LOADS = (1, 16)
WORKLOAD = "spec_bench"


def run_one(backend: str, name: str, num_prompts: int, output_len: int, out: str) -> None:
    """One engine for ``name`` on ``backend`` serving every load level (at least C prompts at concurrency C)."""
    from serving.backends import open_backend
    from serving.backends.base import ServingConfig
    from serving.bench_api import run_benchmark
    from evals.config import Config
    from serving.loadgen import LoadSpec

    config = ServingConfig(Config.parse(backend=backend, **CONFIGS[name]), max_model_len=1024)
    records = []
    with open_backend(config) as engine:
        for c in LOADS:
            run = run_benchmark(config, WORKLOAD, LoadSpec.closed(c), backend=engine, num_prompts=max(num_prompts, c),
                                output_len=output_len)
            run.record.results["load_avg_1m_after"] = os.getloadavg()[0]
            records.append(run.record.to_dict())
    Path(out).write_text(json.dumps(records, default=str))


def main(args) -> None:
    records, failures = [], []
    for backend in BACKENDS:
        for name in CONFIGS:
            with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
                cmd = [sys.executable, __file__, "--one", backend, name, "--num-prompts", str(args.num_prompts),
                       "--output-len", str(args.output_len), "--out", tmp.name]
                print(f"--- {backend} {name}", flush=True)
                proc = subprocess.run(cmd, stdout=subprocess.DEVNULL)
                runs = json.loads(Path(tmp.name).read_text() or "[]") if proc.returncode == 0 else []
            if proc.returncode != 0:
                failures.append({"backend": backend, "config": name, "failed": f"exit {proc.returncode}"})
            records += [dict(rec, bench_config=name) for rec in runs]
            rows = table_rows(records) + failures
            write(args, rows, records)  # after every configuration: a cut-short run keeps what it measured
    print_table(rows)


def table_rows(records: list[dict]) -> list[dict]:
    rows = []
    for rec in records:
        res, spec = rec["results"], rec["results"].get("spec") or {}
        rows.append({"backend": rec["engine"]["backend"], "config": rec["bench_config"],
                     "concurrency": rec["arrival"]["concurrency"], "effective_tok_s": res.get("effective_tok_s"),
                     "alpha": spec.get("alpha"), "tau": spec.get("tau"), "tpot_p50_ms": 1e3 * res["tpot_s"]["p50"],
                     "ttft_p50_ms": 1e3 * res["ttft_s"]["p50"], "peak_rss_mib": res["peak_rss_mib"],
                     "n_prompts": rec["lengths"]["n_requests"], "load_avg_1m": res.get("load_avg_1m_after")})
    tok_s = {(r["backend"], r["config"], r["concurrency"]): r["effective_tok_s"] for r in rows}
    for r in rows:
        base = tok_s.get((r["backend"], "bf16", r["concurrency"]))
        native = tok_s.get(("native", r["config"], r["concurrency"]))
        r["vs_bf16_same_backend"] = r["effective_tok_s"] / base if base else None
        r["vllm_over_native"] = r["effective_tok_s"] / native if r["backend"] == "vllm" and native else None
    return rows


def write(args, rows: list[dict], records: list[dict]) -> None:
    from evals.record import write_json_atomic

    out = Path(__file__).parent / "results" / "backends.json"
    write_json_atomic(out, {"workload": WORKLOAD, "num_prompts": args.num_prompts, "output_len": args.output_len,
                            "load_avg_1m_end": os.getloadavg()[0], "table": rows, "runs": records})
    print(f"wrote {out}", flush=True)


def print_table(rows) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="effective output tok/s, default model, spec_bench prompts, greedy, fixed output length")
    for col in ("config", "C", "native tok/s", "vLLM tok/s", "vLLM/native", "native vs bf16", "vLLM vs bf16",
                "α native/vLLM"):
        table.add_column(col, justify="right")
    for name in CONFIGS:
        for c in LOADS:
            n = next((r for r in rows if r["backend"] == "native" and r["config"] == name and r.get("concurrency") == c), {})
            v = next((r for r in rows if r["backend"] == "vllm" and r["config"] == name and r.get("concurrency") == c), {})
            fmt = lambda x, p="{:.1f}": p.format(x) if x is not None else "-"  # noqa: E731
            table.add_row(name, str(c), fmt(n.get("effective_tok_s")), fmt(v.get("effective_tok_s")),
                          fmt(v.get("vllm_over_native"), "{:.2f}x"), fmt(n.get("vs_bf16_same_backend"), "{:.2f}x"),
                          fmt(v.get("vs_bf16_same_backend"), "{:.2f}x"),
                          f"{fmt(n.get('alpha'), '{:.2f}')}/{fmt(v.get('alpha'), '{:.2f}')}")
    Console(width=160).print(table)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=positive_int, default=6, help="prompts per run (at least C at concurrency C)")
    parser.add_argument("--output-len", type=positive_int, default=32)
    parser.add_argument("--one", nargs=2, metavar=("BACKEND", "CONFIG"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        run_one(*args.one, args.num_prompts, args.output_len, args.out)
    else:
        main(args)
