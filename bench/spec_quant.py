"""Quantization x speculation coupling: how a learned EAGLE head's acceptance and speedup change with the target's
weight precision and the head's own.

Usage: flock /tmp/qs-bench.lock .venv/bin/python bench/spec_quant.py --head-dir /tmp/quantspec-eagle-head
       [--per-category 2] [--max-new-tokens 256] [--ks 2,3,4,5] [--targets none,W8A8,w8ch-sym,w4g32-asym]
       [--heads none,w8ch-sym] [--note TEXT]
Conditions: target weights none (bf16) / W8A8 (int8 per-channel weights x dynamic per-token int8 activations) /
w8ch-sym / w4g32-asym, all RTN (``evals.build.build_native``), times the head bf16 / int8 (``eagle:DIR,weights=
w8ch-sym``: weight-only int8 per channel of the head's linears, RTN through quant/ kernels). The head was trained
on the bf16 target's hidden states; quantizing the target moves those states, which is the erosion measured here.
Per condition: ``quantspec.measure_acceptance`` (acceptance per position, alpha, beta, tau, measured speedup vs
plain decoding of the *same quantized target*, beside Leviathan's and the refined prediction), greedy, fixed
output length (ignore_eos), the first --per-category questions of each Spec-Bench task (bench/spec_sweep.py's
choice), batch 1, eager attention. Each sweep times its own plain baseline, so the two baselines of one target
show the timing noise. Writes bench/results/spec_quant.json (one run record, the six conditions; rewritten after
every condition, so an interrupted run keeps what it measured).

Default model caveat: its body weights were Q4_1-dequantized from a GGUF (a 4-bit group-32 grid with a free
float offset per block), so re-quantizing it to int4-g32-asym (integer zero point) is **not** near-lossless,
and its w4g32-asym rows need not transfer to natively trained checkpoints.
"""
import argparse
import copy
import gc
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import quantspec  # noqa: E402
from evals.acceptance import METRICS  # noqa: E402
from evals.build import build_native  # noqa: E402
from evals.record import RunRecord  # noqa: E402
from quantspec.report import print_sweep  # noqa: E402
from runtime.errors import UserError  # noqa: E402
from runtime.hardware import kernels_used  # noqa: E402
from runtime.sampling import SamplingConfig  # noqa: E402
from spec_sweep import SPEC_BENCH_TASKS, spec_bench_prompts  # noqa: E402
from specdec.proposers.base import check_proposer_spec  # noqa: E402
from specdec.sweep import parse_ks  # noqa: E402
from runtime.argtypes import positive_int

TARGETS = "none,W8A8,w8ch-sym,w4g32-asym"
HEADS = "none,w8ch-sym"


def head_spec(head_dir: str, head: str) -> str:
    return f"eagle:{head_dir}" if head == "none" else f"eagle:{head_dir},weights={head}"


def head_provenance(head_dir: str) -> dict:
    """What the head directory says about its training (config.json's quantspec_eagle; train_result.json's budget
    and time split when bench/train_draft.py trained it)."""
    out = {"config": json.loads((Path(head_dir) / "config.json").read_text()).get("quantspec_eagle", {})}
    side = Path(head_dir) / "train_result.json"
    if side.exists():
        t = json.loads(side.read_text())
        out["training"] = {k: t.get(k) for k in ("budget", "wall_s", "extract_s", "train_s", "eval_s", "steps",
                                                 "n_sequences", "n_train_tokens", "epochs")}
    return out


def scheme_of(built, dtype: str) -> str:
    return built.report.scheme.label if built.report else f"none ({dtype})"


def condition(target: str, head: str, built, record: RunRecord, dtype: str) -> dict:
    r = record.results
    return {"target": target, "target_scheme": scheme_of(built, dtype), "head": head, "proposer": r["proposer"],
            "target_kernels": kernels_used(built.lm.model), "baseline": r["baseline"], "rows": r["rows"],
            "best_k_measured": r["best_k_measured"], "best_k_theory": r["best_k_theory"],
            "verify_cost_curve": r["verify_cost_curve"], "load_average_after": os.getloadavg()}


