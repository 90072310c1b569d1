"""Speculative decoding on the real default model: n-gram greedy output equals plain greedy, α > 0."""
import pytest

from evals.data import load_prompts
from quant.loading import load_model
from specdec.generate import Decoder, encode_prompt
from specdec.speculative import SpeculativeDecoder
from test_specdec import one_thread  # noqa: F401  (autouse: one torch thread, restored afterwards)

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("dtype,n_prompts,new_tokens", [("fp32", 2, 48), ("bf16", 4, 160)])
def test_ngram_greedy_equals_plain_on_default_model(default_model_dir, dtype, n_prompts, new_tokens):
    """bf16 runs longer: before verification was batch-invariant, its text parted from plain decoding after
    ~100 tokens on most prompts."""
    lm = load_model(default_model_dir, dtype, attn_implementation="eager")
    prompts = [encode_prompt(lm.tokenizer, p) for p in load_prompts("spec_bench", limit=n_prompts)]
    max_len = max(map(len, prompts)) + new_tokens + 8
    spec = SpeculativeDecoder(lm, "ngram:min=2,max=4", 4, max_len=max_len)
    plain = Decoder(lm, max_len)
    accepted = 0
    for ids in prompts:
        result = spec.generate(ids, new_tokens, ignore_eos=True)
        assert result.tokens == plain.generate(ids, new_tokens, ignore_eos=True).tokens
        accepted += result.stats["accepted"]
    assert accepted > 0
