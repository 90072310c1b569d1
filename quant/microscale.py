"""Microscaling formats (MXFP4, MXFP8, NVFP4) by compressed-tensors' own functions, so our codes are theirs
(weights; and the dynamic per-group activations of MXFP4 / MXFP8 / NVFP4, whose per-tensor global scale
``quant.quantize`` calibrates per layer as its ``static_minmax`` observer does: ``range_global_scale``).

Scales come from ``calculate_qparams`` (MX: the group's absmax rounded to a power of two by
``generate_mx_scales``, kept as E8M0 exponents on export; NVFP4: ``global * absmax / 6`` rounded to E4M3, with the
per-tensor ``global = 448 * 6 / absmax(W)`` of ``generate_gparam``); codes from its ``quantize`` (E2M1 by
``FP4_E2M1_DATA.cast_to_fp4``, E4M3 by the cast). Our ``scale`` is the *effective* group scale, ``s / global``
for NVFP4 computed as compressed-tensors computes it, so ``dequantize`` is ``q * scale`` for every format.
FP4 codes are stored one per byte as float8_e4m3fn (every E2M1 value is exact there).

compressed-tensors compiles ``cast_to_fp4`` with ``torch.compile`` (12 s on first use here, again per shape);
``eager`` runs the same function uncompiled (comparisons and assignments: bitwise the same result).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from compressed_tensors.compressors.mx_utils import decompress_mx_scale
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import fake_quantize as ct_fake_quantize
from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
from compressed_tensors.quantization.utils import calculate_qparams, compute_dynamic_scales_and_zp, generate_gparam

from quant.scheme import ActSpec, WeightSpec
from runtime.errors import UserError


@contextmanager
def eager():
    """compressed-tensors' ``torch.compile``d helpers run as plain Python (see the module docstring)."""
    with torch._dynamo.config.patch(disable=True):
        yield


def ct_args(spec: WeightSpec | ActSpec) -> QuantizationArgs:
    """Our weight or activation spec as compressed-tensors ``QuantizationArgs`` (its presets' fields for the MX/NV
    formats, and ``block_structure`` for per-block weights)."""
    number = spec.number
    extra = {}
    if number.microscaled:
        extra = {"scale_dtype": number.scale_dtype, "zp_dtype": number.scale_dtype,
                 "strategy": "tensor_group" if number.global_scale else "group"}
        if isinstance(spec, ActSpec) and spec.calibrated_global:  # compressed-tensors' NVFP4 preset
            extra |= {"dynamic": "local", "observer": "static_minmax"}
    elif spec.granularity == "block":
        extra = {"block_structure": [spec.group_size, spec.group_size], "group_size": None}
    return QuantizationArgs(**{"num_bits": spec.bits, "type": number.ct_type, "symmetric": spec.symmetric,
                               "strategy": spec.granularity, "group_size": spec.group_size,
                               "dynamic": isinstance(spec, ActSpec) and spec.dynamic, **extra})


def range_global_scale(absmax: torch.Tensor) -> torch.Tensor:
    """NVFP4's per-tensor fp32 scale [1] of values within ``[-absmax, absmax]`` (``generate_gparam``)."""
    absmax = absmax.float().amax()
    return generate_gparam(-absmax, absmax)


def global_scale(w: torch.Tensor) -> torch.Tensor:
    """NVFP4's per-tensor fp32 scale [1]: ``generate_gparam`` over the whole weight."""
    w = w.float()
    return generate_gparam(w.amin(), w.amax())


def qparams(g_min: torch.Tensor, g_max: torch.Tensor, spec: WeightSpec, gscale: torch.Tensor | None):
    """Effective group scales (and zero zeros) from per-group min/max [out, n_groups]."""
    with eager():
        scale, _ = calculate_qparams(g_min, g_max, ct_args(spec), global_scale=gscale)
    scale = scale.float()
    if gscale is not None:
        scale = scale / gscale  # what compressed-tensors' quantize and dequantize divide by
    return scale, torch.zeros_like(scale)


def quantize(w: torch.Tensor, scale: torch.Tensor, spec: WeightSpec) -> torch.Tensor:
    """Codes of ``w`` [out, in] with effective group scales [out, n_groups] (``spec.code_dtype``); ``+ 0.0`` makes
    the -0 its FP4 cast gives tiny negatives +0, the code its compressor writes for them (equal values)."""
    with eager():
        q = ct_quantize(w.float(), scale, None, ct_args(spec))
    return (q + 0.0).to(spec.code_dtype)


def stored_scale(scale: torch.Tensor, gscale: torch.Tensor | None) -> torch.Tensor:
    """The group scale a checkpoint stores (fp32 values; its compressor writes E8M0 or E4M3): NVFP4's E4M3 scale
    is ``scale * global`` rounded to E4M3, exactly the one ``scale`` was divided from."""
    if gscale is None:
        return scale
    return (scale * gscale).to(torch.float8_e4m3fn).float()


def loaded_scale(stored: torch.Tensor, spec: WeightSpec, gscale: torch.Tensor | None) -> torch.Tensor:
    """The effective group scale from a checkpoint's stored one (E8M0 exponents or E4M3 values)."""
    if spec.number.scale_dtype == torch.uint8:
        return decompress_mx_scale(stored).float()
    scale = stored.float()
    return scale / gscale if gscale is not None else scale


def fake_quantize_activation(x: torch.Tensor, spec: ActSpec, global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Dynamic quantize-dequantize of a Linear input per group (compressed-tensors' ``forward_quantize`` for
    dynamic activations: ``compute_dynamic_scales_and_zp``, then ``fake_quantize``), in ``x``'s dtype; NVFP4's group
    scales under the layer's calibrated ``global_scale``."""
    if spec.calibrated_global and global_scale is None:
        raise UserError(f"{spec.label} needs each layer's calibrated input global scale: quantize with "
                        "quant.quantize.quantize_model, which calibrates it")
    args = ct_args(spec)
    with eager():
        scale, zero = compute_dynamic_scales_and_zp(x, args, module=None, global_scale=global_scale)
        return ct_fake_quantize(x, scale, zero, args, global_scale=global_scale)
