"""Separate draft models: ``draft:PATH[@SCHEME[:METHOD]]`` (another checkpoint with the target's vocabulary,
optionally quantized) and ``selfquant:SCHEME[:METHOD]`` (a quantized copy of the target)."""
from __future__ import annotations

import copy
from dataclasses import replace

from runtime.errors import UserError
from runtime.loading import LoadedModel, load_model
from runtime.generate import Decoder
from specdec.proposers.base import AutoregressiveDraft, register_proposer
from quant.quantize import quantize_model


def check_same_vocab(target: LoadedModel, draft: LoadedModel) -> None:
    """Speculative sampling compares distributions token by token: the vocabularies must be identical."""
    t_size, d_size = target.model.args.vocab_size, draft.model.args.vocab_size
    if t_size != d_size or target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
        raise UserError(f"draft {draft.path} has another vocabulary than target {target.path} "
                        f"(sizes {d_size} vs {t_size}); use a draft with the target's tokenizer")


def quantize_copy(lm: LoadedModel, scheme_text: str, method: str) -> LoadedModel:
    """A quantized copy of ``lm`` (``quant.quantize.quantize_model`` on a deep copy; ``lm`` stays intact)."""
    twin = replace(lm, model=copy.deepcopy(lm.model))
    quantize_model(twin, scheme_text, method, progress=False)
    return twin


def split_scheme(text: str) -> tuple[str, str]:
    scheme, _, method = text.partition(":")
    return scheme, method or "rtn"


class DraftModelProposer(AutoregressiveDraft):
    """Runs its own model and KV cache; before each proposal it rolls its cache back to the longest prefix
    it shares with the context (rejected drafts drop out) and feeds the rest."""

    def __init__(self, draft: LoadedModel, label: str):
        self.draft = draft
        self._label = label
        self.target: Decoder | None = None
        self.decoder: Decoder | None = None
        self.cached: list[int] = []

    @property
    def label(self) -> str:
        return self._label

    def attach(self, decoder):
        self.target = decoder
        self.decoder = Decoder(self.draft, decoder.max_len, compile_mode=decoder.compile_mode)
        self.cached = []

    def reset(self):
        self.decoder.reset()
        self.decoder.reserve(self.target.span)  # the target's request: its compiled steps read as many positions
        self.cached = []

    def catch_up(self, context):
        shared = 0
        limit = min(len(self.cached), len(context) - 1)  # always feed at least one token to get logits
        while shared < limit and self.cached[shared] == context[shared]:
            shared += 1
        self.decoder.rollback(shared)
        self.cached = list(context)
        return self.decoder.forward(context[shared:])[-1]

    def step(self, token):
        self.cached.append(token)
        return self.decoder.forward([token])[-1]


@register_proposer("draft")
class SeparateDraft(DraftModelProposer):
    @classmethod
    def from_spec(cls, arg, target):
        if not arg:
            raise UserError("draft needs a model: draft:PATH or draft:PATH@w4g32-asym")
        path, _, scheme = arg.partition("@")
        lm = load_model(path, target.dtype, attn_implementation=target.model.attn_implementation, device=target.device)
        check_same_vocab(target, lm)
        if scheme:
            lm = quantize_copy(lm, *split_scheme(scheme))
        return cls(lm, f"draft:{arg}")


@register_proposer("selfquant")
class SelfQuantDraft(DraftModelProposer):
    @classmethod
    def from_spec(cls, arg, target):
        if not arg:
            raise UserError("selfquant needs a scheme: e.g. selfquant:w4g32-asym")
        return cls(quantize_copy(target, *split_scheme(arg)), f"selfquant:{arg}")
