"""Train an EAGLE-1 style draft head (specdec/eagle_head.py) for a target, from the target itself.

Training set: the target's own greedy answers (self-distillation, through its chat template, generated in
left-padded batches by ``runtime.generate.greedy_batch``) to Alpaca instructions from the data dir
(``alpaca/alpaca_5000.json``, training prompts only; any instruction overlapping a Spec-Bench or MT-Bench turn is
dropped, GSM8K is never read) and, with ``n_context``, to long-context prompts shaped like Spec-Bench's
summarization and RAG turns but built from WikiText-2 validation passages; plus chunks of WikiText-2 validation
text. The target's final-norm hidden states
over each sequence are extracted teacher-forced. Loss per position: smooth L1
between the predicted and the target's next hidden state + ``ce_weight`` x cross-entropy of the draft's token
distribution against the target's next-token distribution (both through the target's frozen LM head). With
``ttt_steps`` > 1 the head is also trained on its own predictions (EAGLE-3's training-time test,
``EagleHead.unroll``): step s of every chain is scored against the same targets, weighted 0.8^(s-1). A held-out
slice gives a per-epoch acceptance estimate per chain step: how often the draft's token at step s equals the
target's greedy token (teacher-forced tokens, the head's own states; over every position, not only those where
the earlier steps hit, so it approximates rather than equals acceptance at draft position s given the earlier
ones, under greedy verification).
"""
from __future__ import annotations

import json
import random
import re
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from runtime.data import PROMPT_FILES, data_file, read_jsonl
from runtime.errors import UserError
from runtime.generate import Decoder, encode_prompt, greedy_batch
from runtime.loading import LoadedModel
from specdec.eagle_head import head_config, new_head, save_head

ALPACA = "alpaca/alpaca_5000.json"
WIKITEXT_VALID = "wikitext2/tokens/valid.txt"
Progress = Callable[[str, int, int, str], None]  # (stage, done, total, detail)


def _at_least(lo: int, flag: str) -> dict:
    """Field metadata: the smallest allowed value and the CLI flag an error names."""
    return {"min": lo, "flag": flag}


@dataclass
class TrainConfig:
    n_prompts: int = field(default=200, metadata=_at_least(0, "--num-prompts"))  # Alpaca instructions answered
    max_answer_tokens: int = field(default=64, metadata=_at_least(1, "--max-answer-tokens"))  # stops at end of turn
    n_wikitext: int = field(default=32, metadata=_at_least(0, "--wikitext"))  # WikiText-2 validation chunks
    wikitext_len: int = field(default=128, metadata=_at_least(2, "--wikitext-len"))  # tokens per chunk
    holdout: float = 0.1            # fraction of sequences held out for the acceptance estimate
    epochs: int = field(default=4, metadata=_at_least(1, "--epochs"))
    batch: int = field(default=8, metadata=_at_least(1, "--batch"))  # sequences per step
    lr: float = 1e-3
    ce_weight: float = field(default=0.1, metadata=_at_least(0, "--ce-weight"))  # EAGLE-1: regression 1, tokens 0.1
    draft_vocab: int | None = None  # reduced draft vocabulary (EAGLE-3 d2t): the N most frequent target tokens
    train_seconds: float | None = None  # wall-clock cap on the training loop (stops mid-epoch)
    seed: int = 0
    answer_seconds: float | None = None  # wall-clock cap on generating the answers (fewer prompts if reached)
    answer_batch: int = field(default=16, metadata=_at_least(1, "--answer-batch"))  # prompts answered together
    ttt_steps: int = field(default=1, metadata=_at_least(1, "--ttt-steps"))  # EAGLE-3 training-time test steps
    n_context: int = field(default=0, metadata=_at_least(0, "--context-prompts"))  # long-context task prompts
    context_len: int = field(default=384, metadata=_at_least(16, "--context-len"))  # passage tokens per prompt
    fuse_layers: tuple[int, ...] = ()  # target layers whose outputs the head fuses with the final state (EAGLE-3)
    head_layers: int = field(default=1, metadata=_at_least(1, "--head-layers"))  # decoder layers in the head

    def __post_init__(self):
        for f in fields(self):
            value, lo = getattr(self, f.name), f.metadata.get("min")
            if lo is not None and value is not None and value < lo:
                raise UserError(f"{f.metadata['flag']} must be >= {lo}, got {value}")


