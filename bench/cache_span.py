"""What reading the whole preallocated KV cache costs a compiled step: bf16, int8 and int4 g32 compiled one-token
steps of the default model on a cache of ``--max-model-len`` positions (1024, what ``quantspec bench`` / ``search`` /
the demo allocate), reading the span its request reserves (``Decoder.reserve``: prompt + output rounded up to
``runtime.compiled.SPAN_BLOCK``, what the product runs) vs the whole cache (what every compiled step read before
spans). A step attends over its span masked (one graph per span); each config's two spans alternate on one decoder
in paired, interleaved rounds (ratio with its 95% CI), beside the KV bytes a step reads, and each quantized step's
tok/s over the bf16 step's at the same span.

Usage: flock /tmp/qs-bench.lock .venv/bin/python bench/cache_span.py [--max-model-len 1024] [--new-tokens 128]
Writes bench/results/cache_span.<machine tag>.json.
"""
import argparse
from pathlib import Path

from rich.console import Console
from rich.table import Table

from evals.decode_speed import DEFAULT_PROMPT, decoder_block
from evals.record import (ArrivalProcess, EngineCondition, LengthDistribution, MetricCondition, ModelCondition,
                          RunRecord, hardware_info)
from quant.quantize import quantize_model
from runtime.argtypes import positive_int
from runtime.compiled import DEFAULT_MODE, SPAN_BLOCK, cache_span, step_attention
from runtime.errors import UserError
from runtime.generate import Decoder, encode_prompt
from runtime.hardware import kernels_used, probe
from runtime.loading import load_model, set_threads
from runtime.measure import SpeedProtocol, paired_ratio, with_ci
from runtime.model_store import SMOLLM2, is_default_model, weights_hash

CONFIGS = [("bf16", None), ("int8 W8A16", "W8A16"), ("int4 g32", "w4g32-sym")]


def kv_bytes(lm, positions: int) -> int:
    """Bytes of K and V one step reads over ``positions`` cache positions, all layers."""
    args = lm.model.args
    return args.n_layers * 2 * args.n_kv_heads * args.head_dim * positions * lm.model.embed_tokens.weight.itemsize


def run(model: str, max_model_len: int, new_tokens: int) -> RunRecord:
    rows, lm = [], None
    for label, scheme in CONFIGS:
        lm = load_model(model, "bf16")
        if scheme:
            quantize_model(lm, scheme, progress=False)
        ids = encode_prompt(lm.tokenizer, DEFAULT_PROMPT)
        decoder = Decoder(lm, max_model_len, compile_mode=DEFAULT_MODE)
        spans = {"short": cache_span(len(ids) + new_tokens, max_model_len), "long": max_model_len}
        if spans["short"] == max_model_len:
            raise UserError(f"--max-model-len {max_model_len} must exceed the request's span ({spans['short']} "
                            f"positions: prompt {len(ids)} + --new-tokens {new_tokens}, rounded up to {SPAN_BLOCK})")
        reserved = {"short": None, "long": max_model_len}
        tokens = {length: decoder.generate(ids, new_tokens, ignore_eos=True, positions=reserved[length]).tokens
                  for length in spans}  # builds each span's step
        paired = paired_ratio(decoder_block(decoder, ids, new_tokens, max_model_len),
                              decoder_block(decoder, ids, new_tokens), 1, SpeedProtocol(), "one greedy generation")
        rows.append({"config": label, "scheme": scheme or "none", "kernels_run": kernels_used(lm.model),
                     "step": decoder.step_label, "attention": step_attention(lm.model),
                     "short_len": spans["short"], "long_len": max_model_len, "short_tok_s": paired.candidate.value,
                     "long_tok_s": paired.reference.value, "short_over_long": paired.ratio.value,
                     "short_over_long_ci": list(paired.ratio.ci), "noisy": paired.noisy, "rounds": paired.rounds,
                     "kv_mib_short": kv_bytes(lm, spans["short"]) / 2**20,
                     "kv_mib_long": kv_bytes(lm, max_model_len) / 2**20,
                     "tokens_equal": tokens["short"] == tokens["long"],
                     "compile_s": decoder.compile_s, "paired": paired.to_dict()})
    for row in rows:
        for length in ("short", "long"):
            row[f"{length}_over_bf16"] = row[f"{length}_tok_s"] / rows[0][f"{length}_tok_s"]
    return RunRecord(
        name="cache-span",
        model=ModelCondition(model, weights_hash(lm.path), "bf16; int8 W8A16 and int4 g32 (RTN) as the rows say",
                             scheme="see rows", note=SMOLLM2.note if is_default_model(lm.path) else ""),
        hardware=hardware_info(),
        lengths=LengthDistribution(1, {"fixed": len(ids)}, {"fixed": new_tokens}, f"one chat prompt: {DEFAULT_PROMPT!r}",
                                   True),
        arrival=ArrivalProcess("batch-1 sequential", 1),
        engine=EngineCondition("native", {"compile_mode": DEFAULT_MODE, "max_model_len": max_model_len,
                                          "span_block": SPAN_BLOCK},
                               warmup="one generation per span (builds its step), excluded",
                               cache_warmth="KV cache reset per request; weights resident"),
        metric=MetricCondition({"short_over_long": "paired, interleaved ratio of decode tok/s (prefill excluded), "
                                                   "the request's span over the whole cache; CI: 95% t-interval "
                                                   "of the mean log ratio",
                                "x_over_bf16": "a row's tok/s over the bf16 row's at the same cache length "
                                               "(separate pairings, no CI)"},
                               "greedy, ignore_eos, fixed output length; tokens_equal: the two spans' outputs"),
        results={"rows": rows},
    )


def print_table(record: RunRecord) -> None:
    table = Table(title="compiled one-token step: the request's span vs the whole serving cache")
    for col in ("config", "span (request / whole)", "tok/s short", "tok/s long", "short / long", "vs bf16 short",
                "vs bf16 long", "KV MiB a step", "tokens equal"):
        table.add_column(col, justify="right")
    for r in record.results["rows"]:
        table.add_row(r["config"], f"{r['short_len']} / {r['long_len']}", f"{r['short_tok_s']:.1f}",
                      f"{r['long_tok_s']:.1f}", with_ci(r["short_over_long"], r["short_over_long_ci"], ".2f", "x"),
                      f"{r['short_over_bf16']:.2f}x", f"{r['long_over_bf16']:.2f}x",
                      f"{r['kv_mib_short']:.1f} / {r['kv_mib_long']:.1f}", str(r["tokens_equal"]))
    Console().print(table)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--max-model-len", type=positive_int, default=1024)
    parser.add_argument("--new-tokens", type=positive_int, default=128)
    parser.add_argument("--threads", type=positive_int, default=None)
    args = parser.parse_args()
    set_threads(args.threads)
    try:
        record = run(args.model, args.max_model_len, args.new_tokens)
    except UserError as exc:
        parser.error(str(exc))
    print_table(record)
    out = record.write(Path(__file__).parent / "results" / f"cache_span.{probe().tag}.json")
    print(f"wrote {out}")
