"""``eagle:PATH[,weights=SCHEME]`` — a learned EAGLE-1 style draft head (specdec/eagle_head.py) drafting a chain
of K tokens from the target's own final hidden states.

The target decoder keeps the final-norm hidden state of every position it runs (``Decoder.keep_hidden``; after
the outputs of the layers a fused head reads). The
head consumes pairs (target state at t, token t+1) at position t and predicts the state at t+1, whose logits
come from the target's frozen LM head (or the rows a ``d2t`` map selects). Before each proposal it feeds the
pairs it has not seen (real states only: the target holds every context position but the last), then drafts
K tokens by feeding its own predicted state back with the drafted token. Positions it drafted at are
overwritten with real states the next time, so a rejection needs no other rollback. Verification is unchanged.
``weights=w8ch-sym`` runs the head's linears weight-only quantized (RTN, quant/ kernels).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.errors import UserError
from runtime.loading import read_config
from runtime.model_store import resolve_model
from specdec.eagle_head import load_head, quantize_head
from specdec.proposers.base import Proposal, Proposer, draw, parse_params, register_proposer


def parse_eagle(arg: str) -> tuple[str, dict]:
    """``PATH[,weights=SCHEME]`` -> (PATH, options)."""
    path, _, rest = (x.strip() for x in arg.partition(","))
    if not path:
        raise UserError("eagle needs a head directory: eagle:PATH (train one with quantspec train-draft)")
    return path, parse_params(rest, {"weights": str}, f"eagle:{path}")


@register_proposer("eagle")
class EagleProposer(Proposer):
    changes_target = True  # the target's forwards keep hidden states (and run eager with fused layers)

    def __init__(self, target, head, d2t: torch.Tensor | None, label: str):
        self.target, self.head, self.d2t, self._label = target, head, d2t, label
        model = target.model
        self.embed = model.embed_tokens
        self.draft_lm_head = None if d2t is None else model.lm_head.weight[d2t].detach().clone()
        self.decoder = None
        self.pos = 0  # head positions holding real (target-state) pairs

    @staticmethod
    def _load(arg: str, target_config: dict, dtype: torch.dtype):
        """``PATH[,weights=SCHEME]``: the head, its linears quantized when a weight scheme is given."""
        path, options = parse_eagle(arg)
        head, d2t, cfg = load_head(path, target_config, dtype)
        if options.get("weights", "none") != "none":
            quantize_head(head, options["weights"])
        return head, d2t, cfg

    @classmethod
    def from_spec(cls, arg, target):
        head, d2t, _ = cls._load(arg, target.config, target.dtype)
        return cls(target, head, d2t, f"eagle:{arg}")

    @classmethod
    def check_spec(cls, arg, model):
        """The head file and its shapes against ``model``'s config (a head is a few MB: loading it is the check)."""
        cls._load(arg, read_config(resolve_model(model)), torch.float32)

    @property
    def label(self) -> str:
        return self._label

    def attach(self, decoder):
        if decoder.model is not self.target.model:
            raise UserError("eagle drafts from the hidden states of the target it was built for")
        decoder.keep_hidden(self.head.fuse_layers)
        self.head.setup_cache(decoder.max_len)
        self.decoder = decoder
        self.pos = 0

    def reset(self):
        self.pos = 0

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits for one predicted state (-inf outside a reduced draft vocabulary)."""
        if self.d2t is None:
            return self.target.model.lm_head(h[None])[0]
        out = torch.full((self.target.model.args.vocab_size,), float("-inf"), dtype=h.dtype)
        out[self.d2t] = F.linear(h, self.draft_lm_head)
        return out

    @torch.inference_mode()
    def propose(self, context, k, sampling, generator):
        n = len(context)
        if k == 0 or n < 2:
            return Proposal([])
        if self.decoder.pos != n - 1:
            raise RuntimeError(f"eagle: target cache holds {self.decoder.pos} positions, expected {n - 1}")
        start = min(self.pos, n - 2)
        ids = torch.tensor(context[start + 1 : n], dtype=torch.long)
        hidden = self.decoder.hidden[start : n - 1]
        h = self.head(self.embed(ids)[None], hidden[None], torch.arange(start, n - 1))[0, -1]
        self.pos = n - 1
        tokens, qs = [], []
        for i in range(k):
            tokens.append(draw(self.logits(h), sampling, generator, qs))
            if i + 1 < k:
                pos = n - 1 + i
                emb = self.embed(torch.tensor([[tokens[-1]]]))
                h = self.head(emb, h[None, None], torch.tensor([pos]))[0, -1]
        return Proposal(tokens, torch.stack(qs) if qs else None)
