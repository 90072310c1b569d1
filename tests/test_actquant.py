"""Activation quantization: quantizer formulas, observers, the int8 x int8 kernel, SmoothQuant, W8A8 builds."""
import json

import pytest
import torch

from conftest import STATIC_W8A8, VLLM_W8A8_AMX, require
from quant.actquant import (calibrate_input_scales, check_scale, make_observer, quantize_activation,
                            quantize_per_token)
from quant.calibration import CalibConfig
from runtime.errors import UserError
from runtime.hardware import VLLM_STATIC_INT8, vllm_ops
from runtime.loading import load_model
from quant.methods.rtn import RTN
from quant.qlinear import QuantizedLinear
from quant.scheme import ActSpec, parse_scheme
from quant.smoothquant import apply_smoothquant, smoothing_scale
from quant.quantize import quantize_w8a8
from quant.fp8 import Fp8xFp8Kernel
from quant.w8a8 import Int8xInt8Kernel


pytestmark = pytest.mark.isa


def test_dynamic_per_token_matches_formula():
    torch.manual_seed(0)
    x = torch.randn(7, 96) * torch.linspace(0.1, 5, 7)[:, None]
    q, s = quantize_per_token(x)
    assert q.dtype == torch.int8 and s.shape == (7, 1)
    assert torch.equal(s, x.abs().amax(-1, keepdim=True) / 127)
    assert torch.equal(q, torch.round(x / s).to(torch.int8))
    assert (q.abs().amax(-1) == 127).all()  # each row's largest value hits the top code
    assert ((q.float() * s - x).abs() <= s / 2 + 1e-7).all()


def test_static_needs_scale_and_dynamic_needs_tokens():
    x = torch.randn(3, 8)
    with pytest.raises(UserError, match="calibration"):
        quantize_activation(x, ActSpec(8, "tensor", False))
    with pytest.raises(UserError, match="per-token"):
        quantize_activation(x, ActSpec(8, "tensor", True))
    q, s = quantize_activation(x, ActSpec(8, "tensor", False), torch.tensor(0.01))
    assert torch.equal(q, torch.clamp(torch.round(x / 0.01), -127, 127).to(torch.int8))


def test_observers_minmax_percentile_mse():
    torch.manual_seed(0)
    x = torch.randn(20000, 1)
    x[5] = 40.0  # one outlier
    obs = {name: make_observer(name) for name in ("minmax", "percentile", "mse")}
    for chunk in x.split(5000):
        for o in obs.values():
            o.observe(chunk)
    r = {name: o.range().item() for name, o in obs.items()}
    assert r["minmax"] == 40.0
    assert r["percentile"] <= r["minmax"] and r["percentile"] < 10
    assert r["mse"] < r["minmax"]

    def int8_error(rng):
        s = rng / 127
        return ((torch.clamp(torch.round(x / s), -127, 127) * s - x) ** 2).sum().item()

    assert int8_error(r["mse"]) <= int8_error(r["minmax"])


def test_mse_observers_in_place_int8_error_is_the_codes_error_bitwise():
    """``MSEObserver._error`` (int8: rounding and clamp in place) against the error of ``_codes``' int8 codes, at a
    ratio that clips. Negative control: without the clamp the clipped columns' errors differ."""
    from quant.actquant import STATIC_INT8, MSEObserver, _codes

    torch.manual_seed(0)
    x = torch.randn(512, 64).abs() * torch.rand(64) * 3
    scale = x.amax(0) * 0.6 / STATIC_INT8.qmax
    codes_error = ((_codes(x, scale, STATIC_INT8).float() * scale - x) ** 2).sum(0)
    assert torch.equal(MSEObserver(STATIC_INT8)._error(x, scale), codes_error)
    unclamped = ((torch.round(x / scale) * scale - x) ** 2).sum(0)
    assert not torch.equal(unclamped, codes_error)


def test_sampling_observer_keeps_a_uniform_sample_of_the_whole_stream(monkeypatch):
    """Eight batches of 500 values (batch i all equal to i) through an observer keeping about 1000: each batch is
    about an eighth of the sample (binomial sd about 10 of 125). Negative control: the former merge, which
    subsampled the union of the kept sample and each new batch, keeps the last batch at a third."""
    import quant.actquant

    monkeypatch.setattr(quant.actquant, "MAX_SAMPLES", 1000)
    batches = [torch.full((500, 1), float(i)) for i in range(8)]
    observer = make_observer("percentile")
    for batch in batches:
        observer.observe(batch)
    assert 900 < len(observer.sample) < 1100 and observer.sample.shape[1] == 1
    share = torch.bincount(observer.sample.flatten().long(), minlength=8)
    assert ((share - 125).abs() < 40).all(), share

    gen, kept = torch.Generator().manual_seed(0), torch.empty(0, 1)
    for batch in batches:
        kept = torch.cat([kept, batch])
        kept = kept[torch.randperm(len(kept), generator=gen)[:1000]]
    merged = torch.bincount(kept.flatten().long(), minlength=8)
    assert not ((merged - 125).abs() < 40).all() and merged[7] > 300, merged


def test_observer_refusals():
    with pytest.raises(UserError, match="zero calibration samples"):
        make_observer("minmax").range()
    with pytest.raises(UserError, match="unknown observer"):
        make_observer("histogram")
    with pytest.raises(UserError, match="NaN"):
        make_observer("minmax").observe(torch.tensor([[float("nan")]]))
    with pytest.raises(UserError, match="zero or non-finite"):
        check_scale(torch.tensor([0.0]), "x")
    with pytest.raises(UserError, match="zero or non-finite"):
        check_scale(torch.tensor([float("inf")]), "x")


