"""The proposer interface, the registry and the one place spec strings are parsed."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.errors import UserError
from runtime.hardware import EXACT_ROWS
from runtime.loading import LoadedModel
from runtime.registry import Registry
from runtime.sampling import SamplingConfig, logits_to_probs, sample_from

MAX_K = EXACT_ROWS - 1  # a verification's rows (K + 1) stay where bf16 kernels are probed batch-invariant


def check_k(k: int) -> int:
    """``k`` if it is a valid number of draft tokens per step (the one K rule of every entry point)."""
    if not 1 <= k <= MAX_K:
        raise UserError(f"K (draft tokens per step) must be in 1..{MAX_K}, got {k}")
    return k


def draw(logits: torch.Tensor, sampling, generator, qs: list) -> int:
    """One draft token from ``logits``: the argmax when greedy, else sampled, its distribution appended to ``qs``
    (the q the verifier needs)."""
    if sampling.greedy:
        return int(logits.argmax())
    q = logits_to_probs(logits, sampling)
    qs.append(q)
    return int(sample_from(q, generator))


@dataclass
class Proposal:
    """Up to K draft tokens; ``q`` [len(tokens), vocab] holds the draft distributions, None = one-hot."""

    tokens: list[int]
    q: torch.Tensor | None = None


class Proposer:
    """Proposes draft tokens continuing ``context`` (prompt + generated tokens so far)."""

    name = "?"
    # ``attach`` changes the target's decoder (what its forwards keep, or whether they run compiled): that decoder
    # then serves no other point (``serving.backends.native.NativeBackend.serve_also``)
    changes_target = False

    @classmethod
    def from_spec(cls, arg: str, target: LoadedModel) -> "Proposer":
        raise NotImplementedError

    @classmethod
    def check_spec(cls, arg: str, model: str) -> None:
        """Cheap checks of ARG for ``model`` before anything loads (a one-line UserError); default: none."""

    @property
    def label(self) -> str:
        return self.name

    def attach(self, decoder) -> None:
        """Called once per target ``Decoder`` before generating (draft caches are sized from it)."""

    def reset(self) -> None:
        """Called at the start of every request."""

    def propose(self, context: list[int], k: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Proposal:
        raise NotImplementedError


class AutoregressiveDraft(Proposer):
    """A draft model run token by token; subclasses say how it catches up with ``context`` and steps."""

    def catch_up(self, context: list[int]) -> torch.Tensor:
        """Feed what the draft has not seen of ``context``; return the logits after its last token."""
        raise NotImplementedError

    def step(self, token: int) -> torch.Tensor:
        raise NotImplementedError

    def propose(self, context, k, sampling, generator):
        if k == 0:
            return Proposal([])
        logits = self.catch_up(context)
        tokens, qs = [], []
        for i in range(k):
            tokens.append(draw(logits, sampling, generator, qs))
            if i + 1 < k:
                logits = self.step(tokens[-1])
        return Proposal(tokens, torch.stack(qs) if qs else None)


PROPOSERS: Registry[type[Proposer]] = Registry("proposer")
PROPOSER_EXAMPLES = "e.g. ngram:min=2,max=4, draft:PATH, layerskip:8, selfquant:w4g32-asym, eagle:HEAD_DIR; K as k=4"


def register_proposer(name: str):
    def deco(cls: type[Proposer]) -> type[Proposer]:
        cls.name = name
        return PROPOSERS.add(name, cls)

    return deco


@dataclass(frozen=True)
class ProposerSpec:
    """A parsed proposer string ``NAME[:ARG]``; a ``k=K`` item inside ARG is lifted out into ``k``."""

    name: str
    arg: str = ""
    k: int | None = None  # K given inside the string (``ngram:k=4``), else None

    @property
    def label(self) -> str:
        """The proposer string without K (what ``build_proposer`` and the stored configuration use)."""
        return f"{self.name}:{self.arg}" if self.arg else self.name

    def __str__(self) -> str:
        return self.label


def parse_proposer_spec(text: "str | ProposerSpec | None") -> ProposerSpec | None:
    """The one parser of proposer strings: None / "" / "none" -> None; an unknown name is a one-line UserError."""
    if text is None or isinstance(text, ProposerSpec):
        return text
    text = text.strip()
    if not text or text.lower() == "none":
        return None
    name, _, arg = text.partition(":")
    name = name.strip()
    if name not in PROPOSERS:
        raise UserError(f"unknown proposer {name!r}: use one of {', '.join(sorted(PROPOSERS))} ({PROPOSER_EXAMPLES})")
    items = [x.strip() for x in arg.split(",") if x.strip()]
    ks = [x for x in items if x.startswith("k=")]
    rest = ",".join(x for x in items if not x.startswith("k="))
    try:
        k = int(ks[-1][2:]) if ks else None
    except ValueError:
        raise UserError(f"proposer {text!r}: k must be an integer, e.g. ngram:k=4") from None
    return ProposerSpec(name, rest, None if k is None else check_k(k))


def check_proposer_spec(text: "str | ProposerSpec | None", model: str) -> None:
    """Parse ``text`` and let its proposer check its argument for ``model`` (what a search space runs for every
    listed proposer, so a bad one fails before the search starts)."""
    parsed = parse_proposer_spec(text)
    if parsed is not None:
        PROPOSERS.get(parsed.name).check_spec(parsed.arg, model)


def build_proposer(spec: "str | ProposerSpec", target: LoadedModel) -> Proposer:
    """``NAME[:ARG]`` -> a proposer for ``target``; unknown names are a UserError listing the known ones."""
    parsed = parse_proposer_spec(spec)
    if parsed is None:
        raise UserError(f"no proposer given ({PROPOSER_EXAMPLES})")
    return PROPOSERS.get(parsed.name).from_spec(parsed.arg, target)


def parse_params(arg: str, allowed: dict[str, type], proposer: str) -> dict:
    """``key=value,key=value`` with typed values; unknown keys and bad values are UserErrors."""
    params = {}
    for item in filter(None, (x.strip() for x in arg.split(","))):
        key, eq, value = item.partition("=")
        if not eq or key not in allowed:
            raise UserError(f"{proposer}: bad parameter {item!r}; use {', '.join(f'{k}=' for k in allowed)}")
        try:
            params[key] = allowed[key](value)
        except ValueError:
            raise UserError(f"{proposer}: {key} must be {allowed[key].__name__}, got {value!r}") from None
    return params
