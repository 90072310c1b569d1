"""WikiText-2 perplexity on the tiny random Llama, checked against HF transformers on the same windows."""
from __future__ import annotations

import math

import pytest
import torch

from evals.perplexity import Window, windows, wikitext2_perplexity
from runtime.errors import UserError
from runtime.loading import load_model


pytestmark = pytest.mark.isa

TEXT = " = Robert Boulter = \n \n Robert Boulter is an English film , television and theatre actor . \n" * 6


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    (root / "wikitext2").mkdir()
    (root / "wikitext2" / "wiki.test.raw").write_text(TEXT)
    return root


def hf_nll(model_dir, ids: list[int], wins: list[Window]) -> tuple[float, int]:
    """Summed NLL over each window's scored tokens, with HF's own causal-LM loss."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total, count = 0.0, 0
    for w in wins:
        window = torch.tensor([ids[w.begin : w.end]])
        labels = window.clone()
        labels[:, : w.first_scored - w.begin] = -100  # HF shifts labels: position p predicts token p
        n = int((labels[:, 1:] != -100).sum())
        with torch.no_grad():
            total += float(model(window, labels=labels).loss) * n
        count += n
    return total, count


@pytest.mark.parametrize("ctx, stride", [(64, None), (64, 24), (50, 50)])
def test_perplexity_equals_exp_mean_nll_of_hf_on_the_same_windows(tiny_llama_dir, data_dir, ctx, stride):
    lm = load_model(tiny_llama_dir)
    result = wikitext2_perplexity(lm, data_dir=data_dir, ctx=ctx, stride=stride)
    ids = lm.tokenizer.encode(TEXT, add_special_tokens=False)
    wins = windows(len(ids), ctx, stride)
    total, count = hf_nll(tiny_llama_dir, ids, wins)
    assert result.n_tokens == count
    assert result.nll == pytest.approx(total / count, rel=1e-5)
    assert result.ppl == pytest.approx(math.exp(total / count), rel=1e-5)
    assert (result.ctx, result.stride) == (ctx, stride)


def test_windows_score_every_token_once():
    assert windows(10, 4) == [Window(0, 4, 1), Window(4, 8, 5)]  # the ragged tail is dropped
    sliding = windows(10, 4, stride=2)
    assert sliding == [Window(0, 4, 1), Window(2, 6, 4), Window(4, 8, 6), Window(6, 10, 8)]
    scored = [p for w in sliding for p in range(w.first_scored, w.end)]
    assert scored == list(range(1, 10))


def test_max_windows_and_bad_arguments(tiny_llama_dir, data_dir, tmp_path):
    lm = load_model(tiny_llama_dir)
    assert wikitext2_perplexity(lm, data_dir=data_dir, ctx=32, max_windows=2).n_tokens == 2 * 31
    with pytest.raises(UserError, match="stride must be in"):
        wikitext2_perplexity(lm, data_dir=data_dir, ctx=32, stride=64)
    (tmp_path / "wikitext2").mkdir()
    (tmp_path / "wikitext2" / "wiki.test.raw").write_text(TEXT[:100])
    with pytest.raises(UserError, match="fewer than one window"):
        wikitext2_perplexity(lm, data_dir=tmp_path, ctx=128)
    with pytest.raises(UserError, match="exceeds the model's context length 256"):
        wikitext2_perplexity(lm, data_dir=data_dir, ctx=4096)
    with pytest.raises(UserError, match="missing data file wikitext2/wiki.test.raw"):
        wikitext2_perplexity(lm, data_dir=data_dir / "wikitext2")
