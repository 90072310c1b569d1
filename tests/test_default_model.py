"""Integration: the real default model (SmolLM2-135M-Instruct) fetched, converted, and decoded."""
import json

import pytest
import torch

from runtime.loading import load_model
from runtime.model_store import SMOLLM2, fetch_default_model
from runtime.generate import Decoder, encode_prompt

pytestmark = [pytest.mark.isa, pytest.mark.integration]


@pytest.fixture(scope="module")
def smol(default_model_dir):
    return load_model(str(default_model_dir))


def test_fetch_is_idempotent_and_clean(default_model_dir):
    stamp = (default_model_dir / "model.safetensors").stat().st_mtime
    assert fetch_default_model(log=lambda *_: None) == default_model_dir
    assert (default_model_dir / "model.safetensors").stat().st_mtime == stamp
    config = json.loads((default_model_dir / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    assert json.loads((default_model_dir / "QUANTSPEC_SOURCE.json").read_text())["sha256"] == SMOLLM2.gguf_sha256


def test_france_answer_contains_paris(smol):
    ids = encode_prompt(smol.tokenizer, "What is the capital of France?")
    result = Decoder(smol, 256).generate(ids, 32)
    assert "Paris" in result.text


def test_native_greedy_equals_hf_greedy(smol, default_model_dir):
    from transformers import AutoModelForCausalLM

    ids = encode_prompt(smol.tokenizer, "Name three colours of the rainbow.")
    ours = Decoder(smol, 256).generate(ids, 40, ignore_eos=True).tokens
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=40, min_new_tokens=40, do_sample=False,
                      attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    assert ours == ref[0, len(ids):].tolist()


def test_model_info_prints_q4_1_caveat(default_model_dir):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "quantspec.cli", "model", "info", "default"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "134.5 M" in proc.stdout and "Q4_1" in proc.stdout


def test_model_fetch_command_is_idempotent(default_model_dir):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "quantspec.cli", "model", "fetch"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert str(default_model_dir) in proc.stdout.replace("\n", "")
