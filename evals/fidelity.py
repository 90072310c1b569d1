"""Token-level fidelity of a model against a reference on the same tokens: KL, top-1 agreement, perplexity.

``wikitext_fidelity`` runs the reference and the test configuration (quantized weights and/or a quantized
KV cache) over the same WikiText-2 raw test windows (``evals.perplexity``'s convention: non-overlapping
windows of ``ctx`` tokens, every token after a window's first scored) and reports KL(p_ref || p_test) per
next-token distribution (mean and p99), top-1 agreement and both perplexities.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from rich.progress import track

from runtime.data import data_file
from evals.perplexity import WIKITEXT2_TEST, windows
from runtime.errors import UserError


@dataclass
class FidelityStats:
    mean_kl: float  # mean over tokens of KL(p_ref || p_test), nats
    p99_kl: float
    top1_agreement: float  # fraction of positions where argmaxes agree
    n_tokens: int
    ppl_ref: float | None = None  # perplexity of the actual next tokens, same positions
    ppl_test: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def per_token(ref_logits: torch.Tensor, test_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """KL(p_ref || p_test) [N] and top-1 agreement [N] for logits [N, V] at the same positions."""
    ref_logp = torch.log_softmax(ref_logits.float(), -1)
    test_logp = torch.log_softmax(test_logits.float(), -1)
    kl = (ref_logp.exp() * (ref_logp - test_logp)).sum(-1).clamp_min(0)
    return kl, (ref_logits.argmax(-1) == test_logits.argmax(-1)).float()


def summarize(kl: torch.Tensor, agree: torch.Tensor, **ppl) -> FidelityStats:
    return FidelityStats(kl.mean().item(), torch.quantile(kl, 0.99).item(), agree.mean().item(), kl.numel(), **ppl)


def token_fidelity(ref_logits: torch.Tensor, test_logits: torch.Tensor) -> FidelityStats:
    """Compare next-token distributions position by position (logits [N, V], same tokens)."""
    return summarize(*per_token(ref_logits, test_logits))


@torch.inference_mode()
def _window_logits(lm, tokens: torch.Tensor, cache_factory) -> torch.Tensor:
    lm.model.setup_cache(1, tokens.numel(), cache_factory)
    tokens = tokens.to(lm.device)
    return lm.model(tokens[None], torch.arange(tokens.numel(), device=lm.device))[0].cpu()


def _leading_tokens(tokenizer, text: str, need: int) -> list[int]:
    """Tokens of the first lines of ``text`` (at least ``need`` + a margin): the same ids the whole text starts
    with, since the cut is at a line end, without tokenizing all of it."""
    n_chars = 8 * need
    while True:
        prefix = text if n_chars >= len(text) else text[: text.rfind("\n", 0, n_chars) + 1]
        ids = tokenizer.encode(prefix, add_special_tokens=False)
        if len(ids) > need + 64 or len(prefix) == len(text):
            return ids
        n_chars *= 2


def wikitext_fidelity(ref_lm, test_lm, data_dir=None, ctx: int = 512, max_windows: int = 4,
                      ref_cache_factory=None, test_cache_factory=None) -> FidelityStats:
    """KL / agreement / perplexity of ``test_lm`` against ``ref_lm`` on the first WikiText-2 test windows."""
    if max_windows < 1:
        raise UserError(f"fidelity windows must be >= 1, got {max_windows}")
    ids = torch.tensor(_leading_tokens(ref_lm.tokenizer, data_file(WIKITEXT2_TEST, data_dir).read_text(),
                                       ctx * max_windows))
    kls, agrees, nll_ref, nll_test = [], [], 0.0, 0.0
    for w in track(windows(len(ids), ctx)[:max_windows], description="fidelity (KL vs reference)", transient=True):
        tokens = ids[w.begin : w.end]
        ref, test = _window_logits(ref_lm, tokens, ref_cache_factory)[:-1], _window_logits(test_lm, tokens, test_cache_factory)[:-1]
        kl, agree = per_token(ref, test)
        kls.append(kl)
        agrees.append(agree)
        nll_ref += float(F.cross_entropy(ref.float(), tokens[1:], reduction="sum"))
        nll_test += float(F.cross_entropy(test.float(), tokens[1:], reduction="sum"))
    kl, agree = torch.cat(kls), torch.cat(agrees)
    return summarize(kl, agree, ppl_ref=math.exp(nll_ref / kl.numel()), ppl_test=math.exp(nll_test / kl.numel()))
