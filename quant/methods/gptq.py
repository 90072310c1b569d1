"""GPTQ (Frantar et al. 2022): quantize columns one at a time and push each column's error onto the columns not
yet quantized, weighted by the inverse Hessian H = XᵀX of the layer's calibration inputs.

Follows the reference implementation (IST-DASLab/gptq, AutoGPTQ ``GPTQ.fasterquant``): dead inputs zeroed,
``damp`` percent of the mean diagonal added, the upper Cholesky factor of H⁻¹, lazy batch updates over
blocks of ``block_size`` columns. Group scales are computed from the (error-updated) weights when a group's
first column is reached. With ``act_order`` columns go in order of decreasing H diagonal; groups then use
static scales computed from the original weights (AutoGPTQ ``static_groups``), which keeps groups contiguous
so the compressed-tensors layout needs no ``g_idx``.
"""
from __future__ import annotations

import torch

from quant.methods.base import QuantResult, WeightMethod, register_method, require_stats
from runtime.errors import UserError
from quant.qmath import compute_qparams
from quant.scheme import WeightSpec


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, spec: WeightSpec, damp: float = 0.01,
                  act_order: bool = False, block_size: int = 128) -> QuantResult:
    """GPTQ codes/scales/zeros of ``weight`` [out, in] given ``hessian`` [in, in] (any positive multiple of XᵀX)."""
    w = weight.detach().float().clone()
    h = hessian.detach().float().clone()
    rows, cols = w.shape
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0

    group = spec.group_size if spec.granularity == "group" else cols
    n_groups = cols // group
    scale = torch.empty(w.shape[0] if spec.granularity != "tensor" else 1, n_groups)
    zero = torch.empty_like(scale)
    if spec.granularity != "group" or act_order:  # parameters fixed up front (per tensor/channel, or static groups)
        scale[:], zero[:] = compute_qparams(w, spec)

    perm = torch.argsort(torch.diag(h), descending=True) if act_order else torch.arange(cols)
    w, h = w[:, perm], h[perm][:, perm]
    diag = torch.arange(cols)
    h[diag, diag] += damp * torch.mean(torch.diag(h))
    try:
        hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    except torch.linalg.LinAlgError:
        raise UserError(f"GPTQ: Hessian not positive definite with damp={damp}; raise damp or use more "
                        "calibration samples") from None

    q = torch.zeros_like(w)
    loss = torch.zeros(rows)
    for i1 in range(0, cols, block_size):
        i2 = min(i1 + block_size, cols)
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = int(perm[i1 + i])
            g = col // group
            if spec.granularity == "group" and not act_order and col % group == 0:
                # like the reference: the group's weights as updated up to the start of this block
                s, z = compute_qparams(w[:, col:col + group], spec)
                scale[:, g], zero[:, g] = s[:, 0], z[:, 0]
            column = w1[:, i]
            codes = torch.clamp(torch.round(column / scale[:, g]) + zero[:, g], spec.qmin, spec.qmax)
            deq = (codes - zero[:, g]) * scale[:, g]
            q[:, i1 + i] = codes
            d = hinv1[i, i]
            loss += (column - deq) ** 2 / d**2 / 2
            e = (column - deq) / d
            w1[:, i:] -= e[:, None] @ hinv1[i, i:][None, :]
            err1[:, i] = e
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]

    codes = torch.empty_like(q)
    codes[:, perm] = q
    return QuantResult(codes.to(torch.int8), scale, zero, info={"gptq_loss": float(loss.sum())})


@register_method
class GPTQ(WeightMethod):
    name = "gptq"
    needs = ("hessian",)

    def __init__(self, damp: float = 0.01, act_order: bool = False, block_size: int = 128):
        self.damp, self.act_order, self.block_size = damp, act_order, block_size

    def quantize_weight(self, weight, spec, stats=None):
        stats = require_stats(self, stats)
        return gptq_quantize(weight, stats.hessian, spec, self.damp, self.act_order, self.block_size)
