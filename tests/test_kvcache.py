"""Quantized KV caches: labels, error bounds, real storage, rollback, windows, calibration, vLLM mapping."""
import pytest
import torch

from runtime.errors import UserError
from quant.kvcache import (KVQuantSpec, KVTensorSpec, QuantizedKVCache, calibrate_kv_scales, make_cache_factory,
                           parse_kv_spec, vllm_kv_cache_dtype)
from runtime.loading import load_model
from runtime.generate import Decoder
from runtime.transformer import KVCache


pytestmark = pytest.mark.isa

B, H, D = 2, 3, 64


def fresh(spec, max_len=128, dtype=torch.float32):
    return make_cache_factory(spec)(B, max_len, H, D, dtype)


def write(cache, start, x):
    pos = torch.arange(start, start + x.shape[2])
    return cache.update(pos, x, x, start + x.shape[2])


@pytest.mark.parametrize("label", ["k8tok-v8tok", "kivi4-r32", "kivi2", "fp8_e4m3", "fp8_e5m2", "k4chg64-v4tokg32-r16",
                                   "k8ts-v8hs", "k4chs-v16", "kfp8tok-vfp8e5chg16", "k2tokg16-v8chs"])
def test_labels_parse_back(label):
    spec = parse_kv_spec(label)
    assert spec.label == label and parse_kv_spec(spec.label) == spec


def test_shorthands_expand():
    assert parse_kv_spec("fp8") == parse_kv_spec("fp8_e4m3") == KVQuantSpec(KVTensorSpec("fp8_e4m3", "tensor"),
                                                                             KVTensorSpec("fp8_e4m3", "tensor"))
    kivi = parse_kv_spec("kivi4-r32")
    assert (kivi.key.granularity, kivi.key.group, kivi.value.granularity, kivi.residual) == ("channel", 32, "token", 32)
    assert parse_kv_spec("none") is None and make_cache_factory("none") is None


@pytest.mark.parametrize("bad", ["k8x-v8tok", "k8tokk", "kivi3", "k8t-v8t", "k8toks-v8tok", "k8hg4-v8tok", "k8tok", "kfp8h-vfp8h"])
def test_bad_specs_refused_with_help(bad):
    with pytest.raises(UserError):
        parse_kv_spec(bad)


