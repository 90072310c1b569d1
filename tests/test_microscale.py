"""Microscaling formats (MXFP4, NVFP4, MXFP8; MXFP4 / NVFP4 / MXFP8 activations): grammar and presets against
compressed-tensors' own, the math against its functions, the simulated runtime, the packed exports decompressed
by compressed-tensors, vLLM's refusal and the CLI. Each correctness check is run once on a broken version too
(negative control)."""
import json
from dataclasses import replace

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationStatus, preset_name_to_scheme
from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize
from compressed_tensors.quantization.lifecycle.forward import forward_quantize
from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

from quant.actquant import fake_quantize_activation
from quant.checkpoint import ct_scheme, save_compressed
from quant.methods import get_method
from quant.calibration import calibration_batches
from quant.microscale import eager, range_global_scale, stored_scale
from quant.qlinear import QuantizedLinear
from quant.qmath import compute_qparams, dequantize, global_scale, group_view, quantize
from quant.quantize import quantize_model
from quant.scheme import PRESETS, parse_scheme
from quant.vllm_support import vllm_support
from runtime.errors import UserError
from runtime.generate import Decoder
from runtime.loading import load_model
from test_cli_errors import assert_one_line_error, run_main
from test_fp8 import _local
from test_fp8 import decompressed_equals as fp8_decompressed_equals

IDS = [5, 17, 33, 9, 60, 2, 44, 71, 12]
# preset, label, compressed-tensors format
FORMATS = [("MXFP4A16", "wmxfp4g32-sym", "mxfp4-pack-quantized"),
           ("NVFP4A16", "wnvfp4g16-sym", "nvfp4-pack-quantized"),
           ("MXFP8A16", "wmxfp8g32-sym", "mxfp8-quantized")]
PRESET_NAMES = [f[0] for f in FORMATS]
# with dynamic per-group activations of the same format
ACT_FORMATS = [("MXFP4", "wmxfp4g32-sym_amxfp4g32-dyn", "mxfp4-pack-quantized"),
               ("NVFP4", "wnvfp4g16-sym_anvfp4g16-dyn", "nvfp4-pack-quantized"),
               ("MXFP8", "wmxfp8g32-sym_amxfp8g32-dyn", "mxfp8-quantized")]
E2M1 = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0}


# ---- grammar and presets ----

@pytest.mark.parametrize("preset,label,_fmt", FORMATS + ACT_FORMATS)
def test_presets_are_labels_that_parse_back(preset, label, _fmt):
    scheme = parse_scheme(preset)
    assert scheme.label == label and parse_scheme(label) == scheme and parse_scheme(preset.lower()) == scheme
    assert (scheme.activations is None) == preset.endswith("A16")


@pytest.mark.parametrize("text,needle", [
    ("wmxfp4g64-sym", "mxfp4 groups are 32 wide (the format's block), not 64: use wmxfp4g32-sym"),
    ("wnvfp4g32-sym", "nvfp4 groups are 16 wide"),
    ("wnvfp4g16-asym", "nvfp weights are symmetric only"),
    ("wmxfp4ch-sym", "not per-channel"),
    ("wnvfp8g16-sym", "unsupported weight bits 8 for nvfp codes"),
    ("wmxfp3g32-sym", "unsupported weight bits 3 for mxfp codes"),
    ("wmxfp8g32-sym_amxfp8tok-dyn", "mxfp activations are quantized dynamically per group of 32: use amxfp8g32-dyn"),
    ("wmxfp4g32-sym_amxfp4g32-static", "quantized dynamically per group of 32"),
    ("wnvfp4g16-sym_anvfp4g16-static", "quantized dynamically per group of 16"),
    ("w8ch-sym_a8g32-dyn", "activation granularity 'group': use token or tensor"),
])
def test_bad_combinations_are_one_line_errors(text, needle):
    with pytest.raises(UserError, match=needle.replace("(", r"\(").replace(")", r"\)")) as err:
        parse_scheme(text)
    assert "\n" not in str(err.value)


