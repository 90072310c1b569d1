"""Speculative decoding on the native runtime (batch 1): propose K tokens, verify them in one target
forward, keep the accepted prefix plus one target token, roll the caches back past the rest."""
from __future__ import annotations

import time

import torch

from runtime.errors import UserError
from runtime.hardware import probe, sync
from runtime.loading import LoadedModel
from runtime.generate import Decoder, GenerationResult
from specdec.metrics import AcceptanceStats
from specdec.proposers import Proposer, build_proposer
from specdec.proposers.base import check_k
from runtime.sampling import SamplingConfig, next_token
from runtime.transformer import KEY_ALIGN, attention_for, attention_rows_differing
from specdec.verify import verify


def variant_kernels(model: torch.nn.Module) -> dict[str, str]:
    """Linear kernels whose rows depend on the batch here (probed): layer name -> kernel."""
    return {name: m.kernel_detail for name, m in model.named_modules()
            if hasattr(m, "batch_invariant") and not m.batch_invariant}


def check_bf16_exact(target: LoadedModel) -> None:
    """Refuse bf16 speculation whose output could differ from plain decoding (attention or a linear kernel
    that is not batch-invariant on this machine), naming what breaks it and what works."""
    if target.model.attn_implementation != "eager":
        raise UserError("bf16 speculation needs batch-invariant attention for its output to equal plain "
                        "decoding: load the target with attn_implementation='eager'")
    model = target.model
    args = model.args
    attend = attention_for(model.attn_implementation, model.embed_tokens.weight.device, target.dtype)
    differing = attention_rows_differing(attend, args.n_kv_heads,
                                         args.n_heads // args.n_kv_heads, args.head_dim,
                                         KEY_ALIGN.get(model.attn_implementation, 1), args.max_seq_len)
    if differing:
        raise UserError(f"bf16 speculation would not be token-exact on this machine: its attention "
                        f"({attend.__name__}) gives {differing} probed queries other bits among a verification's than "
                        f"alone (bf16 matmul here: {probe().bf16_matmul}); speculate in fp32 (--dtype fp32)")
    variant = variant_kernels(model)
    if variant:
        kernels = sorted({detail.split(" (")[0] for detail in variant.values()})
        raise UserError(f"bf16 speculation would not be token-exact on this machine: {len(variant)} linear layers "
                        f"run kernels whose rows depend on the batch (probed: {', '.join(kernels)}); speculate in "
                        "fp32 (--dtype fp32), or on a CPU with oneDNN bf16 prepacking (AVX-512)")


def compiled_rows_differing(decoder: Decoder, tokens: list[int], padding: int = 0) -> tuple[torch.Tensor, int]:
    """Logits of ``tokens`` through the decoder's compiled len(tokens)-token step, and how many of their rows
    differ bitwise from the compiled one-token steps' logits at the same positions (run first, then rolled back).
    ``padding``: trailing filler tokens (``Decoder.forward``), probed too."""
    start, n = decoder.pos, len(tokens)
    rows = torch.cat([decoder.forward([token], padding=int(i >= n - padding)) for i, token in enumerate(tokens)])
    decoder.rollback(start)
    logits = decoder.forward(tokens, compiled=True, padding=padding)
    return logits, int((logits != rows).any(-1).sum())


