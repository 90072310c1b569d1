"""What tree drafting could give an EAGLE head, before building it: top-w acceptance on Spec-Bench per tree level
and the speedup each tree shape predicts.

The target's greedy answers to the Spec-Bench prompts of bench/train_draft.py (fixed length), teacher-forced. A
draft that starts after position i is accepted to depth 1 when token i+2 is among the head's top w1 draft tokens,
to depth 2 when also token i+3 is among the top w2 of the head's second chain step on that branch (its own state,
``EagleHead.unroll``). Greedy verification accepts exactly these, so the top-1 widths are chain drafting and are
checked against the chain record's measured per-position acceptance. A full tree of widths (w1, w2) verifies
1 + w1 + w1*w2 rows; its prediction is tau / (V(rows - 1) + levels x c): V from ``verify_cost_curve`` at the run's
contexts (a causal forward over as many rows: a tree mask changes which keys a row reads, not the matmuls), c the
head's measured one-row step from its chain record, taken as the cost of one tree level of any width (a lower
bound). A prediction, not a measured speedup: no tree decoder exists yet.

Usage: flock /tmp/qs-bench.lock .venv/bin/python bench/eagle_tree_bound.py --head-dir DIR --chain-record JSON
Writes bench/results/eagle_tree_bound.json (a RunRecord).
"""
import argparse
import json
import sys
from itertools import product
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from rich.progress import track  # noqa: E402

from evals.record import (ArrivalProcess, EngineCondition, LengthDistribution, MetricCondition,  # noqa: E402
                          ModelCondition, RunRecord, hardware_info)
from runtime.errors import UserError  # noqa: E402
from runtime.generate import Decoder, encode_prompt  # noqa: E402
from runtime.loading import load_model  # noqa: E402
from runtime.model_store import SMOLLM2, is_default_model, weights_hash  # noqa: E402
from runtime.sampling import SamplingConfig  # noqa: E402
from specdec.eagle_head import load_head  # noqa: E402
from specdec.proposers.base import check_proposer_spec  # noqa: E402
from specdec.sweep import run_contexts, verify_cost_curve  # noqa: E402
from specdec.train_draft import extract_features  # noqa: E402
from spec_sweep import SPEC_BENCH_TASKS, spec_bench_prompts  # noqa: E402
from runtime.argtypes import positive_int


@torch.inference_mode()
def top_w_hits(head, embed, w_draft, draft_ids, ids, hidden, start, width):
    """(hits1 [n, width], hits2 [n, width]) for chains starting at positions start..: whether the target's token at
    depth d is within the head's top w (cumulative over w) at its chain step d."""
    preds = head.unroll(embed(ids[1:][None]), hidden[:-1].float()[None], 2)
    top = [draft_ids[(p[0] @ w_draft.T).topk(width, -1).indices] for p in preds]  # [T-1, width] target ids
    n = len(ids) - 3 - start  # chains whose depth-2 token exists
    i = torch.arange(start, start + n)
    hit1 = (top[0][i] == ids[i + 2, None]).cumsum(-1).bool()
    hit2 = (top[1][i + 1] == ids[i + 3, None]).cumsum(-1).bool()
    return hit1, hit2


def draft_tables(model, d2t):
    """(embedding, draft-vocabulary target ids, their LM-head rows), fp32: what the head drafts with."""
    embed = torch.nn.Embedding.from_pretrained(model.embed_tokens.weight.detach().float(), freeze=True)
    draft_ids = d2t if d2t is not None else torch.arange(model.args.vocab_size)
    return embed, draft_ids, model.lm_head.weight.detach().float()[draft_ids]


def tree_rows(shape) -> int:
    """Verification rows of a full tree: the root, w1 children, w1 x w2 grandchildren."""
    return 1 + shape[0] + (shape[0] * shape[1] if len(shape) == 2 else 0)


def tree_shapes(widths, max_rows):
    """(w1,) and (w1, w2) full trees with at most ``max_rows`` verification rows."""
    shapes = [(w,) for w in widths] + [s for s in product(widths, widths) if tree_rows(s) <= max_rows]
    return sorted(shapes, key=lambda s: (len(s), s))


