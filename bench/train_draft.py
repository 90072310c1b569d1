"""Train an EAGLE draft head on the default model under a wall-clock cap, then measure it on Spec-Bench.

Usage: .venv/bin/python bench/train_draft.py [--prompts 300] [--answer-seconds 240] [--answer-batch 16] [--train-seconds 300]
       [--ks 1,2,3,4,5] [--per-category 2] [--max-new-tokens 128] [--head-dir /tmp/quantspec-eagle-head]
Training (specdec/train_draft.py): the target's own greedy answers to Alpaca instructions (benchmark overlaps
dropped) and to --context-prompts long-context prompts + WikiText-2 validation chunks, the head optionally fusing
--fuse-layers; the time split (extraction, training, held-out evaluation) and the budget go into the record. Measurement: ``measure_acceptance`` (alpha, beta, tau, per-position acceptance,
speedup vs plain decoding with the same eager attention, beside the prediction), greedy, fixed output length,
the first --per-category questions of each Spec-Bench task. Writes bench/results/eagle_train_draft.json.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import quantspec  # noqa: E402
from quantspec.report import print_sweep  # noqa: E402
from runtime.loading import load_model  # noqa: E402
from runtime.sampling import SamplingConfig  # noqa: E402
from specdec.sweep import parse_ks  # noqa: E402
from specdec.train_draft import TrainConfig, parse_layers, train_head  # noqa: E402
from runtime.argtypes import nonnegative_int, positive_int

SPEC_BENCH = Path(__file__).parent / "spec_sweep.py"


def spec_bench_prompts(per_category, data_dir=None):
    sys.path.insert(0, str(Path(__file__).parent))
    from spec_sweep import spec_bench_prompts as pick  # the same prompt choice as the n-gram sweep

    return pick(per_category, data_dir)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--threads", type=positive_int, default=None)
    parser.add_argument("--prompts", type=positive_int, default=300)
    parser.add_argument("--max-answer-tokens", type=positive_int, default=64)
    parser.add_argument("--wikitext", type=positive_int, default=32)
    parser.add_argument("--answer-seconds", type=float, default=240.0, help="Cap on generating answers.")
    parser.add_argument("--answer-batch", type=positive_int, default=16, help="Prompts answered together (greedy batch).")
    parser.add_argument("--train-seconds", type=float, default=300.0, help="Cap on the training loop.")
    parser.add_argument("--epochs", type=positive_int, default=8)
    parser.add_argument("--batch", type=positive_int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--ce-weight", type=float, default=TrainConfig.ce_weight)
    parser.add_argument("--draft-vocab", type=int, default=None)
    parser.add_argument("--ttt-steps", type=nonnegative_int, default=TrainConfig.ttt_steps,
                        help="Chain steps trained on the head's own states (EAGLE-3 training-time test).")
    parser.add_argument("--context-prompts", type=nonnegative_int, default=0,
                        help="Long-context prompts (WikiText-2 validation passages in Spec-Bench's long-context shapes).")
    parser.add_argument("--context-len", type=positive_int, default=TrainConfig.context_len)
    parser.add_argument("--fuse-layers", default="", help="EAGLE-3 feature fusion: target layers the head also reads.")
    parser.add_argument("--head-layers", type=positive_int, default=TrainConfig.head_layers)
    parser.add_argument("--ks", default="1,2,3,4,5")
    parser.add_argument("--per-category", type=positive_int, default=2)
    parser.add_argument("--max-new-tokens", type=positive_int, default=128)
    parser.add_argument("--head-dir", default="/tmp/quantspec-eagle-head")
    parser.add_argument("--note", default=None, help="Stored in the record, e.g. which budget protocol this run is.")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--reuse-head", action="store_true",
                        help="Skip training: measure the head in --head-dir, taking the training part of the record "
                             "from its train_result.json (written by a run that trained it).")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "eagle_train_draft.json"))
    args = parser.parse_args()
    lm = load_model(args.model, args.dtype, args.threads, "eager")
    cfg = TrainConfig(n_prompts=args.prompts, max_answer_tokens=args.max_answer_tokens, n_wikitext=args.wikitext,
                      epochs=args.epochs, batch=args.batch, lr=args.lr, ce_weight=args.ce_weight,
                      draft_vocab=args.draft_vocab,
                      train_seconds=args.train_seconds, answer_seconds=args.answer_seconds,
                      answer_batch=args.answer_batch, ttt_steps=args.ttt_steps,
                      n_context=args.context_prompts, context_len=args.context_len,
                      fuse_layers=parse_layers(args.fuse_layers), head_layers=args.head_layers)
    last = [0.0]

    def progress(stage, done, total, detail):
        now = time.perf_counter()
        if stage == "epoch" or now - last[0] > 20 or done == total:
            last[0] = now
            print(f"[{time.strftime('%H:%M:%S')}] {stage} {done}/{total} {detail}", flush=True)

    side = Path(args.head_dir) / "train_result.json"
    if args.reuse_head:
        training = json.loads(side.read_text())
    else:
        t0 = time.perf_counter()
        result = train_head(lm, args.head_dir, cfg, args.data_dir, progress, target_name=args.model)
        train_wall = time.perf_counter() - t0
        print(f"trained in {train_wall:.0f} s: extraction {result.extract_s:.0f} s, training {result.train_s:.0f} s, "
              f"held-out evaluation {result.eval_s:.0f} s; epochs {result.epochs}", flush=True)
        training = {**result.to_dict(), "wall_s": train_wall,
                    "budget": {"answer_seconds": args.answer_seconds, "train_seconds": args.train_seconds,
                               "prompts": args.prompts, "max_answer_tokens": args.max_answer_tokens,
                               "answer_batch": args.answer_batch,
                               "context_prompts": args.context_prompts},
                    "head_dir": args.head_dir}
        side.write_text(json.dumps(training, indent=1))
    texts = spec_bench_prompts(args.per_category, args.data_dir)
    t1 = time.perf_counter()
    record = quantspec.measure_acceptance(
        lm, args.model, f"eagle:{args.head_dir}", parse_ks(args.ks), texts,
        f"spec_bench: first {args.per_category} of each task", args.max_new_tokens, SamplingConfig(0.0),
        ignore_eos=True, tick=lambda what: progress("measure", 0, 1, what))
    measure_s = time.perf_counter() - t1
    record.name = "eagle-train-draft"
    record.results["training"] = training
    record.results["time_split_s"] = {"extraction": training["extract_s"], "training": training["train_s"],
                                      "heldout_evaluation": training["eval_s"], "spec_bench_measurement": measure_s}
    record.results["threads"] = torch.get_num_threads()
    if args.note:
        record.results["notes"] = args.note
    record.results["load_average_after"] = os.getloadavg()
    print_sweep(record)
    print(f"wrote {record.write(args.out)}")
