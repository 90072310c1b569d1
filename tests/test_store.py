"""Calibrated quantizations kept on disk (quant/store.py): a second process reads what the first calibrated, and only
what was made from the same checkpoint, scheme, method, calibration text and code."""
import json

import pytest
import torch

import quant.quantize as qq
from quant import store
from quant.calibration import CalibConfig
from quant.methods import get_method
from runtime.generate import Decoder
from runtime.loading import load_model

IDS = [1, 40, 41, 42, 43, 44, 45, 46, 47, 48]


def logits(lm):
    return Decoder(lm, 64).forward(IDS)


@pytest.fixture()
def fresh_process(monkeypatch, tmp_path):
    """Each call quantizes as a new process would: nothing memoised in memory, one disk store for the test."""
    monkeypatch.setenv(store.STORE_ENV, str(tmp_path / "store"))

    def quantize(model_dir, *args, **kw):
        monkeypatch.setattr(qq, "_quantized_models", {})
        lm = load_model(str(model_dir))
        return lm, qq.quantize_fresh(lm, *args, progress=False, **kw)
    return quantize


def calibrations(monkeypatch) -> list:
    """Records each calibration pass (``collect_layer_stats``) from now on."""
    calls = []
    real = qq.collect_layer_stats
    monkeypatch.setattr(qq, "collect_layer_stats", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_a_second_process_reads_the_calibrated_layers_and_decodes_the_same(tiny_llama_dir, calib, fresh_process,
                                                                         monkeypatch, method):
    first, made = fresh_process(tiny_llama_dir, "w4g32-asym", method, calib)
    assert made.stored is None and len(list((store.store_dir()).iterdir())) == 1
    calls = calibrations(monkeypatch)
    second, read = fresh_process(tiny_llama_dir, "w4g32-asym", method, calib)
    assert calls == [] and read.stored is not None  # no calibration pass: the layers came from the store
    assert torch.equal(logits(first), logits(second))
    assert [layer.weight_rel_error for layer in read.layers] == [layer.weight_rel_error for layer in made.layers]
    assert read.kernels == made.kernels and read.transform == made.transform and read.calibration == made.calibration


def test_the_full_precision_tensors_awq_rewrote_are_restored(tiny_llama_dir, calib, fresh_process, monkeypatch):
    first, _ = fresh_process(tiny_llama_dir, "w4g32-asym", "awq", calib)
    real_load = store.load

    def without_changed(key):
        made = real_load(key)
        assert made.changed  # AWQ folded its scales into the norms
        made.changed = {}
        return made
    monkeypatch.setattr(store, "load", without_changed)
    second, _ = fresh_process(tiny_llama_dir, "w4g32-asym", "awq", calib)
    # negative control: the codes alone, on the norms as loaded, are another model
    assert not torch.allclose(logits(first), logits(second))


def test_other_calibration_text_under_the_same_label_is_calibrated_again(tiny_llama_dir, calib, fresh_process,
                                                                          monkeypatch, tmp_path):
    fresh_process(tiny_llama_dir, "w4g32-asym", "gptq", calib)
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    other = other_dir / "calib.jsonl"
    other.write_text("\n".join(json.dumps({"text": "Pack my box with five dozen liquor jugs. " * 20})
                               for _ in range(2)))
    other_calib = CalibConfig(source=str(other), samples=calib.samples, seqlen=calib.seqlen)
    assert other_calib.label == calib.label and other_calib.fingerprint != calib.fingerprint
    calls = calibrations(monkeypatch)
    fresh_process(tiny_llama_dir, "w4g32-asym", "gptq", other_calib)
    assert calls == [1] and len(list(store.store_dir().iterdir())) == 2


def test_the_key_covers_dtype_scheme_method_rotation_and_the_code(tiny_llama_dir, calib, monkeypatch):
    gptq = get_method("gptq")
    base = ("fp32", "w4g32-asym", gptq, calib, None)
    key = store.entry_key(tiny_llama_dir, *base)
    assert store.entry_key(tiny_llama_dir, *base) == key
    for i, value in enumerate(["bf16", "w4g32-sym", get_method("awq"), CalibConfig(**{**vars(calib), "seed": 1}),
                               "hadamard"]):
        assert store.entry_key(tiny_llama_dir, *base[:i], value, *base[i + 1:]) != key, value
    monkeypatch.setattr(gptq, "damp", 0.1)  # the method's settings
    assert store.entry_key(tiny_llama_dir, *base) != key
    monkeypatch.undo()
    monkeypatch.setattr(store, "CODE", (*store.CODE, "quant.scheme"))  # the source that computes it
    assert store.entry_key(tiny_llama_dir, *base) != key


def test_an_unreadable_entry_is_made_again(tiny_llama_dir, calib, fresh_process, monkeypatch):
    first, _ = fresh_process(tiny_llama_dir, "w4g32-asym", "gptq", calib)
    (entry,) = store.store_dir().iterdir()
    (entry / "tensors.safetensors").write_bytes(b"not a safetensors file")
    calls = calibrations(monkeypatch)
    second, report = fresh_process(tiny_llama_dir, "w4g32-asym", "gptq", calib)
    assert calls == [1] and report.stored is None
    assert torch.equal(logits(first), logits(second))


def test_uncalibrated_methods_and_changed_models_keep_nothing(tiny_llama_dir, calib, fresh_process):
    fresh_process(tiny_llama_dir, "w4g32-asym", "rtn")
    lm = load_model(str(tiny_llama_dir))
    qq.quantize_model(lm, "w4g32-asym", "gptq", calib, progress=False)  # not stored=True: e.g. after SmoothQuant
    assert not store.store_dir().exists()


def test_a_store_that_cannot_be_written_warns_once_and_the_result_is_used(tiny_llama_dir, calib, monkeypatch,
                                                                          tmp_path, caplog):
    """A cache, not a requirement: with the store path taken by a file, the calibrated model is used, nothing is
    written, and one warning names the variable to set (before, the write's OSError ended the command)."""
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv(store.STORE_ENV, str(blocked))
    monkeypatch.setattr(qq, "_quantized_models", {})
    lm = load_model(str(tiny_llama_dir))
    report = qq.quantize_fresh(lm, "w4g32-asym", "gptq", calib, progress=False)
    assert report.stored is None and blocked.read_text() == ""
    [warning] = [r for r in caplog.records if r.name == "quant.store"]
    assert store.STORE_ENV in warning.getMessage() and "not kept" in warning.getMessage()
    assert torch.isfinite(logits(lm)).all()
