"""Native runtime on a tiny random Llama: logits match HF, cache rollback, sampling, bad input."""
import pytest
import torch
import torch.nn.functional as F

from conftest import require_bf16_exact
from runtime.errors import UserError
from runtime.loading import load_model
from runtime.generate import Decoder
from runtime.sampling import SamplingConfig, logits_to_probs


pytestmark = pytest.mark.isa


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return load_model(str(tiny_llama_dir))


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_prefill_logits_match_hf(tiny, tiny_llama_dir):
    ids = [5, 17, 33, 9, 60, 2, 44]
    with torch.inference_mode():
        ref = hf_model(tiny_llama_dir)(torch.tensor([ids])).logits[0]
    ours = Decoder(tiny, 64).forward(ids)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_incremental_decode_matches_full_prefill(tiny):
    ids = [3, 8, 13, 21, 34, 55, 89, 4]
    dec = Decoder(tiny, 64)
    full = dec.forward(ids)
    dec.reset()
    dec.forward(ids[:3])
    steps = [dec.forward([t])[0] for t in ids[3:]]
    torch.testing.assert_close(torch.stack(steps), full[3:], atol=1e-5, rtol=1e-5)


def test_rollback_then_new_tokens_equal_fresh_run(tiny):
    dec = Decoder(tiny, 64)
    dec.forward([1, 2, 3, 4])
    dec.forward([90, 91, 92])  # a rejected continuation
    dec.rollback(4)
    after = dec.forward([10, 11])
    dec.reset()
    fresh = dec.forward([1, 2, 3, 4, 10, 11])[-2:]
    torch.testing.assert_close(after, fresh, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError):
        dec.rollback(dec.pos + 1)


def test_greedy_generate_equals_hf_generate(tiny, tiny_llama_dir):
    ids = [7, 8, 9, 10]
    ours = Decoder(tiny, 64).generate(ids, 20, ignore_eos=True).tokens
    ref = hf_model(tiny_llama_dir).generate(torch.tensor([ids]), max_new_tokens=20, min_new_tokens=20,
                                            do_sample=False, attention_mask=torch.ones(1, 4, dtype=torch.long))
    assert ours == ref[0, 4:].tolist()


def test_sampling_is_seeded_and_respects_max_tokens(tiny):
    dec = Decoder(tiny, 64)
    cfg = SamplingConfig(temperature=1.0, top_k=20, top_p=0.9, seed=123)
    a = dec.generate([5, 6], 15, cfg, ignore_eos=True).tokens
    b = dec.generate([5, 6], 15, cfg, ignore_eos=True).tokens
    assert a == b and len(a) == 15


def test_stops_on_eos(tiny):
    dec = Decoder(tiny, 64)
    dec.eos_ids = set(range(128))  # every token is EOS: stop after the first
    result = dec.generate([5, 6], 10)
    assert len(result.tokens) == 1 and result.finish_reason == "eos"


def test_top_k_top_p_filtering():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    probs = logits_to_probs(logits, SamplingConfig(temperature=1.0, top_k=2))
    assert (probs[0, 2:] == 0).all() and probs[0, :2].sum().item() == pytest.approx(1.0)
    full = logits.softmax(-1)[0]
    probs = logits_to_probs(logits, SamplingConfig(temperature=1.0, top_p=float(full[0]) + 1e-3))
    assert (probs[0] > 0).tolist() == [True, True, False, False, False]
    greedy = logits_to_probs(logits, SamplingConfig())
    assert greedy.tolist() == [[1.0, 0.0, 0.0, 0.0, 0.0]]


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2)])
def test_bad_sampling_config(kwargs):
    with pytest.raises(UserError):
        SamplingConfig(**kwargs)


def test_bf16_load(tiny_llama_dir):
    lm = load_model(str(tiny_llama_dir), "bf16")
    assert lm.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    assert len(Decoder(lm, 32).generate([4, 5], 5, ignore_eos=True).tokens) == 5


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 0.05)])
def test_packed_linear_matches_linear_and_repacks_after_in_place_edit(dtype, atol):
    from runtime.packed_linear import PackedLinear

    torch.manual_seed(0)
    layer = PackedLinear(64, 96, bias=True).to(dtype)
    x = torch.randn(2, 9, 64, dtype=dtype)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=atol, rtol=0.02)
        first_pack = layer._pack.kernel
        layer.weight.mul_(-3)  # what calibration's scale folding does
        torch.testing.assert_close(layer(x[:, :1]), F.linear(x[:, :1], layer.weight, layer.bias), atol=3 * atol, rtol=0.02)
    assert layer._pack.kernel is not first_pack
    layer(x.float().to(dtype)).sum().backward()  # with grad enabled it is a plain Linear
    assert layer.weight.grad is not None and layer.weight.grad.shape == (96, 64)


