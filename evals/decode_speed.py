"""Batch-1 decode speed: native runtime vs HF ``generate``, same model, dtype, prompt and length."""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from evals.record import (ArrivalProcess, EngineCondition, LengthDistribution, MetricCondition, ModelCondition,
                          RunRecord, hardware_info)
from evals.roofline import decode_bytes_per_token, measure_bandwidth
from runtime.hardware import sync
from runtime.loading import LoadedModel, load_model
from runtime.model_store import SMOLLM2, is_default_model, weights_hash
from runtime.generate import Decoder, encode_prompt
from runtime.measure import Sample, SpeedProtocol, paired_ratio
from runtime.sampling import SamplingConfig
from runtime.threads import apply_threads

DEFAULT_PROMPT = "Write a short story about a robot who learns to paint."


@dataclass
class DecodeSpeed:
    engine: str
    new_tokens: int
    decode_tok_s: float  # median over repeats of (new_tokens - 1) / decode seconds
    prefill_ms: float
    roofline_pct: float
    tokens: list[int]
    fallback: str | None = None  # why a compiled step ran eager instead
    compile_s: float = 0.0  # one-time build of the compiled step (in the warm-up, apart from decode_tok_s)
    step: str | None = None  # native: the decode step that ran (``Decoder.step_label``)
    decode_tok_s_ci: list | None = None  # 95% CI across rounds when measured paired
    rounds: int | None = None


def first_diff(a: list[int], b: list[int]) -> int | None:
    """The first position where two greedy outputs differ (None: equal)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def native_decode(lm: LoadedModel, prompt_ids: list[int], new_tokens: int, repeats: int,
                  bandwidth: float, label: str = "native", compile_mode: str | None = None) -> DecodeSpeed:
    """Native greedy decode speed; ``compile_mode``: through the compiled one-token step (compiled in the
    warm-up)."""
    decoder = Decoder(lm, max_len=len(prompt_ids) + new_tokens + 8, compile_mode=compile_mode)
    decoder.generate(prompt_ids, 8, ignore_eos=True)  # warm-up, excluded
    runs = [decoder.generate(prompt_ids, new_tokens, SamplingConfig(), ignore_eos=True) for _ in range(repeats)]
    tok_s = statistics.median(r.decode_tokens_per_s for r in runs)
    roof = bandwidth / decode_bytes_per_token(lm.model)
    return DecodeSpeed(label, new_tokens, tok_s, statistics.median(r.prefill_s for r in runs) * 1e3,
                       100 * tok_s / roof, runs[0].tokens, decoder.step.fallback if decoder.step else None,
                       decoder.compile_s, decoder.step_label)


def load_hf(lm: LoadedModel):
    """The same weights through transformers (its weight-loading bar off: the comparison's table is the output)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(lm.path, dtype=lm.dtype, use_safetensors=True).to(lm.device).eval()


def native_block(lm: LoadedModel, prompt_ids: list[int], new_tokens: int):
    """One native greedy generation per call (eager step): its decode tokens and seconds (prefill excluded)."""
    return decoder_block(Decoder(lm, max_len=len(prompt_ids) + new_tokens + 8), prompt_ids, new_tokens)


def decoder_block(decoder: Decoder, prompt_ids: list[int], new_tokens: int, positions: int | None = None):
    """``native_block`` on a given decoder (e.g. a compiled one); ``positions``: what each request reserves
    (``Decoder.generate``)."""
    def block(_unit: int) -> Sample:
        r = decoder.generate(prompt_ids, new_tokens, SamplingConfig(), ignore_eos=True, positions=positions)
        return Sample(len(r.tokens) - 1, r.decode_s)

    return block


def hf_block(hf, prompt_ids: list[int], new_tokens: int, prefill_s: float, pad_token_id: int | None):
    """One HF ``generate`` per call: decode tokens and seconds (its measured prefill subtracted, as above)."""
    ids = torch.tensor([prompt_ids], device=hf.device)

    @torch.inference_mode()
    def block(_unit: int) -> Sample:
        sync(hf.device)
        t = time.perf_counter()
        hf.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                    pad_token_id=pad_token_id, attention_mask=torch.ones_like(ids))
        sync(hf.device)
        return Sample(new_tokens - 1, time.perf_counter() - t - prefill_s)

    return block