def parse_layers(text: str | None) -> tuple[int, ...]:
    """"2,15" -> (2, 15): the --fuse-layers value."""
    try:
        return tuple(int(x) for x in (text or "").split(",") if x.strip())
    except ValueError:
        raise UserError(f"--fuse-layers takes comma-separated layer indices like 2,15, got {text!r}") from None


@dataclass
class TrainResult:
    out: str
    config: dict
    n_sequences: int
    n_train_tokens: int
    n_heldout_tokens: int
    n_dropped_prompts: int
    n_alpaca_answers: int  # prompts answered within the answer cap, per source
    n_context_answers: int
    extract_s: float
    train_s: float
    eval_s: float
    steps: int
    epochs: list[dict] = field(default_factory=list)  # per epoch: loss, reg, ce, heldout_top1

    def to_dict(self) -> dict:
        return asdict(self)


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text.lower()).strip()


def benchmark_turns(data_dir=None) -> list[str]:
    """Every Spec-Bench and MT-Bench turn (normalized): what training prompts may not overlap."""
    turns = []
    for rel in PROMPT_FILES.values():
        for row in read_jsonl(data_file(rel, data_dir)):
            turns += [_norm(t) for t in row.get("turns") or [] if t]
    return turns


def overlaps(text: str, turns: list[str], min_len: int = 20) -> bool:
    """True when ``text`` equals a turn, or one contains the other (both compared normalized, >= min_len chars)."""
    t = _norm(text)
    return any(t == u or (len(t) >= min_len and t in u) or (len(u) >= min_len and u in t) for u in turns)


def alpaca_prompts(n: int, data_dir=None, seed: int = 0) -> tuple[list[str], int]:
    """(up to n Alpaca prompts in a seeded order, number dropped for overlapping a benchmark turn)."""
    rows = json.loads(data_file(ALPACA, data_dir).read_text())
    turns = benchmark_turns(data_dir)
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    prompts, dropped = [], 0
    for i in order:
        row = rows[i]
        text = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
        if overlaps(row["instruction"], turns) or overlaps(text, turns):
            dropped += 1
            continue
        prompts.append(text)
        if len(prompts) == n:
            break
    return prompts, dropped


def wikitext_chunks(lm: LoadedModel, n: int, length: int, data_dir=None) -> list[list[int]]:
    if n <= 0:
        return []
    text = data_file(WIKITEXT_VALID, data_dir).read_text()
    ids = lm.tokenizer.encode(text[: n * length * 8], add_special_tokens=False)
    return [ids[i : i + length] for i in range(0, len(ids) - length + 1, length)][:n]


MAX_PROMPT_TOKENS = 512  # a longer prompt keeps its last tokens
DETOKENIZE = ((" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", "."), (" <unk>", ""), (" ,", ","), (" .", "."), (" ;", ";"),
              (" :", ":"), (" 's", "'s"), ("( ", "("), (" )", ")"))


def wikitext_articles(data_dir=None) -> list[tuple[str, str]]:
    """(title, body) of every WikiText-2 validation article, its tokenization undone."""
    articles = []
    for line in data_file(WIKITEXT_VALID, data_dir).read_text().splitlines():
        heading = re.fullmatch(r" = ([^=].*) = ", line)
        if heading:
            articles.append((heading.group(1), ""))
        elif articles and line.strip() and not line.startswith(" = "):
            articles[-1] = (articles[-1][0], articles[-1][1] + line.strip() + "\n")
    for a, b in DETOKENIZE:
        articles = [(title.replace(a, b), body.replace(a, b)) for title, body in articles]
    return articles


