"""compressed-tensors export: llm-compressor's layout, bit-exact reload, atomic writes, bad input."""
import json

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from safetensors import safe_open

from quant import checkpoint
from quant.checkpoint import ct_scheme, save_compressed
from runtime.errors import UserError
from runtime.loading import load_model
from quant.qlinear import QuantizedLinear
from quant.quantize import quantize_model
from runtime.generate import Decoder

IDS = [5, 17, 33, 9, 60, 2, 44, 71, 12]


def quantized(path, label, dtype="fp32"):
    lm = load_model(str(path), dtype)
    return lm, quantize_model(lm, label, progress=False)


@pytest.mark.parametrize("label", ["w4g32-asym", "w4g64-sym", "w8ch-sym", "W8A8", "w3g32-asym", "w8t-asym",
                                   "w4g32-sym@head=w8ch-sym"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_round_trip_is_bit_exact(tiny_llama_dir, tmp_path, label, dtype):
    lm, report = quantized(tiny_llama_dir, label, dtype)
    out = save_compressed(lm, report, tmp_path / "ck")
    loaded = load_model(str(out), dtype)
    assert torch.equal(Decoder(lm, 32).forward(IDS), Decoder(loaded, 32).forward(IDS))
    ours = dict(lm.model.named_modules())
    for name, layer in loaded.model.named_modules():
        if isinstance(layer, QuantizedLinear):
            assert layer.kernel_name == ours[name].kernel_name
            for a, b in zip(layer.export(), ours[name].export()):
                assert torch.equal(a, b)


@pytest.mark.parametrize("label,fmt,names", [
    ("w4g32-asym", "pack-quantized", {"weight_packed", "weight_scale", "weight_zero_point", "weight_shape"}),
    ("w4g64-sym", "pack-quantized", {"weight_packed", "weight_scale", "weight_shape"}),
    ("W8A8", "int-quantized", {"weight", "weight_scale"}),
])
def test_llm_compressor_layout(tiny_llama_dir, tmp_path, label, fmt, names):
    lm, report = quantized(tiny_llama_dir, label)
    out = save_compressed(lm, report, tmp_path / "ck")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == fmt
    assert qc["quantization_status"] == "compressed" and qc["ignore"] == ["lm_head"]
    group = qc["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"] and group["weights"]["num_bits"] == report.scheme.weights.bits
    assert (group["input_activations"] is not None) == (label == "W8A8")
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    prefix = "model.layers.0.mlp.down_proj."
    assert {k.removeprefix(prefix) for k in keys if k.startswith(prefix)} == names
    assert "lm_head.weight" in keys and "model.embed_tokens.weight" in keys
    assert {"tokenizer.json", "generation_config.json", "quantspec_report.json"} <= {p.name for p in out.iterdir()}


def test_compressed_tensors_decompresses_to_our_weight(tiny_llama_dir, tmp_path):
    lm, report = quantized(tiny_llama_dir, "w4g32-asym")
    out = save_compressed(lm, report, tmp_path / "ck")
    prefix = "model.layers.1.self_attn.o_proj."
    with safe_open(out / "model.safetensors", "pt") as f:
        local = {k.removeprefix(prefix): f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}
    weight = PackedQuantizationCompressor.decompress(local, ct_scheme(report.scheme))["weight"]
    ours = lm.model.layers[1].self_attn.o_proj.dequantized_weight()
    assert weight.dtype == torch.bfloat16 and torch.equal(weight, ours.to(torch.bfloat16))  # bf16 scales


def test_transformers_loads_the_checkpoint(tiny_llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    lm, report = quantized(tiny_llama_dir, "w8ch-sym")
    out = save_compressed(lm, report, tmp_path / "ck")
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = hf(torch.tensor([IDS])).logits[0]
    ours = Decoder(lm, 32).forward(IDS)
    torch.testing.assert_close(ours, ref, atol=0.05, rtol=0.05)  # ours: bf16 activations in the int8 kernel


def test_existing_dir_needs_overwrite(tiny_llama_dir, tmp_path):
    lm, report = quantized(tiny_llama_dir, "w4g32-sym")
    out = tmp_path / "ck"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match="--overwrite"):
        save_compressed(lm, report, out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    save_compressed(lm, report, out, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "config.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]  # no temp or swapped-out dirs left


def test_failure_leaves_nothing_half_written(tiny_llama_dir, tmp_path, monkeypatch):
    lm, report = quantized(tiny_llama_dir, "w4g32-sym")

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "save_file", broken)
    with pytest.raises(OSError):
        save_compressed(lm, report, tmp_path / "ck")
    assert list(tmp_path.iterdir()) == []


def test_refusals(tiny_llama_dir, tmp_path):
    lm = load_model(str(tiny_llama_dir))
    with pytest.raises(UserError, match="no quantized layers"):
        save_compressed(lm, "w4g32-sym", tmp_path / "a")
    quantize_model(lm, "w4g32-sym+pad", progress=False)
    with pytest.raises(UserError, match="padded"):
        save_compressed(lm, "w4g32-sym+pad", tmp_path / "b")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("untie", [True, False])
def test_a_quantized_tied_head_is_an_untied_copy_and_round_trips(tmp_path, monkeypatch, untie):
    """``@ignore=`` (lm_head not ignored) quantizes a tied LM head as its own copy: the embedding lookup keeps its
    dense weights, the export says untied, our reload computes the same logits and transformers' (which ties a head
    the config calls tied) agrees with them. Negative control: without the untie, the export calls the head tied and
    transformers cannot load it."""
    from transformers import AutoModelForCausalLM
    from conftest import make_tiny_llama
    from runtime.transformer import Transformer

    if not untie:
        monkeypatch.setattr(Transformer, "untie_lm_head", lambda self: None)
    lm = load_model(str(make_tiny_llama(tmp_path / "tied", tie_word_embeddings=True)), "fp32")
    embedding = lm.model.embed_tokens.weight.detach().clone()
    report = quantize_model(lm, "w8ch-sym@ignore=", progress=False)
    assert isinstance(lm.model.lm_head, QuantizedLinear) and report.dense == [] and len(report.layers) == 15
    assert torch.equal(lm.model.embed_tokens.weight, embedding)
    out = save_compressed(lm, report, tmp_path / "ck")
    ours = Decoder(lm, 32).forward(IDS)
    assert torch.equal(ours, Decoder(load_model(str(out), "fp32"), 32).forward(IDS))
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] == (not untie)
    if not untie:
        with pytest.raises(AttributeError, match="weight"):  # it ties the quantized head to the embedding
            AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        return
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.inference_mode():
        torch.testing.assert_close(ours, hf(torch.tensor([IDS])).logits[0], atol=0.05, rtol=0.05)


def test_a_head_scheme_is_its_own_config_group_and_reloads(tiny_llama_dir, tmp_path):
    """``@head=``: the body's group targets Linear, the head's targets lm_head, each with its own format; the
    reload puts each layer on its own spec (``test_round_trip_is_bit_exact`` checks the logits). Negative control:
    a head group aimed at another target is refused in one line, not loaded as the body's scheme."""
    lm, report = quantized(tiny_llama_dir, "w4g32-asym@head=w8ch-sym")
    assert [layer.name for layer in report.layers if layer.name == "lm_head"] == ["lm_head"] and report.dense == []
    out = save_compressed(lm, report, tmp_path / "ck")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    body, head = qc["config_groups"]["group_0"], qc["config_groups"]["group_1"]
    assert body["targets"] == ["Linear"] and body["weights"]["num_bits"] == 4 and not body["weights"]["symmetric"]
    assert head["targets"] == ["lm_head"] and head["weights"]["num_bits"] == 8
    assert head["weights"]["strategy"] == "channel"
    assert qc["ignore"] == []
    loaded = load_model(str(out), "fp32")
    assert loaded.model.lm_head.spec.bits == 8 and loaded.model.layers[0].mlp.down_proj.spec.bits == 4
    qc["config_groups"]["group_1"]["targets"] = ["model.layers.0.mlp.down_proj"]
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | {"quantization_config": qc}))
    with pytest.raises(UserError, match="one config group targeting Linear"):
        load_model(str(out), "fp32")
