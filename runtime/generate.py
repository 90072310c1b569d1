"""Prefill + decode with the native runtime's explicit KV cache: batch 1, greedy or sampled (``Decoder``), and
several prompts at once, greedy (``greedy_batch``)."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from runtime.compiled import CompiledStep, cache_span
from runtime.errors import UserError
from runtime.hardware import sync
from runtime.loading import LoadedModel
from runtime.sampling import SamplingConfig, next_token


@dataclass
class GenerationResult:
    prompt_tokens: list[int]
    tokens: list[int]
    text: str
    prefill_s: float
    decode_s: float
    finish_reason: str  # "eos" | "length"
    stats: dict = field(default_factory=dict)  # proposer statistics when speculative
    chunk_s: list[float] = field(default_factory=list)  # when each chunk of tokens was ready, s after the call began

    @property
    def decode_tokens_per_s(self) -> float:
        """New tokens after the first (which prefill produces) per second of decoding."""
        return (len(self.tokens) - 1) / self.decode_s if self.decode_s > 0 and len(self.tokens) > 1 else 0.0

    def summary(self) -> str:
        return (f"prompt {len(self.prompt_tokens)} tok, prefill {self.prefill_s * 1e3:.0f} ms, "
                f"{len(self.tokens)} new tok, decode {self.decode_tokens_per_s:.1f} tok/s ({self.finish_reason})")


def eos_token_ids(lm: LoadedModel) -> set[int]:
    ids = set()
    gen_cfg = Path(lm.path) / "generation_config.json"
    if gen_cfg.exists():
        eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if lm.tokenizer.eos_token_id is not None:
        ids.add(lm.tokenizer.eos_token_id)
    return ids


def encode_prompt(tokenizer, prompt: str, chat: bool | None = None) -> list[int]:
    """Token ids for ``prompt``; instruct models (those with a chat template) get it applied."""
    use_chat = getattr(tokenizer, "chat_template", None) is not None if chat is None else chat
    if use_chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=False)
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(prompt)


class Decoder:
    """Owns a KV cache of its model and a position (several decoders of one model keep theirs apart: each puts its
    own back before it runs); ``rollback`` truncates to an earlier position. ``compile_mode`` (a
    name in ``runtime.compiled.MODES``) runs one-token forwards, and those ``forward(..., compiled=True)`` asks for,
    through compiled steps (one per token count, in ``steps``), which read the first ``span`` cache positions
    (``reserve``; one graph per span); None keeps them eager."""

    def __init__(self, lm: LoadedModel, max_len: int = 2048, cache_factory=None, compile_mode: str | None = None):
        self.lm = lm
        self.model = lm.model
        self.max_len = min(max_len, lm.model.args.max_seq_len)
        self.cache_factory = cache_factory
        self.pos = 0
        self.eos_ids = eos_token_ids(lm)
        self.model.setup_cache(1, self.max_len, cache_factory)
        self.cache = self.model.cache_state()  # this decoder's own, put back where another decoder replaced it
        self.compile_mode = compile_mode
        self.span = self.max_len  # cache positions the compiled steps read (``reserve``)
        self.fallback: str | None = None  # why decoding went back to the eager step (``fall_back``)
        self.steps: dict[int, CompiledStep] = {1: CompiledStep(self.model, compile_mode)} if compile_mode else {}
        self.hidden: torch.Tensor | None = None  # [max_len, dim] final hidden state per position, once keep_hidden()
        self.aux_layers: tuple[int, ...] = ()  # layers whose outputs precede it in ``hidden``

    @property
    def step(self) -> CompiledStep | None:
        """The compiled one-token step (None without ``compile_mode``)."""
        return self.steps.get(1)

    @property
    def step_label(self) -> str:
        """What decoding runs, as records say it: ``eager``, ``compiled (MODE)``, ``eager (fallback: why)`` when
        the one-token step did not compile, or the verification lengths that ran eager."""
        if self.fallback:
            return f"eager (fallback: {self.fallback})"
        if not self.compile_mode:
            return "eager"
        if self.step.fallback:
            return f"eager (fallback: {self.step.fallback})"
        eager = sorted(n for n, s in self.steps.items() if s.fallback)
        return f"compiled ({self.compile_mode})" + (f"; {eager}-token verification eager (fallback: "
                                                    f"{self.steps[eager[0]].fallback})" if eager else "")

    def fall_back(self, reason: str) -> None:
        """Decode on the eager step from now on, and say why in ``step_label``."""
        self.compile_mode, self.fallback = None, reason

    @property
    def compile_s(self) -> float:
        """Seconds the compiled steps took to build so far (one-time; not in any decode time measured after)."""
        return sum(s.compile_s or 0.0 for s in self.steps.values())

    def keep_hidden(self, aux_layers: tuple[int, ...] = ()) -> None:
        """From now on every forward also stores the final-norm hidden state of each position it runs, after the
        outputs of ``aux_layers`` (concatenated; rows past ``pos`` after a rollback are stale and overwritten later,
        like the KV cache; compiled steps do not return those, so decoding falls back to eager). Logits are
        unchanged."""
        aux_layers = tuple(aux_layers)
        if self.hidden is not None and aux_layers != self.aux_layers:
            raise UserError(f"this decoder already keeps the outputs of layers {self.aux_layers}, not {aux_layers}")
        if aux_layers and self.compile_mode:
            self.fall_back("a fused EAGLE head reads intermediate layers, which the compiled steps do not return")
        if self.hidden is None:
            dtype = self.model.embed_tokens.weight.dtype
            width = (len(aux_layers) + 1) * self.model.args.dim
            self.hidden = torch.zeros(self.max_len, width, dtype=dtype, device=self.lm.device)
            self.aux_layers = aux_layers

    def reset(self) -> None:
        self.pos = 0

    def reserve(self, positions: int) -> None:
        """The coming request fills at most ``positions`` positions: compiled steps read those, rounded up
        (``runtime.compiled.cache_span``), not the whole cache. A token past them widens the span."""
        self.span = cache_span(positions, self.max_len)

    def rollback(self, pos: int) -> None:
        """Forget everything at positions >= pos (stale cache entries are overwritten before being read)."""
        if not 0 <= pos <= self.pos:
            raise ValueError(f"cannot roll back to {pos}; cache holds {self.pos} positions")
        self.pos = pos

    @torch.inference_mode()
    def forward(self, tokens: list[int] | torch.Tensor, n_layers: int | None = None,
                compiled: bool = False, padding: int = 0) -> torch.Tensor:
        """Append ``tokens`` at the current position; returns logits [len(tokens), vocab]. With ``compile_mode``, one
        token, or any count when ``compiled``, runs through the compiled step for that count (built on first use).
        ``padding``: that many trailing tokens are filler whose logits are dropped: they may lie past the span."""
        device = self.lm.device
        if not self.model.holds(self.cache):
            self.model.restore_cache(self.cache)
        ids = torch.as_tensor(tokens, dtype=torch.long, device=device).reshape(1, -1)
        n = ids.shape[1]
        if self.pos + n > self.max_len:
            raise UserError(f"sequence of {self.pos + n} tokens exceeds max length {self.max_len}; raise --max-len")
        input_pos = torch.arange(self.pos, self.pos + n, device=device)
        if self.compile_mode and (n == 1 or compiled) and n_layers is None:
            if n not in self.steps:
                self.steps[n] = CompiledStep(self.model, self.compile_mode)
                if self.steps[1].regions is False:  # the one-token step's kernels did not build in a region
                    self.steps[n].regions = False
            if self.pos + n - padding > self.span:
                self.reserve(self.pos + n - padding)
            logits, hidden = self.steps[n](ids, input_pos, self.span)
        else:
            logits, hidden = self.model(ids, input_pos, n_layers=n_layers, return_hidden=True,
                                        aux_layers=self.aux_layers)
        if self.hidden is not None and n_layers is None:
            self.hidden[self.pos : self.pos + n] = hidden[0]
        self.pos += n
        return logits[0]

    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingConfig = SamplingConfig(),
                 ignore_eos: bool = False, positions: int | None = None) -> GenerationResult:
        """``positions``: what the request reserves (``reserve``; default prompt + max_new_tokens): a warm-up run
        builds the steps of longer requests with it."""
        if max_new_tokens < 1:
            raise UserError(f"max new tokens must be >= 1, got {max_new_tokens}")
        gen = sampling.generator(self.lm.device)
        self.reset()
        self.reserve(positions or len(prompt_ids) + max_new_tokens)
        sync(self.lm.device)
        t0 = time.perf_counter()
        logits = self.forward(prompt_ids)[-1]
        token = int(next_token(logits, sampling, gen))
        t1 = time.perf_counter()
        out, reason, chunk_s = [token], "length", [t1 - t0]
        while len(out) < max_new_tokens:
            if token in self.eos_ids and not ignore_eos:
                reason = "eos"
                break
            token = int(next_token(self.forward([token])[-1], sampling, gen))
            out.append(token)
            chunk_s.append(time.perf_counter() - t0)
        else:
            reason = "eos" if (token in self.eos_ids and not ignore_eos) else "length"
        sync(self.lm.device)
        t2 = time.perf_counter()
        text = self.lm.tokenizer.decode(out, skip_special_tokens=True)
        return GenerationResult(list(prompt_ids), out, text, t1 - t0, t2 - t1, reason, chunk_s=chunk_s)


@torch.inference_mode()
def greedy_batch(lm: LoadedModel, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy answers to several prompts in one left-padded batch, each stopping after its first end-of-turn token:
    ``Decoder.generate``'s tokens up to rounding. Rows without padding match bitwise; a padded row's attention sums
    over a longer (masked) key tail, which in bf16 can round differently and flip a near-tie (default model, 16
    Alpaca prompts: 11 of 16 answers identical, the others diverged after 6-46 tokens; fp32 tiny model: all).
    Re-allocates the model's KV cache: a ``Decoder`` on the same model must be created afterwards."""
    if max_new_tokens < 1:
        raise UserError(f"max new tokens must be >= 1, got {max_new_tokens}")
    width = max(len(p) for p in prompts)
    if width + max_new_tokens > lm.model.args.max_seq_len:
        raise UserError(f"sequence of {width + max_new_tokens} tokens exceeds max length {lm.model.args.max_seq_len}")
    device = lm.device
    pad = torch.tensor([width - len(p) for p in prompts], device=device)
    ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts], device=device)
    stop = eos_token_ids(lm)
    eos = torch.tensor(sorted(stop), dtype=torch.long, device=device)
    lm.model.setup_cache(len(prompts), width + max_new_tokens)
    token = lm.model(ids, torch.arange(width, device=device), pad=pad)[:, -1].argmax(-1)
    out, done = [token], torch.isin(token, eos)
    while len(out) < max_new_tokens and not bool(done.all()):
        pos = torch.tensor([width + len(out) - 1], device=device)
        token = lm.model(token[:, None], pos, pad=pad)[:, -1].argmax(-1)
        out.append(token)
        done |= torch.isin(token, eos)
    rows = torch.stack(out, 1).tolist()
    return [row[: next((i + 1 for i, t in enumerate(row) if t in stop), len(row))] for row in rows]