def context_prompts(tokenizer, n: int, length: int, data_dir=None, seed: int = 0) -> list[str]:
    """n long-context prompts in the shapes of Spec-Bench's long-context tasks, on WikiText-2 validation passages
    of ``length`` tokens (training text, no benchmark's): "Summarize: PASSAGE" and "PASSAGE\nQUESTION"."""
    if n <= 0:
        return []
    passages = []
    for title, body in wikitext_articles(data_dir):
        ids = tokenizer.encode(body, add_special_tokens=False)
        passages += [(title, tokenizer.decode(ids[i : i + length]).strip())
                     for i in range(0, len(ids) - length + 1, length)]
    random.Random(seed).shuffle(passages)
    shapes = (lambda title, text: f"Summarize: {text}",
              lambda title, text: f"{text}\nWhat does the text say about {title}?")
    return [shapes[i % len(shapes)](*passages[i % len(passages)]) for i in range(n)]


def interleave(a: list, b: list) -> list:
    """``a`` and ``b`` merged, each in its own order, spread evenly through each other."""
    keyed = [((i + 0.5) / len(a), 0, i) for i in range(len(a))] + [((j + 0.5) / len(b), 1, j) for j in range(len(b))]
    return [(a, b)[src][i] for _, src, i in sorted(keyed)]


def build_sequences(lm: LoadedModel, cfg: TrainConfig, data_dir=None, progress: Progress = lambda *a: None):
    """Token sequences (prompt + the target's own greedy answer; WikiText chunks), the dropped-prompt count and
    the answers per source (Alpaca, long-context). Batches of either source alternate, so a time cap cuts both."""
    prompts, dropped = alpaca_prompts(cfg.n_prompts, data_dir, cfg.seed)
    contexts = context_prompts(lm.tokenizer, cfg.n_context, cfg.context_len, data_dir, cfg.seed)
    size = cfg.answer_batch
    batches = interleave([("alpaca", prompts[i : i + size]) for i in range(0, len(prompts), size)],
                         [("context", contexts[i : i + size]) for i in range(0, len(contexts), size)])
    seqs, answered = [], {"alpaca": 0, "context": 0}
    t0 = time.perf_counter()
    for source, texts in batches:
        if cfg.answer_seconds is not None and time.perf_counter() - t0 > cfg.answer_seconds:
            break
        batch = [encode_prompt(lm.tokenizer, text)[-MAX_PROMPT_TOKENS:] for text in texts]
        seqs += [ids + answer for ids, answer in zip(batch, greedy_batch(lm, batch, cfg.max_answer_tokens))]
        answered[source] += len(texts)
        progress("answers", len(seqs), len(prompts) + len(contexts), "self-distillation")
    seqs += wikitext_chunks(lm, cfg.n_wikitext, cfg.wikitext_len, data_dir)
    return seqs, dropped, answered


@torch.inference_mode()
def extract_features(lm: LoadedModel, seqs: list[list[int]], progress: Progress = lambda *a: None,
                     fuse_layers: tuple[int, ...] = ()):
    """Teacher-forced hidden states: [(ids [n], hidden [n, width] bf16)] per sequence: the outputs of
    ``fuse_layers`` and the final-norm state, concatenated (width = (len(fuse_layers) + 1) * dim)."""
    decoder = Decoder(lm, max(len(s) for s in seqs))
    decoder.keep_hidden(fuse_layers)
    out = []
    for i, seq in enumerate(seqs):
        decoder.reset()
        decoder.forward(seq)
        out.append((torch.tensor(seq), decoder.hidden[: len(seq)].to(torch.bfloat16).clone()))
        progress("features", i + 1, len(seqs), "teacher-forced hidden states")
    return out