def test_presets_equal_compressed_tensors_field_by_field():
    """Every field of our weight and input-activation args (num_bits, type, strategy, group_size, symmetric, dynamic,
    scale_dtype, zp_dtype, observer, ...) equals compressed-tensors' preset of the same name. Negative controls: the
    presets differ from each other, and FP4 in groups of 32 without E8M0 scales is not MXFP4A16."""
    dumps = {}
    for name in PRESET_NAMES + [f[0] for f in ACT_FORMATS]:
        ours, theirs = ct_scheme(PRESETS[name]), preset_name_to_scheme(name, ["Linear"])
        assert ours.weights.model_dump() == theirs.weights.model_dump(), name
        acts = [a.model_dump() if a is not None else None for a in (ours.input_activations, theirs.input_activations)]
        assert acts[0] == acts[1], name
        dumps[name] = json.dumps([ours.weights.model_dump(), acts[0]], sort_keys=True, default=str)
    assert len(set(dumps.values())) == len(dumps)
    plain = QuantizationArgs(num_bits=4, type="float", strategy="group", group_size=32, symmetric=True, dynamic=False)
    assert plain.model_dump() != ct_scheme(PRESETS["MXFP4A16"]).weights.model_dump()


# ---- quantization math ----

def _weights(rows=48, cols=128):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(rows, cols, generator=gen) * torch.rand(rows, 1, generator=gen)
    w[0, :8] = torch.tensor([1e-6, -3e-5, 0.0, 2.0, -2.0, 1e-3, 7.0, -7.0])  # tiny codes, zero, the max
    w[1, :32] = 0.0  # an all-zero group
    return w


@pytest.mark.parametrize("preset,label,_fmt", FORMATS)
def test_math_is_compressed_tensors(preset, label, _fmt):
    """Scales, codes and dequantized weights equal compressed-tensors' own functions run with its preset's args
    (NVFP4: with its global scale). Negative controls: the scale of a plain FP4/FP8 format (absmax / qmax) and
    rounding FP4 by the E4M3 cast give other codes."""
    spec = parse_scheme(preset).weights
    args = preset_name_to_scheme(preset, ["Linear"]).weights
    w = _weights()
    scale, zero = compute_qparams(w, spec)
    g = group_view(w, spec)
    gscale = generate_gparam(w.amin(), w.amax()) if preset.startswith("NV") else None
    assert (global_scale(w, spec) is None) == (gscale is None)
    with eager():
        ct_scale, _ = calculate_qparams(g.amin(-1), g.amax(-1), args, global_scale=gscale)
        ct_q = ct_quantize(w, ct_scale, None, args, global_scale=gscale)
        ct_deq = ct_dequantize(ct_q, ct_scale, None, args, dtype=torch.float32, global_scale=gscale)
    assert torch.equal(stored_scale(scale, global_scale(w, spec)), ct_scale) and not zero.any()
    q = quantize(w, scale, zero, spec)
    assert q.dtype == torch.float8_e4m3fn and torch.equal(q.float(), ct_q)
    assert torch.equal(dequantize(q, scale, zero, spec), ct_deq)
    # negative controls
    naive = g.abs().amax(-1) / spec.qmax
    assert not torch.equal(quantize(w, naive, zero, spec), q)
    if spec.bits == 4:
        by_cast = (g / scale[..., None]).clamp(-6, 6).to(torch.float8_e4m3fn).reshape(w.shape)
        assert not torch.equal(by_cast.float(), q.float())


@pytest.mark.parametrize("preset,label,_fmt", FORMATS)
def test_scales_and_codes_have_the_format(preset, label, _fmt):
    """MX scales are powers of two, NVFP4's stored scales are E4M3 values under one fp32 global scale, FP4 codes
    lie on the E2M1 grid, and the group maximum is never clipped by more than the format allows. Negative control:
    the int4 g32 scheme's scales are not powers of two."""
    spec = parse_scheme(preset).weights
    w = _weights()
    scale, zero = compute_qparams(w, spec)
    q = quantize(w, scale, zero, spec)
    if spec.number.scale_dtype == torch.uint8:
        assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)
    else:
        stored = stored_scale(scale, global_scale(w, spec))
        assert torch.equal(stored.to(torch.float8_e4m3fn).float(), stored)
    if spec.bits == 4:
        assert set(q.float().abs().unique().tolist()) <= E2M1
    int4_scale, _ = compute_qparams(w, parse_scheme("w4g32-sym").weights)
    assert not torch.equal(torch.exp2(torch.log2(int4_scale).round()), int4_scale)