def main(args) -> RunRecord:
    lm = load_model(args.model, "bf16", args.threads, "eager")
    head, d2t, _ = load_head(args.head_dir, lm.config, torch.float32)
    chain = json.loads(Path(args.chain_record).read_text())["results"]
    row2 = next(r for r in chain["rows"] if r["k"] == 2)
    embed, draft_ids, w_draft = draft_tables(lm.model, d2t)
    prompts = [encode_prompt(lm.tokenizer, t) for t in spec_bench_prompts(args.per_category, args.data_dir, args.tasks)]
    max_len = max(map(len, prompts)) + args.max_new_tokens + args.max_rows  # V times up to max_rows after a context
    decoder = Decoder(lm, max_len)
    base = [decoder.generate(p, args.max_new_tokens, SamplingConfig(0.0), ignore_eos=True)
            for p in track(prompts, description="target greedy answers")]
    seqs = [p + r.tokens for p, r in zip(prompts, base)]
    features = extract_features(lm, seqs, fuse_layers=head.fuse_layers)
    width = max(args.widths)
    hits = [top_w_hits(head, embed, w_draft, draft_ids, ids, h, len(p) - 1, width)
            for (ids, h), p in zip(track(features, description="head top-w"), prompts)]
    hit1, hit2 = torch.cat([h for h, _ in hits]), torch.cat([h for _, h in hits])
    depth1 = {w: float(hit1[:, w - 1].float().mean()) for w in args.widths}
    depth2 = {(w1, w2): float((hit1[:, w1 - 1] & hit2[:, w2 - 1]).float().mean())
              for w1, w2 in product(args.widths, args.widths)}
    shapes = tree_shapes(args.widths, args.max_rows)
    curve = verify_cost_curve(Decoder(lm, max_len), run_contexts(prompts, base), max(map(tree_rows, shapes)) - 1)
    c = row2["c"]
    rows = []
    for s in shapes:
        n_rows = tree_rows(s)
        tau = 1 + depth1[s[0]] + (depth2[s] if len(s) == 2 else 0.0)
        cost = curve[n_rows - 1] + len(s) * c
        rows.append({"widths": list(s), "rows": n_rows, "tau": tau, "verify_cost": curve[n_rows - 1],
                     "predicted_speedup": tau / cost})
    chain_check = {"teacher_forced": [depth1[1], depth2[(1, 1)]], "measured_k2": row2["acceptance_per_pos"],
                   "measured_speedup_k2": row2["speedup"], "c": c}
    lengths = [len(p) for p in prompts]
    return RunRecord(
        name="eagle-tree-bound",
        model=ModelCondition(args.model, weights_hash(lm.path), "bf16",
                             note=SMOLLM2.note if is_default_model(lm.path) else ""),
        hardware=hardware_info(lm.model),
        lengths=LengthDistribution(len(prompts), {"mean": sum(lengths) / len(lengths), "min": min(lengths),
                                                  "max": max(lengths)}, {"fixed": args.max_new_tokens},
                                   f"spec_bench: first {args.per_category} of each task {args.tasks}", True),
        arrival=ArrivalProcess("batch-1 sequential", 1),
        engine=EngineCondition("native", {"dtype": "bf16", "attention": "eager", "threads": torch.get_num_threads(),
                                          "proposer": f"eagle:{args.head_dir}"},
                               warmup="none: acceptance is teacher-forced; V is the minimum of 7 timings per size",
                               cache_warmth="KV cache prefilled with each run context before timing V"),
        metric=MetricCondition(
            {"depth1[w]": "share of chain starts whose next target token is among the head's top w draft tokens",
             "depth2[w1xw2]": "share of chain starts accepted to depth 2 by a full (w1, w2) tree",
             "tau": "1 + depth1[w1] (+ depth2[w1xw2]): expected tokens per verification step",
             "predicted_speedup": "tau / (V(rows - 1) + levels x c), c = the chain record's K=2 c"},
            "teacher-forced on the target's own greedy outputs, so every accepted token is the one plain greedy "
            "decoding emits"),
        results={"head": args.head_dir, "chain_record": Path(args.chain_record).name, "positions": len(hit1),
                 "depth1": {str(w): a for w, a in depth1.items()},
                 "depth2": {f"{w1}x{w2}": a for (w1, w2), a in depth2.items()},
                 "verify_cost_curve": curve, "chain_check": chain_check, "shapes": rows},
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dir", required=True)
    parser.add_argument("--chain-record", required=True, help="bench/results/eagle_train_draft*.json of this head")
    parser.add_argument("--model", default="default")
    parser.add_argument("--threads", type=positive_int, default=None)
    parser.add_argument("--per-category", type=positive_int, default=2)
    parser.add_argument("--tasks", type=lambda s: tuple(s.split(",")), default=SPEC_BENCH_TASKS,
                        help="Spec-Bench tasks to draw prompts from.")
    parser.add_argument("--max-new-tokens", type=positive_int, default=256)
    parser.add_argument("--widths", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8])
    parser.add_argument("--max-rows", type=positive_int, default=25, help="largest tree verified (root row included)")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "eagle_tree_bound.json"))
    args = parser.parse_args()
    if set(args.tasks) - set(SPEC_BENCH_TASKS):
        parser.error(f"--tasks: pick from {','.join(SPEC_BENCH_TASKS)}")
    if 1 not in args.widths or min(args.widths) < 1:
        parser.error("--widths: positive widths including 1 (width 1 is the chain, checked against its record)")
    if not Path(args.chain_record).is_file():
        parser.error(f"--chain-record {args.chain_record}: no such file (a bench/results/eagle_train_draft*.json)")
    try:  # a missing or mismatched head stops here, in one line
        check_proposer_spec(f"eagle:{args.head_dir}", args.model)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    record = main(args)
    for r in record.results["shapes"]:
        print(f"widths {r['widths']}: rows {r['rows']}, tau {r['tau']:.2f}, V {r['verify_cost']:.2f}, "
              f"predicted {r['predicted_speedup']:.2f}x")
    print("chain check (teacher-forced vs measured, K=2):", record.results["chain_check"])
    print(f"wrote {record.write(args.out)}")