def _batch(items, dim: int):
    """Pad to the longest: embeds' token ids [B, T-1] (t+1), inputs [B, T-1, width] (h_t, fused features
    included), targets [B, T-1, dim] (the final-norm h_{t+1}), mask."""
    T = max(len(ids) for ids, _ in items)
    width = items[0][1].shape[1]
    B = len(items)
    tok = torch.zeros(B, T - 1, dtype=torch.long)
    hin = torch.zeros(B, T - 1, width)
    hout = torch.zeros(B, T - 1, dim)
    mask = torch.zeros(B, T - 1, dtype=torch.bool)
    for b, (ids, h) in enumerate(items):
        n = len(ids) - 1
        tok[b, :n] = ids[1:]
        hin[b, :n] = h[:-1].float()
        hout[b, :n] = h[1:, -dim:].float()
        mask[b, :n] = True
    return tok, hin, hout, mask


STEP_WEIGHT = 0.8  # EAGLE-3's weighting of chain step s: 0.8^(s-1)
EVAL_STEPS = 3  # held-out acceptance is reported for at least this many chain steps


def chain_rows(mask: torch.Tensor, s: int) -> torch.Tensor:
    """The positions of ``mask`` where chain step s (0-based) has a real start: no chain of s+1 steps ends
    before position s."""
    valid = mask.clone()
    valid[:, :s] = False
    return valid


def head_losses(head, embed, w_vocab, batch, ce_weight, steps=1):
    """(loss, reg, ce): step-weighted means over the chain steps of ``EagleHead.unroll``."""
    tok, hin, hout, mask = batch
    preds = head.unroll(embed(tok), hin, steps)
    target_p = F.softmax(hout[mask] @ w_vocab.T, -1)
    reg = ce = norm = 0.0
    for s, pred in enumerate(preds):
        valid = chain_rows(mask, s)
        rows = valid[mask]
        w = STEP_WEIGHT ** s
        reg = reg + w * F.smooth_l1_loss(pred[valid], hout[valid])
        ce = ce - w * (target_p[rows] * F.log_softmax(pred[valid] @ w_vocab.T, -1)).sum(-1).mean()
        norm += w
    reg, ce = reg / norm, ce / norm
    return reg + ce_weight * ce, reg, ce


@torch.no_grad()
def heldout_top1(head, embed, w_full, items, steps=1) -> list[float]:
    """Per chain step s: share of held-out positions where the draft's greedy token (from the head's own state
    after s-1 steps, teacher-forced tokens) is the target's."""
    hits, total = [0] * steps, [0] * steps
    for i in range(0, len(items), 8):
        tok, hin, hout, mask = _batch(items[i : i + 8], w_full.shape[1])
        want = (hout[mask] @ w_full.T).argmax(-1)
        for s, pred in enumerate(head.unroll(embed(tok), hin, steps)):
            valid = chain_rows(mask, s)
            hits[s] += int(((pred[valid] @ w_full.T).argmax(-1) == want[valid[mask]]).sum())
            total[s] += int(valid.sum())
    return [h / max(n, 1) for h, n in zip(hits, total)]


def draft_vocabulary(features, vocab_size: int, n: int) -> torch.Tensor:
    """The n most frequent target tokens in the training sequences, as sorted ids."""
    if not 1 <= n <= vocab_size:
        raise UserError(f"--draft-vocab must be in 1..{vocab_size}, got {n}")
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids, _ in features:
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts.topk(n).indices.sort().values