@pytest.mark.parametrize("preset", [f[0] for f in ACT_FORMATS])
def test_activations_are_compressed_tensors_dynamic_quantization(preset):
    """Our activation quantize-dequantize equals compressed-tensors' ``forward_quantize`` of a dynamic input (what
    its quantized Linear runs; NVFP4 under the module's ``input_global_scale``), and each group is an FP4 / FP8 grid
    under its scale (MX: a power of two). Negative controls: FP8 per-token quantization of the same input is not it;
    NVFP4 under another global scale is not it, and without one it is refused."""
    act = PRESETS[preset].activations
    x = torch.randn(3, 5, 128, generator=torch.Generator().manual_seed(2)) * torch.linspace(0.01, 4, 128)
    module = torch.nn.Module()
    module.quantization_status = QuantizationStatus.FROZEN
    gscale = range_global_scale(x.abs().amax()) if act.calibrated_global else None
    module.input_global_scale = gscale
    with eager():
        theirs = forward_quantize(module, x, "input", ct_scheme(PRESETS[preset]).input_activations)
    ours = fake_quantize_activation(x, act, global_scale=gscale)
    assert torch.equal(ours, theirs)
    groups = ours.reshape(-1, act.group_size)
    if act.calibrated_global:  # E4M3 group scales: the largest |x| lands on the top of both grids
        assert gscale * x.abs().amax() == pytest.approx(448 * 6) and ours.abs().amax() == x.abs().amax()
        assert not torch.equal(ours, fake_quantize_activation(x, act, global_scale=gscale / 3))
        with pytest.raises(UserError, match="needs each layer's calibrated input global scale"):
            fake_quantize_activation(x, act)
    else:  # per group of 32: each an E4M3 value times a power of two
        pow2 = torch.exp2(torch.ceil(torch.log2(groups.abs().amax(-1, keepdim=True) / act.qmax)))
        assert torch.equal((groups / pow2).to(torch.float8_e4m3fn).float() * pow2, groups)
    if act.bits == 4:  # at most 8 magnitudes (E2M1) per group
        assert max(len(g.abs().unique()) for g in groups) <= len(E2M1) < len(x.reshape(groups.shape)[0].abs().unique())
    assert not torch.equal(ours, fake_quantize_activation(x, parse_scheme("FP8_DYNAMIC").activations))


@pytest.mark.parametrize("preset", [f[0] for f in ACT_FORMATS])
def test_activation_schemes_run_on_the_simulated_kernel(tiny_llama_dir, calib, preset):
    """A layer with MX / NV activations computes the quantized input times the dequantized weight; negative control:
    the weight-only twin gives another output."""
    lm = load_model(str(tiny_llama_dir), "fp32")
    assert quantize_model(lm, preset, calib=calib, progress=False).kernels == {"simulated": 14}
    layer = lm.model.get_submodule("layers.0.mlp.down_proj")  # 64 x 128
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(3))
    expected = fake_quantize_activation(x, layer.act, global_scale=layer.kernel.input_global_scale)
    torch.testing.assert_close(layer(x), expected @ layer.dequantized_weight().T, rtol=1e-5, atol=1e-6)
    assert (layer(x) - x @ layer.dequantized_weight().T).abs().max() > 1e-3


