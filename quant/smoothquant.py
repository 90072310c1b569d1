"""SmoothQuant (Xiao et al. 2023): migrate activation outliers into the weights before W8A8 quantization.

Per input channel ``s = max|x|^α / max|W|^(1-α)`` (max over the consumers' columns), folded with
``quant.folding.fold_scale`` so the full-precision model is unchanged: ``1/s`` into the preceding RMSNorm,
``s`` into the consumers. Applied where the producer is an RMSNorm, as the reference implementation and
llm-compressor's Llama mappings do: ``input_layernorm -> q/k/v_proj`` and ``post_attention_layernorm ->
gate/up_proj``. ``o_proj`` and ``down_proj`` are not smoothed (their producers are attention / the gated MLP;
the v_proj -> o_proj fold exists in quant/folding.py but SmoothQuant does not use it).
It is a calibration step before any weight method (``quantize_w8a8(..., smoothquant=0.5)``).
"""
from __future__ import annotations

import torch

from runtime.errors import UserError
from quant.calibration import collect_layer_stats
from quant.folding import fold_groups, fold_scale
from runtime.transformer import RMSNorm

MIN_SCALE = 1e-5


def smoothing_scale(act_absmax: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """``s`` [in] for consumers sharing one input; channels never activated keep ``s = 1``."""
    w_absmax = torch.stack([w.detach().float().abs().amax(0) for w in weights]).amax(0)
    act = act_absmax.float()
    s = act.pow(alpha) / w_absmax.clamp_min(MIN_SCALE).pow(1 - alpha)
    s = torch.where((act > 0) & (w_absmax > 0), s.clamp_min(MIN_SCALE), torch.ones_like(s))
    if not torch.isfinite(s).all():
        raise UserError("SmoothQuant produced non-finite scales; the calibration activations are broken")
    return s


def check_alpha(alpha: float) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise UserError(f"SmoothQuant migration strength must be in [0, 1] (0.5 is the usual choice), got {alpha}")


@torch.no_grad()
def apply_smoothquant(lm, alpha: float, batches: list[list[int]]) -> dict:
    """Smooth ``lm.model`` in place from calibration token windows; returns a summary for the report."""
    check_alpha(alpha)
    groups = [g for g in fold_groups(lm.model) if isinstance(g.producer, RMSNorm)]
    first = [next(iter(g.consumers)) for g in groups]
    stats = collect_layer_stats(lm, batches, first, need=("abs_max",))
    ratios = []
    for group, name in zip(groups, first):
        s = smoothing_scale(stats[name].abs_max, [c.weight for c in group.consumers.values()], alpha)
        fold_scale(group, s)
        ratios.append((s.max() / s.min()).item())
    return {"alpha": alpha, "groups": len(groups), "smoothed": "input_layernorm->qkv, post_attention_layernorm->gate/up",
            "max_scale_ratio": max(ratios)}