@torch.inference_mode()
def hf_model_decode(hf, prompt_ids: list[int], new_tokens: int, repeats: int, bandwidth: float,
                    pad_token_id: int | None = None) -> DecodeSpeed:
    """HF ``generate`` decode speed of a loaded HF model, on the model's device (synchronized at the edges)."""
    device = hf.device
    ids = torch.tensor([prompt_ids], device=device)
    kwargs = dict(do_sample=False, pad_token_id=pad_token_id, attention_mask=torch.ones_like(ids))

    def timed(n: int) -> tuple[float, torch.Tensor]:
        sync(device)
        t = time.perf_counter()
        out = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)
        sync(device)
        return time.perf_counter() - t, out

    timed(8)  # warm-up, excluded
    prefill = statistics.median(timed(1)[0] for _ in range(repeats))
    fulls = [timed(new_tokens) for _ in range(repeats)]
    tok_s = statistics.median((new_tokens - 1) / (t - prefill) for t, _ in fulls)
    roof = bandwidth / _hf_bytes(hf)
    return DecodeSpeed("hf-generate", new_tokens, tok_s, prefill * 1e3, 100 * tok_s / roof,
                       fulls[0][1][0, len(prompt_ids):].tolist())


def _hf_bytes(hf) -> int:
    """Same accounting as the native model: all matrices once; embedding only when tied."""
    embed = hf.get_input_embeddings().weight
    tied = hf.get_output_embeddings().weight is embed
    return sum(p.numel() * p.element_size() for n, p in hf.named_parameters()
               if tied or p is not embed)


def compare_decode(model: str = "default", dtype: str = "fp32", new_tokens: int = 128, repeats: int = 3,
                   prompt: str = DEFAULT_PROMPT, threads: int | None = None, with_hf: bool = True,
                   device: str = "cpu", protocol: SpeedProtocol | None = None) -> RunRecord:
    """Native vs HF decode on one prompt on ``device``; returns a run record with both speeds and their ratio,
    measured paired (one generation each, alternating; ``protocol``: the rounds and noise threshold)."""
    lm = load_model(model, dtype, threads, device=device)
    choice = apply_threads(lm.model, threads)
    prompt_ids = encode_prompt(lm.tokenizer, prompt)
    bandwidth = measure_bandwidth(device=lm.device)
    rows = [native_decode(lm, prompt_ids, new_tokens, repeats, bandwidth)]
    results = {"threads": choice.to_dict()}
    if with_hf:
        hf = load_hf(lm)
        rows.append(hf_model_decode(hf, prompt_ids, new_tokens, repeats, bandwidth, lm.tokenizer.eos_token_id))
        paired = paired_ratio(hf_block(hf, prompt_ids, new_tokens, rows[1].prefill_ms / 1e3, lm.tokenizer.eos_token_id),
                              native_block(lm, prompt_ids, new_tokens), 1, protocol or SpeedProtocol(),
                              f"one greedy generation of {new_tokens} tokens, decode time only")
        for row, spread in zip(rows, (paired.candidate, paired.reference)):
            row.decode_tok_s, row.decode_tok_s_ci, row.rounds = spread.value, list(spread.ci), spread.n
        results |= {"native_over_hf": paired.ratio.value, "native_over_hf_ci": list(paired.ratio.ci),
                    "noisy": paired.noisy, "paired": paired.to_dict(),
                    "greedy_tokens_equal": rows[0].tokens == rows[1].tokens}
    roof = bandwidth / decode_bytes_per_token(lm.model)
    for row in rows:
        row.roofline_pct = 100 * row.decode_tok_s / roof
    results |= {
        "bandwidth_gb_s": bandwidth / 1e9,
        "bytes_per_token": decode_bytes_per_token(lm.model),
        "roofline_tok_s": roof,
        "rows": [{k: v for k, v in asdict(r).items() if k != "tokens"} for r in rows],
    }
    return RunRecord(
        name="decode-speed",
        model=ModelCondition(str(model), weights_hash(lm.path), lm.precision,
                             note=SMOLLM2.note if is_default_model(lm.path) else ""),
        hardware=hardware_info(lm.model),
        lengths=LengthDistribution(1, {"fixed": len(prompt_ids)}, {"fixed": new_tokens}, f"one chat prompt: {prompt!r}", True),
        arrival=ArrivalProcess("batch-1 sequential", 1),
        engine=EngineCondition("native vs hf-generate", {"dtype": lm.precision, "device": str(lm.device),
                                                         "threads": torch.get_num_threads()},
                               warmup="one 8-token generation per engine, excluded",
                               cache_warmth="KV cache reset per request; weights resident in RAM"),
        metric=MetricCondition(
            {"decode_tok_s": "median over rounds of (new_tokens-1)/decode seconds, prefill excluded; with HF: "
                             "native and HF generations alternate (runtime.measure.paired_ratio)",
             "native_over_hf": "median of per-round native/HF decode-rate ratios, Student-t 95% CI of their mean log",
             "roofline_pct": "decode tok/s / (measured read bandwidth / weight bytes per token)"},
            "greedy, ignore_eos, fixed output length; native and HF tokens compared"),
        results=results,
    )
