"""Speculative decoding on the real default model: n-gram greedy output equals plain greedy, α > 0."""
import pytest

from conftest import require_bf16_exact
from runtime.data import load_prompts
from runtime.loading import load_model
from runtime.generate import Decoder, encode_prompt
from specdec.speculative import SpeculativeDecoder
from test_specdec import one_thread  # noqa: F401  (autouse: one torch thread, restored afterwards)

pytestmark = [pytest.mark.isa, pytest.mark.integration, pytest.mark.data]


@pytest.mark.parametrize("dtype,n_prompts,new_tokens", [("fp32", 2, 48), ("bf16", 4, 160)])
def test_ngram_greedy_equals_plain_on_default_model(default_model_dir, dtype, n_prompts, new_tokens):
    """bf16 runs longer: before verification was batch-invariant, its text parted from plain decoding after
    ~100 tokens on most prompts."""
    lm = load_model(default_model_dir, dtype, attn_implementation="eager")
    if dtype == "bf16":
        require_bf16_exact(lm)
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


def test_negative_control_unaligned_keys_break_exactness_on_default_model(default_model_dir, monkeypatch):
    """A verification chunk over 150 keys and a lone query over 146 summed the same row in another order on AMX
    (found on Spec-Bench prompt 3 after 58 greedy tokens): aligned key counts make them equal; unaligned, the
    same check finds the differing rows."""
    from runtime import transformer
    from runtime.hardware import probe
    from test_runtime import rows_differing_from_one_at_a_time

    lm = load_model(default_model_dir, "bf16", attn_implementation="eager")
    require_bf16_exact(lm)
    prompt = encode_prompt(lm.tokenizer, load_prompts("spec_bench", limit=3)[2])
    ids = prompt + Decoder(lm, len(prompt) + 80).generate(prompt, 72, ignore_eos=True).tokens
    assert rows_differing_from_one_at_a_time(lm, ids, len(prompt) + 58) == []
    monkeypatch.setitem(transformer.KEY_ALIGN, "eager", 1)
    differing = rows_differing_from_one_at_a_time(lm, ids, len(prompt) + 58)
    if "AMX" not in probe().bf16_matmul:
        pytest.skip(f"no AMX here (unaligned keys differ on {len(differing)} rows): nothing to control")
    assert differing, "without alignment the check found no difference: it could not catch the bug"
