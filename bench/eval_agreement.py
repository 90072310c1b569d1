"""Native lm-eval backend vs lm-eval's stock ``hf`` backend on the default model (fp32), side by side.

Same tasks (local YAMLs over the data dir), same documents, same prompts; the check is that every task's
accuracy agrees within one stderr, plus how many items the two backends answer differently. Published
SmolLM2-135M-Instruct numbers are listed for context (see the README for why they differ).

    flock /tmp/qs-bench.lock .venv/bin/python bench/eval_agreement.py --limit 500
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path


from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from runtime.data import find_data_dir  # noqa: E402
from evals.harness import run_lm_eval, task_manager  # noqa: E402
from evals.record import (ArrivalProcess, EngineCondition, LengthDistribution, MetricCondition, ModelCondition,  # noqa: E402
                          RunRecord, hardware_info)
from runtime.model_store import SMOLLM2, resolve_model, weights_hash  # noqa: E402
from runtime.argtypes import positive_int

# SmolLM2-135M-Instruct model card (lighteval, zero-shot, HF bf16 weights, not the Q4_1 GGUF used here).
PUBLISHED = {"hellaswag": 40.9, "arc_avg": 37.3, "piqa": 66.3}


def run_backend(name: str, tasks: list[str], limit: int, data_dir: str | None, hf_batch_size: int) -> tuple:
    """One backend on some tasks in its own process with one torch thread (all pairs run side by side)."""
    import torch
    from lm_eval.models.huggingface import HFLM

    from evals.lm_native import NativeLM

    torch.set_num_threads(1)
    path = str(resolve_model("default"))
    make = {"native": lambda: NativeLM(pretrained=path, dtype="fp32"),
            "hf": lambda: HFLM(pretrained=path, device="cpu", dtype="float32", batch_size=hf_batch_size)}[name]
    manager = task_manager(tuple(tasks), find_data_dir(data_dir), ())
    t0, c0 = time.perf_counter(), time.process_time()
    res = run_lm_eval(make(), tasks, manager, limit)
    timing = {"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0}
    rows = {t: {k: v for k, v in res["results"][t].items() if k != "alias"} for t in tasks}
    items = {t: {s["doc_id"]: s["acc"] for s in res["samples"][t]} for t in tasks}
    return rows, items, timing


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default="arc_easy,piqa,hellaswag")
    ap.add_argument("--limit", type=positive_int, default=500)
    ap.add_argument("--hf-batch-size", type=positive_int, default=8)
    ap.add_argument("--workers", type=positive_int, default=2, help="(backend, task) pairs scored at once, 1 thread each.")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--out", default="bench/results/eval_agreement.json")
    ap.add_argument("--merge", action="store_true", help="Keep other tasks already in --out (same limit).")
    args = ap.parse_args()
    tasks = args.tasks.split(",")
    rows, items, seconds = {"native": {}, "hf": {}}, {"native": {}, "hf": {}}, {}
    jobs = [(name, task) for task in tasks for name in ("native", "hf")]
    with ProcessPoolExecutor(min(args.workers, len(jobs)), mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {job: pool.submit(run_backend, job[0], [job[1]], args.limit, args.data_dir, args.hf_batch_size)
                   for job in jobs}
        for (name, task), future in futures.items():
            row, item, seconds[f"{name}/{task}"] = future.result()
            rows[name].update(row)
            items[name].update(item)
            print(f"{name} {task}: {seconds[f'{name}/{task}']}", flush=True)

    results = {"limit": args.limit, "tasks": {}, "seconds": seconds, "published": PUBLISHED}
    previous = Path(args.out)
    if args.merge and previous.exists():  # add these tasks to an earlier run at the same limit
        old = json.loads(previous.read_text())["results"]
        if old.get("limit") == args.limit:
            results["tasks"], results["seconds"] = old["tasks"], {**old["seconds"], **results["seconds"]}
    table = Table(title=f"default model fp32, lm-eval 0-shot, first {args.limit} docs per task")
    for col in ("task", "native acc %", "hf acc %", "|Δ| pts", "stderr pts", "within 1 se", "items differing",
                "native acc_norm %", "hf acc_norm %"):
        table.add_column(col, justify="right")
    for t in tasks:
        nat, hf = rows["native"][t], rows["hf"][t]
        delta = abs(nat["acc,none"] - hf["acc,none"])
        se = max(nat["acc_stderr,none"], hf["acc_stderr,none"])
        differ = sum(items["native"][t][d] != items["hf"][t][d] for d in items["native"][t])
        results["tasks"][t] = {"native": nat, "hf": hf, "abs_delta": delta, "stderr": se, "within_1se": delta <= se,
                               "items_differing": differ, "n": len(items["native"][t])}
        table.add_row(t, f"{100 * nat['acc,none']:.1f}", f"{100 * hf['acc,none']:.1f}", f"{100 * delta:.2f}",
                      f"{100 * se:.2f}", str(delta <= se), f"{differ}/{len(items['native'][t])}",
                      f"{100 * nat['acc_norm,none']:.1f}", f"{100 * hf['acc_norm,none']:.1f}")
    console = Console()
    console.print(table)
    console.print(f"time (1 torch thread per job, {args.workers} jobs at once): {seconds}; published (lighteval): {PUBLISHED}")
    record = RunRecord(
        name="eval agreement: native vs lm-eval hf backend",
        model=ModelCondition(SMOLLM2.name, weights_hash(resolve_model("default")), "fp32", note=SMOLLM2.note),
        hardware=hardware_info(),
        lengths=LengthDistribution(sum(r["n"] for r in results["tasks"].values()), {"tasks": list(results["tasks"])},
                                   {"scored": "loglikelihood of each choice"}, f"local lm-eval tasks, limit {args.limit}",
                                   True),
        arrival=ArrivalProcess(kind="offline scoring"),
        engine=EngineCondition("native vs hf", {"native": "batch 1, shared-prefix KV reuse",
                                                "hf": f"HFLM batch_size {args.hf_batch_size}",
                                                "threads": f"1 torch thread per (backend, task), {args.workers} at once"},
                               warmup="none (accuracy)", cache_warmth="n/a"),
        metric=MetricCondition({"acc": "lm-eval acc", "within_1se": "|acc_native - acc_hf| <= max stderr",
                                "items_differing": "documents whose acc differs between backends"},
                               correctness="accuracy agrees within one stderr on every task"),
        results=results,
    )
    record.write(args.out)
    console.print(f"run record: {args.out}")


if __name__ == "__main__":
    main()