def test_nvfp4_input_global_scales_are_each_layers_calibration_range(tiny_llama_dir, calib, tmp_path):
    """NVFP4's per-layer input global scale is compressed-tensors' ``generate_gparam`` of the range the layer's input
    took over the calibration set (its ``static_minmax`` observer), seen here by a hook on the unquantized model.
    Negative controls: another calibration text gives other scales; layers see other ranges."""
    names = ["layers.0.self_attn.q_proj", "layers.1.mlp.down_proj"]
    reference = load_model(str(tiny_llama_dir), "fp32")
    seen = {n: torch.zeros(()) for n in names}
    for n in names:
        reference.model.get_submodule(n).register_forward_pre_hook(
            lambda _m, args, n=n: seen.__setitem__(n, torch.maximum(seen[n], args[0].abs().amax())))
    for batch in calibration_batches(calib, reference):
        reference.model.setup_cache(1, len(batch))
        reference.model(torch.tensor([batch]), torch.arange(len(batch)))
    lm = load_model(str(tiny_llama_dir), "fp32")
    quantize_model(lm, "NVFP4", calib=calib, progress=False)
    scales = {n: lm.model.get_submodule(n).kernel.input_global_scale for n in names}
    for n in names:
        assert torch.equal(scales[n], generate_gparam(-seen[n], seen[n])), n
    assert not torch.equal(*scales.values())
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"text": "Numbers: 1 22 333 4444 55555, and then some more words. " * 12}) + "\n")
    lm2 = load_model(str(tiny_llama_dir), "fp32")
    quantize_model(lm2, "NVFP4", calib=replace(calib, source=str(other)), progress=False)
    assert not torch.equal(lm2.model.get_submodule(names[1]).kernel.input_global_scale, scales[names[1]])


def test_methods_refuse_microscaling_in_one_line():
    refusal = r"method 'gptq' cannot quantize mxfp weights \(wmxfp4g32-sym\): use awq, mse, rtn$"
    with pytest.raises(UserError, match=refusal):
        get_method("gptq", parse_scheme("MXFP4A16").weights)
    with pytest.raises(UserError, match="cannot quantize nvfp weights"):
        get_method("gptq", parse_scheme("NVFP4A16").weights)
    get_method("gptq", parse_scheme("w4g16-sym").weights)  # control: int weights are fine


@pytest.mark.parametrize("method", ["rtn", "mse", "awq"])
@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_methods_quantize_on_the_simulated_kernel(tiny_llama_dir, calib, method, preset):
    """Every layer on the ``simulated`` kernel, within the format's error; mse and awq never worse than rtn on the
    weight (mse) or not far off it. Negative control: 3-bit integers exceed the FP4 bound, FP4 the FP8 one."""
    report = quantize_model(load_model(str(tiny_llama_dir), "fp32"), preset, method, calib, progress=False)
    assert report.kernels == {"simulated": len(report.layers)}
    bound = 0.04 if preset == "MXFP8A16" else 0.16
    assert max(layer.weight_rel_error for layer in report.layers) < bound
    control = "MXFP4A16" if preset == "MXFP8A16" else "w3g32-sym"
    worse = quantize_model(load_model(str(tiny_llama_dir), "fp32"), control, progress=False)
    assert max(layer.weight_rel_error for layer in worse.layers) > bound


def test_layers_say_simulated_and_count_their_scale_bytes(tiny_llama_dir):
    lm = load_model(str(tiny_llama_dir), "fp32")
    quantize_model(lm, "NVFP4A16", progress=False)
    layer = lm.model.get_submodule("layers.0.self_attn.q_proj")  # 64 x 64
    assert layer.simulated and layer.kernel_detail.startswith("simulated")
    # 4-bit codes, one E4M3 byte per 16 weights, the fp32 global scale
    assert layer.format_bytes() == 64 * 64 // 2 + 64 * 64 // 16 + 4
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(layer(x), x @ layer.dequantized_weight().T, rtol=1e-5, atol=1e-6)


# ---- export: compressed-tensors' packed formats ----

def decompressed_equals(local, qscheme, fmt, layer) -> bool:
    """compressed-tensors' decompressor (which writes bf16 for these formats) gives our dequantized weight
    bitwise."""
    with eager():
        return fp8_decompressed_equals(local, qscheme, fmt, layer.dequantized_weight(torch.bfloat16))