@pytest.mark.parametrize("label,bits", [("k8tok-v8tok", 8), ("k4tokg32-v4tokg32", 4), ("k2tokg16-v2tokg16", 2)])
def test_int_per_token_error_within_half_step(label, bits):
    torch.manual_seed(0)
    x = torch.randn(B, H, 100, D) * 3 + 1
    cache = fresh(label)
    k, _ = write(cache, 0, x)  # the current write is attended in full precision (nothing committed yet)
    assert torch.equal(k, x)
    k, _ = write(cache, 100, x[:, :, :1])  # now positions < 100 are committed and stored as codes
    g = parse_kv_spec(label).key.group or D
    groups = x.reshape(B, H, 100, D // g, g)
    step = (groups.amax(-1) - groups.amin(-1)) / (2 ** bits - 1)
    err = (k[:, :, :100] - x).abs().reshape(B, H, 100, D // g, g).amax(-1)
    assert (err <= step / 2 * 1.01 + 2e-3).all()  # half a step, plus fp16 rounding of scale/offset
    assert err.max() > 0


@pytest.mark.parametrize("fmt,rel", [("fp8_e4m3", 2 ** -4), ("fp8_e5m2", 2 ** -3)])
def test_fp8_storage_is_float8_and_relative_error_bounded(fmt, rel):
    torch.manual_seed(0)
    x = torch.randn(B, H, 40, D)
    cache = fresh(fmt)
    write(cache, 0, x)
    k, _ = write(cache, 40, x[:, :, :1])
    assert cache.k.codes.dtype == {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[fmt]
    big = x.abs() > 0.05
    assert ((k[:, :, :40] - x).abs()[big] <= rel * x.abs()[big] + 1e-6).all()


def test_bytes_per_token_shrink_by_format():
    dense = KVCache(B, 16, H, D, torch.float32).bytes_per_token()
    assert dense == 2 * B * H * D * 4
    assert fresh("k8tok-v8tok").bytes_per_token() == 2 * (B * H * D + B * H * 2 * 2)  # codes + fp16 scale/offset
    assert fresh("fp8").bytes_per_token() == 2 * B * H * D  # 4x smaller than fp32, no per-token scales
    kivi = fresh("kivi4")
    assert kivi.k.codes.dtype == torch.uint8 and kivi.k.codes.shape[-1] == D // 2  # two codes per byte
    assert kivi.bytes_per_token() == (B * H * D / 2 + B * H * D * 4 / 32) + (B * H * D / 2 + B * H * 2 * 4)
    assert fresh("kivi2").k.codes.shape[-1] == D // 4
    assert dense / fresh("kivi2").bytes_per_token() > 9


def test_kivi_window_keeps_recent_tokens_exact():
    torch.manual_seed(0)
    cache = fresh("kivi2-r32")
    x = torch.randn(B, H, 100, D)
    write(cache, 0, x[:, :, :90])
    k, v = write(cache, 90, x[:, :, 90:])
    assert cache.k.sealed == 32 and cache.v.sealed == 58  # keys seal whole 32-token blocks, values token by token
    assert torch.equal(k[:, :, 58:], x[:, :, 58:]) and torch.equal(v[:, :, 58:], x[:, :, 58:])
    assert not torch.equal(k[:, :, :32], x[:, :, :32])


def test_rejected_tokens_never_reach_per_channel_scales():
    """Speculative tokens written then rolled back must not change the per-channel scales of any block."""
    torch.manual_seed(0)
    x = torch.randn(B, H, 20, D)
    outlier = torch.full((B, H, 4, D), 100.0)
    spec_run, plain = fresh("k4chg8-v4chg8"), fresh("k4chg8-v4chg8")
    write(spec_run, 0, x[:, :, :6])
    write(spec_run, 6, outlier)  # draft tokens 6..9, all rejected
    got = write(spec_run, 6, x[:, :, 6:20])[0]
    write(plain, 0, x[:, :, :6])
    want = write(plain, 6, x[:, :, 6:20])[0]
    assert torch.equal(got, want)
    got, want = write(spec_run, 20, x[:, :, :1])[0], write(plain, 20, x[:, :, :1])[0]
    assert spec_run.k.sealed == 16 and torch.equal(got, want) and got[:, :, :16].abs().max() < 10


def test_deep_rollback_reopens_block():
    torch.manual_seed(0)
    x = torch.randn(B, H, 40, D)
    cache = fresh("k8chg8-v8tok")
    write(cache, 0, x[:, :, :30])
    write(cache, 30, x[:, :, 30:31])
    assert cache.k.sealed == 24
    k, _ = write(cache, 20, x[:, :, 20:22])  # back into the sealed block [16, 24)
    assert k.shape[2] == 22 and cache.k.sealed == 16
    assert (k - x[:, :, :22]).abs().max() < 0.1


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return load_model(tiny_llama_dir)


@pytest.mark.parametrize("label", ["k8tok-v8tok", "k2chg8-v2tokg8", "k4chg4-v4tokg16-r2", "fp8_e5m2"])
def test_rollback_then_rewrite_equals_fresh_run(tiny, label):
    prompt = list(range(10, 31))
    dec = Decoder(tiny, 128, make_cache_factory(label))
    dec.forward(prompt)
    dec.forward([40, 41, 42, 43, 44])  # a verified draft: keep 2, reject 3
    dec.rollback(len(prompt) + 2)
    got = torch.cat([dec.forward([50, 51]), dec.forward([52])])
    ref = Decoder(tiny, 128, make_cache_factory(label))
    ref.forward(prompt)
    ref.forward([40, 41])
    want = torch.cat([ref.forward([50, 51]), ref.forward([52])])
    assert torch.allclose(got, want, atol=1e-5, rtol=0)


def test_quantized_decode_tracks_dense(tiny):
    def last_chunk_logits(factory):  # decoders share the model's caches: run one after the other
        dec = Decoder(tiny, 128, factory)
        dec.forward(list(range(5, 37)))
        return dec.forward(list(range(37, 70)))

    want, got = last_chunk_logits(None), last_chunk_logits(make_cache_factory("k8tok-v8tok"))
    assert (got - want).abs().max() < 0.05 and not torch.equal(got, want)


@pytest.mark.parametrize("label", ["k4chg4-v4tokg16-r2", "k8tok-v8tok"])  # KIVI-style, per-token
def test_quantized_cache_under_aligned_eager_attention_matches_sdpa(tiny_llama_dir, label):
    """Eager attention reads a key count aligned up (KEY_ALIGN, masked); a quantized cache must serve those
    unwritten positions too (it once returned only the written ones and every eager + KIVI run crashed)."""
    def logits(attention):
        lm = load_model(tiny_llama_dir, "fp32", attn_implementation=attention)
        dec = Decoder(lm, 128, make_cache_factory(label))
        dec.forward(list(range(5, 41)))  # 36 positions: eager reads 64 keys
        return torch.cat([dec.forward([41 + i]) for i in range(8)])

    assert torch.allclose(logits("eager"), logits("sdpa"), atol=1e-4, rtol=0)


def test_static_scales_from_calibration(tiny):
    spec = parse_kv_spec("k8chs-v8ts")
    with pytest.raises(UserError, match="calibrate"):
        make_cache_factory(spec)
    batches = [torch.randint(3, 128, (1, 48), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    scales = calibrate_kv_scales(tiny.model, batches, spec)
    k_scale, v_scale = scales.layers[0]
    assert len(scales.layers) == 2 and k_scale.shape == (1, 2, 1, 16) and v_scale.shape == (1, 1, 1, 1)
    pct = calibrate_kv_scales(tiny.model, batches, spec, observer="percentile")
    assert (pct.layers[1][1] <= scales.layers[1][1]).all()
    def decode(factory):  # decoders share the model's caches: run one after the other
        dec = Decoder(tiny, 128, factory)
        dec.forward(list(range(3, 60)))
        return torch.cat([dec.forward([7]), dec.forward([8, 9])])

    logits = decode(make_cache_factory(spec, scales))
    assert isinstance(tiny.model.layers[0].self_attn.kv_cache, QuantizedKVCache)
    dense = decode(None)
    err = (logits - dense).abs().max()
    assert 0 < err < 0.003  # ~0.001 measured; the same scales halved (clipping) give 0.014, x4 (coarse) 0.004
    with pytest.raises(UserError, match="zero calibration samples|at least one sample"):
        calibrate_kv_scales(tiny.model, [], spec)


def test_vllm_kv_cache_dtype_mapping_and_refusals():
    assert vllm_kv_cache_dtype(None) == "auto" and vllm_kv_cache_dtype("none") == "auto"
    assert vllm_kv_cache_dtype("fp8") == "fp8" and vllm_kv_cache_dtype("fp8_e5m2") == "fp8_e5m2"
    for bad in ("kivi4", "k8tok-v8tok", "kfp8ch-vfp8tok", "kfp8ts-vfp8ts", "kfp8t-vfp8e5t", "kfp8t-vfp8t-r16"):
        with pytest.raises(UserError, match="supports KV specs none, fp8"):
            vllm_kv_cache_dtype(bad)