@pytest.mark.parametrize("m", [1, 3, 17])
def test_int_mm_kernel_is_integer_exact(m):
    torch.manual_seed(m)
    spec = parse_scheme("W8A8")
    w, x = torch.randn(48, 96), torch.randn(m, 96) * 3
    result = RTN().quantize_weight(w, spec.weights)
    layer = QuantizedLinear.from_result(result, spec.weights, 96, None, spec.activations)
    assert isinstance(layer.kernel, Int8xInt8Kernel) and not layer.simulated
    xq, xs = quantize_per_token(x)
    acc = torch._int_mm(xq, result.q.t())
    assert acc.dtype == torch.int32 and torch.equal(acc.long(), xq.long() @ result.q.long().T)
    expected = acc.float() * xs * result.scale.reshape(-1).float()
    assert torch.equal(layer(x), expected)


def test_smoothing_scale_formula():
    act, w = torch.tensor([4.0, 1.0, 0.0]), torch.tensor([[1.0, 4.0, 2.0], [0.5, 1.0, 1.0]])
    s = smoothing_scale(act, [w], 0.5)
    assert torch.allclose(s, torch.tensor([2.0, 0.5, 1.0]))


@pytest.fixture()
def tiny(tiny_llama_dir):
    return load_model(tiny_llama_dir)


def logits_of(lm, tokens):
    lm.model.setup_cache(1, tokens.shape[1])
    return lm.model(tokens, torch.arange(tokens.shape[1]))


def test_smoothquant_preserves_fp_outputs_and_flattens_activations(tiny, calib):
    from quant.calibration import calibration_batches

    tokens = torch.randint(3, 128, (1, 40))
    tiny.model.layers[0].input_layernorm.weight.data[5] *= 30  # an outlier channel
    before = logits_of(tiny, tokens)
    batches = calibration_batches(calib, tiny)
    names = ["layers.0.self_attn.q_proj"]
    spread = lambda: calibrate_input_scales(tiny.model, [torch.tensor([b]) for b in batches], names)  # noqa: E731
    absmax_before = spread()[names[0]]
    info = apply_smoothquant(tiny, 0.5, batches)
    after = logits_of(tiny, tokens)
    assert info["groups"] == 4 and torch.allclose(before, after, atol=1e-4, rtol=1e-4)
    assert spread()[names[0]] < absmax_before  # the outlier channel migrated into the weights
    with pytest.raises(UserError, match="migration strength"):
        apply_smoothquant(tiny, 1.5, batches)


@pytest.mark.parametrize("label,smooth,kernel", [("W8A8", None, "int8xint8"),
                                                  ("w8ch-sym_a8t-static", None, "int8xint8"),
                                                  ("w8ch-sym_a8t-static", 0.5, "int8xint8"), ("FP8", None, "fp8xfp8"),
                                                  ("FP8_DYNAMIC", 0.5, "fp8xfp8")])
def test_quantize_w8a8_tracks_fp(tiny, calib, label, smooth, kernel):
    tokens = torch.randint(3, 128, (1, 40))
    ref = logits_of(tiny, tokens)
    report = quantize_w8a8(tiny, label, calib=calib, observer="percentile", smoothquant=smooth, progress=False)
    assert report.scheme.label == parse_scheme(label).label and report.kernels == {kernel: 7 * 2}
    layer = tiny.model.layers[1].mlp.down_proj
    dynamic = parse_scheme(label).activations.dynamic
    assert layer.act.dynamic == dynamic and (layer.kernel.input_scale is None) == dynamic
    got = logits_of(tiny, tokens)
    assert (got - ref).abs().max() < 0.1 * ref.abs().max() and not torch.equal(got, ref)


def test_static_w4a8_refused(tiny, calib):
    with pytest.raises(UserError, match="static activation scales need a W8A8 kernel"):
        quantize_w8a8(tiny, "w4g32-sym_a8t-static", calib=calib, progress=False)


@pytest.mark.parametrize("label,kernel", [("w8ch-sym_a8t-static", Int8xInt8Kernel), ("FP8", Fp8xFp8Kernel)])
def test_static_w8a8_checkpoint_round_trip(tiny, calib, tmp_path, label, kernel):
    from quant.checkpoint import save_compressed

    tokens = torch.randint(3, 128, (1, 30))
    report = quantize_w8a8(tiny, label, calib=calib, observer="minmax", progress=False)
    want = logits_of(tiny, tokens)
    out = save_compressed(tiny, report, tmp_path / "w8a8-static")
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    acts = config["config_groups"]["group_0"]["input_activations"]
    assert (acts["dynamic"], acts["strategy"]) == (False, "tensor")
    from safetensors.torch import load_file

    state = load_file(out / "model.safetensors")
    assert state["model.layers.0.mlp.down_proj.input_scale"].shape == (1,)
    loaded = load_model(out)
    layer = loaded.model.layers[0].mlp.down_proj
    assert isinstance(layer.kernel, kernel) and not layer.act.dynamic
    assert torch.equal(layer.kernel.input_scale, tiny.model.layers[0].mlp.down_proj.kernel.input_scale)
    assert torch.equal(logits_of(loaded, tokens), want)


# ------------------------------------------------------------------------------------------------ vLLM


@pytest.mark.vllm
@pytest.mark.integration
@pytest.mark.data
@VLLM_W8A8_AMX
def test_vllm_generates_from_static_w8a8_checkpoint(vllm_export_answers):
    require(vllm_ops()[VLLM_STATIC_INT8])
    assert "Paris" in vllm_export_answers[STATIC_W8A8]
