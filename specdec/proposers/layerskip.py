"""``layerskip:L`` — self-drafting with the target's first L layers + final norm + head.

No weights are copied and no second cache is allocated: the draft writes into the target's own KV cache for
layers < L. That is consistent because a layer's K/V at a position depends only on the tokens up to it and
on layers below, which draft and target share: every committed position < ``decoder.pos`` already holds
exactly what the draft would compute, and the positions the draft writes (>= ``decoder.pos``) are the ones
the target's next verification overwrites before it reads them. After a rejection the target rolls back its
position; the draft restarts from that position, so no stale entry is ever read by either.
"""
from __future__ import annotations

import torch

from runtime.errors import UserError
from specdec.proposers.base import AutoregressiveDraft, register_proposer


@register_proposer("layerskip")
class LayerSkipProposer(AutoregressiveDraft):
    def __init__(self, model, n_layers: int):
        total = len(model.layers)
        if not 1 <= n_layers <= total - 1:
            raise UserError(f"layerskip: L must be in 1..{total - 1} (the target has {total} layers), got {n_layers}")
        self.model, self.n_layers = model, n_layers
        self.decoder = None
        self.pos = 0

    @classmethod
    def from_spec(cls, arg, target):
        try:
            return cls(target.model, int(arg))
        except ValueError:
            raise UserError(f"layerskip needs a layer count: layerskip:L, got {arg!r}") from None

    @property
    def label(self) -> str:
        return f"layerskip:{self.n_layers}"

    def attach(self, decoder):
        if decoder.model is not self.model:
            raise UserError("layerskip drafts from the target it was built for")
        self.decoder = decoder

    @torch.inference_mode()
    def forward(self, tokens: list[int]) -> torch.Tensor:
        device = self.model.embed_tokens.weight.device
        ids = torch.tensor([tokens], dtype=torch.long, device=device)
        logits = self.model(ids, torch.arange(self.pos, self.pos + len(tokens), device=device), n_layers=self.n_layers)
        self.pos += len(tokens)
        return logits[0, -1]

    def catch_up(self, context):
        self.pos = self.decoder.pos  # the target cache holds context[:pos] in every layer
        return self.forward(context[self.pos:])

    def step(self, token):
        return self.forward([token])
