"""Which attention a compiled decode step should run on CPU: the compiled bf16 one-token step of the default model
with SDPA (torch's flash kernel, the step's attention before this bench), with the batch-invariant ``eager``
attention (the native serving backend's, for exact bf16 speculation; since this bench also SDPA models' where the
CPU multiplies bf16 natively) and with ``reduce_attention`` (fp32 multiply-reduce that inductor fuses: SDPA models'
before that), over KV caches of two lengths, each read whole (``generate(positions=...)``: the step's span is the
cache), so the cache length, not the tokens written, sets its attention cost: the short cache is the span the
product's step reads for this request (``runtime.compiled.cache_span``), the long one is ``quantspec bench``'s
default ``--max-model-len``. Per length the three steps stay resident and each of eager and reduce alternates with
SDPA in paired rounds of one greedy generation each, then eager with reduce directly (``over_reduce``, on the eager
row); over the short cache each one's 5-token verification step is probed against its one-token step (rows
differing bitwise).

Usage: flock /tmp/qs-bench.lock .venv/bin/python bench/step_attention.py [--new-tokens 128] [--long 1024]
Writes bench/results/step_attention.<machine tag>.json.
"""
import argparse
import os
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from evals.decode_speed import DEFAULT_PROMPT, decoder_block, first_diff
from evals.record import (ArrivalProcess, EngineCondition, LengthDistribution, MetricCondition, ModelCondition,
                          RunRecord, hardware_info)
from runtime import compiled
from runtime.argtypes import positive_int
from runtime.generate import Decoder, encode_prompt
from runtime.hardware import probe
from runtime.loading import load_model, set_threads
from runtime.measure import SpeedProtocol, paired_ratio, with_ci
from runtime.model_store import SMOLLM2, is_default_model, weights_hash
from runtime.sampling import SamplingConfig
from runtime.transformer import ATTENTION, sdpa_attention
from specdec.speculative import compiled_rows_differing

# SDPA under a name of its own: the compiled step keeps a model's attention unless it is "sdpa" on CPU
# (runtime.compiled.step_attention), so a model loaded with this one compiles SDPA into its step
ATTENTION.register("sdpa-in-step")(sdpa_attention)
ATTENTION.register("reduce-in-step")(compiled.reduce_attention)  # what SDPA models' steps ran before eager won here
# the step's attention -> the model's attention, kept in its compiled step
ATTENTIONS = {"sdpa": "sdpa-in-step", "eager": "eager", "reduce": "reduce-in-step"}
VERIFY_ROWS = 5  # K = 4


def step(model: str, attention: str, max_len: int, prompt_ids: list[int]) -> Decoder:
    """A compiled bf16 decoder whose steps attend with ``attention``, built in an excluded warm-up."""
    lm = load_model(model, "bf16", attn_implementation=ATTENTIONS[attention])
    decoder = Decoder(lm, max_len, compile_mode=compiled.DEFAULT_MODE)
    decoder.generate(prompt_ids, 8, ignore_eos=True, positions=max_len)
    assert compiled.step_attention(lm.model) == ATTENTIONS[attention]
    return decoder


def rows_differing(decoder: Decoder, prompt_ids: list[int]) -> int:
    """Rows of the compiled 5-token step's logits not bitwise the one-token step's (greedy speculation needs 0)."""
    decoder.reset()
    decoder.forward(prompt_ids[:-VERIFY_ROWS])
    return compiled_rows_differing(decoder, prompt_ids[-VERIFY_ROWS:])[1]


