"""Calibration data and per-layer input statistics for calibrated weight methods (GPTQ, AWQ).

Sources (``CalibConfig.source``):

* ``wikitext2``: the WikiText-2 *validation* split, ``wikitext2/tokens/valid.txt`` in the data dir. It is the
  tokenized release (rare words are ``<unk>``, hyphens ``@-@``), used because no raw validation file exists and
  calibrating on ``wiki.test.raw`` would calibrate on the split the perplexity eval scores.
* ``self``: text the model samples itself (temperature 1, EOS suppressed) after a few seed prompts put through
  its chat template, so calibration needs no data at all.
* ``PATH.jsonl``: the ``text`` field of every row.

Text sources are joined, tokenized once, and ``samples`` windows of ``seqlen`` tokens start at random offsets
(seeded), as in the GPTQ/AWQ reference code. Statistics are collected in one pass over the full-precision
model (no block-by-block re-collection on quantized outputs).
"""
from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.progress import track
from torch import nn

from runtime.data import data_file, read_jsonl
from runtime.errors import UserError
from quant.methods.base import STAT_KINDS, LayerStats
from runtime.generate import eos_token_ids, encode_prompt
from runtime.sampling import SamplingConfig, sample_from, logits_to_probs

WIKITEXT2_VALID = "wikitext2/tokens/valid.txt"
SELF_PROMPTS = (
    "Tell me a story about a lighthouse keeper.",
    "Explain how a bicycle works.",
    "Write a short essay about the history of bread.",
    "Describe a day in the life of a software engineer.",
    "What are the main causes of the seasons on Earth?",
    "Give me advice on learning a new language.",
    "Summarize the plot of a famous novel you know.",
    "How do vaccines train the immune system?",
)


@dataclass(frozen=True)
class CalibConfig:
    source: str = "wikitext2"  # wikitext2 | self | PATH.jsonl
    samples: int = 128
    seqlen: int = 512
    seed: int = 0
    data_dir: str | Path | None = None

    def __post_init__(self):
        if self.samples < 1:
            raise UserError(f"calibration samples must be >= 1, got {self.samples}")
        if self.seqlen < 8:
            raise UserError(f"calibration seqlen must be >= 8 tokens, got {self.seqlen}")
        if self.source not in TEXT_SOURCES and self.source != "self":
            path = Path(self.source)
            if path.suffix != ".jsonl":
                raise UserError(f"calibration source {self.source!r}: use wikitext2, self or a PATH.jsonl")
            if not path.is_file():
                raise UserError(f"calibration file {path} does not exist")

    @property
    def label(self) -> str:
        return f"{Path(self.source).name}:{self.samples}x{self.seqlen}:seed{self.seed}"

    @property
    def fingerprint(self) -> str:
        """``label`` plus a hash of the text it reads (``self``: the model's own samples, fixed by the label)."""
        if self.source == "self":
            return self.label
        text = TEXT_SOURCES[self.source](self) if self.source in TEXT_SOURCES else Path(self.source).read_text()
        return f"{self.label}:{hashlib.sha256(text.encode()).hexdigest()[:16]}"


TEXT_SOURCES = {"wikitext2": lambda cfg: data_file(WIKITEXT2_VALID, cfg.data_dir).read_text()}


def _jsonl_text(path: Path) -> str:
    rows = read_jsonl(path)
    texts = [row["text"] for row in rows if isinstance(row.get("text"), str)]
    if not texts:
        raise UserError(f"calibration file {path} has no rows with a \"text\" field")
    return "\n\n".join(texts)


def calibration_batches(cfg: CalibConfig, lm) -> list[list[int]]:
    """``cfg.samples`` token windows of exactly ``cfg.seqlen`` tokens each."""
    if cfg.source == "self":
        return self_generated_batches(cfg, lm)
    text = TEXT_SOURCES[cfg.source](cfg) if cfg.source in TEXT_SOURCES else _jsonl_text(Path(cfg.source))
    ids = lm.tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < cfg.seqlen:
        raise UserError(f"calibration source {cfg.source} has {len(ids)} tokens, fewer than seqlen {cfg.seqlen}; "
                        "lower --calib-seqlen or add text")
    rng = random.Random(cfg.seed)
    starts = [rng.randint(0, len(ids) - cfg.seqlen) for _ in range(cfg.samples)]
    return [ids[s : s + cfg.seqlen] for s in starts]