@pytest.mark.parametrize("preset,label,fmt", FORMATS + ACT_FORMATS)
def test_export_decompresses_to_our_weights_and_reloads(tiny_llama_dir, calib, tmp_path, preset, label, fmt):
    lm = load_model(str(tiny_llama_dir), "fp32")
    report = quantize_model(lm, preset, calib=calib, progress=False)
    out = save_compressed(lm, report, tmp_path / "ck")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == fmt
    qscheme = ct_scheme(report.scheme)
    layers = {n: m for n, m in lm.model.named_modules() if isinstance(m, QuantizedLinear)}
    for name, layer in layers.items():
        local = _local(out, name)
        assert "weight_zero_point" not in local
        assert local["weight_scale"].dtype == layer.spec.number.scale_dtype
        assert ("weight_global_scale" in local) == preset.startswith("NV")
        g = layer.kernel.input_global_scale
        assert ("input_global_scale" in local) == (g is not None) == (preset == "NVFP4")
        assert g is None or torch.equal(local["input_global_scale"], g)
        assert decompressed_equals(local, qscheme, fmt, layer), name
    # negative controls: the group scales transposed, their rows reversed, one exponent / value off, the global
    # scale nudged by 1% (the decompressor writes bf16, which hides smaller nudges): none decompresses to ours
    name = "layers.0.self_attn.q_proj"
    local, layer = _local(out, name), layers[name]
    scale = local["weight_scale"]
    assert not decompressed_equals({**local, "weight_scale": scale.T.contiguous()}, qscheme, fmt, layer)
    assert not decompressed_equals({**local, "weight_scale": scale.flip(0)}, qscheme, fmt, layer)
    bumped = scale.view(torch.uint8).clone()
    bumped[0, 0] += 1
    assert not decompressed_equals({**local, "weight_scale": bumped.view(scale.dtype)}, qscheme, fmt, layer)
    if "weight_global_scale" in local:
        nudged = local["weight_global_scale"] * 1.01
        assert not decompressed_equals({**local, "weight_global_scale": nudged}, qscheme, fmt, layer)
    # reloaded natively: the same codes, scales and logits
    loaded = load_model(str(out), "fp32")
    assert torch.equal(Decoder(lm, 32).forward(IDS), Decoder(loaded, 32).forward(IDS))
    for name, layer in loaded.model.named_modules():
        if isinstance(layer, QuantizedLinear):
            assert layer.kernel_name == "simulated" and (layer.spec, layer.act) == (layers[name].spec, layers[name].act)
            for a, b in zip(layer.export(), layers[name].export()):
                assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                                   b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
            assert torch.equal(layer.global_scale, layers[name].global_scale) if preset.startswith("NV") else True
            ours, saved = layer.kernel.input_global_scale, layers[name].kernel.input_global_scale
            assert (ours is None) == (saved is None) and (ours is None or torch.equal(ours, saved))


# ---- vLLM and the CLI ----

@pytest.mark.parametrize("preset", PRESET_NAMES + [f[0] for f in ACT_FORMATS] + ["w8ch-sym_amxfp8g32-dyn"])
def test_vllm_refuses_in_one_line(preset):
    with pytest.raises(UserError, match="no CPU kernel for MXFP4 / NVFP4 / MXFP8.*--backend native") as err:
        vllm_support(preset)
    assert "\n" not in str(err.value)
    try:  # control: the FP8 rule still answers for FP8 (a refusal where its product is slow here, vllm_scaled_mm)
        answer = vllm_support("FP8_DYNAMIC")
    except UserError as exc:
        answer = str(exc)
    assert "FP8" in answer and "MXFP4" not in answer


def test_cli_help_lists_the_presets():
    proc = run_main("quantize", "--help")
    assert proc.returncode == 0 and all(name in proc.stdout for name in PRESET_NAMES)


def test_cli_quantize_and_refusals(tiny_llama_dir, tmp_path):
    proc = run_main("quantize", str(tiny_llama_dir), "--scheme", "NVFP4A16", "--dtype", "fp32",
                    "--output-dir", str(tmp_path / "ck"))
    assert proc.returncode == 0, proc.stderr
    assert "simulated" in proc.stdout and (tmp_path / "ck" / "model.safetensors").exists()
    model = str(tiny_llama_dir)
    assert_one_line_error(run_main("quantize", model, "--scheme", "wmxfp4g64-sym"), "groups are 32 wide")
    assert_one_line_error(run_main("quantize", model, "--scheme", "wnvfp4g16-asym"), "symmetric only")
    assert_one_line_error(run_main("quantize", model, "--scheme", "MXFP4A16", "--method", "gptq"),
                          "cannot quantize mxfp weights")
    assert_one_line_error(run_main("bench", model, "--scheme", "MXFP4A16", "--backend", "vllm", "-n", "1"),
                          "no CPU kernel for MXFP4")