def run(model: str, new_tokens: int, long: int) -> RunRecord:
    prompt_ids = encode_prompt(load_model(model, "bf16").tokenizer, DEFAULT_PROMPT)
    rows = []
    short = compiled.cache_span(len(prompt_ids) + new_tokens, long)  # what the product's step reads for this request
    for max_len in (short, long):
        steps = {a: step(model, a, max_len, prompt_ids) for a in ATTENTIONS}
        blocks = {a: decoder_block(d, prompt_ids, new_tokens, max_len) for a, d in steps.items()}
        tokens = {a: d.generate(prompt_ids, new_tokens, SamplingConfig(), ignore_eos=True, positions=max_len).tokens
                  for a, d in steps.items()}
        for attention in ("eager", "reduce"):
            paired = paired_ratio(blocks["sdpa"], blocks[attention], 1, SpeedProtocol(), "one greedy generation")
            rows.append({"cache_len": max_len, "attention": attention, "sdpa_tok_s": paired.reference.value,
                         "tok_s": paired.candidate.value, "over_sdpa": paired.ratio.value,
                         "over_sdpa_ci": list(paired.ratio.ci), "noisy": paired.noisy, "rounds": paired.rounds,
                         "build_s": steps[attention].compile_s, "sdpa_build_s": steps["sdpa"].compile_s,
                         "step": steps[attention].step_label, "first_diff_vs_sdpa": first_diff(tokens[attention],
                                                                                              tokens["sdpa"]),
                         "verify_rows_differing": rows_differing(steps[attention], prompt_ids)
                         if max_len == short else None})
            print(rows[-1], flush=True)
        direct = paired_ratio(blocks["reduce"], blocks["eager"], 1, SpeedProtocol(), "one greedy generation")
        rows[-2].update(over_reduce=direct.ratio.value, over_reduce_ci=list(direct.ratio.ci),
                        reduce_noisy=direct.noisy)
        print(f"eager over reduce at {max_len}: {direct.ratio.value:.3f} {direct.ratio.ci}", flush=True)
    path = load_model(model, "bf16").path
    return RunRecord(
        name="step-attention",
        model=ModelCondition(model, weights_hash(path), "bf16", note=SMOLLM2.note if is_default_model(path) else ""),
        hardware=hardware_info(),
        lengths=LengthDistribution(1, {"fixed": len(prompt_ids)}, {"fixed": new_tokens},
                                   f"one chat prompt: {DEFAULT_PROMPT!r}", True),
        arrival=ArrivalProcess("batch-1 sequential", 1),
        engine=EngineCondition("native", {"threads": torch.get_num_threads(), "compile_mode": compiled.DEFAULT_MODE,
                                          "gemm_backends": compiled.gemm_backends(compiled.DEFAULT_MODE)},
                               warmup="one 8-token generation per step (it builds the step: build_s), excluded",
                               cache_warmth="KV cache reset per request; weights resident in RAM"),
        metric=MetricCondition(
            {"over_sdpa": "median over paired, interleaved rounds (one greedy generation each, seeded AB/BA order) of "
                          "the row's step's decode tok/s over the SDPA step's; CI: 95% t-interval of the mean log "
                          "ratio",
             "over_reduce": "as over_sdpa, eager's step over reduce's, paired directly (eager rows)",
             "first_diff_vs_sdpa": "first position where the greedy tokens differ from the SDPA step's (bf16 "
                                   "rounding; not a verdict)",
             "verify_rows_differing": "rows of the compiled 5-token step's logits not bitwise the one-token step's "
                                      "at the same positions (greedy speculation needs 0; short cache only)"},
            "greedy, ignore_eos, fixed output length; speed only"),
        results={"load_average_1_5_15": os.getloadavg(), "rows": rows},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--new-tokens", type=positive_int, default=128)
    parser.add_argument("--long", type=positive_int, default=1024, help="The long cache's length.")
    parser.add_argument("--threads", type=positive_int, default=None)
    args = parser.parse_args()
    set_threads(args.threads)
    record = run(args.model, args.new_tokens, args.long)
    table = Table(title="compiled bf16 decode step: attention over the cache")
    for col in ("cache positions", "attention", "tok/s", "SDPA tok/s", "vs SDPA [95% CI]", "V(4) rows differing"):
        table.add_column(col, justify="right")
    for r in record.results["rows"]:
        table.add_row(str(r["cache_len"]), r["attention"], f"{r['tok_s']:.1f}", f"{r['sdpa_tok_s']:.1f}",
                      with_ci(r["over_sdpa"], r["over_sdpa_ci"], ".2f", "x"), str(r["verify_rows_differing"]))
    Console().print(table)
    out = record.write(Path(__file__).parent / "results" / f"step_attention.{probe().tag}.json")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