@torch.inference_mode()
def self_generated_batches(cfg: CalibConfig, lm, batch: int = 16) -> list[list[int]]:
    """Sample continuations of seed prompts from the model itself, ``batch`` sequences per forward."""
    model, tok = lm.model, lm.tokenizer
    sampling = SamplingConfig(temperature=1.0, seed=cfg.seed)
    gen = sampling.generator(lm.device)
    eos = sorted(eos_token_ids(lm))
    prompts = [encode_prompt(tok, p) for p in SELF_PROMPTS]
    out: list[list[int]] = []
    chunks = [(i, min(batch, cfg.samples - i)) for i in range(0, cfg.samples, batch)]
    for start, n in track(chunks, description="sampling calibration text", transient=True):
        prompt = prompts[(start // batch) % len(prompts)][: cfg.seqlen - 1]
        seqs = torch.tensor([prompt] * n, device=lm.device)
        model.setup_cache(n, cfg.seqlen)
        logits = model(seqs, torch.arange(len(prompt), device=lm.device))[:, -1]
        while seqs.shape[1] < cfg.seqlen:
            logits[:, eos] = float("-inf")
            nxt = sample_from(logits_to_probs(logits, sampling), gen)
            logits = model(nxt[:, None], torch.tensor([seqs.shape[1]], device=lm.device))[:, -1]
            seqs = torch.cat([seqs, nxt[:, None]], 1)
        out.extend(seqs.tolist())
    return out


class _Accumulator:
    """Running statistics of one input tensor stream (shared by layers that read the same tensor)."""

    def __init__(self, need: tuple[str, ...], rows_per_batch: int, generator: torch.Generator):
        self.need, self.rows_per_batch, self.gen = need, rows_per_batch, generator
        self.stats = LayerStats()
        self.abs_sum: torch.Tensor | None = None
        self.samples: list[torch.Tensor] = []

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()
        st = self.stats
        st.n_tokens += x.shape[0]
        if "hessian" in self.need:
            xtx = (x.T @ x).double()
            st.hessian = xtx if st.hessian is None else st.hessian + xtx
        if "abs_mean" in self.need:
            s = x.abs().sum(0)
            self.abs_sum = s if self.abs_sum is None else self.abs_sum + s
        if "abs_max" in self.need:
            m = x.abs().amax(0)
            st.abs_max = m if st.abs_max is None else torch.maximum(st.abs_max, m)
        if "samples" in self.need:
            pick = torch.randperm(x.shape[0], generator=self.gen)[: self.rows_per_batch].sort().values
            self.samples.append(x[pick].clone())

    def finish(self) -> LayerStats:
        if self.abs_sum is not None:
            self.stats.abs_mean = self.abs_sum / self.stats.n_tokens
        if self.samples:
            self.stats.samples = torch.cat(self.samples)
        return self.stats


class _Stop(Exception):
    """Raised at the last hooked layer so the rest of the forward (e.g. the lm_head) is skipped."""


@torch.inference_mode()
def collect_layer_stats(lm, batches: list[list[int]], layer_names: list[str],
                        need: tuple[str, ...] = STAT_KINDS, max_samples: int = 512,
                        batch_size: int = 4, seed: int = 0) -> dict[str, LayerStats]:
    """Input statistics of the named Linear layers over the calibration ``batches`` (forward hooks).

    Layers fed the very same tensor (q/k/v, gate/up) get one shared ``LayerStats``. ``samples`` keeps about
    ``max_samples`` random input rows per layer (in token order within each forward of ``batch_size`` sequences).
    """
    unknown = [k for k in need if k not in STAT_KINDS]
    if unknown:
        raise UserError(f"unknown statistics {unknown}: use {', '.join(STAT_KINDS)}")
    if not batches:
        raise UserError("no calibration batches: calibration needs at least one sample")
    model = lm.model
    modules = dict(model.named_modules())
    missing = [n for n in layer_names if not isinstance(modules.get(n), nn.Linear)]
    if missing:
        raise UserError(f"no Linear layers named {missing[:3]} in the model")
    gen = torch.Generator().manual_seed(seed)
    chunks = range(0, len(batches), batch_size)
    rows = -(-max_samples // len(chunks))  # sampled input rows per forward
    accumulators: dict[str, _Accumulator] = {}
    owner: dict[str, str] = {}  # layer name -> name of the layer whose accumulator it shares
    last: dict = {"x": None, "name": None}
    order = {name: i for i, name in enumerate(modules)}
    last_layer = max(layer_names, key=order.__getitem__)  # stop the forward once its input is recorded

    def hook(name):
        def pre_hook(module, args):
            x = args[0]
            if last["x"] is x:
                owner[name] = owner.get(last["name"], last["name"])
            elif name not in owner:
                accumulators.setdefault(name, _Accumulator(need, rows, gen)).add(x)
                last["x"], last["name"] = x, name
            if name == last_layer:
                raise _Stop
        return pre_hook

    handles = [modules[n].register_forward_pre_hook(hook(n)) for n in layer_names]
    try:
        for i in track(chunks, description="calibration statistics", transient=True):
            chunk = torch.tensor(batches[i : i + batch_size])
            model.setup_cache(chunk.shape[0], chunk.shape[1])
            last["x"] = None
            try:
                model(chunk, torch.arange(chunk.shape[1]))
            except _Stop:
                pass
    finally:
        for h in handles:
            h.remove()
    done = {name: acc.finish() for name, acc in accumulators.items()}
    return {name: done[owner.get(name, name)] for name in layer_names}
