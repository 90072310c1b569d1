"""lm-eval ``LM`` for the native runtime: any quant/ configuration (weights + KV cache) scored by lm-eval.

Registered as ``quantspec`` so ``lm_eval --model quantspec --model_args pretrained=default,scheme=w4g32-asym``
works too. Scoring mirrors lm-eval's ``HFLM`` token for token (same encoding of context/continuation pairs,
same left truncation, same rolling windows), so the numbers are comparable with the stock ``hf`` backend.

Speed: requests are sorted lexicographically by token sequence, and the model's KV cache keeps the last
sequence, so each request recomputes only the tokens after the prefix it shares with the previous one
(the question of a multiple-choice item, a few-shot preamble) at batch 1.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from rich.progress import track

from evals.build import build_native
from evals.config import Config
from runtime.loading import DEFAULT_DTYPE, LoadedModel
from runtime.generate import eos_token_ids


def _shared_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixScorer:
    """Logits for token sequences at batch 1, reusing the KV cache of the previous sequence's shared prefix.

    With a quantized KV cache the context is written first and the scored tokens second, so every request
    reads its context from the quantized cache (a quantized cache keeps the current write in full precision)
    whether or not its prefix was already cached.
    """

    def __init__(self, lm: LoadedModel, max_len: int, cache_factory=None):
        self.model = lm.model
        self.model.setup_cache(1, max_len, cache_factory)
        self.split_context = cache_factory is not None
        self.cached: list[int] = []
        self.forward_tokens = 0  # tokens actually run through the model (for tests and progress)

    @torch.inference_mode()
    def logits(self, tokens: list[int], first: int) -> torch.Tensor:
        """Logits [len(tokens) - first, V] predicting tokens first+1.. from inputs at positions first.."""
        start = min(_shared_prefix(self.cached, tokens), first)
        if self.split_context and start < first:
            self.model(torch.tensor(tokens[start:first])[None], torch.arange(start, first))
            self.forward_tokens += first - start
            start = first
        ids = torch.tensor(tokens[start:], dtype=torch.long)[None]
        out = self.model(ids, torch.arange(start, len(tokens)))[0]
        self.cached = list(tokens)
        self.forward_tokens += len(tokens) - start
        return out[first - start :]


@register_model("quantspec")
class NativeLM(TemplateLM):
    """lm-eval model over ``runtime.loading.load_model`` (+ optional scheme and KV cache spec, built by ``evals.build``)."""

    def __init__(self, pretrained: str = "default", scheme: str | None = None, method: str = "rtn",
                 kv: str | None = None, dtype: str = DEFAULT_DTYPE, max_length: int | None = None,
                 max_gen_toks: int = 256, threads: int | None = None, loaded: LoadedModel | None = None,
                 cache_factory=None, **_):
        super().__init__()
        if loaded is None:
            built = build_native(Config.parse(model=pretrained, scheme=scheme, method=method, kv=kv, dtype=dtype),
                                 int(threads) if threads else None)
            loaded, cache_factory = built.lm, built.cache_factory
        self.lm = loaded
        self.tokenizer = loaded.tokenizer
        self.cache_factory = cache_factory
        self._max_length = int(max_length or loaded.model.args.max_seq_len)
        self._max_gen_toks = int(max_gen_toks)
        self.eos_ids = eos_token_ids(loaded)
        self.forward_tokens = 0

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:  # HFLM: BOS when the tokenizer has one, else EOS
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return str(self.lm.path).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len=None, **_) -> list[int]:
        kwargs = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        bos = self.tokenizer.decode(self.prefix_token_id)
        if add_special_tokens is None and bos and string.startswith(bos):
            kwargs["add_special_tokens"] = False
        ids = self.tokenizer.encode(string, **kwargs)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def _scorer(self, max_len: int) -> PrefixScorer:
        return PrefixScorer(self.lm, min(max_len, self.lm.model.args.max_seq_len), self.cache_factory)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **_) -> list[tuple[float, bool]]:
        """(sum log p(continuation | context), continuation is the greedy decode) per request, like HFLM."""
        seqs = [(ctx + cont)[-(self.max_length + 1):] for _, ctx, cont in requests]
        if not seqs:
            return []
        scorer = self._scorer(max(len(s) for s in seqs))
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        for i in track(sorted(range(len(seqs)), key=lambda j: seqs[j]), "native loglikelihood", disable=disable_tqdm):
            seq, n_cont = seqs[i], len(requests[i][2])
            logits = scorer.logits(seq[:-1], len(seq) - 1 - n_cont)
            logp = F.log_softmax(logits.float(), dim=-1)
            target = torch.tensor(seq[-n_cont:])
            answer = (logp.gather(1, target[:, None]).sum().item(), bool((logp.argmax(-1) == target).all()))
            results[i] = answer
            if requests[i][0] is not None:
                self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
        self.forward_tokens += scorer.forward_tokens
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Total log-likelihood of each string over disjoint rolling windows (HFLM's windows, context 1)."""
        windows, owners = [], []
        for idx, (string,) in enumerate(req.args for req in requests):
            for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
                    self.tok_encode(string), self.prefix_token_id, self.max_length, 1)):
                windows.append((None, ctx, cont))
                owners.append(idx)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[owner] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    @torch.inference_mode()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuation until a stop string, EOS or ``max_gen_toks`` (lm-eval's gen_kwargs)."""
        outputs = []
        for req in track(requests, "native generate", disable=disable_tqdm):
            context, gen_kwargs = req.args
            until = gen_kwargs.get("until", [])
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(gen_kwargs.get("max_gen_toks", self._max_gen_toks))
            ids = self.tok_encode(context, left_truncate_len=self.max_length - max_new)
            text = self._greedy_until(ids, until, max_new)
            outputs.append(text)
            self.cache_hook.add_partial("generate_until", req.args, text)
        return outputs

    def _greedy_until(self, ids: list[int], until: list[str], max_new: int) -> str:
        model = self.lm.model
        model.setup_cache(1, len(ids) + max_new, self.cache_factory)
        logits = model(torch.tensor(ids)[None], torch.arange(len(ids)))[0, -1]
        out: list[int] = []
        while True:
            token = int(logits.argmax())
            if token in self.eos_ids:
                break
            out.append(token)
            text = self.tok_decode(out)
            if any(stop in text for stop in until) or len(out) >= max_new:
                break
            pos = len(ids) + len(out) - 1
            logits = model(torch.tensor([[token]]), torch.tensor([pos]))[0, -1]
        text = self.tok_decode(out)
        for stop in until:
            text = text.split(stop)[0]
        return text

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)
