"""Native speculative decoding on the default model: acceptance, speedup and predictions vs K.

Usage: flock /tmp/qs-bench.lock .venv/bin/python bench/spec_sweep.py [--per-category 1] [--max-new-tokens 96]
       [--ks 1,2,3,4,5,6,7,8] [--proposer ngram:min=2,max=4 --proposer selfquant:w4g32-asym] [--temperatures 0,1]
Prompts: the first question of each of Spec-Bench's six tasks (MT-bench, translation, summarization, QA,
math reasoning, RAG) from the data dir. Batch 1, fixed output length (ignore_eos), per prompt plain decoding
and every K interleaved. Writes bench/results/specdec.json (a RunRecord with one sweep per proposer x T).
--compile MODE: plain and speculative decoding through compiled steps (runtime/compiled.py; the reference stays
eager), so a run with and one without it (each with its own --out) compare compiled and eager speculation.
"""
import argparse
import copy
import os
import sys
from pathlib import Path


import torch  # noqa: E402

from runtime.compiled import MODES
from runtime.data import PROMPT_FILES, data_file, read_jsonl
from evals.record import RunRecord
from runtime.loading import load_model
from specdec.proposers import build_proposer
from runtime.sampling import SamplingConfig
import quantspec
from quantspec.report import print_sweep
from specdec.sweep import parse_ks
from runtime.argtypes import positive_int

SPEC_BENCH_TASKS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")


def spec_bench_prompts(per_category: int, data_dir=None, tasks=SPEC_BENCH_TASKS) -> list[str]:
    """The first ``per_category`` questions of each Spec-Bench task (its 80 MT-bench rows form one task)."""
    rows = read_jsonl(data_file(PROMPT_FILES["spec_bench"], data_dir))
    picked = {task: [] for task in SPEC_BENCH_TASKS}
    for row in rows:
        task = row["category"] if row["category"] in picked else "mt_bench"
        if len(picked[task]) < per_category:
            picked[task].append(row["turns"][0])
    return [text for task in tasks for text in picked[task]]


def combine(records: list[RunRecord]) -> RunRecord:
    """One record for all sweeps: shared conditions from the first, every sweep's config and results."""
    combined = copy.deepcopy(records[0])
    combined.name = "specdec-bench"
    combined.engine.config = {"dtype": records[0].engine.config["dtype"], "threads": torch.get_num_threads(),
                              "sweeps": [r.engine.config for r in records]}
    combined.results = {"sweeps": [{**r.engine.config, **r.results} for r in records]}
    return combined


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--threads", type=positive_int, default=None)
    parser.add_argument("--per-category", type=positive_int, default=1)
    parser.add_argument("--tasks", default=",".join(SPEC_BENCH_TASKS), help="Spec-Bench tasks to draw prompts from.")
    parser.add_argument("--max-new-tokens", type=positive_int, default=96)
    parser.add_argument("--ks", default="1,2,3,4,5,6,7,8")
    parser.add_argument("--proposer", action="append", default=None)
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--reference-attention", default="sdpa",
                        help="Also time plain decoding with this attention (the faster, not batch-invariant one); "
                             "'' to skip. Speculation always runs the batch-invariant 'eager'.")
    parser.add_argument("--natural-eos", action="store_true",
                        help="Stop at the end of turn (Spec-Bench's protocol) instead of a fixed output length.")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--compile", choices=MODES, default=None, help="Compile mode of the decode steps.")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "specdec.json"))
    args = parser.parse_args()
    lm = load_model(args.model, args.dtype, args.threads, "eager")
    reference = load_model(args.model, args.dtype, args.threads, args.reference_attention) \
        if args.reference_attention else None
    tasks = tuple(args.tasks.split(","))
    if set(tasks) - set(SPEC_BENCH_TASKS):
        parser.error(f"--tasks: pick from {','.join(SPEC_BENCH_TASKS)}")
    texts = spec_bench_prompts(args.per_category, args.data_dir, tasks)
    records = []
    for spec in args.proposer or ["ngram:min=2,max=4", "selfquant:w4g32-asym"]:
        proposer = build_proposer(spec, lm)
        for temperature in (float(t) for t in args.temperatures.split(",")):
            try:
                record = quantspec.measure_acceptance(lm, args.model, proposer, parse_ks(args.ks), texts,
                                                      f"spec_bench: first {args.per_category} of each task {tasks}",
                                                      args.max_new_tokens, SamplingConfig(temperature, seed=0),
                                                      reference, ignore_eos=not args.natural_eos,
                                                      compile_mode=args.compile)
            except quantspec.UserError as exc:  # e.g. compiled verification rows not bitwise the decode step's
                print(f"error: {spec} at T={temperature}: {exc}", file=sys.stderr)
                sys.exit(2)
            record.results["load_average_after"] = os.getloadavg()
            print_sweep(record)
            records.append(record)
            combine(records).write(args.out)  # after every sweep, so a long run keeps what it measured
    print(f"wrote {args.out}")
