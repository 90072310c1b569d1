"""Clip-ratio search: per group, shrink the min/max range by the ratio that minimises reconstruction error.

``mse`` minimises the weight error ||W - Ŵ||² of each group over a grid of ratios (1.0 included, so it is never
worse than ``rtn``). ``clip_search`` also takes another per-group error (AWQ uses the output error on
calibration inputs, like AutoAWQ's ``auto_clip``).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from quant.methods.base import QuantResult, WeightMethod, register_method
from quant.qmath import compute_qparams, dequantize, global_scale, group_view, quantize
from quant.scheme import WeightSpec

CLIP_RATIOS = tuple(1.0 - 0.025 * i for i in range(21))  # 1.0 ... 0.5

GroupError = Callable[[torch.Tensor], torch.Tensor]  # (W - Ŵ) [out, in] -> error [scale shape]


def weight_error(spec: WeightSpec) -> GroupError:
    """Squared weight error summed over each group."""
    return lambda diff: (group_view(diff, spec) ** 2).sum(-1)


def output_error(h: torch.Tensor, spec: WeightSpec) -> GroupError:
    """Output error ``d_g H_gg d_gᵀ`` of each (row, group) with the diagonal blocks of ``h`` = XᵀX [in, in]."""
    h = h.float()
    if spec.granularity == "group":
        gs = spec.group_size
        ng = h.shape[0] // gs
        blocks = h.view(ng, gs, ng, gs).diagonal(dim1=0, dim2=2).permute(2, 0, 1)  # [ng, gs, gs]
        return lambda d: torch.einsum("ogi,gij,ogj->og", d.view(d.shape[0], ng, gs), blocks,
                                      d.view(d.shape[0], ng, gs))
    if spec.granularity == "channel":
        return lambda d: ((d @ h) * d).sum(-1, keepdim=True)
    return lambda d: ((d @ h) * d).sum().view(1, 1)


def clip_search(weight: torch.Tensor, spec: WeightSpec, error: GroupError | None = None,
                ratios: tuple[float, ...] = CLIP_RATIOS) -> QuantResult:
    """Quantize ``weight`` with, per group, the clip ratio of ``ratios`` that minimises ``error``."""
    w = weight.float()
    error = error or weight_error(spec)
    best_err = best_q = best_scale = best_zero = best_ratio = None
    for ratio in ratios:
        scale, zero = compute_qparams(w, spec, ratio)
        q = quantize(w, scale, zero, spec)
        err = error(w - dequantize(q, scale, zero, spec))
        if best_err is None:
            best_err, best_q, best_scale, best_zero = err, q, scale, zero
            best_ratio = torch.full_like(err, ratio)
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_q = torch.where(_expand(better, q, spec), q, best_q)
        best_scale, best_zero = torch.where(better, scale, best_scale), torch.where(better, zero, best_zero)
        best_ratio = torch.where(better, ratio, best_ratio)
    return QuantResult(best_q, best_scale, best_zero, info={"mean_clip_ratio": float(best_ratio.mean())},
                       global_scale=global_scale(w, spec))


def _expand(mask: torch.Tensor, q: torch.Tensor, spec: WeightSpec) -> torch.Tensor:
    """A per-group mask [scale shape] broadcast to the weight's shape."""
    grouped = group_view(q, spec)
    return mask[..., None].expand(grouped.shape).reshape(q.shape)


@register_method
class MSE(WeightMethod):
    name, types = "mse", ("int", "float", "mxfp", "nvfp")

    def quantize_weight(self, weight, spec, stats=None):
        return clip_search(weight, spec)
