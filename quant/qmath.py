"""Integer and FP8 quantization math, compressed-tensors compatible.

``q = clip(round(x / scale) + zero, qmin, qmax)``, ``x̂ = (q - zero) * scale`` with the signed range
``[-2^(b-1), 2^(b-1)-1]``; symmetric: ``scale = absmax / ((qmax - qmin) / 2)``, zero 0; asymmetric:
``scale = (max - min) / (qmax - qmin)``, ``zero = round(qmin - min / scale)``; the range always includes 0.
FP8 (E4M3, symmetric) is the same with the range ``[-448, 448]`` (``scale = absmax / 448``) and the rounding done
by the cast to ``float8_e4m3fn`` (nearest, ties to even), as compressed-tensors does. The microscaling formats
(MXFP4, MXFP8, NVFP4) take their scales and codes from compressed-tensors itself (``quant.microscale``).
Scales/zeros have shape [out, n_groups] (per-group), [out, 1] (per-channel), [1, 1] (per-tensor) or
[ceil(out / b), ceil(in / b)] (per b x b block; partial blocks padded with zeros, as compressed-tensors pads them).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.errors import UserError
from quant.scheme import WeightSpec

EPS = torch.finfo(torch.float32).eps


def group_view(w: torch.Tensor, spec: WeightSpec) -> torch.Tensor:
    """Reshape [out, in] to [out, n_groups, group] so that per-group stats reduce over the last dim (per-block:
    [row blocks, column blocks, b * b], zero-padded; ``ungroup`` inverts it)."""
    out_f, in_f = w.shape
    if spec.granularity == "block":
        b = spec.group_size
        w = F.pad(w, (0, -in_f % b, 0, -out_f % b))
        return w.reshape(w.shape[0] // b, b, w.shape[1] // b, b).transpose(1, 2).reshape(w.shape[0] // b, -1, b * b)
    if spec.granularity == "group":
        if in_f % spec.group_size:
            raise UserError(f"group size {spec.group_size} does not divide input width {in_f}")
        return w.reshape(out_f, in_f // spec.group_size, spec.group_size)
    if spec.granularity == "channel":
        return w.reshape(out_f, 1, in_f)
    return w.reshape(1, 1, -1)


def ungroup(g: torch.Tensor, spec: WeightSpec, shape: torch.Size) -> torch.Tensor:
    """``group_view``'s inverse: back to ``shape`` [out, in]."""
    if spec.granularity != "block":
        return g.reshape(shape)
    b = spec.group_size
    rows, cols = g.shape[0], g.shape[1]
    return g.reshape(rows, cols, b, b).transpose(1, 2).reshape(rows * b, cols * b)[: shape[0], : shape[1]]


def check_finite(w: torch.Tensor, what: str = "weight") -> None:
    if not torch.isfinite(w).all():
        raise UserError(f"{what} contains NaN or inf; cannot quantize (check the checkpoint)")


def qparams_from_range(min_vals: torch.Tensor, max_vals: torch.Tensor, spec: WeightSpec):
    """Scale and zero point from per-group min/max (0 always representable; constant groups get eps scale)."""
    min_vals = torch.minimum(min_vals, torch.zeros_like(min_vals)).float()
    max_vals = torch.maximum(max_vals, torch.zeros_like(max_vals)).float()
    bit_range = spec.qmax - spec.qmin
    if spec.symmetric:
        scale = torch.maximum(min_vals.abs(), max_vals.abs()) / (bit_range / 2)
        zero = torch.zeros_like(scale)
    else:
        scale = (max_vals - min_vals) / bit_range
        zero = None
    scale = torch.where(scale == 0, torch.full_like(scale, EPS), scale)
    if zero is None:
        zero = torch.clamp(torch.round(spec.qmin - min_vals / scale), spec.qmin, spec.qmax)
    return scale, zero


def _microscale():
    """``quant.microscale``, imported on first use: it loads compressed-tensors (seconds), which only the
    microscaling formats need."""
    import quant.microscale

    return quant.microscale


def global_scale(w: torch.Tensor, spec: WeightSpec) -> torch.Tensor | None:
    """The per-tensor scale above the group scales of formats that have one (NVFP4), else None."""
    return _microscale().global_scale(w) if spec.number.global_scale else None


def compute_qparams(w: torch.Tensor, spec: WeightSpec, clip_ratio: float | torch.Tensor = 1.0):
    """Min/max scale and zero for ``w`` [out, in]; ``clip_ratio`` shrinks the range (MSE clipping)."""
    check_finite(w)
    g = group_view(w.float(), spec)
    g_min, g_max = g.amin(-1) * clip_ratio, g.amax(-1) * clip_ratio
    if spec.number.microscaled:
        return _microscale().qparams(g_min, g_max, spec, global_scale(w, spec))
    return qparams_from_range(g_min, g_max, spec)


def quantize(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, spec: WeightSpec) -> torch.Tensor:
    """Codes (``spec.code_dtype``: int8 storage for integers, float8_e4m3fn for fp8 and fp4) with the shape of
    ``w``."""
    if spec.number.microscaled:
        return _microscale().quantize(w, scale, spec)
    g = group_view(w.float(), spec)
    q = torch.clamp(spec.number.round(g / scale[..., None], spec.bits) + zero[..., None], spec.qmin, spec.qmax)
    return ungroup(q, spec, w.shape).to(spec.code_dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, spec: WeightSpec,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = group_view(q.float(), spec)
    return ungroup((g - zero[..., None]) * scale[..., None], spec, q.shape).to(dtype)


def fake_quantize(w: torch.Tensor, spec: WeightSpec, clip_ratio: float | torch.Tensor = 1.0) -> torch.Tensor:
    """Quantize-dequantize round trip (simulated quantization) in ``w``'s dtype."""
    scale, zero = compute_qparams(w, spec, clip_ratio)
    return dequantize(quantize(w, scale, zero, spec), scale, zero, spec, w.dtype)