@pytest.fixture(scope="module")
def wide_bf16(tmp_path_factory):
    """Two layers at the default model's widths: oneDNN's one-row and many-row bf16 kernels (and CPU SDPA's
    one- and many-query paths) round differently only at realistic widths."""
    from conftest import make_tiny_llama

    path = make_tiny_llama(tmp_path_factory.mktemp("wide"), hidden_size=576, intermediate_size=1536,
                           num_attention_heads=9, num_key_value_heads=3, vocab_size=512)
    return load_model(str(path), "bf16", attn_implementation="eager")


def rows_differing_from_one_at_a_time(lm, ids: list[int], history: int) -> list[int]:
    """Rows of ``ids[history:]`` whose logits, verified in chunks of 1-9 tokens, differ bitwise from decoding the
    tokens one at a time."""
    dec = Decoder(lm, len(ids) + 16)
    dec.forward(ids[:history])
    one_by_one = torch.stack([dec.forward([t])[0] for t in ids[history:]])
    dec.rollback(history)
    chunks, start = [], history
    for size in (5, 1, 9, 3, 2, 8, 4, 7, 1, 9, 9, 9, 9):
        size = min(size, len(ids) - start)
        if size == 0:
            break
        chunks.append(dec.forward(ids[start:start + size]))
        start += size
    batched = torch.cat(chunks)
    assert start == len(ids) and batched.dtype == torch.bfloat16
    return (batched != one_by_one).any(-1).nonzero().flatten().tolist()


@pytest.mark.parametrize("history", [50, 141])
def test_bf16_verify_rows_equal_one_at_a_time_decoding_bitwise(wide_bf16, history):
    """Speculative verification scores K+1 tokens in one forward; greedy speculation is token-exact only if
    each row's logits are bitwise those of decoding the tokens one by one. (The default-model test in
    test_specdec_integration.py also covers the ragged key tails that only real activations expose.)"""
    require_bf16_exact(wide_bf16)
    ids = torch.randint(3, 512, (history + 40,), generator=torch.Generator().manual_seed(history)).tolist()
    assert rows_differing_from_one_at_a_time(wide_bf16, ids, history) == []


@pytest.mark.parametrize("history", [40, 1016, 2045])
def test_eager_attention_rows_do_not_depend_on_the_other_queries(history):
    """Also where a verification's keys cross the 1024-key block that a lone query's keys do not."""
    from runtime.transformer import batch_invariant_attention

    g = torch.Generator().manual_seed(1)
    n_q, n = 9, history + 9
    q = (torch.randn(1, n_q, 9, 64, generator=g) * 2).bfloat16().transpose(1, 2)
    k = (torch.randn(1, 3, n, 64, generator=g) * 2).bfloat16()
    v = (torch.randn(1, 3, n, 64, generator=g) * torch.randn(1, 3, n, 64, generator=g).exp()).bfloat16()
    mask = torch.arange(n)[None, :] <= (history + torch.arange(n_q))[:, None]
    together = batch_invariant_attention(q, k, v, mask)
    for i in range(n_q):
        alone = batch_invariant_attention(q[:, :, i : i + 1], k[:, :, : history + i + 1], v[:, :, : history + i + 1], None)
        assert torch.equal(alone[:, :, 0], together[:, :, i]), i


def test_unknown_attention_and_bf16_speculation_without_it(tiny_llama_dir):
    from specdec.speculative import SpeculativeDecoder

    with pytest.raises(UserError, match="unknown attention"):
        load_model(str(tiny_llama_dir), "bf16", attn_implementation="flash")
    with pytest.raises(UserError, match="attn_implementation='eager'"):
        SpeculativeDecoder(load_model(str(tiny_llama_dir), "bf16"), "ngram", 4)