def combine(first: RunRecord, conditions: list[dict], args, head: dict) -> RunRecord:
    """One record for the table: shared conditions from the first sweep's record, the per-condition precision
    and kernels in engine.config, every condition's sweep in results."""
    rec = copy.deepcopy(first)
    rec.name = "spec-quant"
    rec.model.precision = f"{args.dtype} activations and unquantized layers; target weights per condition"
    rec.model.scheme = "per condition: " + ", ".join(args.targets.split(","))
    rec.engine.config = {"dtype": args.dtype, "attention": "eager", "threads": torch.get_num_threads(),
                         "ks": parse_ks(args.ks), "head_dir": args.head_dir, "sampling": "greedy",
                         "conditions": [{k: c[k] for k in ("target", "target_scheme", "head", "proposer",
                                                           "target_kernels", "refused") if k in c} for c in conditions]}
    rec.metric.metrics = {**METRICS, "speedup": "speculative tok/s / plain tok/s of the same quantized target"}
    rec.metric.correctness = ("greedy: every speculative output token-identical to plain greedy decoding of the "
                              "same quantized target (greedy_equal); ignore_eos, fixed output length")
    rec.results = {"conditions": conditions, "head": head, "notes": args.note or "", "per_category": args.per_category}
    return rec


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dir", required=True, help="EAGLE head trained for --model (quantspec train-draft).")
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--threads", type=positive_int, default=None)
    parser.add_argument("--per-category", type=positive_int, default=2)
    parser.add_argument("--tasks", default=",".join(SPEC_BENCH_TASKS), help="Spec-Bench tasks to draw prompts from.")
    parser.add_argument("--max-new-tokens", type=positive_int, default=256)
    parser.add_argument("--ks", default="2,3,4,5")
    parser.add_argument("--targets", default=TARGETS, help="Target weight schemes (none = unquantized).")
    parser.add_argument("--heads", default=HEADS, help="Head weight schemes (none = the target's dtype).")
    parser.add_argument("--note", default=None, help="Stored in the record, e.g. how the head was trained.")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "spec_quant.json"))
    args = parser.parse_args()
    tasks = tuple(args.tasks.split(","))
    if set(tasks) - set(SPEC_BENCH_TASKS):
        parser.error(f"--tasks: pick from {','.join(SPEC_BENCH_TASKS)}")
    try:  # a missing or mismatched head (or head scheme) stops here, in one line
        for head_weights in args.heads.split(","):
            check_proposer_spec(head_spec(args.head_dir, head_weights), args.model)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    texts = spec_bench_prompts(args.per_category, args.data_dir, tasks)
    head = head_provenance(args.head_dir)
    first, conditions = None, []
    for target in args.targets.split(","):
        built = build_native(quantspec.Config.parse(target, model=args.model, dtype=args.dtype, method="rtn",
                                                    attention="eager"), args.threads)
        for head_weights in args.heads.split(","):
            spec = head_spec(args.head_dir, head_weights)
            head_label = args.dtype if head_weights == "none" else head_weights
            try:
                record = quantspec.measure_acceptance(
                    built.lm, args.model, spec, parse_ks(args.ks), texts,
                    f"spec_bench: first {args.per_category} of each task {tasks}", args.max_new_tokens,
                    SamplingConfig(0.0), ignore_eos=True)
            except UserError as exc:  # e.g. bf16 speculation refused for a kernel that is not batch-invariant
                print(f"{target} x head {head_weights}: refused: {exc}", flush=True)
                conditions.append({"target": target, "target_scheme": scheme_of(built, args.dtype),
                                   "head": head_label, "proposer": spec, "refused": str(exc)})
                continue
            record.model.precision = f"target {scheme_of(built, args.dtype)}, head {head_label}"
            print_sweep(record)
            first = first or record
            conditions.append(condition(target, head_label, built, record, args.dtype))
            combine(first, conditions, args, head).write(args.out)
        del built
        gc.collect()
    if first is None:
        sys.exit("no condition ran: see the refusals above")
    print("target       head      best K  alpha  tau   acc. per pos.        speedup  refined  =greedy")
    for c in conditions:
        if "refused" in c:
            print(f"{c['target']:<12} {c['head']:<9} refused: {c['refused']}")
            continue
        r = max(c["rows"], key=lambda row: row["speedup"])
        print(f"{c['target']:<12} {c['head']:<9} {r['k']:>6}  {r['alpha']:.2f}  {r['tau']:.2f}  "
              f"{' '.join(f'{a:.2f}' for a in r['acceptance_per_pos']):<20} {r['speedup']:>6.2f}x  "
              f"{r['refined_speedup']:>6.2f}x  {r['greedy_equal']}/{len(texts)}")
    print(f"wrote {args.out}")