class SpeculativeDecoder:
    """Output equals plain decoding token for token when greedy, and in distribution when sampling. In bf16
    the target must use batch-invariant ("eager") attention: the logits of a verified token are then bitwise its
    decoded logits (in fp32 the MKL GEMMs are not batch-invariant; greedy equality is tested, not constructed).

    ``compile_mode`` runs the target's one-token and verification forwards (and a draft model's steps) through
    compiled steps; greedy output then equals plain decoding through the compiled one-token step, which each
    verification width's compiled step is probed against on its first call (``verify_logits``).

    ``k`` and ``sampling`` may be changed between requests; the proposer is bound to this decoder's caches.
    ``decoder``: the target's existing plain ``Decoder`` (its caches and compiled steps, e.g. another point's of the
    same model) instead of a new one; one that other points share needs a proposer that leaves it as it is
    (``Proposer.changes_target``)."""

    def __init__(self, target: LoadedModel, proposer: Proposer | str, k: int,
                 sampling: SamplingConfig = SamplingConfig(), max_len: int = 2048, compile_mode: str | None = None,
                 decoder: Decoder | None = None):
        if target.dtype == torch.bfloat16:
            check_bf16_exact(target)
        self.k = check_k(k)
        self.sampling = sampling
        self.proposer = build_proposer(proposer, target) if isinstance(proposer, str) else proposer
        if decoder is not None and decoder.lm is not target:
            raise ValueError("the decoder given must be the target's own")
        self.decoder = decoder or Decoder(target, max_len, compile_mode=compile_mode)
        # (compiled verification width, span) -> rows differing from the one-token steps'
        self.differing: dict[tuple[int, int], int] = {}
        self.proposer.attach(self.decoder)

    def start(self, prompt_ids: list[int], generator) -> int:
        """Reset both caches and prefill the prompt; returns the first token (sampled from the prefill)."""
        self.decoder.reset()
        self.proposer.reset()
        return int(next_token(self.decoder.forward(prompt_ids)[-1], self.sampling, generator))

    def verify_logits(self, tokens: list[int]) -> torch.Tensor:
        """The target's logits for ``tokens`` (the last context token and the draft) in one forward. Compiled, a
        draft runs padded to ``width`` rows, and the first call of each width and span is probed
        (``compiled_rows_differing``): greedy speculation is refused where a row differs, since its output could
        then differ from plain compiled decoding."""
        decoder, n = self.decoder, len(tokens)
        if decoder.compile_mode is None:
            return decoder.forward(tokens)
        width = self.width(n)
        tokens = [*tokens, *tokens[-1:] * (width - n)]
        if (width, decoder.span) in self.differing:
            logits = decoder.forward(tokens, compiled=True, padding=width - n)
        else:
            logits, self.differing[width, decoder.span] = compiled_rows_differing(decoder, tokens, width - n)
        inexact = self._inexact(width)
        if inexact:
            raise UserError(f"greedy speculation with --compile would not be token-exact here: {inexact}; "
                            "speculate with --compile eager")
        return logits[:n]

    def width(self, n: int) -> int:
        """Rows a compiled verification of ``n`` tokens runs: K+1, a shorter draft padded with copies of its last
        token (their rows are computed and dropped; every row is probed equal to the one-token step's, so this is
        exact), so one compiled step serves every draft length, where one per length cost a build each
        (n-gram drafts run short); ``n`` for no draft, or where K+1 rows would pass the cache's end."""
        fits = self.decoder.pos + self.k + 1 <= self.decoder.max_len
        return self.k + 1 if n > 1 and fits else n

    def _inexact(self, n: int) -> str | None:
        """Why greedy speculation through the compiled n-token verification could differ from plain compiled
        decoding (a row of its probe differed bitwise), or None."""
        decoder = self.decoder
        differing = self.differing.get((n, decoder.span))
        if not (differing and self.sampling.greedy) or decoder.steps[1].fallback or decoder.steps[n].fallback:
            return None
        return (f"the compiled {n}-token verification step's logits differ bitwise from the compiled one-token "
                f"step's in {differing} of {n} rows over {decoder.span} cache positions ({decoder.lm.precision})")

    def prepare(self, prompt_ids: list[int], k: int, positions: int | None = None) -> str | None:
        """Compiled: build and probe the steps rounds of ``k`` run (``width``: K+1 rows) for requests of
        ``positions`` positions (their span, ``Decoder.reserve``; None: the whole cache), so that no timed round
        compiles. Where the probe refuses greedy speculation, decoding goes back to the eager step
        (``Decoder.step_label`` says why); returns that reason. Eager: nothing to do."""
        if self.decoder.compile_mode is None:
            return None
        n = k + 1
        self.decoder.rollback(0)
        self.decoder.reserve(positions or self.decoder.max_len)
        self.decoder.forward(prompt_ids)
        start = self.decoder.pos
        if (n, self.decoder.span) not in self.differing:
            self.differing[n, self.decoder.span] = compiled_rows_differing(self.decoder, prompt_ids[-1:] * n)[1]
        self.decoder.rollback(start)
        reason = self._inexact(n)
        if reason:
            self.decoder.fall_back(reason)
        return reason

    def step(self, context: list[int], k: int, generator, stats: AcceptanceStats) -> list[int]:
        """One propose + verify round after ``context`` (the target cache holds all of it but the last token);
        returns the accepted draft tokens plus the target's correction or bonus token."""
        t0 = time.perf_counter()
        proposal = self.proposer.propose(context, k, self.sampling, generator)
        t1 = time.perf_counter()
        logits = self.verify_logits([context[-1], *proposal.tokens])
        verdict = verify(logits, proposal, self.sampling, generator)
        self.decoder.rollback(len(context) + verdict.accepted)
        stats.observe(len(proposal.tokens), verdict.accepted, t1 - t0, time.perf_counter() - t1)
        return [*proposal.tokens[:verdict.accepted], verdict.token]

    def generate(self, prompt_ids: list[int], max_new_tokens: int, ignore_eos: bool = False,
                 positions: int | None = None) -> GenerationResult:
        """``positions``: as ``Decoder.generate``'s."""
        if max_new_tokens < 1:
            raise UserError(f"max new tokens must be >= 1, got {max_new_tokens}")
        if len(prompt_ids) + max_new_tokens > self.decoder.max_len:
            raise UserError(f"prompt ({len(prompt_ids)}) + {max_new_tokens} new tokens exceed max length "
                            f"{self.decoder.max_len}; raise max_len")
        device = self.decoder.lm.device
        generator = self.sampling.generator(device)
        eos = set() if ignore_eos else self.decoder.eos_ids
        stats = AcceptanceStats(self.k)
        self.decoder.reserve(positions or len(prompt_ids) + max_new_tokens)
        sync(device)
        t0 = time.perf_counter()
        out = [self.start(prompt_ids, generator)]
        t1 = time.perf_counter()
        chunk_s = [t1 - t0]
        while len(out) < max_new_tokens and out[-1] not in eos:
            context = [*prompt_ids, *out]
            k = min(self.k, max_new_tokens - len(out), self.decoder.max_len - len(context))
            for token in self.step(context, k, generator, stats):
                out.append(token)
                if len(out) == max_new_tokens or token in eos:
                    break
            chunk_s.append(time.perf_counter() - t0)
        sync(device)
        t2 = time.perf_counter()
        reason = "eos" if out[-1] in eos else "length"
        text = self.decoder.lm.tokenizer.decode(out, skip_special_tokens=True)
        return GenerationResult(list(prompt_ids), out, text, t1 - t0, t2 - t1, reason,
                                stats={"proposer": self.proposer.label, **stats.to_dict()}, chunk_s=chunk_s)