def train_head(lm: LoadedModel, out: str | Path, cfg: TrainConfig = TrainConfig(), data_dir=None,
               progress: Progress = lambda *a: None, target_name: str | None = None) -> TrainResult:
    """Build the training set from ``lm``, train a head, save it to ``out`` (safetensors + config.json)."""
    torch.manual_seed(cfg.seed)
    t0 = time.perf_counter()
    head = new_head(lm.config, torch.float32, cfg.seed, cfg.fuse_layers, cfg.head_layers).train()  # checks fuse_layers first
    seqs, dropped, answered = build_sequences(lm, cfg, data_dir, progress)
    seqs = [s for s in seqs if len(s) >= 2]
    features = extract_features(lm, seqs, progress, cfg.fuse_layers)
    extract_s = time.perf_counter() - t0
    random.Random(cfg.seed).shuffle(features)
    n_held = max(1, int(len(features) * cfg.holdout)) if len(features) > 1 else 0
    held, train = features[:n_held], features[n_held:]
    if not train:
        raise UserError("no training sequences: raise --num-prompts or --wikitext")
    model = lm.model
    embed = torch.nn.Embedding.from_pretrained(model.embed_tokens.weight.detach().float(), freeze=True)
    w_full = model.lm_head.weight.detach().float()
    d2t = None
    w_vocab = w_full
    if cfg.draft_vocab and cfg.draft_vocab < model.args.vocab_size:
        ids = draft_vocabulary(train, model.args.vocab_size, cfg.draft_vocab)
        d2t = ids - torch.arange(len(ids))
        w_vocab = w_full[ids]
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=0.0)
    steps_per_epoch = -(-len(train) // cfg.batch)
    total_steps = steps_per_epoch * cfg.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10) * max(0.05, 1 - s / total_steps))
    train_s = eval_s = 0.0
    steps, epochs, stop = 0, [], False
    t_train = time.perf_counter()
    rng = random.Random(cfg.seed + 1)
    for epoch in range(cfg.epochs):
        order = sorted(range(len(train)), key=lambda i: len(train[i][0]))  # similar lengths per batch
        batches = [order[i : i + cfg.batch] for i in range(0, len(order), cfg.batch)]
        rng.shuffle(batches)
        sums = [0.0, 0.0, 0.0]
        for j, idx in enumerate(batches):
            loss, reg, ce = head_losses(head, embed, w_vocab, _batch([train[i] for i in idx], w_full.shape[1]),
                                        cfg.ce_weight,
                                        cfg.ttt_steps)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            sched.step()
            steps += 1
            for k, v in enumerate((loss, reg, ce)):
                sums[k] += float(v.detach())
            progress("train", steps, total_steps, f"epoch {epoch + 1} loss {float(loss.detach()):.4f}")
            if cfg.train_seconds is not None and train_s + time.perf_counter() - t_train > cfg.train_seconds:
                stop = True
                break
        train_s += time.perf_counter() - t_train
        t_eval = time.perf_counter()
        head.eval()
        n_eval = max(cfg.ttt_steps, EVAL_STEPS)
        chain = heldout_top1(head, embed, w_full, held, n_eval) if held else [float("nan")] * n_eval
        head.train()
        eval_s += time.perf_counter() - t_eval
        n = j + 1
        epochs.append({"epoch": epoch + 1, "steps": n, "loss": sums[0] / n, "reg": sums[1] / n, "ce": sums[2] / n,
                       "heldout_top1": chain[0], "heldout_chain": chain})
        progress("epoch", epoch + 1, cfg.epochs, "held-out acceptance per chain step "
                 + " ".join(f"{a:.3f}" for a in chain))
        t_train = time.perf_counter()
        if stop:
            break
    extra = {"target": target_name or str(lm.path), "train": asdict(cfg), "heldout_top1": epochs[-1]["heldout_top1"],
             "steps": steps}
    save_head(head.eval(), Path(out), head_config(lm.config, len(w_vocab) if d2t is not None else None, extra,
                                                        cfg.fuse_layers, cfg.head_layers), d2t)
    return TrainResult(str(out), asdict(cfg), len(features), sum(len(i) - 1 for i, _ in train),
                       sum(len(i) - 1 for i, _ in held), dropped, answered["alpaca"],
                       answered["context"], extract_s, train_s, eval_s, steps, epochs)
