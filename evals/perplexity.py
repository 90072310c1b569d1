"""WikiText-2 raw test perplexity on the native runtime (fp or quantized ``LoadedModel``).

Convention: ``wikitext2/wiki.test.raw`` as is (the file llama.cpp and GPTQ-style evals use), tokenized once
without special tokens. Default: non-overlapping windows of ``ctx`` tokens (512), each scored on every token
after its first. With ``stride``: HF's sliding window, windows of ``ctx`` tokens starting every ``stride``
tokens, each scoring only the tokens the previous window did not (all but the very first token overall).
``ppl = exp(mean NLL)`` over the scored tokens; ``max_windows`` keeps the first N windows.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from rich.progress import track

from runtime.data import data_file
from runtime.errors import UserError

WIKITEXT2_TEST = "wikitext2/wiki.test.raw"


@dataclass
class PerplexityResult:
    ppl: float
    nll: float  # mean negative log-likelihood per scored token, nats
    n_tokens: int  # scored tokens
    ctx: int
    stride: int | None  # None: non-overlapping windows

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Window:
    begin: int
    end: int
    first_scored: int  # absolute position of the first target token scored in this window


def windows(n_tokens: int, ctx: int, stride: int | None = None) -> list[Window]:
    """Evaluation windows over a stream of ``n_tokens`` tokens."""
    if ctx < 2:
        raise UserError(f"perplexity context must be >= 2 tokens, got {ctx}")
    if stride is not None and not 1 <= stride <= ctx:
        raise UserError(f"stride must be in [1, ctx={ctx}], got {stride}")
    if stride is None:
        return [Window(b, b + ctx, b + 1) for b in range(0, n_tokens - ctx + 1, ctx)]
    out, prev_end = [], 0
    for begin in range(0, n_tokens - 1, stride):
        end = min(begin + ctx, n_tokens)
        out.append(Window(begin, end, max(prev_end, begin + 1)))
        prev_end = end
        if end == n_tokens:
            break
    return out


@torch.inference_mode()
def token_stream_nll(model, ids: list[int], wins: list[Window], batch_size: int = 4) -> tuple[float, int]:
    """Summed NLL and count of the scored tokens of ``wins`` under the native ``model``."""
    total, count = 0.0, 0
    tokens = torch.tensor(ids)
    by_len: dict[int, list[Window]] = {}
    for w in wins:
        by_len.setdefault(w.end - w.begin, []).append(w)
    chunks = [(n, ws[i : i + batch_size]) for n, ws in by_len.items() for i in range(0, len(ws), batch_size)]
    for length, chunk in track(chunks, description="perplexity", transient=True):
        batch = torch.stack([tokens[w.begin : w.end] for w in chunk])
        model.setup_cache(len(chunk), length)
        logits = model(batch, torch.arange(length))
        for row, w in enumerate(chunk):
            start = w.first_scored - w.begin  # first target position inside the window
            targets = batch[row, start:]
            total += float(F.cross_entropy(logits[row, start - 1 : -1].float(), targets, reduction="sum"))
            count += targets.numel()
    return total, count


def perplexity_of_text(lm, text: str, ctx: int = 512, stride: int | None = None,
                       max_windows: int | None = None) -> PerplexityResult:
    """Perplexity of ``lm`` (native runtime) on ``text`` tokenized once."""
    if max_windows is not None and max_windows < 1:
        raise UserError(f"max windows must be >= 1, got {max_windows}")
    if ctx > lm.model.args.max_seq_len:
        raise UserError(f"ctx {ctx} exceeds the model's context length {lm.model.args.max_seq_len}; lower ctx")
    ids = lm.tokenizer.encode(text, add_special_tokens=False)
    wins = windows(len(ids), ctx, stride)[:max_windows]
    if not wins:
        raise UserError(f"text has {len(ids)} tokens, fewer than one window of {ctx}; lower ctx")
    total, count = token_stream_nll(lm.model, ids, wins)
    nll = total / count
    return PerplexityResult(math.exp(nll), nll, count, ctx, stride)


def wikitext2_perplexity(lm, data_dir=None, ctx: int = 512, stride: int | None = None,
                         max_windows: int | None = None) -> PerplexityResult:
    """WikiText-2 raw test perplexity (see the module docstring for the windowing convention)."""
    return perplexity_of_text(lm, data_file(WIKITEXT2_TEST, data_dir).read_text(), ctx, stride, max_windows)
